"""The CPU-side device guard catches a tensor created on an implicit device (a GPU crash) on CPU."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from launch import check, run_torchrun


def test_guard_off_the_careless_executor_runs(tmp_path):
    out = tmp_path / "sums.json"
    check(run_torchrun("guard_world.py", nproc=1, args=["--out", str(out), "--guard", "off"], timeout_s=120))
    assert json.loads(out.read_text()) == [3.0, 3.0]


def test_guard_on_the_careless_executor_fails_with_a_named_line(tmp_path):
    out = tmp_path / "sums.json"
    proc = run_torchrun("guard_world.py", nproc=1, args=["--out", str(out), "--guard", "on"], timeout_s=120)
    assert proc.returncode != 0 and not out.exists()
    assert "executor 'careless' (rank 0, local rank 0) failed at step 0 during step: RuntimeError" in proc.stderr
    assert "meta" in proc.stderr
