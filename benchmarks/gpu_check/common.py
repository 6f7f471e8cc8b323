"""What the sections share: the targets, device peaks, model shapes and sizes, random-init models."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
for _path in (REPO, BENCH):  # llamarl, recipes; generation.py, async_speedup.py
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

SECTIONS = ("tests", "decode", "capture", "recipe", "tick")
LETTERS = dict(zip(SECTIONS, "abcde"))
# Per-section timeouts (s); together within the 8-minute budget (--budget-s), the rest is start-up.
# tests runs last and gets what is left of the budget, up to its own timeout.
TIMEOUTS = {"tests": 200, "decode": 90, "capture": 45, "recipe": 115, "tick": 90}
ORDER = ("decode", "capture", "tick", "recipe", "tests")  # the quick device numbers first

TARGETS = {
    "decode_vs_hf_generate": 0.1,  # graph step / HF generate step, at most, at 64 and 512 rows
    "capture_seconds_per_graph": 10.0,  # every bucket captured in at most this
    "recipe_seconds_to_0.70": 10.0,  # training seconds (after the model loads) to 0.70 held-out accuracy
    "tick_gen_tokens_per_s": 200_000.0,  # at least
    "tick_trainer_mfu": 0.30,  # at least
}

# (name contains all of, dense bf16 TFLOPS, HBM TB/s): vendor data sheets (sparsity not counted).
DEVICE_PEAKS = (
    (("h200", "nvl"), 835.0, 4.8),
    (("h200",), 989.0, 4.8),
    (("h100", "pcie"), 756.0, 2.0),
    (("h100", "nvl"), 835.0, 3.9),
    (("h100",), 989.0, 3.35),
    (("a100", "80gb"), 312.0, 2.039),
    (("a100",), 312.0, 1.555),
)


def device_peaks(name: str) -> tuple[float | None, float | None]:
    """(bf16 TFLOPS, HBM TB/s) of a device named ``name`` (``torch.cuda.get_device_name()``), or
    (None, None) for one this table does not know."""
    lower = name.lower()
    for parts, tflops, tbps in DEVICE_PEAKS:
        if all(p in lower for p in parts):
            return tflops, tbps
    return None, None


SMOLLM2_SHAPE = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                 "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True,
                 "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}
"""SmolLM2-135M(-Instruct)'s dimensions (its config.json), for random-init models of its shape."""
TINY_SHAPE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-5}


@dataclass
class Sizes:
    """How big each section's work is: the GPU check's, or ``--smoke``'s (tiny, on the CPU)."""

    smoke: bool
    device: str
    shape: dict = field(default_factory=dict)
    dtype: str = "bfloat16"
    decode_rows: tuple[int, ...] = (64, 512)
    decode_new_tokens: int = 33
    decode_compiled: bool = False  # --decode-compiled: also time static_decode="compiled"
    decode_repeats: int = 3
    hf_repeats: int = 2  # the slow paths (HF's modules, HF generate)
    copy_bytes: int = 1 << 30
    capture_rows: int = 256
    capture_new_tokens: int = 128
    capture_eos_every: int = 40  # every 40th id stops a row: rows end at different steps
    capture_grow_rows: int = 512
    recipe_ticks: int = 25
    recipe_eval_every: int = 5
    tick_prompts: int = 64
    tick_samples: int = 4
    tick_new_tokens: int = 256
    tick_ticks: int = 3


def sizes(*, smoke: bool, device: str, recipe_ticks: int = 25, recipe_eval_every: int = 5,
          decode_compiled: bool = False) -> Sizes:
    if not smoke:
        return Sizes(smoke=False, device=device, shape=dict(SMOLLM2_SHAPE), recipe_ticks=recipe_ticks,
                     recipe_eval_every=recipe_eval_every, decode_compiled=decode_compiled)
    # fp32: the CPU's bf16 paths compile C kernels on first use, which a dry run need not wait for.
    return Sizes(smoke=True, device=device, shape=dict(TINY_SHAPE), dtype="float32", decode_rows=(2, 4),
                 decode_new_tokens=3, decode_repeats=1, hf_repeats=1, copy_bytes=1 << 22, capture_rows=4,
                 capture_new_tokens=6, capture_eos_every=8, capture_grow_rows=8, recipe_ticks=2,
                 recipe_eval_every=1, tick_prompts=2, tick_samples=2, tick_new_tokens=8, tick_ticks=2,
                 decode_compiled=decode_compiled)


def build_model(shape: dict, *, dtype: str, device: str, seed: int = 0):
    """A random-init ``LlamaForCausalLM`` of ``shape`` (seeded; the caller's RNG untouched), in
    eval mode, on ``device`` in ``dtype``. EOS 2, pad 0, BOS 1 (the ids the tiny tokenizer uses)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            model = LlamaForCausalLM(config)
    return model.to(getattr(torch, dtype)).eval()


def num_params(model) -> int:
    """Unique parameters (a tied embedding counted once: it is also the LM head's matmul)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


class IdsTokenizer:
    """What benchmarks/generation.py's prompts need of a tokenizer (``apply_chat_template``, a call
    returning ``input_ids``, ``pad_token_id``), without one to load: every two bytes of the text one
    id (about BPE's length for English), below the vocabulary. The decode step's cost depends on
    the shapes, not on which ids these are."""

    pad_token_id, eos_token_id = 0, 2

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True, tokenize: bool = False):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, text: str):
        data = text.encode()
        ids = [3 + (data[i] * 256 + (data[i + 1] if i + 1 < len(data) else 0)) % (self.vocab_size - 3)
               for i in range(0, len(data), 2)]
        return SimpleNamespace(input_ids=ids)


def static_decoder_of(engine):
    """The engine's ``StaticDecoder`` (``engine.static_decoder``; ``engine._static`` before that
    property existed), or None: not built yet, or fallen back to HF's modules."""
    decoder = getattr(engine, "static_decoder", None)
    return decoder if decoder is not None else getattr(engine, "_static", None)


def decoder_counters(engine) -> dict:
    """The static decoder's counters (None where it has no such attribute, or there is no decoder)."""
    decoder = static_decoder_of(engine)
    return {name: getattr(decoder, name, None) if decoder is not None else None
            for name in ("num_steps", "num_captures", "capture_seconds", "num_calls", "cuda_graphs")}


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


class SectionFailed(Exception):
    """A section that ends without its numbers (some may have been saved): ``status`` is
    ``"error"`` or ``"timeout"``."""

    def __init__(self, message: str, *, status: str = "error") -> None:
        super().__init__(message)
        self.status = status
