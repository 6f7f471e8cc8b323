"""The standard RL pipeline, as data: generator -> reward -> trainer -> (weights) -> generator.

``standard_pipeline(config, task)`` describes it for ``--run.schedule``; ``run_rl(config, task, recipe=...,
stages=...)``, the one way a recipe runs, validates the config and hands the description (the
standard one, or the recipe's own: ``stages``) to ``llamarl.run.runner.run_pipeline``. The stage builders
(``generator_stage``, ``reward_stage``, ``trainer_stage``) are public so that a recipe can describe
a different pipeline from the same pieces, e.g. with a reference-policy stage between the reward
and the trainer (``recipes/ref_kl.py``) or an LLM judge instead of the rule-based reward
(``recipes/llm_judge.py``).

Schedules (channel delivery, see llamarl/run/controller.py for each tick's timeline):

- ``async`` with ``--run.async-lag 2`` (LlamaRL Algorithm 1 as written): every channel next
  tick; the trainer trains at t+2 on rollouts generated at t. ``--run.async-lag 1`` (default): rollouts
  same-tick (scored right after generation), scored and weights next tick: data one version old.
- ``sync``: rollouts and scored same-tick, weights next tick: strictly on-policy, one executor
  busy at a time.
- ``colocated``: the ``sync`` pipeline with every stage on every rank (``Pipeline.colocated``):
  each rank generates, scores and trains in turn, the batches are handed over in memory and the
  weights copied into the generation model in place at the end of each tick. Strictly on-policy,
  the same samples as ``sync``. Any pipeline runs so, a recipe's own stages included
  (``place``). The phases never overlap, so each runs with every thread the rank was given: the
  larger of ``--generator.num-threads`` and ``--trainer.num-threads`` (``schedule_config``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable

import torch

from llamarl.executors.dynamic_sampling import DynamicSampling
from llamarl.executors.generator import GeneratorExecutor
from llamarl.executors.reward import RewardExecutor
from llamarl.executors.trainer import TrainerExecutor
from llamarl.models.colocated_memory import EngineFootprint
from llamarl.rewards.funcs import FuncsScore, RewardFuncs, split_funcs
from llamarl.rewards.trajectory import TrajectoryScore, resolve_trajectory_scorer
from llamarl.rl.config import RLConfig
from llamarl.rl.config_checks import validate_config
from llamarl.rl.run_plan import plan_run
from llamarl.rl.task import Task
from llamarl.run.runner import run_pipeline
from llamarl.run.stages import ChannelSpec, Pipeline, Stage

logger = logging.getLogger(__name__)

GENERATOR_HEADLINE = ("gen_tokens_per_s", "env_tool_errors", "env_tool_timeouts", "env_tool_calls", "env_turns_mean")
REWARD_HEADLINE = ("reward_mean", "accuracy")
TRAINER_HEADLINE = ("loss", "staleness_mean", "train_tokens_per_s")


def dynamic_sampling(config: RLConfig, *, scorer: str | None, rewards_from: str | None = None) -> DynamicSampling | None:
    """What the generator's dynamic sampling (``--algo.max-refill`` N > 0;
    ``llamarl/executors/dynamic_sampling.py``) scores with: the run's rule-based scorer, the recipe's
    ``scorer`` unless a ``--reward`` flag replaces it; None when off. ValueError (before any process
    group) when the generator cannot call the run's reward: none it can resolve, or the rewards are
    replaced downstream by a stage of the recipe's (``rewards_from``, e.g. an LLM judge)."""
    refill = config.algo.max_refill
    if not refill:
        return None
    if rewards_from is not None:
        raise ValueError(f"--algo.max-refill {refill}: dynamic sampling scores groups in the generator with the "
                         f"run's rule-based scorer, but this recipe's rewards come from its stage {rewards_from!r}, "
                         "which the generator cannot call; set --algo.max-refill 0 (also after --algo.preset dapo)")
    reward = config.reward
    if scorer is None and all(name is None for name in (reward.scorer, reward.trajectory_scorer,
                                                        getattr(reward, "funcs", None))):
        raise ValueError(f"--algo.max-refill {refill}: dynamic sampling needs a scorer the generator can call "
                         "(the recipe's, --reward.scorer, --reward.trajectory-scorer or --reward.funcs)")
    return DynamicSampling(reward=reward, scorer=scorer, target=config.generator.num_prompts_per_step,
                           max_refill=refill)


