"""A rank that stops responding (SIGSTOP: alive, sockets open, so no collective errors) ends the job
through the heartbeat, with a line naming its rank, executor and step; the collective timeout
(an hour here) plays no part."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from launch import REPO


def test_a_stopped_rank_ends_the_job_with_a_named_line(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "--monitor-interval=0.5", str(REPO / "tests" / "worlds" / "liveness_world.py"),
                             str(tmp_path), "3"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    pid = None
    try:
        while not (tmp_path / "rank1.pid").is_file():
            if proc.poll() is not None:
                pytest.fail(proc.stderr.read()[-4000:])
            time.sleep(0.05)
        time.sleep(0.2)  # the pid file is written before its contents are flushed on some filesystems
        pid = int((tmp_path / "rank1.pid").read_text())
        os.kill(pid, signal.SIGSTOP)
        _, stderr = proc.communicate(timeout=120)  # a hang fails here
    finally:
        if pid is not None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        proc.kill()
    assert proc.returncode != 0
    assert "llamarl: rank 1 (executor 'b') stopped responding at step" in stderr, stderr[-4000:]
    assert "noticed by rank 0" in stderr
