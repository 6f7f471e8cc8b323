"""Building an environment from its name (``--env.name``, ``--env.tools``): one place that knows both
kinds, the registered classes (llamarl/environments/base.py) and the tools' environment
(llamarl/environments/function_tools.py), so neither of those imports the other."""

from __future__ import annotations

from llamarl.environments.base import Environment, resolve_environment_class
from llamarl.environments.function_tools import FORMAT_PREFIX, REFERENCE_PREFIX, FunctionToolsEnvironment


def build_environment(name: str) -> Environment:
    """A new instance of the environment registered as ``name``; ValueError listing the known ones.
    ``module:Class`` also works (imported, for a user's environment outside a registry import);
    ``tools:module:fn,...`` is the environment of those functions (``--env.tools``; ``tools@<format>:...``
    in that tool-call format)."""
    if name.startswith((REFERENCE_PREFIX, FORMAT_PREFIX)):
        return FunctionToolsEnvironment.from_reference(name)
    return resolve_environment_class(name)()
