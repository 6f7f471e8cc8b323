"""A pipeline is data: its stages (executors on their ranks) and the channels between them.

A recipe describes its pipeline and hands it to ``llamarl.run.runner.run_pipeline``, which makes the
world, builds this rank's executor from its stage, wires the channels and the controller, and runs
metrics, evaluation, checkpoints and the summary. The runner never asks what an executor *is*:
everything it needs is in the description.

    Pipeline(
        stages=[Stage("generator", build=gen_config.build, num_ranks=1, headline=("gen_tokens_per_s",)),
                Stage("reward", build=reward_config.build, num_ranks=1),
                Stage("trainer", build=trainer_config.build, num_ranks=None)],   # None: the other ranks
        channels=[ChannelSpec("rollouts", "generator", "reward", "scatter", same_tick=True),
                  ChannelSpec("scored", "reward", "trainer", "scatter"),
                  ChannelSpec("weights", "trainer", "generator", "weights")],
        evaluator="generator")

Stages take consecutive global ranks in the order listed, which is also the data order the
controller walks each tick (a same-tick channel must go forward in it, see llamarl/run/controller.py).

Placement: a stage with ``colocate_with="trainer"`` takes no ranks of its own and runs on the
trainer's, in the same processes (co-resident); it steps at its place in the stage order, and a
channel between co-resident stages is handed over in memory (``llamarl/channels/in_memory.py``).
``Pipeline.colocated()`` puts every stage on every rank: the one-process / one-GPU placement.
A ``weights`` channel is a ``WeightsChannel`` (DDMA by default): it also runs once after ``init``,
so both ends start from bit-identical weights, and once after the last tick, before the final
evaluation. Every other kind is a ``CommunicationChannel``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from llamarl.channels.base import (
    BROADCAST,
    GATHER,
    SCATTER,
    CommunicationChannel,
    check_delivery_order,
    check_endpoints,
)
from llamarl.channels.in_memory import InMemoryChannel, InMemoryWeights
from llamarl.channels.weights import MODES, WeightsChannel
from llamarl.runtime.world import ExecutorSpec

if TYPE_CHECKING:
    from llamarl.runtime.executor import Executor
    from llamarl.runtime.world import ExecutorContext

KINDS = {"broadcast": BROADCAST, "scatter": SCATTER, "gather": GATHER}
"""Data channel kinds by name; ``weights`` is the fourth kind (a WeightsChannel)."""


@dataclass
class Stage:
    """One executor of a pipeline: its name, how to build it, its ranks and its parallelism."""

    name: str
    """The executor's name: unique, used by channels, metrics files, checkpoints and logs."""
    build: Callable[[ExecutorContext], Executor]
    """Makes this rank's executor once the world exists (typically a config's ``build`` method);
    called only on the stage's own ranks, with their ``ExecutorContext``."""
    num_ranks: int | None = 1
    """Ranks the stage owns; ``None`` for the ranks the other stages leave (at most one stage)."""
    ranks_flag: str | None = None
    """The command-line flag that sets ``num_ranks`` (``--ref.num-ranks``): the error for a world too
    small for the split names it (None: the stage's name)."""
    tp: int = 1
    """Tensor-parallel degree: the stage's mesh is 2-D ``(dp, tp)`` when > 1."""
    device: str = "auto"
    """``auto``: each rank's GPU on a CUDA node (the host for ranks beyond its GPUs); ``cpu``: the
    host even where GPUs exist (llamarl/runtime/placement.py: a stage that needs no GPU, e.g. a scorer)."""
    headline: tuple[str, ...] = ()
    """Metric keys of this executor shown on rank 0's progress bar (those it reports each tick)."""
    colocate_with: str | None = None
    """Another stage (one with ranks of its own) whose ranks this one shares: both executors live on
    each of those ranks and step one after the other in stage order; channels between them hand batches over in
    memory and a weights channel copies in place. ``num_ranks`` is then ignored. None: ranks of its own."""

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"a stage needs a non-empty name without '/', got {self.name!r}")
        if self.num_ranks is not None and self.num_ranks < 1:
            raise ValueError(f"stage {self.name!r}: num_ranks must be >= 1 (or None for the rest), got {self.num_ranks}")
        if self.tp < 1:
            raise ValueError(f"stage {self.name!r}: tp must be >= 1, got {self.tp}")


