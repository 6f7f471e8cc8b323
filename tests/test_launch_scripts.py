"""torchrun/ launch scripts: a real 2-"node" c10d job over loopback, and the scripts' argument handling."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WORLD = REPO / "tests" / "worlds" / "launch_world.py"
TORCHRUN = f"{sys.executable} -m torch.distributed.run"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script(name: str, *args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("NNODES", "MASTER_ADDR", "NODE_RANK", "NPROC_PER_NODE")}
    return subprocess.run(["bash", str(REPO / "torchrun" / name), *args], cwd=REPO, capture_output=True, text=True,
                          env={**base, "TORCHRUN": TORCHRUN, **(env or {})}, timeout=timeout, check=False)


def test_two_node_job_over_loopback_c10d(tmp_path):
    """Two torchrun agents (two "nodes", 2 processes each) started with the same command meet at
    one c10d rendezvous and form one 4-rank gloo world."""
    env = {**os.environ, "NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "NPROC_PER_NODE": "2", "RDZV_ID": "launch-test", "RDZV_TIMEOUT": "120", "TORCHRUN": TORCHRUN,
           "OMP_NUM_THREADS": "1", "LAUNCH_OUT": str(tmp_path), "EXTRA_TORCHRUN_ARGS": "--monitor-interval 0.5"}
    env.pop("NODE_RANK", None)
    cmd = ["bash", str(REPO / "torchrun" / "multinode.sh"), str(WORLD)]
    agents = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=240)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert {r["world_size"] for r in ranks} == {4}
    assert {r["sum"] for r in ranks} == {1.0 + 2 + 3 + 4}
    assert sorted((r["node"], r["local_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # Global ranks are laid out node by node (what the executor split relies on).
    assert all(r["rank"] == 2 * r["node"] + r["local_rank"] for r in ranks)


def test_local_dry_run_builds_the_standalone_command():
    proc = script("local.sh", "--dry-run", "recipes.gsm8k", "cpu-smoke", "--run.max-steps", "2",
                  env={"NPROC_PER_NODE": "3"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [*TORCHRUN.split(), "--standalone", "--nproc-per-node", "3", "-m", "recipes.gsm8k",
                                   "cpu-smoke", "--run.max-steps", "2"]


def test_multinode_dry_run_builds_the_c10d_command():
    proc = script("multinode.sh", "--dry-run", "tests/worlds/launch_world.py", "--flag",
                  env={"NNODES": "4", "MASTER_ADDR": "node001", "MASTER_PORT": "1234", "NPROC_PER_NODE": "8",
                       "RDZV_ID": "job7", "NODE_RANK": "3"})
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    for flag, value in [("--nnodes", "4"), ("--nproc-per-node", "8"), ("--rdzv-backend", "c10d"),
                        ("--rdzv-endpoint", "node001:1234"), ("--rdzv-id", "job7"), ("--node-rank", "3")]:
        assert words[words.index(flag) + 1] == value, flag
    assert words[-2:] == ["tests/worlds/launch_world.py", "--flag"]


@pytest.mark.parametrize(("name", "args", "env", "message"), [
    ("local.sh", [], {}, "missing RECIPE"),
    ("local.sh", ["--bogus", "recipes.gsm8k"], {}, "unknown option '--bogus'"),
    ("local.sh", ["recipes/gsm8k"], {}, "must be a Python module name or a .py file"),
    ("local.sh", ["missing_file.py"], {}, "no such file"),
    ("local.sh", ["recipes.gsm8k"], {"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE must be a positive integer"),
    ("multinode.sh", ["recipes.gsm8k"], {"MASTER_ADDR": "h"}, "NNODES is not set"),
    ("multinode.sh", ["recipes.gsm8k"], {"NNODES": "2"}, "MASTER_ADDR is not set"),
    ("multinode.sh", ["recipes.gsm8k"], {"NNODES": "two", "MASTER_ADDR": "h"}, "NNODES must be N or MIN:MAX"),
    ("multinode.sh", ["recipes.gsm8k"], {"NNODES": "2", "MASTER_ADDR": "h", "MASTER_PORT": "x"}, "MASTER_PORT"),
    ("multinode.sh", ["recipes.gsm8k"], {"NNODES": "2", "MASTER_ADDR": "h", "NODE_RANK": "-1"}, "NODE_RANK"),
])
def test_bad_arguments_fail_with_a_message(name, args, env, message):
    proc = script(name, *args, env=env)
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.parametrize("name", ["local.sh", "multinode.sh", "slurm.sbatch"])
def test_help_explains_the_variables(name):
    proc = script(name, "--help")
    assert proc.returncode == 0
    for variable in {"local.sh": ["NPROC_PER_NODE", "TORCHRUN"],
                     "multinode.sh": ["NNODES", "MASTER_ADDR", "MASTER_PORT", "RDZV_ID", "NODE_RANK"],
                     "slurm.sbatch": ["sbatch", "NPROC_PER_NODE", "MASTER_PORT"]}[name]:
        assert variable in proc.stdout, variable


def test_slurm_script_runs_one_agent_per_node_at_the_first_node(tmp_path):
    """With stand-in ``scontrol`` / ``srun`` on PATH: the job's first node hosts the rendezvous and
    srun starts multinode.sh once per node with the job's node count and id."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"scontrol": 'printf "gpu-a17\\ngpu-a18\\n"',
                       "srun": 'echo "srun $* NNODES=$NNODES MASTER_ADDR=$MASTER_ADDR RDZV_ID=$RDZV_ID '
                               'NPROC_PER_NODE=$NPROC_PER_NODE"'}.items():
        path = bin_dir / name
        path.write_text(f"#!/usr/bin/env bash\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "gpu-a[17-18]", "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "8",
           "SLURM_SUBMIT_DIR": str(REPO)}
    proc = script("slurm.sbatch", "recipes.gsm8k", "qwen2.5-1.5b-8gpu", env=env)
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip().splitlines()[-1]
    assert "--ntasks-per-node=1" in line
    assert f"{REPO}/torchrun/multinode.sh recipes.gsm8k qwen2.5-1.5b-8gpu" in line
    assert "NNODES=2 MASTER_ADDR=gpu-a17 RDZV_ID=llamarl-4242 NPROC_PER_NODE=8" in line
    outside = script("slurm.sbatch", "recipes.gsm8k", env={"SLURM_JOB_ID": ""})
    assert outside.returncode == 2 and "not inside a SLURM job" in outside.stderr


