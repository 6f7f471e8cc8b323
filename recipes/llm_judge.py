"""Arithmetic RL rewarded by an LLM judge, with the rule-based scorer kept as an auditor.

    torchrun --standalone --nproc-per-node 4 -m recipes.llm_judge \
        [--judge.model smollm2-135m-instruct --judge.num-ranks 1 --judge.hard --run.max-steps 40 ...]

A worked extension of the RL pipeline built from the library's public pieces only. Four
executors, in rank order::

    generator --rollouts--> reward --ruled--> judge --scored--> trainer
        ^                                                          |
        +------------------------- weights ------------------------+

The rule-based ``reward`` stage (``reward_stage``) still scores every sample; its ``rewards`` are
kept as ``rule_reward``, an audit of the judge (``judge_agreement``), and train nothing. The
``judge`` stage (``JudgeExecutor``, ``--judge.num-ranks`` ranks) is a causal LM (``--judge.model``,
default the policy's ``--model.name``) that reads, for each sample, the question, the reference
answer and the completion through a prompt (``--judge.prompt``, the judge tokenizer's chat template
around it), and replaces ``rewards`` with its verdict before the batch reaches the trainer.

The verdict is read from ONE forward pass, not from generated text: the judge's next-token
distribution after the prompt, restricted to the answer tokens. The "yes" tokens are the first
tokens of ``yes``, ``Yes``, `` yes`` and `` Yes`` in the judge's tokenizer, the "no" tokens those
of the same spellings of ``no`` (a token that starts both, e.g. a bare space, is dropped), and the
reward is ``p(yes) / (p(yes) + p(no))`` (a sigmoid of the log-sum-exp difference, exact in fp32),
or, with ``--judge.hard``, 1 when that is >= ``--judge.threshold`` and 0 otherwise. Soft scores
give graded rewards and never ask the judge to produce a well-formed answer;
``judge_answer_mass_mean`` (the probability the judge puts on the answer tokens at all) shows
whether it follows the format.

Where the question comes from: the rollout batch carries the ``completion`` and ``reference``
strings, not the question. Its ``group_ids`` are the prompts' data indices (the generator's
contract), so the judge asks the recipe's task for ``task.sample(group_id).question``: the
question as written, without the policy's chat template. Everything is then tokenized by the
judge's own tokenizer, so a judge with a different vocabulary (another model family) works.

The judge is frozen (no optimizer, no weight channel) and forward-only. It is data-parallel:
SCATTER gives each judge rank whole prompt groups and each rank holds a full replica of the
judge model (no collectives in its step), which suits judges that fit one device; a judge too
large for one would need sharding (FSDP2 as in ``recipes/ref_kl.py``). A judge prompt longer
than ``--judge.max-tokens-per-microbatch`` or the judge's context is not judged: its reward is 0,
counted as ``judge_too_long`` (a running total per rank) and warned about.

Schedules: ``async`` (default) and ``sync`` deliver as ``standard_pipeline``; the ``ruled`` hop (reward
-> judge) is always same-tick, so the judge adds no lag. ``colocated`` runs every stage, the judge
included, on every rank (one process suffices).

Metrics (``metrics/judge.jsonl``): ``judge_reward_mean``, ``judge_yes_prob_mean``,
``judge_answer_mass_mean``, ``judge_agreement`` (the share of samples where the thresholded verdict
equals the rule scorer's: reward >= 0.5 counts as correct), ``rule_reward_mean``,
``judge_samples``, ``judge_too_long``, ``judge_prompt_tokens_mean``, ``judge_seconds``.
"""

from __future__ import annotations

import logging
import string
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import torch
import tyro

from llamarl.data.prompts import build_chat_prompt
from llamarl.models.loading import load_causal_lm
from llamarl.rl.arithmetic_task import ArithmeticConfig, arithmetic_task
from llamarl.rl.config_checks import check_model
from llamarl.rl.standard_pipeline import run_rl, stage_before_trainer
from llamarl.rl.task import Task
from llamarl.run.stages import Pipeline, Stage
from llamarl.runtime.batch import TensorBatch, set_balance_tokens
from llamarl.runtime.checkpoint import read_json, write_json
from llamarl.runtime.errors import config_errors, parse_flags
from llamarl.runtime.executor import Executor
from llamarl.runtime.metrics import MetricSpec

logger = logging.getLogger("llamarl.llm_judge")

