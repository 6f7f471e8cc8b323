"""DAPO's overlong reward shaping and overlong filtering (Yu et al., 2025, arXiv:2503.14476, §3.4).

With ``L_max`` the longest a completion may be (``--generator.max-new-tokens``) and ``L_cache`` the
buffer (``--reward.overlong-buffer``), the soft overlong punishment added to a sample's reward is
(DAPO eq. 13, scaled by ``--reward.overlong-penalty``)::

    R_len(y) = 0                                  if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
             = -1                                  if |y| > L_max

so a completion is pushed, more the closer it gets, away from the limit. Overlong filtering
(``--reward.overlong-filter``) masks every truncated sample (one that did not end on an end token)
out of the loss: its reward still counts in its group's baseline, its tokens train nothing, so a
correct reasoning that merely ran out of tokens is not punished as a wrong one.
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, *, max_len: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """``penalty * R_len`` (module docstring) of completion lengths ``lengths`` (``[N]``), float32."""
    if buffer < 1 or buffer > max_len:
        raise ValueError(f"the overlong buffer must be in [1, max_len={max_len}], got {buffer}")
    lengths = lengths.to(torch.float32)
    start = max_len - buffer
    ramp = (start - lengths) / buffer
    shaped = torch.where(lengths <= start, torch.zeros_like(lengths), torch.where(lengths <= max_len, ramp, -1.0))
    return shaped * penalty


def mask_truncated(loss_mask: Tensor, ended: Tensor) -> Tensor:
    """``loss_mask`` ``[N, T]`` with every row whose sample did not end on an end token (``ended``
    ``[N]`` false) zeroed."""
    return loss_mask * ended.to(loss_mask.dtype).unsqueeze(1)
