"""Weights & Biases, beside TensorBoard (``--run.wandb-project NAME``).

One W&B run, on the reporting rank (the evaluator's first rank; global rank 0 without evaluator),
logs:

- every metric of every executor each tick, with the tick as its step, under the TensorBoard tag
  (``<executor>/<section>/<key>``): the same reduced values ``metrics/<executor>.jsonl`` holds.
  Each executor's first rank reports its own, so they are gathered over WORLD once per tick
  (``gather_json``; only when W&B is asked for, on every rank alike);
- each evaluation's accuracy (``eval/accuracy``, at the step it was made after) and a table of its
  rollouts (``eval/rollouts``: question, reference, the policy's text and the environment's
  observations apart, the turns as JSON, the score);
- with ``--run.log-samples``, the training samples of the tick before each evaluation that this
  rank wrote (``train/samples``).

A resumed run (``--checkpoint.resume``) continues the same W&B run: the run's id is kept in
``<run>/wandb_run_id`` (plain text, written by the reporting rank when the run starts) and passed
back to ``wandb.init(id=..., resume="allow")``, so its charts go on where the first segment's
stopped. W&B's steps only grow: ticks the first segment logged after the checkpoint it resumes from
keep their first values in W&B (the run directory moves those ticks' files into
``abandoned-<time>/``; W&B's ``resume_from`` rewinding is left out: a beta that offline runs lack).
A fresh run in the same directory starts a new W&B run, and ``WANDB_RUN_ID`` in the environment,
W&B's own way, wins over the file.

``WANDB_MODE=offline`` needs no key and writes the run under ``$WANDB_DIR`` (default: the run
directory), to upload later with ``wandb sync``. A missing ``wandb`` package, a missing key in
online mode or a failed ``wandb.init`` is one warning line and the run goes on with TensorBoard;
a failed ``log`` call later is one warning line and W&B is dropped for the rest of the run.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger("llamarl.wandb")

TABLE_COLUMNS = ["step", "question", "reference", "policy", "observation", "turns", "score"]
"""The rollout tables' columns (``policy`` / ``observation``: every turn's text, one per line block)."""

TURN_SEPARATOR = "\n---\n"

RUN_ID_FILE = "wandb_run_id"
"""Where a run directory keeps its W&B run's id (module docstring)."""

_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def run_id(run_dir: Path, *, resumed: bool) -> tuple[str, bool]:
    """``(id, continued)``: the id ``RUN_ID_FILE`` holds when ``resumed`` (continued True), else a new
    one, then recorded there. A file that is not an id is one warning line and a new run."""
    path = run_dir / RUN_ID_FILE
    if resumed and path.is_file():
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        if _RUN_ID.fullmatch(text):
            return text, True
        logger.warning("%s does not hold a W&B run id (%r); the resumed run starts a new W&B run", path, text[:80])
    new = secrets.token_hex(4)  # wandb's own ids are 8 lowercase alphanumerics too
    path.write_text(new + "\n", encoding="utf-8")
    return new, False


def gather_json(payload: dict, *, device: torch.device, world_size: int) -> list[dict]:
    """Every rank's ``payload`` (JSON), on every rank, in rank order. Collective over WORLD (two
    small collectives; none in a world of one rank)."""
    if world_size == 1:
        return [payload]
    data = json.dumps(payload).encode("utf-8")
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.all_reduce(size, op=dist.ReduceOp.MAX)
    # Padded with spaces: JSON allows trailing white space.
    buffer = torch.full((int(size.item()),), ord(" "), dtype=torch.uint8, device=device)
    if data:
        buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    gathered = [torch.empty_like(buffer) for _ in range(world_size)]
    dist.all_gather(gathered, buffer)
    return [json.loads(bytes(t.cpu().tolist()).decode("utf-8")) for t in gathered]