DEFAULT_JUDGE_PROMPT = ("Question: {question}\nReference answer: {reference}\nStudent answer: {completion}\n"
                        "Is the student's answer correct? Answer yes or no.")
YES_WORDS = ("yes", "Yes", " yes", " Yes")
NO_WORDS = ("no", "No", " no", " No")
PLACEHOLDERS = ("question", "reference", "completion")
JUDGE_HEADLINE = ("judge_reward_mean", "judge_agreement")


def _placeholders(template: str) -> set[str]:
    """The ``{name}`` fields of a ``str.format`` template (ValueError when it does not parse)."""
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


@dataclass
class JudgeConfig:
    """The LLM judge: its model, its ranks, its prompt and how its verdict becomes a reward."""

    num_ranks: int = 1
    """Ranks given to the judge (after the rule-based reward's); each holds a full replica of the
    judge model and judges the prompt groups SCATTER gives it."""
    model: str | None = None
    """The judge: an HF causal-LM directory or the alias ``smollm2-135m-instruct``; None: the
    policy's ``--model.name`` (the initial weights, frozen). Any vocabulary: the judge tokenizes
    the question, reference and completion texts itself."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the judge's weights and forward."""
    prompt: str | None = None
    """What the judge reads (the user turn of its chat template, or plain text plus a last
    ``Answer:`` line for a tokenizer without one): a ``str.format`` template with ``{completion}``
    and optionally ``{question}`` and ``{reference}``, asking for a yes / no answer. None: four
    lines, ``Question: {question}`` / ``Reference answer: {reference}`` / ``Student answer:
    {completion}`` / ``Is the student's answer correct? Answer yes or no.``"""
    hard: bool = False
    """Reward 1 when p(yes) / (p(yes) + p(no)) >= ``--judge.threshold``, else 0 (default: the
    probability itself, a graded reward)."""
    threshold: float = 0.5
    """Decision threshold on p(yes) / (p(yes) + p(no)): for ``--judge.hard`` and for
    ``judge_agreement``."""
    max_tokens_per_microbatch: int = 4096
    """Token budget of one judge forward (rows x the longest prompt of the micro-batch, left-padded);
    a single prompt longer than this (or than the judge's context) is not judged (reward 0, counted
    as ``judge_too_long``)."""
    num_threads: int = 1
    """torch intra-op threads on each judge rank."""

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"--judge.num-ranks must be >= 1, got {self.num_ranks}")
        if self.model is not None and not self.model.strip():
            raise ValueError("--judge.model must name a model (or be None for --model.name)")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--judge.dtype must be float32 or bfloat16, got {self.dtype!r}")
        try:
            names = _placeholders(self.template)
        except ValueError as exc:
            raise ValueError(f"--judge.prompt is not a valid format template: {exc}") from None
        if "completion" not in names or not names <= set(PLACEHOLDERS):
            raise ValueError(f"--judge.prompt must contain {{completion}} and no fields but {PLACEHOLDERS}, "
                             f"got {sorted(names)}")
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"--judge.threshold must be in (0, 1), got {self.threshold}")
        if self.max_tokens_per_microbatch < 1:
            raise ValueError(f"--judge.max-tokens-per-microbatch must be >= 1, got {self.max_tokens_per_microbatch}")
        if self.num_threads < 1:
            raise ValueError(f"--judge.num-threads must be >= 1, got {self.num_threads}")

    @property
    def template(self) -> str:
        """The judge's prompt template: ``prompt``, or ``DEFAULT_JUDGE_PROMPT`` when it is None."""
        return self.prompt if self.prompt is not None else DEFAULT_JUDGE_PROMPT


@dataclass
class LLMJudgeConfig(ArithmeticConfig):
    """Arithmetic RL rewarded by an LLM judge; the rule-based scorer audits it (``judge_agreement``)."""

    judge: JudgeConfig = field(default_factory=JudgeConfig)


def answer_token_ids(tokenizer, *, yes_words: Sequence[str] = YES_WORDS,
                     no_words: Sequence[str] = NO_WORDS) -> tuple[list[int], list[int]]:
    """``(yes_ids, no_ids)``: the first token of each spelling, without special tokens, sorted.

    A token that starts a "yes" and a "no" spelling (a bare space in a character-level tokenizer)
    is dropped from both. Raises ValueError when either side is left empty.
    """
    def first_tokens(words):
        return {ids[0] for ids in (tokenizer.encode(w, add_special_tokens=False) for w in words) if ids}

    yes, no = first_tokens(yes_words), first_tokens(no_words)
    yes, no = yes - no, no - yes
    if not yes or not no:
        raise ValueError(f"the judge's tokenizer gives no distinct first token for yes {list(yes_words)} and "
                         f"no {list(no_words)}")
    return sorted(yes), sorted(no)


