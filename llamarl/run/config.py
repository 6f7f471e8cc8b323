"""The run's settings, read by the runner and its objects: the run itself (``--run.*``: ticks,
schedule, seed, directory, timeouts, evaluations, logging), checkpoints (``--checkpoint.*``) and
exports (``--export.*``); ``RunSections``, what ``run_pipeline`` needs of any recipe's config.

Dataclasses parsed by tyro at a recipe's entry point (``llamarl/rl/config.py`` composes every
section): every field has a docstring (tyro shows it in ``--help``), and each config checks itself
in ``__post_init__``, raising ``ValueError`` with one line naming the flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from llamarl.runtime.errors import check_flag


def resume_step(path: str) -> int | None:
    """The tick count ``n`` of a ``.../step_<n>`` checkpoint directory name, else None."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


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
        check_flag(self.log_samples >= 0, f"--run.log-samples must be >= 0, got {self.log_samples}")
        check_flag(self.stop_on_no_signal is None or self.stop_on_no_signal >= 1,
                   f"--run.stop-on-no-signal must be >= 1, got {self.stop_on_no_signal}")
        check_flag(self.wandb_project is None or self.wandb_project.strip() != "",
                   "--run.wandb-project must be a non-empty name")
        check_flag(self.max_steps >= 0, f"--run.max-steps must be >= 0, got {self.max_steps}")
        check_flag(self.collective_timeout_s > 0, "--run.collective-timeout-s must be > 0")
        check_flag(self.liveness_timeout_s > 0, "--run.liveness-timeout-s must be > 0")
        check_flag(self.eval_every >= 0, f"--run.eval-every must be >= 0, got {self.eval_every}")
        check_flag(self.num_eval_problems >= 0, f"--run.num-eval-problems must be >= 0, got {self.num_eval_problems}")


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
    differ from this run's is refused (llamarl/runtime/run_identity.py; docs/troubleshooting.md)."""

    def allowed_changes(self) -> tuple[str, ...]:
        """``allow_changes`` as a tuple of field names."""
        return tuple(part.strip() for part in self.allow_changes.split(",") if part.strip())

    def __post_init__(self) -> None:
        check_flag(self.every >= 0, f"--checkpoint.every must be >= 0, got {self.every}")
        check_flag(self.keep >= 0, f"--checkpoint.keep must be >= 0, got {self.keep}")
        if self.resume is not None and self.resume != "latest":
            check_flag(resume_step(self.resume) is not None,
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
        check_flag(self.every >= 0, f"--export.every must be >= 0, got {self.every}")


class RunSections(Protocol):
    """What the runner (``llamarl.run.runner.run_pipeline``) reads of a recipe's config: a dataclass
    (written whole to ``config.json``) with these three sections. ``RLConfig`` and every recipe's
    config have them; a pipeline of one's own may bring a smaller dataclass."""

    run: RunConfig
    checkpoint: CheckpointConfig
    export: ExportConfig
