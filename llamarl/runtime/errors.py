"""How a job reports what stops it: a configuration error once for the whole job, a crash per rank.

A **configuration error** is a ``ValueError`` raised before this process made its part of the world
(``world.world_made()``): a whole-config check (``llamarl/rl/config_checks.py``: a rank split that
does not fit, a model that does not exist, an unwritable output directory), a recipe's own checks,
data that cannot be read, the rank plan of ``world.plan_ranks``. Every rank parses the same flags
and so finds the same error. Under ``config_errors()`` global rank 0 prints
``llamarl: config error: <message>`` (one line, no traceback) and every rank exits with code 2.
Per-field checks run inside ``tyro.cli`` (``__post_init__``), which prints its own box and exits 2,
as it does for a flag it does not know: a recipe parses with ``parse_flags`` so that only rank 0
prints it.

A ``ValueError`` once the world exists is a failure of the run, not of its flags: the controller's
one-line failure report (``llamarl/run/controller.py``, built with ``exception_text``) or a traceback.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

from llamarl.runtime.world import world_made

T = TypeVar("T")

PREFIX = "llamarl: config error: "
# How long a rank other than 0 stays alive after finding a configuration error: torchrun ends every
# rank as soon as one exits, so a rank that exited at once could take rank 0 down before it printed.
# Rank 0 finds the same error (same flags) and its exit makes torchrun end this rank well before;
# only a rank whose files differ from rank 0's (another node) outlives the wait and reports itself.
REPORTER_GRACE_S = 30.0


def check_flag(condition: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``condition``: a config's own check of its fields in
    ``__post_init__``, ``message`` one line naming the flag (tyro prints it and exits 2)."""
    if not condition:
        raise ValueError(message)


def exception_text(exc: BaseException, *, limit: int = 500) -> str:
    """``exc``'s message as one line: its non-empty lines, stripped, joined with `` | ``, cut to at most
    ``limit`` characters (ending in ``...``). Empty when the message is; never raises."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the failure being reported
        message = "<unprintable message>"
    text = " | ".join(line.strip() for line in message.splitlines() if line.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def reports_config_errors() -> bool:
    """Whether this process prints the job's configuration errors: global rank 0 (torchrun's ``RANK``),
    or a process started without torchrun."""
    return os.environ.get("RANK", "0") == "0"


def parse_flags(parse: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``parse(*args, **kwargs)`` (``tyro.cli`` or one of tyro's extras) with what it prints (an error
    box, ``--help``) shown by global rank 0 only: elsewhere stdout and stderr go nowhere meanwhile."""
    if reports_config_errors():
        return parse(*args, **kwargs)
    # Not tyro's console_outputs=False: tyro prints a __post_init__ error's box regardless of it.
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        return parse(*args, **kwargs)


def _wait_for_the_reporter() -> None:
    """On a rank other than 0: give rank 0 time to print and exit (torchrun then ends this process)."""
    if not reports_config_errors():
        time.sleep(REPORTER_GRACE_S)


def report_config_error(exc: BaseException) -> NoReturn:
    """Print ``llamarl: config error: <exc's message>`` on rank 0 and exit with code 2 on every rank.

    A rank other than 0 first waits ``REPORTER_GRACE_S`` seconds for torchrun to end it; if it is
    still alive then, rank 0 did not find the error, and this rank prints the line itself, naming it.
    """
    text = exception_text(exc) or type(exc).__name__
    if not reports_config_errors():
        _wait_for_the_reporter()
        text += f" (found on rank {os.environ.get('RANK')}; rank 0 did not report it in {REPORTER_GRACE_S:.0f} s)"
    sys.stdout.flush()
    print(PREFIX + text, file=sys.stderr, flush=True)
    sys.exit(2)


@contextlib.contextmanager
def config_errors() -> Iterator[None]:
    """Around a recipe's entry point (parsing the flags and ``main``): report a configuration error
    once for the whole job (``report_config_error``) and exit 2, without a traceback.

    Only a ``ValueError`` raised before the world was made counts (module docstring); anything else
    propagates unchanged. A non-zero ``SystemExit`` before the world (tyro rejected the flags, with
    output on rank 0 only) is delayed on the other ranks so that rank 0 lives to print it.
    """
    try:
        yield
    except ValueError as exc:
        if world_made():
            raise
        report_config_error(exc)
    except SystemExit as exc:
        if exc.code not in (None, 0) and not world_made():
            _wait_for_the_reporter()
        raise
