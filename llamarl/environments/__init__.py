"""Multi-turn environments (llamarl/environments/base.py); importing this package registers the
built-in ones: ``calculator`` (a tool call per turn) and ``guess_number`` (several turns of feedback)."""

from llamarl.environments import calculator, guess  # noqa: F401 - register their environments
