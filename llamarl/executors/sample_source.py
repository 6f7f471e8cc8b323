"""How the generator's samples are produced: one object, chosen once (``choose_sample_source``).

A sample is one completion of its prompt, or, with ``--env.name`` / ``--env.tools``, an episode of
that environment: the engine wrapped by ``EpisodeRunner`` (llamarl/environments/episode_engine.py),
which has the engine's contract, so the generator's step and its evaluation call ``engine.generate``
alike whichever it is. What differs is what the generator asks at fixed points of its life, and each
class answers all of it:

- ``SingleTurn``: the engine itself; no counters to checkpoint, no ``env_*`` metrics, nothing to
  swap for an evaluation.
- ``Episodes``: the episode runner; its tool workers' counters (calls, errors, timeouts) are
  checkpointed and restored (a resumed run continues them), reported per tick as the ``env_*``
  metrics, and kept clear of the evaluation's calls; an evaluation's episodes start from its
  problems, not the training's groups.

The generator builds the engine, then calls ``choose_sample_source``; after that it reads
``engine`` (what generates), ``prompt_fn`` (the prompt as the policy sees it), ``counts`` /
``restore_counts`` (checkpoints), ``metrics`` (each tick) and ``evaluating`` (around an evaluation).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from llamarl.data.prompts import Problem, PromptFn
from llamarl.engines.base import Completion, GenerationEngine, sampled_mask
from llamarl.environments.building import build_environment
from llamarl.environments.config import EnvConfig
from llamarl.environments.episode_engine import EpisodeRunner
from llamarl.environments.function_tools import presenting_tools, tools_reference
from llamarl.environments.tool_formats import choose_tool_format
from llamarl.environments.tool_workers import ToolRunner, TurnShare

__all__ = ["Episodes", "SampleSource", "SingleTurn", "choose_sample_source"]


class SampleSource:
    """One way a sample is produced (module docstring). The base is ``SingleTurn``'s behaviour: the
    engine generates each sample in one call, and there is nothing else to keep."""

    engine: GenerationEngine

    def prompt_fn(self, prompt_fn: PromptFn) -> PromptFn:
        """The prompt as the policy sees it, from the task's ``prompt_fn``: unchanged."""
        return prompt_fn

    def counts(self) -> dict[str, int]:
        """The cumulative counters a checkpoint keeps (the generator's ``state_rank<r>.json``, key ``tools``): none."""
        return {}

    def restore_counts(self, counts: dict) -> None:
        """Continue the counters of a checkpointed run (``counts()``'s keys, missing ones 0): none to continue."""

    def metrics(self, before: dict, completions: list[Completion], *, emits: bool) -> dict[str, float]:
        """The tick's ``env_*`` metrics, ``before`` being ``counts()`` at its start and ``completions``
        the samples it emits (``emits``: this rank emits them, a TP group's first rank): none."""
        return {}

    @contextmanager
    def evaluating(self, problems: list[Problem]) -> Iterator[None]:
        """Around an evaluation of ``problems`` (sample i of its requests being problem i): nothing to change."""
        yield


class SingleTurn(SampleSource):
    """One completion per sample: the engine itself."""

    def __init__(self, engine: GenerationEngine) -> None:
        self.engine = engine


class Episodes(SampleSource):
    """Every sample an episode of an environment: ``runner`` generates, its tools' counters are kept."""

    def __init__(self, runner: EpisodeRunner) -> None:
        self.engine = self.runner = runner

    def prompt_fn(self, prompt_fn: PromptFn) -> PromptFn:
        """An environment that presents tools (``PresentsTools``) shows their schemas in every prompt."""
        schemas = self.runner.tool_schemas
        return prompt_fn if schemas is None else presenting_tools(prompt_fn, schemas)

    def counts(self) -> dict[str, int]:
        """The tool workers' cumulative calls, errors and timeouts (``ToolRunner.counts``)."""
        return self.runner.tools.counts()

    def restore_counts(self, counts: dict) -> None:
        self.runner.tools.restore_counts(counts)

    def metrics(self, before: dict, completions: list[Completion], *, emits: bool) -> dict[str, float]:
        """``env_tool_<key>`` (this tick's) and ``env_tool_<key>_total`` (the run's, a resumed run
        continuing them) for each counter; of the emitted samples, those whose episode got an
        observation and those whose last turn the token budget cut; turns per emitted episode."""
        metrics = {}
        for key, value in self.counts().items():
            metrics[f"env_tool_{key}"] = float(value - before.get(key, 0))
            metrics[f"env_tool_{key}_total"] = float(value)
        # emitted samples whose episode got at least one observation (a tool's answer)
        metrics["env_samples_with_observation"] = float(sum(0 in sampled_mask(c) for c in completions) if emits else 0)
        # emitted episodes whose last turn the token budget cut (neither a call nor an answer)
        metrics["env_truncated"] = float(sum(bool(c.episode.get("truncated")) for c in completions) if emits else 0)
        if emits and completions:  # tool calls per emitted episode (training episodes only)
            metrics["env_turns_mean"] = sum(c.episode.get("turns", 0) for c in completions) / len(completions)
        return metrics

    @contextmanager
    def evaluating(self, problems: list[Problem]) -> Iterator[None]:
        """The evaluation's episodes start from ``problems``; afterwards (also on an error) the
        training's problems are back, and its counters as they were: the ``env_tool_*`` metrics count
        training episodes, the evaluation's calls are not theirs."""
        runner = self.runner
        training_problems, runner.problem_of = runner.problem_of, problems.__getitem__
        training_counts = runner.tools.counts()
        try:
            yield
        finally:
            runner.problem_of = training_problems
            runner.tools.restore_counts(training_counts)


def choose_sample_source(engine: GenerationEngine, env: EnvConfig | None, *, tokenizer,
                         problem_of: Callable[[int], Problem], device: torch.device,
                         tp_group=None, tp_src: int = 0) -> SampleSource:
    """The way samples are produced with ``engine``: ``Episodes`` of ``env``'s environment when it
    names one (its tools run in worker processes of this rank; a new episode is ``reset`` with
    ``problem_of(sample_id)``), ``SingleTurn`` otherwise. ``tp_group`` (None: no TP) and ``tp_src``, its
    first rank: TP peers must append the same observations, so the first rank runs the tools and
    broadcasts their answers (``TurnShare``, on ``device``). Tools given without ``--env.tool-format``
    speak the format the tokenizer's chat template does."""
    reference = env.reference() if env is not None else None
    if reference is None:
        return SingleTurn(engine)
    share = None if tp_group is None else TurnShare(group=tp_group, device=device, src=tp_src)
    if env.tools is not None and env.tool_format is None:
        reference = tools_reference(env.tools, tool_format=choose_tool_format(tokenizer).name)
    return Episodes(EpisodeRunner(
        engine, environment=build_environment(reference), tokenizer=tokenizer,
        tools=ToolRunner(reference, timeout_s=env.tool_timeout_s, num_workers=env.num_tool_workers, share=share),
        max_turns=env.max_turns, problem_of=problem_of, mask_truncated=env.mask_truncated))
