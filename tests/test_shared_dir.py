"""The start-up check that every rank sees the same run directory (llamarl/runtime/shared_dir.py), in a
real 3-rank gloo world (this file is also that world's script): a shared directory passes and
leaves nothing behind; a rank whose directory is its own (a node-local disk) makes every rank
raise the same one-line error naming that rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from launch import check, run_torchrun

WORLD = "../" + Path(__file__).name  # run_torchrun resolves scripts under tests/worlds/


def world_main() -> None:
    """usage: test_shared_dir.py --base DIR --local-ranks R,... (ranks whose run directory is their
    own); each rank writes ``DIR/result-<rank>.json`` with the error it got (or null)."""
    import argparse

    import torch
    import torch.distributed as dist

    from llamarl.runtime.shared_dir import check_shared_run_dir

    parser = argparse.ArgumentParser()
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--local-ranks", default="")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    local = {int(r) for r in args.local_ranks.split(",") if r}
    run_dir = args.base / (f"node-local-{rank}" if rank in local else "shared")
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        check_shared_run_dir(run_dir, device=torch.device("cpu"))
        error = None
    except ValueError as exc:
        error = str(exc)
    (args.base / f"result-{rank}.json").write_text(json.dumps({"error": error}))
    dist.destroy_process_group()


def test_every_rank_must_see_the_run_directory(tmp_path):
    shared, split = tmp_path / "shared-case", tmp_path / "split-case"
    check(run_torchrun(WORLD, nproc=3, args=["--base", str(shared)], timeout_s=120))
    assert [json.loads((shared / f"result-{r}.json").read_text())["error"] for r in range(3)] == [None] * 3
    assert list((shared / "shared").iterdir()) == []  # the marker is gone

    check(run_torchrun(WORLD, nproc=3, args=["--base", str(split), "--local-ranks", "2"], timeout_s=120))
    errors = [json.loads((split / f"result-{r}.json").read_text())["error"] for r in range(3)]
    # each rank names the directory as it was given to it (on a real job: the same string everywhere)
    own_dirs = [split / "shared", split / "shared", split / "node-local-2"]
    assert len({error.replace(str(d), "<run dir>") for error, d in zip(errors, own_dirs)}) == 1, errors
    assert all("\n" not in error for error in errors)
    assert errors[0].startswith(f"the run directory {split / 'shared'} is not shared: ranks [2] do not see")
    assert "--run.output-dir" in errors[0]


if __name__ == "__main__":
    world_main()
