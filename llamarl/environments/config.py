"""The environment's settings (``--env.*``): which environment or tools, their call format, turns,
timeouts and tool workers. The references themselves are resolved with the run's other checks
(``llamarl/rl/config_checks.py``), not here.

A dataclass parsed by tyro at a recipe's entry point (``llamarl/rl/config.py`` composes every
section): every field has a docstring (tyro shows it in ``--help``), and it checks itself in
``__post_init__``, raising ``ValueError`` with one line naming the flag.
"""

from __future__ import annotations

from dataclasses import dataclass

from llamarl.runtime.errors import check_flag


@dataclass
class EnvConfig:
    """Multi-turn episodes with an environment and its tools (llamarl/environments/)."""

    name: str | None = None
    """Registered environment (built in: ``calculator``, ``guess_number``) or ``module:Class`` (imported
    and checked at flag parsing); None: one completion per sample."""
    tools: str | None = None
    """Plain Python functions as the tools, ``module:function[,module:function...]``, presented and
    called through the chat template as TRL's ``tools=`` (llamarl/environments/function_tools.py):
    each needs type hints and a docstring with ``Args:``; checked at flag parsing. Instead of ``name``."""
    tool_format: str | None = None
    """With ``tools``: the tool-call format the policy writes, a registered one (``hermes``: Qwen /
    Hermes ``<tool_call>`` JSON; ``llama3``: Llama-3.1 / 3.2 JSON; ``mistral``: ``[TOOL_CALLS]``;
    llamarl/environments/tool_formats.py); None: the one the chat template speaks (``hermes``, the
    default format, for a template with none)."""
    mask_truncated: bool = False
    """Mask from the loss a policy turn the token budget (``--generator.max-new-tokens``) cut: neither
    a tool call nor an answer (the episode is marked truncated either way, counted per tick as
    ``env_truncated``); its tokens stay in the transcript, never trained."""
    max_turns: int = 4
    """Policy turns per episode at most (a turn ends at one of the environment's stop tokens or EOS)."""
    tool_timeout_s: float = 5.0
    """Seconds a tool call may take; past it the call becomes an error observation (counted) and the
    episode goes on."""
    num_tool_workers: int = 1
    """Processes running the tools on each generator rank (0: inline in the generator, for tests)."""

    def reference(self) -> str | None:
        """What ``build_environment`` and the tool workers build: ``name``, or ``tools:<tools>``; None
        without an environment."""
        if self.tools is None:
            return self.name
        return f"tools:{self.tools}" if self.tool_format is None else f"tools@{self.tool_format}:{self.tools}"

    def __post_init__(self) -> None:
        # The references themselves (a module:Class, each module:function's schema) are resolved by
        # llamarl.rl.config_checks.check_environment with the run's other checks: one line and exit 2
        # before any rank starts, not tyro's multi-line box.
        if self.tools is not None:
            check_flag(self.name is None, f"--env.tools and --env.name are two environments: pass one (got --env.name "
                       f"{self.name} and --env.tools {self.tools}; --env.name None drops a recipe's default)")
        check_flag(self.tool_format is None or self.tools is not None,
                   f"--env.tool-format {self.tool_format} applies to --env.tools, which is not set")
        check_flag(self.max_turns >= 1, f"--env.max-turns must be >= 1, got {self.max_turns}")
        check_flag(self.tool_timeout_s > 0, f"--env.tool-timeout-s must be > 0, got {self.tool_timeout_s}")
        check_flag(self.num_tool_workers >= 0, f"--env.num-tool-workers must be >= 0, got {self.num_tool_workers}")
