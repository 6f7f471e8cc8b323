"""Executor: the unit of work that owns a set of ranks (LlamaRL §4), and the roles it may play.

Subclasses implement ``step`` and whatever of ``get_output`` / ``set_input`` their channels
use. An executor only ever sees its own process group / mesh (``self.ctx.group`` /
``self.ctx.mesh``); it never talks to other executors except through channels.

Roles (``typing.Protocol``s; the runner checks them when it builds a pipeline's executors and
names the stage and what it lacks):

- ``WeightSource``: the outbound end of a ``weights`` channel (the trainer): ``get_model()`` and
  ``version`` (its optimizer-step count).
- ``WeightSink``: the inbound end (the generator): ``get_model()`` (whose parameters are written)
  and ``set_weights_version(version)``; optionally ``get_weight_slices()`` for a tensor-parallel
  model whose parameters are slices of the trainer's, and ``weight_sink()``: a callable that takes
  the sync as an iterator of ``(name, full tensor)`` (the generator with vLLM, whose ``get_model()``
  is then a layout on the meta device; ``llamarl/channels/weights.py``).
- ``Evaluator``: the pipeline's ``evaluator`` stage: ``evaluate(problems, score, *, samples_path)``
  returns the greedy held-out accuracy.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from llamarl.runtime.batch import TensorBatch
from llamarl.runtime.checkpoint_files import written

if TYPE_CHECKING:
    from llamarl.runtime.world import ExecutorContext


class Executor:
    """Base class with the paper's surface. An executor's name is its stage's (``self.ctx.executor``)."""

    metric_specs: ClassVar[dict] = {}
    """``{metric key: llamarl.runtime.metrics.MetricSpec}``: the section and the reduction over this
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

    metric_sections: dict[str, dict[str, float]] | None = None
    """Set instead of ``metrics`` by an executor hosting several roles: one metric section (and
    ``metrics/<section>.jsonl``) per role. None: ``metrics`` under the stage's name."""

    def get_model(self) -> torch.nn.Module | None:
        """The module a weight channel reads (trainer) or writes (generator)."""
        return None

    def close(self) -> None:
        """Release what ``init`` started (worker processes, engines); called once after the run."""

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
        written(directory / f"outputs_rank{self.ctx.local_rank}.safetensors")  # digest for COMPLETE.json

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


@runtime_checkable
class WeightSource(Protocol):
    """The outbound end of a weights channel (module docstring)."""

    version: int

    def get_model(self) -> torch.nn.Module | None: ...


@runtime_checkable
class WeightSink(Protocol):
    """The inbound end of a weights channel (module docstring)."""

    def get_model(self) -> torch.nn.Module | None: ...

    def set_weights_version(self, version: int) -> None: ...


@runtime_checkable
class Evaluator(Protocol):
    """The pipeline's evaluator stage (module docstring)."""

    def evaluate(self, problems: list, score: Callable[[str, str], float], *, samples_path: Path | None = None) -> float:
        ...


def check_roles(executors: dict[str, Executor], *, weight_channels: list, evaluator: str | None) -> None:
    """Raise TypeError naming the stage and the missing role when an executor on this rank is an
    end of one of ``weight_channels``, or the evaluator, without what that role needs."""
    def need(name: str, role: type, what: str) -> None:
        if name in executors and not isinstance(executors[name], role):
            raise TypeError(f"stage {name!r} ({type(executors[name]).__name__}) is {what} but lacks the "
                            f"{role.__name__} role: see llamarl/runtime/executor.py")
    for channel in weight_channels:
        need(channel.outbound, WeightSource, f"the source of weights channel {channel.name!r}")
        need(channel.inbound, WeightSink, f"the sink of weights channel {channel.name!r}")
    if evaluator is not None:
        need(evaluator, Evaluator, "the pipeline's evaluator")
