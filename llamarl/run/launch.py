"""torchrun for the launch scripts (torchrun/local.sh, multinode.sh): the same launcher
(``torch.distributed.run``: the same flags, rendezvous, restarts and environment), but a job that
fails ends on the failing rank's own words (issue 50 item 3: one line, once).

When a rank fails, llamarl's controller prints one ``llamarl:`` line naming the executor, rank, step
and phase, writes the traceback to ``<run>/logs/rank<r>.traceback.txt``, and every other rank exits
quietly (llamarl/run/controller.py, llamarl/runtime/liveness.py). torchrun then raises ``ChildFailedError``,
whose uncaught traceback and failure report (another 30 lines, none of them the cause) used to
follow that line, after torchrun's own ``ERROR ... failed (exitcode: 2)`` log lines. Here the
error is caught: the job exits with the first failed rank's exit code (a rank killed by signal N:
128 + N) and prints nothing more; torchrun's elastic agent logs only what is critical. Run
``torchrun`` itself (``TORCHRUN=torchrun torchrun/local.sh ...``) to see its report.

    python -m llamarl.run.launch [torchrun's flags] (-m module | script.py) [args]
"""

from __future__ import annotations

import logging
import sys


def exit_code(error) -> int:
    """The exit code a job ends with for torchrun's ``ChildFailedError``: its first failure's (the
    root cause), 128 + N for a rank killed by signal N, 1 where none is known."""
    _, failure = error.get_first_failure()
    code = getattr(failure, "exitcode", None)
    if code is None or code == 0:
        return 1
    return 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(sys.argv[1:] if argv is None else argv)
    # The agent's "failed (exitcode: ...)" lines repeat what the failing rank said.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as error:
        return exit_code(error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