@dataclass
class ChannelSpec:
    """A channel between two stages: what moves, from whom to whom, and when it arrives."""

    name: str
    """The channel's name: the outbound executor's ``get_output(name)`` feeds the inbound's
    ``set_input(name, batch)`` (weights: ``get_model()`` on both ends)."""
    outbound: str
    """The sending stage."""
    inbound: str
    """The receiving stage."""
    kind: str
    """``broadcast``, ``scatter``, ``gather`` (see llamarl/channels/base.py) or ``weights``."""
    same_tick: bool = False
    """True: delivered within the tick, right before the inbound executor steps (its outbound must
    come earlier in the stage order). False: what was produced at tick t arrives at tick t + 1."""
    weights_mode: str = "ddma"
    """``weights`` channels only: ``ddma`` (each shard straight to the ranks that need it) or
    ``gather_broadcast``."""
    weights_bucket_mb: float = 0.0
    """``weights`` channels: the bound on one bucket in MiB (``WeightsChannel.bucket_mb``; 0: none)."""

    def __post_init__(self) -> None:
        if self.kind not in (*KINDS, "weights"):
            raise ValueError(f"channel {self.name!r}: kind must be one of {sorted((*KINDS, 'weights'))}, "
                             f"got {self.kind!r}")
        if self.weights_mode not in MODES:
            raise ValueError(f"channel {self.name!r}: weights_mode must be one of {MODES}, got {self.weights_mode!r}")

    def build(self, *, in_memory: bool = False):
        """The channel object the controller runs; ``in_memory`` for one between co-resident stages
        (``llamarl/channels/in_memory.py``)."""
        if in_memory:
            cls = InMemoryWeights if self.kind == "weights" else InMemoryChannel
            return cls(self.name, self.outbound, self.inbound, same_tick=self.same_tick)
        if self.kind == "weights":
            return WeightsChannel(self.name, self.outbound, self.inbound, mode=self.weights_mode,
                                  same_tick=self.same_tick, bucket_mb=self.weights_bucket_mb)
        return CommunicationChannel(self.name, self.outbound, self.inbound, KINDS[self.kind], same_tick=self.same_tick)