def rollout_rows(step: int, records: list[dict], *, score_key: str) -> list[list]:
    """``TABLE_COLUMNS`` rows of evaluation (``score``) or training (``reward``) records with ``turns``."""
    rows = []
    for r in records:
        turns = r.get("turns") or [{"policy": r.get("completion", ""), "observation": None}]
        rows.append([step, r.get("question") or "", r.get("reference") or "",
                     TURN_SEPARATOR.join(t["policy"] for t in turns),
                     TURN_SEPARATOR.join(t["observation"] for t in turns if t["observation"] is not None),
                     json.dumps(turns), float(r.get(score_key, 0.0))])
    return rows


class WandbLog:
    """The W&B run of a training run (module docstring); ``start`` makes one or says why not."""

    def __init__(self, run) -> None:
        self.run = run

    @classmethod
    def start(cls, *, project: str, name: str | None, entity: str | None, run_dir: Path,
              config: dict | None = None, resumed: bool = False) -> WandbLog | None:
        """A W&B run in ``project``, or None after one warning line; ``resumed``: this segment
        resumes a checkpoint, so the run directory's W&B run continues (module docstring)."""
        try:
            import wandb
        except ImportError as exc:
            logger.warning("--run.wandb-project %s: wandb cannot be imported (%s; pip install wandb); logging to "
                           "TensorBoard only", project, exc)
            return None
        mode = os.environ.get("WANDB_MODE", "online").lower()
        try:
            if mode not in ("offline", "dryrun", "disabled") and not _has_api_key(wandb):
                logger.warning("--run.wandb-project %s: no W&B API key (wandb login, WANDB_API_KEY, or "
                               "WANDB_MODE=offline); logging to TensorBoard only", project)
                return None
            identity = {}
            if not os.environ.get("WANDB_RUN_ID"):
                identity["id"], continued = run_id(run_dir, resumed=resumed)
                if continued:
                    identity["resume"] = "allow"
            run = wandb.init(project=project, name=name or run_dir.name, entity=entity, config=config,
                             dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
                             settings=wandb.Settings(console="off", silent=True), **identity)
        except Exception as exc:  # noqa: BLE001 - a logger must not end the run
            logger.warning("--run.wandb-project %s: wandb.init failed (%s: %s); logging to TensorBoard only",
                           project, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return None
        logger.info("W&B run %s, id %s%s (%s)", run.name, run.id, ", continued" if identity.get("resume") else "",
                    getattr(run, "dir", ""))
        return cls(run)

    def _call(self, what: str, fn) -> None:
        if self.run is None:
            return
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a logger must not end the run
            logger.warning("W&B %s failed (%s: %s); no more W&B logging in this run", what, type(exc).__name__, exc)
            self.run = None

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """One tick's metrics, keyed by their TensorBoard tags."""
        if metrics:
            self._call("log", lambda: self.run.log(metrics, step=step))

    def log_evaluation(self, step: int, accuracy: float, records: list[dict],
                       samples: list[dict] | None = None) -> None:
        """An evaluation after ``step`` ticks: its accuracy and the table of its rollouts (the
        ``eval_*.jsonl`` records), and the latest training samples when given."""
        def log() -> None:
            import wandb

            values = {"eval/accuracy": accuracy,
                      "eval/rollouts": wandb.Table(columns=TABLE_COLUMNS,
                                                   data=rollout_rows(step, records, score_key="score"))}
            if samples:
                values["train/samples"] = wandb.Table(columns=TABLE_COLUMNS,
                                                      data=rollout_rows(step, samples, score_key="reward"))
            self.run.log(values, step=step)
        self._call("evaluation log", log)

    def close(self) -> None:
        self._call("finish", lambda: self.run.finish())
        self.run = None


def _has_api_key(wandb) -> bool:
    """Whether a key is configured (``WANDB_API_KEY`` or ``wandb login``'s netrc), without prompting."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return bool(wandb.login(prompt=False, verify=False))
    except Exception:  # noqa: BLE001 - an unknown wandb version: let init decide
        return True
