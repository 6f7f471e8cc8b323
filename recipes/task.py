"""Your own task from one file and one command: a dataset, a scorer, optionally tools, by reference.

    torchrun --standalone --nproc-per-node 1 -m recipes.task --run.schedule colocated \\
        --task.dataset data.jsonl --task.prompt-field question --task.answer-field answer \\
        --reward.scorer my_task:score

(docs/your_own_task.md walks through it, a tool task included.) The pieces:

- ``--task.dataset``: a local JSONL / JSON / Parquet / Arrow file (or a ``save_to_disk``
  directory), or a Hugging Face dataset ``name[:config][@split]`` (llamarl/data/task_dataset.py).
  Each row gives the prompt (``--task.prompt-field``, or ``--task.prompt-template`` formatted with
  the row's fields) and the reference answer (``--task.answer-field``).
- The evaluation: ``--task.eval-dataset`` (same forms, split ``test`` by default), else
  ``--task.eval-fraction`` of the rows held out by a seeded shuffle; the greedy evaluations before
  and after training (and every ``--run.eval-every``) use the first ``--run.num-eval-problems``.
- The prompt: the row's text as the user turn of the model's chat template, after
  ``--task.system-prompt`` (or the row's ``--task.system-field``) if given (with ``--env.tools``,
  the tools' schemas in that template). A prompt field holding a list of messages
  (``[{"role": "system" | "user" | "assistant", "content": ...}, ...]``, TRL's conversational
  format) is rendered whole through the chat template.
- The reward: ``--reward.funcs module:f,module:g`` with ``--reward.weights`` (TRL's reward
  functions, ``f(completions, **kwargs)`` with every dataset column, or per sample:
  llamarl/rewards/funcs.py), ``--reward.scorer module:function``, ``(completion: str, reference:
  str) -> float``, or ``--reward.trajectory-scorer module:function``, ``(trajectory, problem) ->
  float`` (llamarl/rewards/trajectory.py: the turns, the tool answers, the environment's reward).
  The row's other fields reach each of them, and the environment, as ``problem.columns``.
- A KL penalty to the initial policy: ``--ref.kl-coef beta`` (> 0) adds the reference stage of
  recipes/ref_kl.py (llamarl/rl/reference_stage.py) on the trainer's ranks (a frozen copy of the
  initial weights; under LoRA the trainer's model with its adapters disabled): each reward becomes
  ``reward - beta * sum_t kl_t``.
- Episodes: ``--env.name module:Class`` or ``--env.tools module:fn,...``, as in every recipe.

Every reference is resolved before any rank starts: an unknown module or function, a missing
dataset file, a field no row has, is one line (``llamarl: config error: --flag value: what is
wrong``) and exit code 2 (through ``torchrun/local.sh``, torchrun never starts: llamarl/runtime/preflight.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tyro

from llamarl.data.problem_list import ListTask
from llamarl.data.prompts import build_chat_prompt, build_conversation_prompt, conversation_of
from llamarl.data.task_dataset import load_rows, rows_to_problems, split_heldout, template_fields
from llamarl.executors.config import GeneratorConfig, TrainerConfig
from llamarl.executors.reference import RefConfig
from llamarl.rl.config import RLConfig
from llamarl.rl.config_checks import check_scorers
from llamarl.rl.reference_stage import ref_kl_pipeline
from llamarl.rl.standard_pipeline import run_rl
from llamarl.rl.task import Task
from llamarl.run.config import RunConfig
from llamarl.runtime.errors import config_errors, parse_flags

FLAGS = {"dataset": "--task.dataset", "prompt_field": "--task.prompt-field", "answer_field": "--task.answer-field",
         "prompt_template": "--task.prompt-template"}


@dataclass
class TaskSection:
    """Your task's data and prompt: the rows (``--task.dataset``), which field is the prompt (text,
    or a list of chat messages) and which the reference answer, the evaluation rows."""

    dataset: str | None = None
    """The training rows: a local ``.jsonl`` / ``.json`` / ``.parquet`` / ``.arrow`` / ``.csv`` file, a
    ``save_to_disk`` directory, or a Hugging Face dataset ``name[:config][@split]`` (split ``train``
    by default). Required."""
    prompt_field: str = "question"
    """The row field holding the prompt text (used when ``--task.prompt-template`` is not set)."""
    answer_field: str = "answer"
    """The row field holding the reference answer: what the scorer gets as ``reference`` (a non-string
    value as JSON)."""
    prompt_template: str | None = None
    """The user turn as a Python format string of the row's fields, e.g. ``"Convert {value} {from_unit}
    to {to_unit}."``; None: the prompt field's text as it is."""
    system_prompt: str | None = None
    """A system turn before the user turn (chat templates; without one it is prepended as plain text)."""
    system_field: str | None = None
    """The row field holding the row's own system turn (a row without it gets ``--task.system-prompt``)."""
    eval_dataset: str | None = None
    """The evaluation rows, in any form ``--task.dataset`` takes (a Hub name's split defaults to
    ``test``); None: ``--task.eval-fraction`` of the training rows are held out instead."""
    eval_fraction: float = 0.1
    """Without ``--task.eval-dataset``: this fraction of the rows (at least one, seeded by
    ``--run.seed``) is held out of training for the greedy evaluations; 0 holds none out."""
    max_train_problems: int | None = None
    """Train on only the first this many rows (None: all)."""

    def __post_init__(self) -> None:
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"--task.eval-fraction must be in [0, 1), got {self.eval_fraction}")
        if self.max_train_problems is not None and self.max_train_problems < 1:
            raise ValueError(f"--task.max-train-problems must be >= 1, got {self.max_train_problems}")