def _generator(config: RLConfig, *, task: Task, output: str = "rollouts", rewards_from: str | None = None):
    plan = plan_run(config)  # once per pipeline, before the world: what every generator rank runs with
    generator_config = dataclasses.replace(config.generator, token_budget=plan.token_budget)
    dynamic_sampling(config, scorer=task.scorer, rewards_from=rewards_from)  # refused here, before the world

    def build(ctx) -> GeneratorExecutor:
        if plan.token_budget != config.generator.token_budget and ctx.local_rank == 0:
            logger.info("partial rollouts on (--generator.partial-rollouts auto: async on %s, up to %d new "
                        "tokens): --generator.token-budget %d", ctx.device, generator_config.max_new_tokens,
                        plan.token_budget)
        return GeneratorExecutor(ctx, model_config=config.model, config=generator_config, task=task.sampler,
                                 prompt_fn=task.prompt_fn, output_name=output, seed=config.run.seed,
                                 max_sequence_tokens=plan.max_sequence_tokens, algo=config.algo, env=config.env,
                                 expected_lag=plan.expected_lag, lora=config.trainer.lora.spec(),
                                 dynamic=dynamic_sampling(config, scorer=task.scorer, rewards_from=rewards_from))
    return build


def _trainer(config: RLConfig, *, input_name: str = "scored"):
    def build(ctx) -> TrainerExecutor:
        return TrainerExecutor(ctx, model_config=config.model, config=config.trainer, algo=config.algo,
                               temperature=config.generator.temperature, input_name=input_name,
                               seed=config.run.seed, stop_on_no_signal=config.run.stop_on_no_signal,
                               engine_state=kept_engine_state(config))
    return build


def kept_engine_state(config: RLConfig) -> EngineFootprint | None:
    """What a colocated native engine keeps on the trainer's device while the trainer runs
    (``--generator.torch.no-sleep``; None when released or not colocated), as an upper bound:
    ``--generator.max-num-seqs`` slots (else every sample of a step), each as wide as a micro-batch
    (``--trainer.max-tokens-per-microbatch`` caps a sample's prompt + completion)."""
    generator = config.generator
    if config.run.schedule != "colocated" or generator.engine != "torch" or generator.torch.sleep:
        return None
    from llamarl.engines.static_shapes import bucket, state_width

    rows = generator.max_num_seqs or generator.num_prompts_per_step * generator.samples_per_prompt
    return EngineFootprint(slots=bucket(rows), width=state_width(config.trainer.max_tokens_per_microbatch),
                           dtype=getattr(torch, generator.dtype))


def generator_stage(config: RLConfig, *, task: Task, name: str = "generator", output: str = "rollouts",
                    rewards_from: str | None = None) -> Stage:
    """The policy's sampler on ``--generator.num-ranks`` ranks (``--generator.tp`` per replica):
    ``task``'s prompts, emitting whole prompt groups on channel ``output``; it evaluates greedy
    accuracy. ``task.scorer`` / ``rewards_from``: what its dynamic sampling scores with
    (``dynamic_sampling``)."""
    return Stage(name, build=_generator(config, task=task, output=output, rewards_from=rewards_from),
                 num_ranks=config.generator.num_ranks, ranks_flag="--generator.num-ranks", tp=config.generator.tp,
                 headline=GENERATOR_HEADLINE)


def reward_stage(config: RLConfig, *, scorer: str | None, name: str = "reward", input_name: str = "rollouts",
                 output: str = "scored") -> Stage:
    """The rule-based scorer (``scorer`` by registry name, or ``--reward.trajectory-scorer`` which
    replaces it) on ``--reward.num-ranks`` ranks, or on the
    trainer's (stage ``trainer``) with ``--reward.num-ranks 0``: reads ``input_name``, adds
    ``rewards``, sends on ``output``."""
    def build(ctx) -> RewardExecutor:
        return RewardExecutor(ctx, config=config.reward, scorer=scorer, input_name=input_name, output_name=output)
    if config.reward.num_ranks == 0:
        return Stage(name, build=build, num_ranks=None, colocate_with="trainer", headline=REWARD_HEADLINE)
    return Stage(name, build=build, num_ranks=config.reward.num_ranks, ranks_flag="--reward.num-ranks",
                 device=config.reward.device, headline=REWARD_HEADLINE)