def judge_prompt_ids(tokenizer, template: str, *, question: str, reference: str, completion: str) -> list[int]:
    """Token ids of the judge's prompt for one sample: ``template`` filled in, as the user turn of
    the tokenizer's chat template with the generation prompt (``build_chat_prompt``), or, for a
    tokenizer without one, the plain text followed by ``\\nAnswer:``."""
    content = template.format(question=question, reference=reference, completion=completion)
    if getattr(tokenizer, "chat_template", None):
        return build_chat_prompt(tokenizer, content)
    return list(tokenizer(f"{content}\nAnswer:")["input_ids"])


def _microbatches(lengths: list[int], budget: int) -> list[list[int]]:
    """Row indices, longest first, cut so that rows x the longest row of each chunk <= ``budget``."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    chunks: list[list[int]] = []
    for index in order:
        if chunks and (len(chunks[-1]) + 1) * lengths[chunks[-1][0]] <= budget:
            chunks[-1].append(index)
        else:
            chunks.append([index])
    return chunks


@torch.no_grad()
def judge_yes_probability(model, prompts: list[list[int]], *, yes_ids: list[int], no_ids: list[int],
                          pad_token_id: int, max_tokens_per_microbatch: int,
                          device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p_yes, answer_mass)``, float32 [N] on ``device``, from one forward per micro-batch.

    ``p_yes[i] = p(yes) / (p(yes) + p(no))`` of the judge's next token after ``prompts[i]``, with
    p(yes) / p(no) summed over ``yes_ids`` / ``no_ids`` (so ``1 - p_yes`` is the normalised "no"),
    computed as ``sigmoid(logsumexp(yes logits) - logsumexp(no logits))``; ``answer_mass[i]`` is
    p(yes) + p(no) under the full softmax. Prompts are left-padded into micro-batches of at most
    ``max_tokens_per_microbatch`` padded tokens (a longer single prompt raises ValueError), with
    position ids counting real tokens only, and only the last position's logits are computed.
    Deterministic for the same inputs; a row's value does not depend on its micro-batch beyond
    floating-point rounding.
    """
    p_yes = torch.zeros(len(prompts), dtype=torch.float32, device=device)
    mass = torch.zeros(len(prompts), dtype=torch.float32, device=device)
    lengths = [len(p) for p in prompts]
    if any(n < 1 for n in lengths):
        raise ValueError("an empty judge prompt")
    too_long = [i for i, n in enumerate(lengths) if n > max_tokens_per_microbatch]
    if too_long:
        raise ValueError(f"judge prompts {too_long} exceed the micro-batch budget of {max_tokens_per_microbatch} tokens")
    yes = torch.tensor(yes_ids, dtype=torch.long, device=device)
    no = torch.tensor(no_ids, dtype=torch.long, device=device)
    for rows in _microbatches(lengths, max_tokens_per_microbatch):
        width = max(lengths[i] for i in rows)
        ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long, device=device)
        attention = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        for r, i in enumerate(rows):
            ids[r, width - lengths[i]:] = torch.tensor(prompts[i], dtype=torch.long, device=device)
            attention[r, width - lengths[i]:] = 1
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False,
                       logits_to_keep=1).logits[:, -1].float()
        lse_yes, lse_no = logits[:, yes].logsumexp(dim=1), logits[:, no].logsumexp(dim=1)
        index = torch.tensor(rows, dtype=torch.long, device=device)
        p_yes[index] = torch.sigmoid(lse_yes - lse_no)
        mass[index] = torch.exp(torch.logaddexp(lse_yes, lse_no) - logits.logsumexp(dim=1))
    return p_yes, mass


