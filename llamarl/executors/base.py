"""Executor: the unit of work that owns a set of ranks (LlamaRL §4).

Subclasses implement ``step`` and whatever of ``get_output`` / ``set_input`` their channels
use. An executor only ever sees its own process group / mesh (``self.ctx.group`` /
``self.ctx.mesh``); it never talks to other executors except through channels.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from llamarl.batch import TensorBatch

if TYPE_CHECKING:
    from llamarl.world import ExecutorContext


class Executor:
    """Base class with the paper's surface. An executor's name is its stage's (``self.ctx.executor``)."""

    metric_specs: ClassVar[dict] = {}
    """``{metric key: llamarl.metrics.MetricSpec}``: the section and the reduction over this
    executor's ranks of each metric it reports in ``self.metrics`` (undeclared keys are logged with
    the first rank's value)."""

    num_threads: int | None = None
    """torch threads while this executor steps (set by the controller before each step, so that
    co-resident executors each run with their own); None leaves the process's setting."""

    def __init__(self, ctx: ExecutorContext) -> None:
        self.ctx = ctx
        self.current_step = 0
        self.inputs: dict[str, TensorBatch] = {}
        self.outputs: dict[str, TensorBatch] = {}
        self.metrics: dict[str, float] = {}

    def init(self) -> None:
        """Build model / engine / optimizer / data on this executor's mesh. Called once."""

    def set_step(self, step: int) -> None:
        """Tell the executor which tick it is on (before channels and ``step`` run)."""
        self.current_step = step

    def step(self) -> None:
        """One unit of work on what the channels delivered (generate, score, train, ...)."""
        raise NotImplementedError(f"{type(self).__name__} must implement step()")

    def get_output(self, name: str) -> TensorBatch:
        """The batch an outbound channel ``name`` sends; empty when there is nothing yet.

        The default pops ``self.outputs[name]`` so a batch is sent once.
        """
        return self.outputs.pop(name, TensorBatch())

    def set_input(self, name: str, batch: TensorBatch) -> None:
        """Receive the batch an inbound channel ``name`` delivered (replaces the previous one)."""
        self.inputs[name] = batch

    def get_model(self) -> torch.nn.Module | None:
        """The module a weight channel reads (trainer) or writes (generator)."""
        return None

    def export(self, directory: Path) -> None:
        """Write a deployable artefact of this executor's model into ``directory`` (the trainer: an
        HF directory). Called on every rank of every executor when an export is due; the default
        does nothing."""

    def save_checkpoint(self, directory: Path) -> None:
        """Save this executor's own state under ``directory`` (created by the caller).

        The base class saves the outputs not yet sent (a batch produced at this tick leaves at
        the next one), so a resumed run neither loses nor repeats them. Subclasses that add
        state call ``super().save_checkpoint(directory)``.
        """
        tensors = {}
        for name, batch in self.outputs.items():
            tensors[f"{name}.header"], tensors[f"{name}.data"] = batch.encode()
        save_file(tensors, str(directory / f"outputs_rank{self.ctx.local_rank}.safetensors"))

    def load_checkpoint(self, directory: Path) -> None:
        """Restore what ``save_checkpoint`` wrote."""
        path = directory / f"outputs_rank{self.ctx.local_rank}.safetensors"
        if not path.is_file():
            raise ValueError(f"checkpoint {directory} has no {path.name} for this rank")
        try:
            tensors = load_file(str(path))
        except (OSError, SafetensorError) as exc:
            raise ValueError(f"cannot read checkpoint file {path}: {exc}") from None
        names = {key.rsplit(".", 1)[0] for key in tensors}
        self.outputs = {name: TensorBatch.decode(tensors[f"{name}.header"], tensors[f"{name}.data"],
                                                 source=str(path)) for name in names}
