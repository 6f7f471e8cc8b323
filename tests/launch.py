"""Start real torchrun worlds from tests (gloo on CPU) and collect what their ranks wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_torchrun(script: str, *, nproc: int, args: list[str] = (), timeout_s: float = 300,
                 env: dict[str, str] | None = None, stderr_dir: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``tests/worlds/<script>`` under ``torchrun --standalone`` with ``nproc`` CPU ranks.

    With ``stderr_dir``, each rank's stderr goes to its own ``<stderr_dir>/**/<rank>/stderr.log``
    (torchrun ``--redirects 2``) instead of the shared pipe, where two ranks' tracebacks can interleave
    within a line."""
    # The caller's PYTHONPATH is kept after ours (e.g. packages installed with pip --target).
    python_path = os.pathsep.join(filter(None, [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH")]))
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path, "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--monitor-interval=0.5",
           *([f"--log-dir={stderr_dir}", "--redirects=2"] if stderr_dir is not None else []),
           str(REPO / "tests" / "worlds" / script), *args]
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)


def check(proc: subprocess.CompletedProcess) -> None:
    """Fail with the world's output tail when it exited non-zero."""
    if proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}"
                             f"\n--- stderr ---\n{proc.stderr[-8000:]}")


def run_colocated_runs(runs: list[list[str]], *, plan_file: Path, env: dict[str, str] | None = None,
                       timeout_s: float = 600) -> subprocess.CompletedProcess:
    """Run several one-process colocated ``recipes.arithmetic`` runs (each a flag list) one after the
    other in ONE Python process (``tests/worlds/colocated_runs.py``: a 1-rank world each, imports
    paid once; what ``torchrun --nproc-per-node 1`` does for one run). ``plan_file`` gets the plan."""
    import json

    plan_file.write_text(json.dumps(runs))
    python_path = os.pathsep.join(filter(None, [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH")]))
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path, "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.run([sys.executable, str(REPO / "tests" / "worlds" / "colocated_runs.py"),
                           "--plan", str(plan_file)],
                          cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout_s, check=False)
