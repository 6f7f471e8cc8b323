"""Reward functions as TRL users write them: several, weighted, with the dataset's columns.

``--reward.funcs my_task:correct,my_task:short`` with ``--reward.weights 1.0 0.2``: a sample's
reward is ``sum_i weight_i * f_i`` (weights default to 1 each), and each function's mean is logged
per tick as ``reward_fn_<name>`` (``metrics/reward.jsonl``). Each function is called one of two
ways, chosen by its signature:

* **per batch, TRL's convention**, when it has a parameter named ``completions``::

      def f(completions, **kwargs) -> list[float | None]

  called with keyword lists, one entry per sample: ``prompts`` (the prompt text, or for a
  conversational row its list of messages), ``completions`` (the completion text, or for a
  conversational row ``[{"role": "assistant", "content": text}]``), ``completion_ids`` (the
  completion's token ids), and every other column of the dataset row by its name (the answer
  field included: ``--task.answer-field answer`` gives ``answer=[...]``). It returns one value per
  sample; ``None`` means "does not apply" and counts as 0 in the sum (TRL: NaN, skipped by nansum)
  and not in the function's mean.
* **per sample**, otherwise: ``f(completion, reference) -> float`` as ``--reward.scorer`` takes
  (a registered name too: ``gsm8k``), plus, as keywords, the row's columns its signature names
  (all of them with ``**kwargs``).

A batch is scored in chunks of whole prompt groups, one per reward worker
(``--reward.num-workers``), each chunk with a timeout of ``--reward.timeout-s`` per sample in it.
A function that raises, times out, returns the wrong number of values or a non-finite one gives 0
for the chunk's samples (counted in ``reward_errors``); the others still count.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

from llamarl.data.prompts import Problem, conversation_of
from llamarl.runtime.registry import import_path

RESERVED = ("prompts", "completions", "completion_ids")


def split_funcs(spec: str) -> list[str]:
    """``"a:f, b:g"`` -> ``["a:f", "b:g"]``; ValueError for an empty entry."""
    refs = [ref.strip() for ref in spec.split(",")]
    if not all(refs):
        raise ValueError(f"--reward.funcs {spec}: an empty entry (give module:function,module:function)")
    return refs


def resolve_func(ref: str) -> Callable:
    """One entry of ``--reward.funcs``: a registered text scorer's name or ``module:function``."""
    from llamarl.rewards import SCORERS

    if ref in SCORERS:
        return SCORERS[ref]
    if ":" not in ref:
        raise ValueError(f"--reward.funcs {ref}: not a registered scorer ({', '.join(sorted(SCORERS))}) "
                         "nor module:function")
    return import_path(ref, kind="reward function", flag="--reward.funcs")


def is_batched(fn: Callable) -> bool:
    """Whether ``fn`` takes a batch (TRL's ``f(completions, **kwargs)``): it names a ``completions``
    parameter."""
    try:
        return "completions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin: no signature to read, called per sample
        return False


def _keywords(fn: Callable) -> tuple[set[str], bool]:
    """The keyword parameters ``fn`` names past its first two, and whether it takes ``**kwargs``."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return set(), False
    named = {p.name for p in params[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind is p.VAR_KEYWORD for p in params)


@dataclass
class RewardFuncs:
    """The functions of ``--reward.funcs`` (see the module docstring), resolved once per process."""

    spec: str
    """The flag's value, ``module:function,...``."""

    def __post_init__(self) -> None:
        refs = split_funcs(self.spec)
        self.funcs = [resolve_func(ref) for ref in refs]
        self.batched = [is_batched(fn) for fn in self.funcs]
        names = [getattr(fn, "__name__", ref.rpartition(":")[2]) for fn, ref in zip(self.funcs, refs)]
        # Two functions of one name (a:score, b:score): the second is score_2, and so on.
        self.names = [name if names[:i].count(name) == 0 else f"{name}_{names[:i].count(name) + 1}"
                      for i, name in enumerate(names)]

    def __call__(self, samples: list[dict]) -> dict:
        """Every function's values on ``samples`` (dicts of ``completion``, ``reference``,
        ``question``, ``columns``, ``completion_ids``): ``{"values": [per function: a value or None
        per sample], "errors": [one line per failed function]}``; a failed function's values are 0."""
        values, errors = [], []
        for name, fn, batched in zip(self.names, self.funcs, self.batched):
            try:
                got = _call_batched(fn, samples) if batched else [_call_per_sample(fn, s) for s in samples]
            except Exception as exc:  # noqa: BLE001 - a reward function's failure is a 0 reward, counted
                errors.append(f"reward function {name}: {type(exc).__name__}: {exc}")
                got = [0.0] * len(samples)
            values.append(got)
        return {"values": values, "errors": errors}


def _checked(value, where: str) -> float | None:
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{where}: non-finite reward {value}")
    return value


def _call_batched(fn: Callable, samples: list[dict]) -> list[float | None]:
    conversations = [conversation_of(s["question"]) for s in samples]
    columns = sorted({key for s in samples for key in s["columns"]} - set(RESERVED))
    kwargs = {
        "prompts": [c if c is not None else s["question"] for s, c in zip(samples, conversations)],
        "completions": [s["completion"] if c is None else [{"role": "assistant", "content": s["completion"]}]
                        for s, c in zip(samples, conversations)],
        "completion_ids": [list(s["completion_ids"]) for s in samples],
        **{key: [s["columns"].get(key) for s in samples] for key in columns},
    }
    out = fn(**kwargs)
    if out is None or len(out) != len(samples):
        raise ValueError(f"returned {'None' if out is None else len(out)} values for {len(samples)} completions")
    return [_checked(v, f"completion {i}") for i, v in enumerate(out)]


def _call_per_sample(fn: Callable, sample: dict) -> float:
    named, any_keyword = _keywords(fn)
    columns = {k: v for k, v in sample["columns"].items() if any_keyword or k in named}
    value = _checked(fn(sample["completion"], sample["reference"], **columns), "the completion")
    if value is None:
        raise ValueError("a per-sample scorer returned None (return a number)")
    return value


def combine(values: list[list[float | None]], weights: list[float]) -> list[float]:
    """Each sample's ``sum_i weights[i] * values[i][sample]``, a None counting as 0."""
    return [sum(w * v for w, v in zip(weights, column) if v is not None) for column in zip(*values)]


def function_means(names: list[str], values: list[list[float | None]]) -> dict[str, float]:
    """``reward_fn_<name>``: each function's mean over the samples it gave a value (None skipped)."""
    means = {}
    for name, column in zip(names, values):
        given = [v for v in column if v is not None]
        if given:
            means[f"reward_fn_{name}"] = sum(given) / len(given)
    return means


@dataclass(frozen=True)
class FuncsScore:
    """``--reward.funcs`` where an evaluation takes a score (``llamarl.executors.evaluation_loop.score_samples``):
    the weighted sum of the functions on one completion of ``problem``, scored inline."""

    funcs: RewardFuncs
    weights: tuple[float, ...]

    def __call__(self, text: str, problem: Problem, completion_ids: list[int] = ()) -> float:
        sample = {"completion": text, "reference": problem.answer, "question": problem.question,
                  "columns": problem.columns, "completion_ids": list(completion_ids)}
        return combine(self.funcs([sample])["values"], list(self.weights))[0]
