"""Multi-turn environments (llamarl/environments/base.py); importing this package registers the
built-in ones: ``calculator``."""

from llamarl.environments import calculator  # noqa: F401 - registers its environment
