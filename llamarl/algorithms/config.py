"""The RL algorithm's settings (``--algo.*``): the registered policy loss and advantage estimator
(``registered.py``), their coefficients and presets, the proximal policy and staleness control;
and the one check that ties them to a pipeline's lag (``check_wait_meets_lag``).

A dataclass parsed by tyro at a recipe's entry point (``llamarl/rl/config.py`` composes every
section): every field has a docstring (tyro shows it in ``--help``), and it checks itself in
``__post_init__``, raising ``ValueError`` with one line naming the flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from llamarl.algorithms.registered import ADVANTAGES, POLICY_LOSSES
from llamarl.runtime.errors import check_flag

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
    """Policy loss, by registered name (``llamarl.algorithms.registered.register_policy_loss``): built in
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
        check_flag(self.loss in POLICY_LOSSES, f"--algo.loss {self.loss!r} is not registered; known: {POLICY_LOSSES.names()}")
        check_flag(self.mismatch == "none" or POLICY_LOSSES.get(self.loss).needs_prox,
                   f"--algo.mismatch {self.mismatch} corrects the behaviour weight of a loss with a proximal policy "
                   f"(decoupled_ppo, dapo, gspo, gspo_token, cispo); --algo.loss {self.loss} has none")
        check_flag(self.mismatch == "none" or self.prox == "recompute",
                   f"--algo.mismatch {self.mismatch} needs --algo.prox recompute (the log-linear proximal policy "
                   "equals the behaviour policy at staleness 0: it cannot see the mismatch)")
        check_flag(self.mismatch_cap > 1, f"--algo.mismatch-cap must be > 1, got {self.mismatch_cap}")
        check_flag(self.dual_clip is None or self.dual_clip > 1, f"--algo.dual-clip must be > 1, got {self.dual_clip}")
        check_flag(self.eps_low is None or 0 < self.eps_low <= 1, f"--algo.eps-low must be in (0, 1], got {self.eps_low}")
        check_flag(self.eps_high is None or self.eps_high > 0, f"--algo.eps-high must be > 0, got {self.eps_high}")
        check_flag(self.loss_agg_length is None or self.loss_agg_length >= 1,
                   f"--algo.loss-agg-length must be >= 1, got {self.loss_agg_length}")
        check_flag(self.max_refill >= 0, f"--algo.max-refill must be >= 0 (0: no dynamic sampling), got {self.max_refill}")
        check_flag(math.isfinite(self.entropy_coef), f"--algo.entropy-coef must be finite, got {self.entropy_coef}")
        check_flag(self.adv_pos_weight >= 0 and self.adv_neg_weight >= 0,
                   "--algo.adv-pos-weight and --algo.adv-neg-weight must be >= 0")
        check_flag(self.advantage in ADVANTAGES,
                   f"--algo.advantage {self.advantage!r} is not registered; known: {ADVANTAGES.names()}")
        check_flag(self.rho > 0, f"--algo.rho must be > 0, got {self.rho}")
        check_flag(0 < self.eps_clip < 1, f"--algo.eps-clip must be in (0, 1), got {self.eps_clip}")
        check_flag(self.max_staleness is None or self.max_staleness >= 0, "--algo.max-staleness must be >= 0")
        check_flag(self.stale_policy in ("drop", "wait"),
                   f"--algo.stale-policy must be 'drop' or 'wait', got {self.stale_policy!r}")
        check_flag(self.stale_policy == "drop" or self.max_staleness is not None,
                   "--algo.stale-policy wait needs --algo.max-staleness (the bound to wait for)")


def check_wait_meets_lag(algo: AlgoConfig | None, lag: int, *, why: str = "") -> None:
    """ValueError when ``--algo.stale-policy wait``'s eta is below the pipeline's ``lag``: every
    sample would be too old, so none could ever be trained. ``why``: the flags that made the lag."""
    if algo is not None and algo.stale_policy == "wait" and algo.max_staleness is not None \
            and algo.max_staleness < lag:
        raise ValueError(f"--algo.max-staleness {algo.max_staleness} is below the pipeline's lag ({lag} versions"
                         f"{': ' + why if why else ''}): --algo.stale-policy wait could never train a sample")
