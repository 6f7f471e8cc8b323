"""A recipe's task as one object: what ``llamarl.rl.standard_pipeline.run_rl(config, task, ...)`` runs.

A ``Task`` is built once, by a recipe (``arithmetic_task`` in ``llamarl/rl/arithmetic_task.py``,
``split_task`` in ``llamarl/rl/dataset_recipes.py``) or from ``--task.*`` flags (``recipes/task.py``),
and holds every piece the run needs of it: the training sampler, the held-out problems, the prompt,
the scorer by reference and, optionally, the environment. Each reference is resolved here, once:
the scorer's callable (``score``) for the evaluations; the reward workers, other processes, import
the same reference by name (``llamarl/rewards/pool.py``).

    task = Task(ArithmeticTask(num_digits=2, seed=0), heldout=..., prompt_fn=arithmetic_prompt,
                scorer="arithmetic")
    run_rl(config, task, recipe="arithmetic")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

from llamarl.data.prompts import Problem, PromptFn, Sampler
from llamarl.environments.config import EnvConfig
from llamarl.executors.config import RewardConfig
from llamarl.rewards import Scorer, resolve_scorer
from llamarl.runtime.run_identity import dataset_fingerprint

__all__ = ["Sampler", "Task"]


@dataclass(frozen=True)
class Task:
    """The training problems, the held-out ones, the prompt, the scorer and the environment of a run."""

    sampler: Sampler
    """The training problems: ``sampler.sample(index) -> Problem`` for every data index (the
    generator's prompts; an ``ArithmeticTask``, a ``ListTask``, ...)."""
    heldout: Sequence[Problem] | Callable[[int], Sequence[Problem]] = ()
    """The held-out problems of the greedy evaluations: a sequence (its first ``--run.num-eval-problems``
    are used), or ``heldout(n)`` that makes the first ``n`` when asked (``eval_problems``)."""
    prompt_fn: PromptFn | None = None
    """``prompt_fn(tokenizer, question) -> token ids``: the policy's prompt for a question."""
    scorer: str | None = None
    """The text scorer ``(completion, reference) -> float`` by reference: a registered name
    (``llamarl.rewards.SCORERS``: ``arithmetic``, ``gsm8k``, ``math``) or ``module:function``. None:
    the task has none of its own, and the run needs ``--reward.scorer``, ``--reward.trajectory-scorer``
    or ``--reward.funcs`` (a ``--reward.scorer`` replaces it: ``for_reward``)."""
    env: EnvConfig | None = None
    """The episodes' environment or tools; None (every recipe's): the run's ``--env.*`` section
    decides. Set, it replaces that section for the run (and is checked as the flags are)."""

    @cached_property
    def score(self) -> Scorer | None:
        """The callable of ``scorer`` (None without one), resolved once, on first use: what the
        greedy evaluations (and a recipe's pass@k) score with. ValueError for a reference that
        does not resolve."""
        return None if self.scorer is None else resolve_scorer(self.scorer)

    @cached_property
    def fingerprint(self) -> str:
        """The dataset fingerprint of ``sampler`` (``llamarl.runtime.run_identity.dataset_fingerprint``: the
        problems it serves first), computed once, on first use (the run's identity)."""
        return dataset_fingerprint(self.sampler)

    def sample(self, index: int) -> Problem:
        """The training problem of data index ``index`` (``sampler.sample``)."""
        return self.sampler.sample(index)

    def eval_problems(self, n: int) -> list[Problem]:
        """The first ``n`` held-out problems (fewer when ``heldout`` holds fewer)."""
        return list(self.heldout(n) if callable(self.heldout) else self.heldout[:n])

    def for_reward(self, reward: RewardConfig) -> Task:
        """This task as a run with ``reward`` scores it: ``--reward.scorer`` replaces ``scorer``
        (training and evaluations alike); else the task itself."""
        if reward.scorer is None or reward.scorer == self.scorer:
            return self
        return dataclasses.replace(self, scorer=reward.scorer)