@dataclass
class Pipeline:
    """Stages (in rank and data order), channels, and which stage evaluates."""

    stages: list[Stage]
    """The executors, in the order they take ranks and step within a tick."""
    channels: list[ChannelSpec]
    """Data and weight channels between stages."""
    evaluator: str | None = None
    """The stage whose executor has ``evaluate(problems, score, *, samples_path) -> accuracy``:
    it evaluates before training, every ``--run.eval-every`` ticks and after the last one, and its
    first rank writes ``summary.json``. None: no evaluation."""
    title: str = ""
    """A short description for the timeline picture (e.g. ``async (lag 1)``)."""
    summary: dict = field(default_factory=dict)
    """Extra entries of ``summary.json`` (e.g. the schedule and the loss)."""

    def __post_init__(self) -> None:
        names = [s.name for s in self.stages]
        if not names:
            raise ValueError("a pipeline needs at least one stage")
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        for stage in self.stages:
            host = next((s for s in self.stages if s.name == stage.colocate_with), None)
            if stage.colocate_with is not None and (host is None or host.colocate_with is not None):
                raise ValueError(f"stage {stage.name!r} shares the ranks of {stage.colocate_with!r}, which must be a "
                                 f"stage with ranks of its own; stages {names}")
        if sum(s.num_ranks is None for s in self.stages if s.colocate_with is None) > 1:
            raise ValueError("at most one stage may take the remaining ranks (num_ranks=None)")
        channel_names = [c.name for c in self.channels]
        if len(set(channel_names)) != len(channel_names):
            raise ValueError(f"channel names must be unique, got {channel_names}")
        check_endpoints(self.channels, names)
        for channel in self.channels:
            if self.in_memory(channel) and channel.kind == "weights" and self.stage(channel.inbound).tp != 1:
                raise ValueError(f"weights channel {channel.name!r} between co-resident stages copies in place and "
                                 f"needs stage {channel.inbound!r} at tp 1, got tp {self.stage(channel.inbound).tp}")
        check_delivery_order(self.channels, names)
        if self.evaluator is not None and self.evaluator not in names:
            raise ValueError(f"evaluator {self.evaluator!r} is not one of the stages {names}")

    @property
    def order(self) -> list[str]:
        """Stage names in data order."""
        return [s.name for s in self.stages]

    def stage(self, name: str) -> Stage:
        """The stage called ``name``."""
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"no stage {name!r} in {self.order}")

    def host(self, name: str) -> str:
        """The stage whose ranks stage ``name`` runs on (itself unless co-resident)."""
        return self.stage(name).colocate_with or name

    def in_memory(self, channel: ChannelSpec) -> bool:
        """Whether ``channel`` joins two co-resident stages (handed over in memory on each rank)."""
        return self.host(channel.outbound) == self.host(channel.inbound)

    def colocated(self) -> Pipeline:
        """This pipeline with every stage on every rank (``--run.schedule colocated``): the first
        stage takes the whole world, the others share its ranks (and so its device); channels and
        order unchanged."""
        first, *rest = self.stages
        stages = [replace(first, num_ranks=None, colocate_with=None),
                  *(replace(s, colocate_with=first.name, device="auto") for s in rest)]
        return replace(self, stages=stages)

    def specs(self, world_size: int) -> list[ExecutorSpec]:
        """Rank counts for ``world_size`` ranks (the ``None`` stage gets what the others leave; a
        co-resident stage its host's).

        Raises ValueError naming the stages' flags when the split does not fit the world, or when a
        broadcast / gather channel joins co-resident stages on more than one rank (in memory, each
        rank keeps its own batch: the meaning of scatter between equal rank sets, not of those)."""
        hosts = [s for s in self.stages if s.colocate_with is None]
        fixed = sum(s.num_ranks for s in hosts if s.num_ranks is not None)
        rest = world_size - fixed
        if any(s.num_ranks is None for s in hosts) and rest < 1:
            # The one check of the rank split, for every recipe and every user pipeline.
            split = " + ".join(f"{s.ranks_flag or f'stage {s.name!r}'} {s.num_ranks}" for s in hosts
                               if s.num_ranks is not None)
            rest_stage = next(s.name for s in hosts if s.num_ranks is None)
            raise ValueError(f"{split} + at least 1 {rest_stage} rank = {fixed + 1} > the world size {world_size} "
                             f"(torchrun --nproc-per-node); or use --run.schedule colocated")
        counts = {s.name: rest if s.num_ranks is None else s.num_ranks for s in hosts}
        for channel in self.channels:
            if self.in_memory(channel) and channel.kind in ("broadcast", "gather") \
                    and counts[self.host(channel.inbound)] > 1:
                raise ValueError(f"{channel.kind} channel {channel.name!r} joins co-resident stages on "
                                 f"{counts[self.host(channel.inbound)]} ranks; use scatter (each rank keeps its rows) "
                                 "or give one stage ranks of its own")
        return [ExecutorSpec(s.name, counts[self.host(s.name)], tp=s.tp, colocate_with=s.colocate_with,
                             device=s.device) for s in self.stages]

    def build_channels(self) -> list:
        """Every channel's object, in memory between co-resident stages."""
        return [c.build(in_memory=self.in_memory(c)) for c in self.channels]

    def headline_keys(self) -> list[tuple[str, str]]:
        """``(stage, metric)`` pairs on the progress bar, in stage order."""
        return [(s.name, key) for s in self.stages for key in s.headline]