JUDGE_METRICS = {
    "judge_reward_mean": MetricSpec("judge", "mean", weight="judge_samples"),
    "judge_yes_prob_mean": MetricSpec("judge", "mean", weight="judge_samples"),
    "judge_answer_mass_mean": MetricSpec("judge", "mean", weight="judge_samples"),
    "judge_agreement": MetricSpec("audit", "mean", weight="judge_samples"),
    "rule_reward_mean": MetricSpec("audit", "mean", weight="judge_samples"),
    "judge_samples": MetricSpec("data", "sum"),
    "judge_too_long": MetricSpec("data", "sum"),
    "judge_prompt_tokens_mean": MetricSpec("data", "mean", weight="judge_samples"),
    "judge_seconds": MetricSpec("time", "max"),
}
"""The judge's metrics and their reduction over its ranks (sample-weighted means, summed counts)."""


class JudgeExecutor(Executor):
    """An LLM judge as the reward: replaces each sample's ``rewards`` with the judge's verdict.

    Input ``input_name``: a rollout batch (``completion`` / ``reference`` strings, ``group_ids``,
    ``num_tokens``), scored by the rule-based reward (``rewards``) or not. Output ``output_name``:
    the same batch with ``rewards`` (float32 [N]) the judge's reward, ``judge_yes_prob`` [N] its
    normalised p(yes), ``rule_reward`` [N] the incoming ``rewards`` (when there were any), and
    ``balance_tokens`` recomputed (0 for the rows of a group whose judge rewards all tie, as the
    reward executor does). The question of each row is ``question_of(group_id)``. No collectives:
    every rank judges its own rows with its own replica.
    """

    metric_specs: ClassVar[dict] = JUDGE_METRICS

    def __init__(self, ctx, *, config: JudgeConfig, model_name: str, question_of: Callable[[int], str],
                 input_name: str = "ruled", output_name: str = "scored") -> None:
        super().__init__(ctx)
        self.config, self.model_name, self.question_of = config, model_name, question_of
        self.input_name, self.output_name = input_name, output_name
        self.model = self.tokenizer = None
        self.too_long_total = 0
        self.max_prompt_tokens = config.max_tokens_per_microbatch

    def init(self) -> None:
        torch.set_num_threads(self.config.num_threads)
        self.model, self.tokenizer = load_causal_lm(self.model_name, dtype=getattr(torch, self.config.dtype),
                                                    device=self.ctx.device)
        self.model.requires_grad_(False)
        self.yes_ids, self.no_ids = answer_token_ids(self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else 0  # attention-masked: never read
        context = getattr(self.model.config, "max_position_embeddings", None)
        self.max_prompt_tokens = min(self.config.max_tokens_per_microbatch, context or self.config.max_tokens_per_microbatch)
        if self.ctx.local_rank == 0:
            logger.info("judge %s (%s) on %d rank(s); yes tokens %s, no tokens %s; %s rewards", self.model_name,
                        self.config.dtype, self.ctx.local_world_size, self.tokenizer.convert_ids_to_tokens(self.yes_ids),
                        self.tokenizer.convert_ids_to_tokens(self.no_ids),
                        f"hard (threshold {self.config.threshold})" if self.config.hard else "soft")

    def judge(self, questions: list[str], references: list[str],
              completions: list[str]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """``(p_yes, answer_mass, prompt_lengths)`` of each sample; a prompt longer than
        ``max_prompt_tokens`` (the micro-batch budget, or the judge's context if shorter) gets p_yes
        0 and mass 0 (and is warned about)."""
        prompts = [judge_prompt_ids(self.tokenizer, self.config.template, question=q, reference=r, completion=c)
                   for q, r, c in zip(questions, references, completions)]
        lengths = [len(p) for p in prompts]
        fits = [i for i, n in enumerate(lengths) if n <= self.max_prompt_tokens]
        p_yes = torch.zeros(len(prompts), dtype=torch.float32, device=self.ctx.device)
        mass = torch.zeros_like(p_yes)
        if len(fits) < len(prompts):
            logger.warning("%d judge prompts longer than %d tokens (--judge.max-tokens-per-microbatch or the judge's "
                           "context; up to %d): not judged, reward 0", len(prompts) - len(fits),
                           self.max_prompt_tokens, max(lengths))
        if fits:
            index = torch.tensor(fits, dtype=torch.long, device=self.ctx.device)
            p_yes[index], mass[index] = judge_yes_probability(
                self.model, [prompts[i] for i in fits], yes_ids=self.yes_ids, no_ids=self.no_ids,
                pad_token_id=self.pad_token_id, max_tokens_per_microbatch=self.config.max_tokens_per_microbatch,
                device=self.ctx.device)
        return p_yes, mass, lengths

    def save_checkpoint(self, directory: Path) -> None:
        """Pending outputs (base class) and this rank's ``judge_too_long`` running total."""
        super().save_checkpoint(directory)
        write_json(directory / f"state_rank{self.ctx.local_rank}.json", {"too_long_total": self.too_long_total})

    def load_checkpoint(self, directory: Path) -> None:
        super().load_checkpoint(directory)
        self.too_long_total = int(read_json(directory / f"state_rank{self.ctx.local_rank}.json")["too_long_total"])

    def step(self) -> None:
        batch = self.inputs.pop(self.input_name, TensorBatch())
        if not len(batch):
            self.metrics = {}
            return
        start = time.perf_counter()
        batch = batch.to(self.ctx.device)
        group_ids = batch["group_ids"].tolist()
        questions = {g: self.question_of(g) for g in set(group_ids)}
        p_yes, mass, lengths = self.judge([questions[g] for g in group_ids], batch.get_strings("reference"),
                                          batch.get_strings("completion"))
        unjudged = torch.tensor([n > self.max_prompt_tokens for n in lengths], dtype=torch.bool, device=self.ctx.device)
        self.too_long_total += int(unjudged.sum())
        verdict = (p_yes >= self.config.threshold) & ~unjudged
        rewards = verdict.float() if self.config.hard else p_yes.clone()  # unjudged rows: p_yes 0
        samples = float(len(batch))
        metrics = {"judge_reward_mean": float(rewards.sum()) / samples, "judge_yes_prob_mean": float(p_yes.sum()) / samples,
                   "judge_answer_mass_mean": float(mass.sum()) / samples, "judge_samples": samples,
                   "judge_too_long": float(self.too_long_total),
                   "judge_prompt_tokens_mean": sum(lengths) / samples}
        if "rewards" in batch:
            rule = batch["rewards"].float()
            batch.fields["rule_reward"] = rule
            metrics["rule_reward_mean"] = float(rule.sum()) / samples
            metrics["judge_agreement"] = float((verdict == (rule >= 0.5)).float().sum()) / samples
        batch.fields["judge_yes_prob"] = p_yes
        batch.fields["rewards"] = rewards
        set_balance_tokens(batch)
        self.outputs[self.output_name] = batch
        self.metrics = {**metrics, "judge_seconds": time.perf_counter() - start}


def judge_stage(config: LLMJudgeConfig, *, task: Task, name: str = "judge", input_name: str = "ruled",
                output: str = "scored") -> Stage:
    """The judge on ``--judge.num-ranks`` ranks: reads ``input_name``, sends ``output``; questions
    from ``task.sample(group_id)``."""
    def build(ctx) -> JudgeExecutor:
        return JudgeExecutor(ctx, config=config.judge, model_name=config.judge.model or config.model.name,
                             question_of=lambda index: task.sample(index).question,
                             input_name=input_name, output_name=output)
    return Stage(name, build=build, num_ranks=config.judge.num_ranks, ranks_flag="--judge.num-ranks",
                 headline=JUDGE_HEADLINE)


def llm_judge_pipeline(config: LLMJudgeConfig, task: Task) -> Pipeline:
    """generator -> reward ("ruled") -> judge ("scored") -> trainer, weights trainer -> generator,
    after ``check_llm_judge``: ``run_rl``'s ``stages``.

    Delivery follows ``--run.schedule`` like ``standard_pipeline`` (``ruled`` always same-tick: the judge
    adds no lag); colocated puts every stage, the judge included, on every rank.
    """
    check_llm_judge(config)
    return stage_before_trainer(config, judge_stage(config, task=task, input_name="ruled", output="scored"), task=task,
                                reward_output="ruled", output="scored",
                                title="LLM judge", replaces_rewards=True,
                                summary={"judge": config.judge.model or config.model.name,
                                         "judge_hard": config.judge.hard})


def check_llm_judge(config: LLMJudgeConfig) -> None:
    """The judge's model must name a model as the policy's does (``check_model``)."""
    if config.judge.model is not None:
        check_model(config.judge.model, flag="--judge.model")


def main(config: LLMJudgeConfig) -> dict | None:
    """The arithmetic task, judged by the LLM, audited and evaluated by the arithmetic scorer."""
    return run_rl(config, arithmetic_task(config), recipe="llm_judge", stages=llm_judge_pipeline)


if __name__ == "__main__":
    with config_errors():
        main(parse_flags(tyro.cli, LLMJudgeConfig))
