"""Check a job's configuration once, in one process, before torchrun starts any rank.

Under bare ``torchrun`` a configuration error is printed once (global rank 0, ``llamarl/runtime/errors.py``),
but torchrun then adds its own ``ChildFailedError`` summary and exits 1: torchrun, not llamarl,
owns what its agent prints. The launch scripts (``torchrun/local.sh``, ``torchrun/multinode.sh``,
and so ``make run``) therefore run the recipe here first, as global rank 0 of a world of the job's
size, with ``LLAMARL_CHECK_CONFIG=1``: every check that runs before the world is made runs, and the
process stops where it would create its first process group (``world.ExecutorContext.create``).

Outcome (the exit code of ``python -m llamarl.runtime.preflight``):

- 0: the configuration passed; the script starts torchrun. Nothing is printed.
- 2: a configuration error (``llamarl: config error: ...``, or tyro's box for a flag it rejects),
  printed once; torchrun is never started.
- 3: the program neither reached the world nor reported a configuration error (a script that makes
  its own process group, or a crash before the world): the preflight cannot judge it, prints
  nothing, and the script starts torchrun, which reports whatever happens there.

Decision: the check is a second start of the recipe (imports, flag parsing, data and tokenizer
checks: a few seconds) rather than a separate description of every recipe's checks, so that a
check can never disagree with the run. ``LLAMARL_PREFLIGHT=0`` skips it; ``--help`` skips it.
"""

from __future__ import annotations

import argparse
import os
import runpy
import subprocess
import sys

CHECK_ENV = "LLAMARL_CHECK_CONFIG"
# The exit code of a program that passed every check and stopped before making its world.
CHECKED = 0
CONFIG_ERROR = 2
CANNOT_JUDGE = 3
# The outcome on stdout of the child that reached the world in check mode (an exit code of 0 alone
# could also be a program that did its work without llamarl's world).
CHECKED_MARK = "llamarl-preflight: configuration checked"


def checking_only() -> bool:
    """Whether this process only checks its configuration (``LLAMARL_CHECK_CONFIG=1``)."""
    return os.environ.get(CHECK_ENV) == "1"


def stop_after_checks() -> None:
    """Called where the world is about to be made: in check mode, report success and exit 0."""
    if checking_only():
        sys.stdout.flush()
        print(CHECKED_MARK, flush=True)
        raise SystemExit(CHECKED)


def _child(target: list[str]) -> None:
    """Run ``target`` (``-m module args...`` or ``path.py args...``) as ``__main__`` in this process."""
    if target[0] == "-m":
        sys.argv = [target[1], *target[2:]]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(target)
        runpy.run_path(target[0], run_name="__main__")


def preflight(target: list[str], *, world_size: int, timeout_s: float = 600.0) -> int:
    """Run ``target`` once as global rank 0 of a ``world_size`` world in check mode; return
    ``CHECKED``, ``CONFIG_ERROR`` (after printing what the program printed) or ``CANNOT_JUDGE``."""
    env = {**os.environ, CHECK_ENV: "1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size),
           "LOCAL_WORLD_SIZE": str(world_size)}
    # No rendezvous address: a program that makes its own process group fails at once instead of
    # waiting for peers that never come (and the preflight then cannot judge it).
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    try:
        proc = subprocess.run([sys.executable, "-m", "llamarl.runtime.preflight", "--child", "--", *target], env=env,
                              capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return CANNOT_JUDGE
    if proc.returncode == CHECKED and CHECKED_MARK in proc.stdout:
        return CHECKED
    if proc.returncode == CONFIG_ERROR:
        sys.stdout.write(proc.stdout.replace(CHECKED_MARK + "\n", ""))
        sys.stderr.write(proc.stderr)
        return CONFIG_ERROR
    return CANNOT_JUDGE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llamarl.runtime.preflight", description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=1, help="the job's number of processes, all nodes")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("target", nargs=argparse.REMAINDER,
                        help="what torchrun would run: -m MODULE ARGS... or SCRIPT.py ARGS...")
    args = parser.parse_args(argv)
    target = args.target[1:] if args.target[:1] == ["--"] else args.target
    if not target or (target[0] == "-m" and len(target) < 2):
        parser.error("missing the program: -m MODULE [ARGS...] or SCRIPT.py [ARGS...]")
    if args.child:
        _child(target)
        return CANNOT_JUDGE  # the program returned without reaching the world
    if args.world_size < 1:
        parser.error(f"--world-size must be >= 1, got {args.world_size}")
    return preflight(target, world_size=args.world_size)


if __name__ == "__main__":
    sys.exit(main())
