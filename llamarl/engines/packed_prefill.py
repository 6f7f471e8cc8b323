"""Prefill straight into the one KV state (issue 45 item 1): the contexts packed into one row, no
padding, each layer's keys and values written into their slots as the layer computes them, no
transformers ``DynamicCache`` and no copy out of one.

Before, a prefill was a second path: the contexts left-padded into a ``[n, longest]`` batch, run
through HF's model into a ``DynamicCache`` (every padded column computed and cached), then copied
into the slots (``KVSlots.load``: a gather per layer). Here (``prefill_into``):

* each distinct context once (GRPO submits a prompt once per sample of its group: its rows share
  one prefill, its keys and values written to each of their slots), all of them back to back in
  one packed row ``[1, sum of lengths]`` with their own positions (0 .. length - 1);
* HF's own modules (norms, projections, RoPE, MLP: the model's numerics), with attention through
  llamarl/models/segment_attention.py's ``sequence_spans``: causal within each context, one SDPA
  call each, nothing across contexts, GQA without repeating K / V;
* the "cache" the attention modules update is ``SlotWriter``: per layer one indexed write of the
  layer's keys and values into ``state.caches[layer]`` at (slot, position) for every token of
  every row, and the packed keys returned as they are (a prefill attends only to its own tokens);
* the LM head on each context's last token only.

Which models (``supports``): those whose attention runs through ``segment_attention`` (HF ``sdpa``,
no soft-capping, windows longer than the contexts: llamarl/models/segment_attention.py) and whose
cache writes happen in ``update(keys, values, layer_idx)`` (the Llama-family layers the native
steps run). The rest keep the padded prefill (``TorchEngine._prefill``). Numerics: HF's modules over
the same tokens and positions; the attention's sums in another order than the padded batch's
masked kernel, so fp32 logits and caches agree to fp32 rounding (tests/test_packed_prefill.py).
"""

from __future__ import annotations

import torch

from llamarl.models import segment_attention


def supports(model: torch.nn.Module, *, width: int) -> bool:
    """Whether ``prefill_into`` reproduces ``model``'s prefill for contexts up to ``width`` tokens."""
    config = getattr(model, "config", None)
    return (segment_attention.supports(model, width=width) and hasattr(model, "model") and hasattr(model, "lm_head")
            and not getattr(config, "final_logit_softcapping", None))


class SlotWriter:
    """The cache HF's attention modules update during ``prefill_into``: writes each layer's keys and
    values ``[1, kv, T, d]`` of the packed tokens into the state's slots (``token_index[n]``'s
    keys go to slot ``slots[n]`` at column ``columns[n]``) and returns them unchanged."""

    is_compileable = False

    def __init__(self, state, *, token_index: torch.Tensor, slots: torch.Tensor, columns: torch.Tensor) -> None:
        self.state, self.token_index, self.slots, self.columns = state, token_index, slots, columns
        self.layers_written = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.state.caches[layer_idx]  # [2, slots, kv, width, d]
        keys = key_states[0].transpose(0, 1)[self.token_index]  # [N, kv, d]
        values = value_states[0].transpose(0, 1)[self.token_index]
        # The indexed dims first: [N, 2, kv, d] into (slot, column) pairs, keys and values in one write.
        cache[:, self.slots, :, self.columns] = torch.stack((keys, values), dim=1).to(cache.dtype)
        self.layers_written += 1
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are given explicitly (prefill_into)


@torch.no_grad()
def prefill_into(model: torch.nn.Module, state, slots: list[int], contexts: list[tuple[int, ...]]) -> torch.Tensor:
    """Prefill ``contexts`` into ``slots`` of ``state`` (a ``KVSlots``: row j's positions
    ``0 .. len(contexts[j]) - 1`` written in slot ``slots[j]``'s columns of the same index); return
    each row's next-token logits ``[len(slots), vocab]`` (module docstring). The state widens
    first if it is growable and a context needs more columns. Tokens forwarded: the distinct
    contexts' lengths, summed (the caller's count)."""
    if len(slots) != len(contexts) or not contexts:
        raise ValueError(f"prefill_into: {len(slots)} slots for {len(contexts)} contexts")
    longest = max(len(c) for c in contexts)
    if getattr(state, "growable", False):
        state.grow(longest + 1)
    if longest > state.width - 1:
        raise ValueError(f"a context of {longest} tokens does not fit the state's {state.width} columns")
    device = state.tokens.device
    first: dict[tuple[int, ...], int] = {}
    source = [first.setdefault(c, len(first)) for c in contexts]
    distinct = list(first)
    starts, tokens, positions = [], [], []
    for context in distinct:
        starts.append(len(tokens))
        tokens += context
        positions += range(len(context))
    # Every row's tokens: which packed token, which slot, which column (built on the host).
    token_index, slot_of, column_of = [], [], []
    for slot, d in zip(slots, source):
        length = len(distinct[d])
        token_index += range(starts[d], starts[d] + length)
        slot_of += [slot] * length
        column_of += range(length)
    writer = SlotWriter(state, token_index=torch.tensor(token_index, dtype=torch.long, device=device),
                        slots=torch.tensor(slot_of, dtype=torch.long, device=device),
                        columns=torch.tensor(column_of, dtype=torch.long, device=device))
    segment_attention.enable(model)
    sequences = tuple(zip(starts, (len(c) for c in distinct)))
    hidden = model.model(input_ids=torch.tensor([tokens], dtype=torch.long, device=device),
                         position_ids=torch.tensor([positions], dtype=torch.long, device=device),
                         attention_mask=torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device),
                         past_key_values=writer, use_cache=True, sequence_spans=(sequences,)).last_hidden_state
    if writer.layers_written != len(state.caches):
        raise RuntimeError(f"prefill_into: {writer.layers_written} of {len(state.caches)} layers wrote their cache "
                           f"({type(model).__name__}'s attention does not update a cache as the Llama family's does)")
    last = torch.tensor([s + len(c) - 1 for s, c in zip(starts, distinct)], dtype=torch.long, device=device)
    logits = model.lm_head(hidden[0, last])
    return logits[torch.tensor(source, dtype=torch.long, device=device)]
