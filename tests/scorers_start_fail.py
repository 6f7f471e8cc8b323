"""A scorer module whose import fails while the counter file named by ``LLAMARL_TEST_START_FAILS``
holds a positive number (decremented by each failing import): replacement workers then fail to
start that many times, as under transient memory pressure."""

import os
from pathlib import Path

_counter = os.environ.get("LLAMARL_TEST_START_FAILS")
if _counter and Path(_counter).is_file():
    left = int(Path(_counter).read_text() or 0)
    if left > 0:
        Path(_counter).write_text(str(left - 1))
        raise ImportError(f"simulated start-up failure ({left} left)")


def score(completion: str, reference: str) -> float:
    if completion == "die":
        os._exit(3)
    return 1.0 if completion == reference else 0.0