@dataclass
class TaskConfig(RLConfig):
    """RL on your own task, each piece given by reference: the rows (``--task.dataset`` data.jsonl,
    a Parquet / Arrow / CSV file or a Hugging Face dataset ``name[:config][@split]``), the reward
    (``--reward.funcs my_task:f,my_task:g`` TRL-style functions ``f(completions, **columns)``,
    weighted by ``--reward.weights``; or ``--reward.scorer my_task:score``, ``(completion,
    reference) -> float``; or ``--reward.trajectory-scorer my_task:fn``, ``(trajectory, problem)
    -> float``), optionally tools (``--env.tools my_task:fn``) or an environment (``--env.name
    my_task:Class``), and a KL penalty to the initial policy (``--ref.kl-coef``). Run it from the
    directory holding my_task.py: ``torchrun --standalone --nproc-per-node 1 -m recipes.task
    --run.schedule colocated --task.dataset data.jsonl --reward.scorer my_task:score``."""

    task: TaskSection = field(default_factory=TaskSection)
    ref: RefConfig = field(default_factory=lambda: RefConfig(kl_coef=0.0, num_ranks=0))
    """The KL penalty to the initial policy: off while ``--ref.kl-coef`` is 0 (here, unlike
    recipes.ref_kl, 0 means no reference stage); on the trainer's ranks unless ``--ref.num-ranks N``."""
    generator: GeneratorConfig = field(default_factory=lambda: GeneratorConfig(
        num_prompts_per_step=16, samples_per_prompt=4, max_new_tokens=64, temperature=0.8, dtype="bfloat16",
        num_threads=1))
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(full_lr=1.5e-5, param_dtype="bfloat16",
                                                                          num_threads=2))
    run: RunConfig = field(default_factory=lambda: RunConfig(max_steps=30, num_eval_problems=64))


def make_prompt_fn(system: str | None):
    """``prompt_fn(tokenizer, question)``: the question as the user turn of the chat template, after
    ``system`` (``build_chat_prompt``), or a conversation's messages (``conversation_of``) through
    the template, after ``system`` unless they open with their own (with ``--env.tools`` the
    generator adds the tools' schemas to that template call: llamarl/environments/function_tools.py)."""

    def prompt_fn(tokenizer, question: str) -> list[int]:
        messages = conversation_of(question)
        if messages is not None:
            return build_conversation_prompt(tokenizer, messages, system=system)
        return build_chat_prompt(tokenizer, question, system=system)
    return prompt_fn


def load_task(config: TaskConfig) -> Task:
    """The task of the ``--task.*`` flags: the training rows, the held-out ones, the prompt
    (``make_prompt_fn``), no scorer of its own (``--reward.*`` gives it), after checking every
    reference (the scorers, the tools' functions, the dataset and its fields); ValueError (one line
    naming the flag) otherwise. Sets ``--run.num-eval-problems`` to the held-out count when there
    are fewer."""
    task, run = config.task, config.run
    if config.reward.scorer is None and config.reward.trajectory_scorer is None and config.reward.funcs is None:
        raise ValueError("recipes.task needs a reward: --reward.funcs module:f,module:g (TRL's f(completions, "
                         "**kwargs)), --reward.scorer module:function, (completion, reference) -> float, or "
                         "--reward.trajectory-scorer module:function, (trajectory, problem) -> float")
    check_scorers(config.reward)
    if task.dataset is None:
        raise ValueError("recipes.task needs --task.dataset: a JSONL / Parquet / Arrow file or a Hugging Face "
                         "dataset name[:config][@split]")
    if task.prompt_template is not None:
        template_fields(task.prompt_template, FLAGS["prompt_template"])
    fields = {"prompt_field": task.prompt_field, "answer_field": task.answer_field, "prompt_template": task.prompt_template,
              "system_field": task.system_field}
    problems = rows_to_problems(load_rows(task.dataset, flag=FLAGS["dataset"]), flags=FLAGS, **fields)
    if task.eval_dataset is not None:
        train = problems
        heldout = list(rows_to_problems(load_rows(task.eval_dataset, flag="--task.eval-dataset", default_split="test"),
                                        flags={**FLAGS, "dataset": "--task.eval-dataset"}, **fields))
    else:
        train, heldout = split_heldout(problems, fraction=task.eval_fraction, seed=run.seed)
    if task.max_train_problems is not None:
        skipped, train = train.num_skipped_rows, type(train)(train[: task.max_train_problems])
        train.num_skipped_rows = skipped
    if run.num_eval_problems > len(heldout):
        if not heldout:
            raise ValueError(f"--run.num-eval-problems {run.num_eval_problems}: no problem is held out for "
                             "evaluation; set --task.eval-dataset or --task.eval-fraction > 0, or "
                             "--run.num-eval-problems 0")
        run.num_eval_problems = len(heldout)
    # No scorer of the recipe's own: --reward.funcs, --reward.scorer or --reward.trajectory-scorer replaces it.
    return Task(ListTask(train, seed=run.seed), heldout=heldout[: run.num_eval_problems],
                prompt_fn=make_prompt_fn(task.system_prompt))


def main(config: TaskConfig) -> dict | None:
    """The task of the flags; with ``--ref.kl-coef`` > 0 the reference stage before the trainer."""
    return run_rl(config, load_task(config), recipe="task", stages=ref_kl_pipeline if config.ref.kl_coef else None)


if __name__ == "__main__":
    with config_errors():
        main(parse_flags(tyro.cli, TaskConfig))