def trainer_stage(config: RLConfig, *, name: str = "trainer", input_name: str = "scored") -> Stage:
    """The policy under FSDP2 on the ranks the other stages leave, training on ``input_name``."""
    return Stage(name, build=_trainer(config, input_name=input_name), num_ranks=None, headline=TRAINER_HEADLINE)


def schedule_title(config: RLConfig) -> str:
    """``async (lag 1)``, ``sync`` or ``colocated``: the timeline picture's title."""
    return f"async (lag {config.run.async_lag})" if config.run.schedule == "async" else config.run.schedule


def schedule_config(config: RLConfig) -> RLConfig:
    """``config`` with what its schedule implies resolved once: colocated, the generator and the
    trainer both get the larger of their thread counts (they never run at the same time)."""
    if config.run.schedule != "colocated":
        return config
    threads = max(config.generator.num_threads, config.trainer.num_threads)
    # Shallow copies with one field set: no second validation of values the caller already holds.
    resolved, generator, trainer = copy.copy(config), copy.copy(config.generator), copy.copy(config.trainer)
    generator.num_threads = trainer.num_threads = threads
    resolved.generator, resolved.trainer = generator, trainer
    return resolved


def data_order(stages: list[Stage], config: RLConfig) -> list[Stage]:
    """``stages`` (listed in data order) in the order they step within a tick: under ``async`` a
    stage on the trainer's ranks whose output reaches the trainer at the next tick (the reward with
    ``--reward.num-ranks 0``) steps after the trainer, so that the trainer trains while the
    generator generates instead of waiting with the scorer for this tick's rollouts."""
    if config.run.schedule != "async":
        return stages
    trainer = next((s for s in stages if s.name == "trainer"), None)
    if trainer is None:
        return stages
    later = [s for s in stages if s.colocate_with == "trainer"]
    return [s for s in stages if s not in later and s is not trainer] + [trainer] + later


def place(pipeline: Pipeline, config: RLConfig) -> Pipeline:
    """``pipeline`` placed for ``--run.schedule``: colocated puts every stage on every rank (its
    channels must then be those of ``sync``: data same-tick, weights next tick); else unchanged."""
    return pipeline.colocated() if config.run.schedule == "colocated" else pipeline


def standard_pipeline(config: RLConfig, task: Task) -> Pipeline:
    """The generator -> reward -> trainer pipeline of ``config.run.schedule`` (module docstring) for
    ``task``: what ``run_rl`` runs unless the recipe gives its own ``stages``."""
    return _standard_pipeline(config, task=task)


def stage_before_trainer(config: RLConfig, stage: Stage, *, task: Task, reward_output: str, output: str,
                         title: str, summary: dict,
                         replaces_rewards: bool = False) -> Pipeline:
    """generator -> reward (``reward_output``) -> ``stage`` (``output``) -> trainer, weights trainer ->
    generator: the standard pipeline with a recipe's own stage between the reward and the trainer
    (a reference policy, an LLM judge, a filter), placed for ``--run.schedule``.

    Delivery as in ``standard_pipeline``, plus: the reward -> stage hop is always same-tick, so the stage
    adds no lag; stage -> trainer is same-tick under sync and colocated. ``title`` is appended to the
    schedule's on the timeline; ``summary`` adds entries to ``summary.json``. ``replaces_rewards``:
    the stage sets the rewards itself (an LLM judge), so the generator's dynamic sampling, which
    scores with ``task.scorer``, is refused (``dynamic_sampling``)."""
    return _standard_pipeline(config, task=task, between=stage, reward_output=reward_output, output=output,
                              title=title, summary=summary, rewards_from=stage.name if replaces_rewards else None)


