"""A run's evaluations and the history a resumed run continues (part of ``llamarl/run/runner.py``).

``Evaluations`` owns what ``summary.json`` says about time and accuracy: every evaluation made
(step, seconds into the run, accuracy, the evaluator's weight version), the wall seconds of every
segment of a resumed run and the steps it resumed from. Evaluations are made before the first tick
(the base model), after every ``--run.eval-every`` ticks and after the last tick.

Its ``state()`` goes into each checkpoint (``runner_state.json``, ``llamarl/run/checkpoints.py``),
and a resumed run starts from the state of its checkpoint, so the summary describes the whole run:
``evals`` lists every evaluation of the whole run, ``wall_seconds`` counts every segment (each up
to its last recorded state), ``resumed_from_step`` lists the steps resumed from (``[]`` for a run
never resumed), and evaluation ``seconds`` continue across segments. A resumed run reuses the first
run's base evaluation, and an evaluation due at step n that the interrupted run did not record (it
died during it) is made by the run resumed at n before its first tick.

Only the ranks of the evaluator's first data-parallel replica evaluate (collective over a TP
group); the first of them reports (the log line, and ``on_evaluation``: the W&B table).

A run without held-out problems (``--run.num-eval-problems 0``, or no evaluator stage) evaluates
nothing: no accuracy is logged, and ``summary.json`` has no accuracy entries.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from llamarl.data.prompts import Problem
from llamarl.run.config import RunConfig
from llamarl.runtime.checkpoint import ResumePoint

logger = logging.getLogger("llamarl.runner")


class Evaluations:
    """Greedy held-out evaluations of one run, and its resumable history (module docstring)."""

    def __init__(self, *, evaluator, stage: str | None, heldout: list[Problem] | None,
                 score: Callable[[str, str], float] | None, run: RunConfig, run_dir: Path, rank: int,
                 evaluates: bool, reports: bool, resume: ResumePoint, wall_start: float) -> None:
        """``evaluates``: this rank evaluates (a rank of the evaluator's first replica); ``reports``:
        it logs each evaluation (the first of them); ``wall_start``: when this segment of the run
        started (``time.time()``), for ``elapsed``."""
        # No held-out problems: nothing to evaluate (no accuracy of an empty set is reported).
        self.evaluator, self.stage = evaluator, stage if heldout else None
        self.heldout, self.score, self.run_dir = heldout, score, run_dir
        self.on_evaluation: Callable[[int, float, Path], None] | None = None
        """Called on the reporting rank after each evaluation: (step, accuracy, its samples file)."""
        self.rank, self.evaluates, self.reports = rank, evaluates, reports
        self.eval_every, self.max_steps, self.device_guard = run.eval_every, run.max_steps, run.device_guard
        self.resume, self.wall_start = resume, wall_start
        restored = resume.restored
        # Seconds the run had spent up to the state resumed from: wall time and evaluation times continue.
        self.elapsed_before = float(restored.get("elapsed_seconds", 0.0))
        self.records: list[dict] = list(restored.get("evals", []))
        resumed_at = resume.resumed_at
        self.resumed_from = [*restored.get("resumed_from_step", []), resumed_at] if resumed_at is not None else []
        self.spans: list[dict] = []  # one of kind ``eval`` per evaluation, for the timeline
        self.base_accuracy: float | None = None
        self.final_accuracy: float | None = None

    def elapsed(self) -> float:
        """Seconds of the whole run so far (every segment)."""
        return self.elapsed_before + time.time() - self.wall_start

    def state(self) -> dict:
        """What a checkpoint keeps of the history (``runner_state.json``)."""
        return {"elapsed_seconds": self.elapsed(), "evals": self.records, "resumed_from_step": self.resumed_from}

    def due(self, step: int) -> bool:
        """An evaluation between ticks is due after ``step`` ticks (the same answer on every rank)."""
        every = self.eval_every
        return self.stage is not None and every > 0 and step % every == 0 and 0 < step < self.max_steps

    def evaluate(self, step: int, samples_name: str) -> float:
        """The evaluator's held-out accuracy now, recorded and drawn as a span of kind ``eval``."""
        start = time.time()
        if getattr(self.evaluator, "num_threads", None):
            torch.set_num_threads(self.evaluator.num_threads)
        accuracy = self.evaluator.evaluate(self.heldout, self.score, samples_path=self.run_dir / samples_name)
        self.spans.append({"executor": self.stage, "rank": self.rank, "step": step, "start": start,
                           "end": time.time(), "kind": "eval"})
        self.record(step, accuracy)
        if self.reports and self.on_evaluation is not None:
            self.on_evaluation(step, accuracy, self.run_dir / samples_name)
        return accuracy

    def record(self, step: int, accuracy: float) -> None:
        version = getattr(self.evaluator, "version", None)
        self.records.append({"step": step, "seconds": self.elapsed(), "accuracy": accuracy, "version": version})
        if self.reports:
            logger.info("eval after %d ticks: greedy accuracy %.1f%% (weights version %s, %.0f s into the run)",
                        step, 100 * accuracy, version, self.records[-1]["seconds"])

    def base(self) -> None:
        """Before the first tick (on the ranks that evaluate): the base model's accuracy. A resumed
        run's weights are not the base model's: it reuses the first run's base evaluation, and makes
        the evaluation due at its checkpoint's step if the interrupted run died before it."""
        resume_dir, start_step = self.resume.directory, self.resume.step
        if self.stage is None:
            return
        if resume_dir is None:
            self.base_accuracy = self.evaluate(0, "eval_base.jsonl")
            return
        base = next((e["accuracy"] for e in self.records if e["step"] == 0), None)
        earlier = resume_dir.parents[1] / "eval_base.jsonl"
        if base is None and earlier.is_file():
            scores = [json.loads(line)["score"] for line in earlier.read_text().splitlines() if line.strip()]
            base = sum(scores) / max(len(scores), 1)
        if base is not None:
            self.base_accuracy = base
        if self.due(start_step) and not any(e["step"] == start_step for e in self.records):
            self.evaluate(start_step, f"eval_step_{start_step}.jsonl")

    def between_ticks(self, step: int) -> None:
        """The evaluation due after ``step`` ticks, on the ranks that evaluate (collective over the
        evaluator's TP group), under the device guard (``--run.device-guard``)."""
        if self.evaluates and self.stage is not None:
            with torch.device("meta") if self.device_guard else contextlib.nullcontext():
                self.evaluate(step, f"eval_step_{step}.jsonl")

    def final(self) -> None:
        """After the last tick, with the final weights (the caller holds the device guard)."""
        if self.evaluates and self.stage is not None:
            self.final_accuracy = self.evaluate(self.max_steps, "eval_final.jsonl")

    def summary(self) -> dict:
        """What ``summary.json`` says of accuracy and time, in its order: ``base_accuracy`` (when
        known), ``final_accuracy`` and every evaluation (``evals``) on a rank that evaluated, then
        ``num_steps``, ``wall_seconds`` (now) and ``resumed_from_step``."""
        result: dict = {}
        if self.base_accuracy is not None:
            result["base_accuracy"] = self.base_accuracy
        if self.final_accuracy is not None:
            result.update(final_accuracy=self.final_accuracy, evals=self.records)
        return {**result, "num_steps": self.max_steps, "wall_seconds": self.elapsed(),
                "resumed_from_step": self.resumed_from}
