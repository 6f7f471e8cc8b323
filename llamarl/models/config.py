"""The policy model's settings and LoRA's (``--model.*``, ``--trainer.lora.*``), beside the loading and
the adapters they configure (``loading.py``, ``lora.py``).

Dataclasses parsed by tyro at a recipe's entry point (``llamarl/rl/config.py`` composes every
section): every field has a docstring (tyro shows it in ``--help``), and each config checks itself
in ``__post_init__``, raising ``ValueError`` with one line naming the flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llamarl.models.lora import LoraSpec
from llamarl.runtime.errors import check_flag


@dataclass
class ModelConfig:
    """The policy model: where it is loaded from and the trainer's parameter dtype."""

    name: str = "smollm2-135m-instruct"
    """HF causal-LM directory, or the built-in alias ``smollm2-135m-instruct``."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Trainer parameter dtype (the optimizer state follows it)."""


@dataclass
class LoraConfig:
    """LoRA adapters on the trainer (``llamarl/models/lora.py``): off unless ``rank`` is set."""

    rank: int | None = None
    """Adapter rank r (None: full fine-tuning, the default). With a rank, the base weights are frozen
    in ``--trainer.param-dtype`` and only the adapters train (fp32 masters and AdamW state), sync to
    the generator (merged there in place: ``W = W_base + (alpha / r) B A``), checkpoint and export."""
    alpha: float | None = None
    """LoRA's alpha: the update is scaled by alpha / r. None: 2 x rank (a scale of 2, TRL's and
    verl's examples' r=16 / alpha=32)."""
    targets: str = "all-linear"
    """Comma-separated module-name suffixes to adapt (``q_proj,v_proj``), or ``all-linear``: every
    linear of the attention and MLP blocks. Embeddings and the LM head are never adapted (tied
    families keep one shared matrix, frozen)."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (peft's ``lora_dropout``); 0 keeps the
    trainer's forward deterministic, which the ratios of the off-policy losses assume."""
    merged_forward: bool = True
    """The trainer computes each adapted linear with the merged weight ``W_base + (alpha / r) B A``
    (one small GEMM per micro-batch), bitwise the weights the generator samples from, instead of
    peft's unmerged sum, which in bf16 drifts from the generator's policy as the adapters grow
    (``llamarl/models/lora_forward.py``; ignored with dropout, which needs the unmerged form)."""
    export_merged: bool = False
    """Also write the merged model (base + adapters, an HF directory ``from_pretrained`` and vLLM
    load as-is) under ``<export>/merged`` beside the PEFT adapter directory."""
    lr: float = 8e-4
    """The learning rate with adapters when ``--trainer.lr`` is unset: 8e-4, the best of the measured
    sweep on the default recipe at rank 8 (4e-4 slower, 1.2e-3 unstable; docs/benchmarks.md, "LoRA vs
    full fine-tuning"), about 50x full fine-tuning's. A run that takes it says so in one line."""

    def __post_init__(self) -> None:
        check_flag(self.lr > 0, f"--trainer.lora.lr must be > 0, got {self.lr}")
        check_flag(self.rank is None or self.rank >= 1,
                   f"--trainer.lora.rank must be >= 1 (leave it unset for full fine-tuning), got {self.rank}")
        check_flag(self.alpha is None or self.alpha > 0, f"--trainer.lora.alpha must be > 0, got {self.alpha}")
        check_flag(0.0 <= self.dropout < 1.0, f"--trainer.lora.dropout must be in [0, 1), got {self.dropout}")
        names = [t.strip() for t in self.targets.split(",")]
        check_flag(all(names), f"--trainer.lora.targets has an empty name: {self.targets!r}")
        check_flag("all-linear" not in names or len(names) == 1,
                   f"--trainer.lora.targets: all-linear cannot be combined with other names, got {self.targets!r}")

    @property
    def enabled(self) -> bool:
        return self.rank is not None

    def spec(self) -> LoraSpec | None:
        """What the trainer, generator and export build the adapters from (None: full fine-tuning)."""
        if self.rank is None:
            return None
        return LoraSpec(rank=self.rank, alpha=self.alpha if self.alpha is not None else 2.0 * self.rank,
                        targets=self.targets, dropout=self.dropout, merged_forward=self.merged_forward)