BAD_SPLIT = ["recipes.arithmetic", "--generator.num-ranks", "5"]
BAD_SPLIT_LINE = ("llamarl: config error: --generator.num-ranks 5 + at least 1 trainer rank = 6 "
                  "> the world size 3 (torchrun --nproc-per-node); or use --run.schedule colocated\n")


def test_a_config_error_through_the_launcher_is_one_line_and_exit_2():
    """The preflight (llamarl/runtime/preflight.py) finds the error in one process: torchrun never starts, so
    the job prints exactly the config-error line (no torchrun failure report) and exits 2."""
    proc = script("local.sh", *BAD_SPLIT, env={"NPROC_PER_NODE": "3", "LLAMARL_PREFLIGHT": "1"})
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", BAD_SPLIT_LINE)


def test_multinode_prints_the_config_error_on_the_first_node_only():
    env = {"NNODES": "1:1", "MASTER_ADDR": "127.0.0.1", "NPROC_PER_NODE": "3", "LLAMARL_PREFLIGHT": "1"}
    first = script("multinode.sh", *BAD_SPLIT, env=env)
    assert (first.returncode, first.stdout, first.stderr) == (2, "", BAD_SPLIT_LINE)
    other = script("multinode.sh", *BAD_SPLIT, env={**env, "NODE_RANK": "1"})
    assert (other.returncode, other.stdout, other.stderr) == (2, "", "")


def test_preflight_outcomes():
    """0 and silent for a configuration that passes (it stops where the world would be made); 2 with
    tyro's own box, once, for a flag tyro rejects; 3 (cannot judge, so the launcher goes on to
    torchrun) for a program that makes its own process group."""
    def preflight(*target):
        return subprocess.run([sys.executable, "-m", "llamarl.runtime.preflight", "--world-size", "3", "--", *target],
                              cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    ok = preflight("-m", "recipes.arithmetic", "--run.max-steps", "1")
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, "", "")
    unknown = preflight("-m", "recipes.arithmetic", "--no-such-flag")
    assert unknown.returncode == 2 and unknown.stderr.count("--no-such-flag") == 1, unknown.stderr
    own_world = preflight(str(WORLD))
    assert own_world.returncode == 3 and own_world.stdout == "", own_world.stdout


def test_a_failed_job_ends_on_the_failing_ranks_line_without_torchruns_report(tmp_path):
    """Issue 50: the launcher's torchrun (llamarl/run/launch.py) exits with the failing rank's code and
    adds nothing after its line: no ChildFailedError traceback, no failure report, no agent log. The
    same job under torchrun itself prints all three (what the launcher removes)."""
    program = tmp_path / "fails.py"
    program.write_text("import os, sys\n"
                       "if os.environ['RANK'] == '1':\n"
                       "    print('llamarl: trainer rank 1 failed at step 0 (stand-in)', file=sys.stderr)\n"
                       "    sys.exit(2)\n")
    env = {"NPROC_PER_NODE": "2", "LLAMARL_PREFLIGHT": "0"}
    ours = script("local.sh", str(program), env={**env, "TORCHRUN": ""})  # the scripts' default launcher
    assert ours.returncode == 2
    assert (ours.stdout + ours.stderr).strip() == "llamarl: trainer rank 1 failed at step 0 (stand-in)"
    theirs = script("local.sh", str(program), env=env)  # TORCHRUN: python -m torch.distributed.run
    assert theirs.returncode != 0 and "Traceback" in theirs.stderr and "ChildFailedError" in theirs.stderr
