"""The ``llamarl`` logger: one line per message, prefixed ``[llamarl <executor> rank <r>]``.

``setup_logging`` is called once per process by the runner as soon as the rank knows its executor;
library modules log through ``logging.getLogger("llamarl....")`` and inherit the prefix. Fatal
one-line failure reports (controller, liveness) are written straight to stderr instead, since they
are the last thing a process does before ``os._exit`` and must not depend on logging's setup.
"""

from __future__ import annotations

import logging
import sys

_HANDLER_NAME = "llamarl-console"


def setup_logging(*, executor: str, rank: int, level: int = logging.INFO) -> logging.Logger:
    """Configure the ``llamarl`` logger of this process (idempotent); return it."""
    logger = logging.getLogger("llamarl")
    logger.setLevel(level)
    logger.propagate = False
    for handler in list(logger.handlers):
        if handler.get_name() == _HANDLER_NAME:
            logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stdout)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter(f"[llamarl {executor} rank {rank}] %(message)s"))
    logger.addHandler(handler)
    return logger
