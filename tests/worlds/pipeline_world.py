"""A four-stage toy pipeline run through the library entry point (``run_pipeline``), no model.

source (1 rank) --numbers, same tick, BROADCAST--> double (1 rank) --doubled, next tick, SCATTER-->
sink (the other ranks) and double --audit, same tick, GATHER--> audit (1 rank): a user-written
fourth executor, with its own metrics and headline, that the runner must host without knowing it.
Sink declares how its metrics reduce over its two ranks (sum, max, and a weighted mean).
Each sink rank writes what it received per tick to ``<run>/sink_rank<r>.json``.

usage: pipeline_world.py --run-dir RUN_DIR (the run's ``--run.output-dir``)
"""

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from llamarl.run.config import CheckpointConfig, ExportConfig, RunConfig
from llamarl.run.runner import run_pipeline
from llamarl.run.stages import ChannelSpec, Pipeline, Stage
from llamarl.runtime.batch import TensorBatch
from llamarl.runtime.executor import Executor
from llamarl.runtime.metrics import MetricSpec


class Source(Executor):
    def step(self):
        values = torch.arange(4, dtype=torch.int64, device=self.ctx.device) + 10 * self.current_step
        self.outputs["numbers"] = TensorBatch({"value": values, "group_ids": values // 2,
                                               "num_tokens": torch.ones_like(values)})
        self.metrics = {"emitted": 4.0}

    def evaluate(self, problems, score, *, samples_path=None):
        return 0.25 * len(problems)


class Double(Executor):
    def step(self):
        batch = self.inputs.pop("numbers", TensorBatch())
        if len(batch):
            batch.fields["value"] = batch["value"] * 2
        self.outputs["doubled"] = batch
        self.outputs["audit"] = batch
        self.metrics = {"doubled": float(len(batch))}


class Audit(Executor):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.total = 0

    def step(self):
        batch = self.inputs.pop("audit", TensorBatch())
        self.total += int(batch["value"].sum()) if len(batch) else 0
        self.metrics = {"audited_total": float(self.total)}


class Sink(Executor):
    metric_specs: ClassVar[dict] = {"received": MetricSpec("rows", "sum"), "sink_rank": MetricSpec("rows", "max"),
                                    "value_mean": MetricSpec("values", "mean", weight="received")}

    def __init__(self, ctx, run_dir):
        super().__init__(ctx)
        self.run_dir, self.seen = run_dir, []

    def step(self):
        batch = self.inputs.pop("doubled", TensorBatch())
        self.seen.append(sorted(batch["value"].tolist()) if len(batch) else [])
        self.metrics = {"received": float(len(batch)), "sink_rank": float(self.ctx.rank)}
        if len(batch):
            self.metrics["value_mean"] = float(batch["value"].double().mean())
        (self.run_dir / f"sink_rank{self.ctx.rank}.json").write_text(json.dumps(self.seen))


@dataclass
class ToyConfig:
    run: RunConfig = field(default_factory=lambda: RunConfig(max_steps=3))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    export: ExportConfig = field(default_factory=lambda: ExportConfig(final=False))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--run-dir", type=Path, required=True, help="the run's output directory")
    run_dir = parser.parse_args().run_dir
    config = ToyConfig()
    config.run.output_dir = str(run_dir)
    pipeline = Pipeline(
        stages=[Stage("source", build=Source, headline=("emitted",)),
                Stage("double", build=Double),
                Stage("audit", build=Audit, headline=("audited_total",)),
                Stage("sink", build=lambda ctx: Sink(ctx, run_dir), num_ranks=None, headline=("received",))],
        channels=[ChannelSpec("numbers", "source", "double", "broadcast", same_tick=True),
                  ChannelSpec("audit", "double", "audit", "gather", same_tick=True),
                  ChannelSpec("doubled", "double", "sink", "scatter")],
        evaluator="source", title="toy", summary={"pipeline": "toy"})
    run_pipeline(pipeline, config, recipe="toy", heldout=[None, None], score=None)
