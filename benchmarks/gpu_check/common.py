"""What the sections share: the parts and their time plans, the targets, the model shapes, the
sizes of each section's work, random-init models built on the device. Imports no torch at module
level (cli.py decides first whether this Python has torch and CUDA)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
for _path in (REPO, BENCH):  # llamarl, recipes; generation.py, async_speedup.py
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

PART_BUDGET_S = 300.0
"""Each prepared part (``engine``, ``run``, ``trainer``) decides within this many seconds of a GPU."""
STARTUP_S = 20.0
"""What a part spends outside its sections' timeouts (this process's start and imports, the report)."""

# A part: its sections in order, each with its timeout (s); a section is ``kind:shape`` or a name.
# engine, run and trainer: the timeouts plus STARTUP_S add up to <= PART_BUDGET_S (plan_seconds; tested).
PARTS = {
    "engine": (("shape:smollm2-135m", 65.0), ("shape:qwen2.5-1.5b", 80.0), ("shape:qwen2.5-7b", 135.0)),
    "run": (("tick:smollm2-135m", 110.0), ("tick:qwen2.5-1.5b", 170.0)),
    "tests": (("tests", 300.0), ("recipe", 200.0)),  # optional, not in the 15 minutes: tests/gpu, the recipe
    "trainer": (("train:smollm2-135m", 45.0), ("train:qwen2.5-1.5b", 75.0), ("train:qwen2.5-7b", 130.0)),
}
SMOKE_PARTS = {"engine": (("shape:tiny", 120.0),), "run": (("tick:tiny", 240.0),),
               "tests": (("tests", 300.0), ("recipe", 240.0)), "trainer": (("train:tiny", 240.0),)}
BUDGETED = ("engine", "run", "trainer")


def plan(part: str, *, smoke: bool = False) -> tuple[tuple[str, float], ...]:
    """The sections of ``part`` with their timeouts (``--smoke``: the tiny shape's)."""
    return (SMOKE_PARTS if smoke else PARTS)[part]


def plan_seconds(part: str, *, smoke: bool = False) -> float:
    """The most ``part`` can take: its sections' timeouts plus ``STARTUP_S``."""
    return sum(timeout for _, timeout in plan(part, smoke=smoke)) + STARTUP_S


TARGETS = {  # issue 45, "Targets (one H100 / H200, make gpu-check)"; issue 46's below
    "step_vs_bound_64": {"smollm2-135m": 12.0, "qwen2.5-1.5b": 1.8, "qwen2.5-7b": 1.3},  # at most, 64 rows
    "step_vs_bound_256": 1.5,  # at most, every shape, the bound with the live KV read
    "capture_seconds_per_shape": 10.0,  # every bucket of a shape's ladder captured in at most this
    "tick_gen_tokens_per_s_135m": 200_000.0,  # at least, the 256 x 256 colocated tick at 135M
    "tick_fraction_of_bound_1.5b": 0.5,  # at least: generated tokens/s over the tick's bound, at 1.5B
    "tests_failed": 0,
    "recipe_seconds_to_0.70": 10.0,
    # issue 46 (the trainer at the hardware): at least, forward + backward + AdamW step, over the data sheet
    "train_mfu": {"smollm2-135m": 0.25, "qwen2.5-1.5b": 0.40, "qwen2.5-7b": 0.35},
    "tick_memory_fraction_1.5b": 1.0,  # at most: the colocated tick's peak over the device's memory
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


# The published models' config.json dimensions (no download: random init of the same shapes).
SHAPES = {
    "smollm2-135m": ("llama", {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                               "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                               "tie_word_embeddings": True, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}),
    "qwen2.5-1.5b": ("qwen2", {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
                               "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                               "tie_word_embeddings": True, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                               "use_sliding_window": False}),
    "qwen2.5-7b": ("qwen2", {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                             "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                             "tie_word_embeddings": False, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                             "use_sliding_window": False}),
    "tiny": ("llama", {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
                       "max_position_embeddings": 512, "rms_norm_eps": 1e-5}),
}
"""name -> (family, config fields): SmolLM2-135M(-Instruct), Qwen2.5-1.5B and -7B (Qwen2: biases on
q/k/v, head_dim 128), and the smoke's tiny Llama."""
SMOLLM2_SHAPE = SHAPES["smollm2-135m"][1]


def head_dim(shape: dict) -> int:
    return shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]


@dataclass
class Sizes:
    """How big each section's work is: the GPU check's, or ``--smoke``'s (tiny, on the CPU)."""

    smoke: bool
    device: str
    dtype: str = "bfloat16"
    rows: tuple[int, ...] = (64, 256)
    widths: tuple[int, ...] = (512, 1024)
    modes: tuple[str, ...] = ("greedy", "sampled")
    prompt_tokens: int = 192  # each row's prompt: live lengths 193 .. 224 over the timed steps
    new_tokens: int = 33  # a timed call's tokens; a step = (wall(new_tokens) - wall(1)) / the steps between
    repeats: int = 2  # best of, each call
    profile_rows: int = 64
    copy_bytes: int = 1 << 30
    gemm_size: int = 8192
    replay_kernels: int = 1000
    tick_prompts: int = 64
    tick_samples: int = 4
    tick_new_tokens: int = 256
    tick_ticks: int = 3
    recipe_ticks: int = 25
    recipe_eval_every: int = 5
    train_microbatch_tokens: int = 16384  # --trainer.max-tokens-per-microbatch
    train_group_size: int = 8  # samples a prompt
    train_prompt_tokens: int = 512
    train_completion_tokens: int = 1536  # a row: 2,048 tokens; a group: one 16,384-token micro-batch
    train_groups: int = 4  # groups (micro-batches) a step (trainer_sections.GROUPS: fewer at 7B)
    train_lora_rank: int = 16
    train_warmup: int = 1  # steps before the timed ones, each case
    train_steps: int = 2  # timed steps, each case
    train_compile: bool = False  # --train-compile: a case with --trainer.compile layers too (opt-in)


def sizes(*, smoke: bool, device: str, recipe_ticks: int = 25, recipe_eval_every: int = 5,
          train_compile: bool = False) -> Sizes:
    if not smoke:
        return Sizes(smoke=False, device=device, recipe_ticks=recipe_ticks, recipe_eval_every=recipe_eval_every,
                     train_compile=train_compile)
    # fp32: the CPU's bf16 paths compile C kernels on first use, which a dry run need not wait for.
    return Sizes(smoke=True, device=device, dtype="float32", rows=(2, 4), widths=(64, 128), prompt_tokens=12,
                 new_tokens=9, repeats=1, profile_rows=2, copy_bytes=1 << 22, gemm_size=128, replay_kernels=50,
                 tick_prompts=2, tick_samples=2, tick_new_tokens=8, tick_ticks=2, recipe_ticks=2, recipe_eval_every=1,
                 train_microbatch_tokens=256, train_group_size=4, train_prompt_tokens=24, train_completion_tokens=40,
                 train_groups=2, train_lora_rank=4, train_steps=1, train_compile=train_compile)


def build_model(name: str, *, dtype: str, device: str, seed: int = 0):
    """A random-init model of shape ``name`` (``SHAPES``), built directly on ``device`` in ``dtype``
    (no fp32 copy, nothing read or written on disk), seeded (the caller's RNG untouched), in eval
    mode. EOS 2, pad 0, BOS 1 (the ids the tests' tiny tokenizer uses)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    family, shape = SHAPES[name]
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
    config = config_cls(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    previous = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if str(device).startswith("cuda"):
            torch.cuda.manual_seed(seed)
        torch.set_default_dtype(getattr(torch, dtype))
        try:
            with torch.device(device):
                model = model_cls(config)
        finally:
            torch.set_default_dtype(previous)
    return model.to(getattr(torch, dtype)).eval()


def num_params(model) -> int:
    """Unique parameters (a tied embedding counted once: it is also the LM head's matmul)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def static_decoder_of(engine):
    """The engine's static decoder (``engine.static_decoder``; ``engine._static`` before that
    property existed), or None: not built yet, fallen back to HF's modules, or renamed."""
    decoder = getattr(engine, "static_decoder", None)
    return decoder if decoder is not None else getattr(engine, "_static", None)


def decoder_counters(engine) -> dict:
    """The static decoder's counters and its state's slots and width (None where absent)."""
    decoder = static_decoder_of(engine)
    found = {name: getattr(decoder, name, None) if decoder is not None else None
             for name in ("num_steps", "num_captures", "capture_seconds", "num_calls", "cuda_graphs")}
    state = getattr(decoder, "state", None)
    found["slots"] = getattr(state, "capacity", None) if state is not None else None
    found["width"] = getattr(state, "width", None) if state is not None else None
    return found


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
