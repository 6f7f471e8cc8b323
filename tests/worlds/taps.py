"""Channel taps for worlds that run a recipe's pipeline: record what an executor receives.

``tap_inputs(pipeline, stage, directory)`` wraps the stage's ``build`` so that its executor saves
every non-empty batch a channel delivers to it as
``<directory>/<stage>_<channel>_step<t>_rank<r>.safetensors`` (the ``TensorBatch`` wire encoding,
no pickle), before handing it on unchanged. ``read_taps`` loads them back in the test process.
"""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file, save_file

from llamarl.runtime.batch import TensorBatch


def tap_inputs(pipeline, stage: str, directory: Path) -> None:
    """Make ``stage``'s executor record its inputs under ``directory`` (created)."""
    directory.mkdir(parents=True, exist_ok=True)
    spec = pipeline.stage(stage)
    build = spec.build

    def tapped_build(ctx):
        executor = build(ctx)
        set_input = executor.set_input

        def recording_set_input(name, batch):
            if len(batch):
                header, data = batch.to("cpu").encode()
                path = directory / f"{stage}_{name}_step{executor.current_step}_rank{ctx.rank}.safetensors"
                save_file({"header": header, "data": data}, str(path))
            set_input(name, batch)

        executor.set_input = recording_set_input
        return executor

    spec.build = tapped_build


def read_taps(directory: Path, stage: str, channel: str) -> dict[int, TensorBatch]:
    """``{tick: batch}`` of everything ``stage`` received on ``channel`` (every rank's rows concatenated)."""
    by_step: dict[int, list[TensorBatch]] = {}
    for path in sorted(directory.glob(f"{stage}_{channel}_step*_rank*.safetensors")):
        step = int(path.stem.split("_step")[1].split("_rank")[0])
        tensors = load_file(str(path))
        by_step.setdefault(step, []).append(TensorBatch.decode(tensors["header"], tensors["data"], source=str(path)))
    return {step: TensorBatch.concat(batches) for step, batches in sorted(by_step.items())}