def _standard_pipeline(config: RLConfig, *, task: Task, between: Stage | None = None, reward_output: str = "scored",
                       output: str = "scored", title: str | None = None, summary: dict | None = None,
                       rewards_from: str | None = None) -> Pipeline:
    """generator -> reward -> [``between``] -> trainer, weights trainer -> generator, the generator
    evaluating: ``standard_pipeline``, or with a stage ``between`` that of ``stage_before_trainer``."""
    config = schedule_config(config)
    sync = config.run.schedule in ("sync", "colocated")
    generator = generator_stage(config, task=task, rewards_from=rewards_from)
    trainer = trainer_stage(config, input_name=output)
    reward = reward_stage(config, scorer=task.scorer, output=reward_output)
    channels = [ChannelSpec("rollouts", "generator", "reward", "scatter", same_tick=sync or config.run.async_lag == 1)]
    if between is None:
        stages = data_order([generator, reward, trainer], config)
    else:
        stages = [generator, reward, between, trainer]
        channels.append(ChannelSpec(reward_output, "reward", between.name, "scatter", same_tick=True))
    channels += [ChannelSpec(output, (between or reward).name, "trainer", "scatter", same_tick=sync),
                 ChannelSpec("weights", "trainer", "generator", "weights", weights_mode=config.weights.mode,
                             weights_bucket_mb=config.weights.bucket_mb)]
    return place(Pipeline(stages=stages, channels=channels, evaluator="generator",
                          title=schedule_title(config) if title is None else f"{schedule_title(config)}, {title}",
                          summary={"schedule": config.run.schedule, "loss": config.algo.loss, **(summary or {})}),
                 config)


Stages = Callable[[RLConfig, Task], Pipeline]
"""A recipe's own pipeline: ``stages(config, task)`` (checks of the recipe's own sections, then e.g.
``stage_before_trainer`` with a reference-policy, judge or filter stage), called once, after
``validate_config`` and before any process group."""


def run_rl(config: RLConfig, task: Task, *, recipe: str, stages: Stages | None = None) -> dict | None:
    """Run ``task`` as ``config`` says: the one way a recipe runs. Validates ``config`` (every rank,
    before any process group), builds the pipeline, ``standard_pipeline(config, task)`` or the recipe's
    ``stages(config, task)``, and hands it to ``run_pipeline`` with the held-out problems
    (``task.eval_problems(--run.num-eval-problems)``), the evaluations' scorer (``evaluation_score``)
    and the dataset fingerprint (``task.fingerprint``). ``recipe``: the run's name (``summary.json``,
    the run directory). Returns the summary dict on global rank 0, else None. A configuration that
    cannot run raises ValueError before any process group: a configuration error under
    ``llamarl.runtime.errors.config_errors``. A task without a scorer of its own (``task.scorer`` None)
    needs ``--reward.scorer``, ``--reward.trajectory-scorer`` or ``--reward.funcs``, which replace
    the task's."""
    if task.env is not None:  # the task's environment replaces the --env.* section, checked as it is
        config = copy.copy(config)
        config.env = task.env
    validate_config(config)
    replaced = (config.reward.trajectory_scorer, config.reward.scorer, config.reward.funcs)
    if task.scorer is None and all(name is None for name in replaced):
        raise ValueError(f"recipe {recipe} has no scorer of its own: set --reward.scorer module:function "
                         "(completion, reference) -> float, or --reward.trajectory-scorer")
    task = task.for_reward(config.reward)
    pipeline = standard_pipeline(config, task) if stages is None else stages(config, task)
    return run_pipeline(pipeline, config, recipe=recipe, heldout=task.eval_problems(config.run.num_eval_problems),
                        score=evaluation_score(config, task), dataset=lambda: task.fingerprint)


def evaluation_score(config: RLConfig, task: Task) -> Callable[[str, str], float] | None:
    """What the evaluations score with: the task's text scorer (``task.score``, after
    ``Task.for_reward``: ``--reward.scorer`` when given), or the one that replaces it in evaluations
    as in training: ``--reward.funcs`` (their weighted sum), else ``--reward.trajectory-scorer``."""
    if config.reward.funcs is not None:
        weights = config.reward.weights or [1.0] * len(split_funcs(config.reward.funcs))
        return FuncsScore(RewardFuncs(config.reward.funcs), tuple(weights))
    name = config.reward.trajectory_scorer
    if name is not None:
        return TrajectoryScore(resolve_trajectory_scorer(name))
    return task.for_reward(config.reward).score
