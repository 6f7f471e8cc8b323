"""Rollouts you can read: training samples (``--run.log-samples N``) and the turns of an episode.

``SampleLog`` writes, each tick, the first N scored samples that the executor consuming them (the
trainer) receives on its first rank, one JSON line each, to ``<run>/samples.jsonl``:

- ``step``: the tick that trains them; ``group``: the prompt's data index; ``reward``;
- ``weights_version``: the newest weight version any of its sampled tokens came from, and
  ``oldest_weights_version``: the oldest (they differ when a sample was carried over ticks,
  ``--generator.token-budget``);
- ``question`` (the problem's text) and ``prompt`` (the prompt's tokens decoded, chat template
  and all, when the receiving executor holds a tokenizer);
- ``turns``: the completion as ``[{"policy": ..., "observation": ...}, ...]``: each run of
  sampled (trained) tokens, followed by the environment's answer to it (``null`` when none: the
  last turn, or a completion without environment). The split follows the loss mask, each run
  decoded on its own (``llamarl.rewards.trajectory.trajectory_of``), so joining the texts gives
  back the completion, and what was trained is exactly the ``policy`` texts;
- ``finish_reason``, ``num_turns`` (tool calls answered) and ``env_reward``.

It taps the ``set_input`` of this rank's executors (``attach``): a non-empty batch that carries
``rewards`` and a ``trajectory`` string is sampled as it arrives. A resumed run drops the lines of
ticks it runs again, as the metric files do. Evaluation files (``eval_*.jsonl``) carry the same
``turns`` per episode (``turns_of``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger("llamarl.samples")

SAMPLES_FILE = "samples.jsonl"


def turns_of(segments) -> list[dict]:
    """An episode's segments (``Segment`` objects or ``{"text", "trained"}`` dicts, in order) as
    turns: ``{"policy": the sampled text, "observation": the environment's answer or None}``."""
    turns: list[dict] = []
    for segment in segments:
        text, trained = (segment["text"], segment["trained"]) if isinstance(segment, dict) else \
            (segment.text, segment.trained)
        if trained:
            turns.append({"policy": text, "observation": None})
        elif turns and turns[-1]["observation"] is None:
            turns[-1]["observation"] = text
        else:  # an observation with no policy text before it
            turns.append({"policy": "", "observation": text})
    return turns


def sample_rows(batch, *, limit: int, step: int, tokenizer=None) -> list[dict]:
    """The first ``limit`` rows of a scored rollout batch as ``samples.jsonl`` records (module docstring)."""
    count = min(limit, len(batch))
    if count <= 0:
        return []
    with torch.device("cpu"):  # the device guard may hold the default device on meta
        rows = batch.select(torch.arange(count, device=batch.device)).to("cpu")
        strings = rows.string_fields
        trajectories = [json.loads(t) for t in rows.get_strings("trajectory")]
        questions = rows.get_strings("question") if "question" in strings else [None] * count
        prompts = [None] * count
        if tokenizer is not None and "prompt_len" in rows:
            prompts = [tokenizer.decode(rows["input_ids"][i, : int(rows["prompt_len"][i])].tolist())
                       for i in range(count)]
        records = []
        for i in range(count):
            versions = []
            if "versions" in rows and "loss_mask" in rows:
                sampled = rows["versions"][i][rows["loss_mask"][i].bool()]
                versions = sampled[sampled >= 0].tolist()
            trajectory = trajectories[i]
            records.append({
                "step": step,
                "group": int(rows["group_ids"][i]) if "group_ids" in rows else None,
                "reward": float(rows["rewards"][i]),
                "weights_version": max(versions, default=None),
                "oldest_weights_version": min(versions, default=None),
                "question": questions[i], "prompt": prompts[i],
                "turns": turns_of(trajectory.get("segments", [])),
                "finish_reason": trajectory.get("finish_reason"), "num_turns": trajectory.get("num_turns", 0),
                "env_reward": trajectory.get("env_reward")})
    return records


class SampleLog:
    """``--run.log-samples N``: this rank's part of ``<run>/samples.jsonl`` (module docstring)."""

    def __init__(self, run_dir: Path, *, count: int, start_step: int = 0) -> None:
        self.count, self.path = count, run_dir / SAMPLES_FILE
        self.written: dict[int, int] = {}  # tick -> lines written this run
        self.latest: list[dict] = []  # the last tick's records (for the W&B table)
        self.file = None
        if count > 0 and start_step > 0 and self.path.exists():
            kept = [line for line in self.path.read_text(encoding="utf-8").splitlines()
                    if line.strip() and json.loads(line).get("step", 0) < start_step]
            self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    def attach(self, executors: dict, contexts: dict) -> None:
        """Tap the ``set_input`` of each executor whose first rank this is."""
        if self.count <= 0:
            return
        for name, executor in executors.items():
            if contexts[name].local_rank == 0:
                self._tap(executor)

    def _tap(self, executor) -> None:
        set_input = executor.set_input

        def sampling_set_input(name, batch):
            self.record(executor, batch)
            set_input(name, batch)

        executor.set_input = sampling_set_input

    def record(self, executor, batch) -> None:
        """Write the first rows of ``batch`` if it is a scored rollout batch (and the tick wants more)."""
        if not len(batch) or "rewards" not in batch or "trajectory" not in batch.string_fields:
            return
        step = int(getattr(executor, "current_step", 0))
        limit = self.count - self.written.get(step, 0)
        records = sample_rows(batch, limit=limit, step=step, tokenizer=getattr(executor, "tokenizer", None))
        if not records:
            return
        if self.file is None:
            self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self.file.write("".join(json.dumps(r) + "\n" for r in records))
        self.file.flush()
        self.written[step] = self.written.get(step, 0) + len(records)
        self.latest = records if step != getattr(self, "_latest_step", None) else self.latest + records
        self._latest_step = step

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
