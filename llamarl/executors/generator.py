"""GeneratorExecutor: samples groups of completions for a task's prompts with the current weights.

Each step takes ``num_prompts_per_step`` new prompts (data position advances deterministically,
so a resumed run neither skips nor repeats a prompt), samples ``samples_per_prompt`` completions
each, plus resumes the samples carried over from the previous step (partial rollouts, with
``--generator.token-budget``). A prompt's group is emitted only when all its samples finished,
because the advantage baseline needs the whole group. That bookkeeping between steps (data
position, carried samples, unfinished groups, stale restarts) is ``GroupBuffer``
(llamarl/executors/group_buffer.py); how the trainer's weights arrive (written in place, streamed
into the engine, LoRA adapters merged) is one ``WeightArrival`` chosen at ``init``
(llamarl/executors/weight_arrival.py), and how a sample is produced (one completion, or an episode
of an environment) one ``SampleSource`` chosen there too (llamarl/executors/sample_source.py).

Output (channel ``rollouts``): right-padded ``input_ids`` [N, L] = prompt + completion,
``loss_mask`` / ``behav_logp`` / ``versions`` [N, L] at the completion positions (versions -1
elsewhere), ``num_tokens``, ``prompt_len``, ``completion_len``, ``group_ids`` (the prompt's data
index), ``finish_stop`` (1 when the sample ended on EOS), strings ``completion`` / ``reference`` /
``question`` / ``trajectory`` (``llamarl.rewards.trajectory.Trajectory`` as JSON: the turns, the
environment's reward and state, for trajectory scorers); metadata ``group_size``.

Staleness (``--algo.max-staleness`` eta with ``--algo.stale-policy wait``): a group emitted now
is trained at a trainer version of at most ``version + expected_lag`` (the pipeline's lag, given by
whoever builds the executor; ``version`` is the one of the weights the channel last wrote here).
So at the start of each step, every group with a carried (unfinished) sample whose oldest token
would then be more than eta versions old is restarted from its prompt, all its samples at once
(finished ones included: they are as old, and restarting the group together keeps its samples in
step), and counted as ``gen_restarted_stale``; a new sample is never too old (eta >= the lag is
checked). With ``drop`` (or no eta) samples are always resumed and the trainer drops stale ones.

With several generator ranks, data-parallel replica d (``ctx.dp_rank``) takes prompts
``position + d * num_prompts_per_step + i``. With ``--generator.tp N`` the ranks form a
``(dp, tp)`` mesh (``ctx.mesh``, see llamarl/runtime/world.py): the model is sharded over each TP group
(llamarl/models/tensor_parallel.py), and every rank of a TP group runs the same requests with the
same seed, so they sample identical tokens (TP all-reduces leave every rank bitwise identical
activations). Only the TP group's first rank emits the rollouts; its peers emit nothing (an empty
batch), since channels concatenate every outbound rank's batch. The parameters are DTensors on the
TP mesh, which the DDMA weight channel reads as per-rank slices, so each TP rank receives exactly
its shard (the ``gather_broadcast`` weight mode supports replicas only).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch

from llamarl.algorithms.config import AlgoConfig, check_wait_meets_lag
from llamarl.data.prompts import Problem, PromptFn, Sampler
from llamarl.engines.base import (
    Completion,
    EngineSetup,
    NonFiniteLogits,
    ReportsCounters,
    Request,
    SamplingParams,
    Sleeps,
    build_engine,
    check_finite_logprobs,
    sampled_mask,
)
from llamarl.environments.config import EnvConfig
from llamarl.executors.config import GeneratorConfig
from llamarl.executors.dynamic_sampling import DYNAMIC_SAMPLING_METRICS, DynamicSampling, Group, agree_counts
from llamarl.executors.evaluation_loop import score_samples
from llamarl.executors.group_buffer import GroupBuffer
from llamarl.executors.sample_source import choose_sample_source
from llamarl.executors.weight_arrival import choose_weight_arrival
from llamarl.models.config import ModelConfig
from llamarl.models.loading import stop_token_ids
from llamarl.models.lora import LoraSpec
from llamarl.rewards.trajectory import trajectory_of
from llamarl.runtime.batch import TensorBatch
from llamarl.runtime.checkpoint import load_rng, read_json, save_rng, write_json
from llamarl.runtime.executor import Executor
from llamarl.runtime.metrics import MetricSpec
from llamarl.runtime.sample_log import turns_of

logger = logging.getLogger("llamarl.generator")


def completions_to_batch(completions: list[Completion], *, group_ids: list[int], references: list[str],
                         texts: list[str], pad_token_id: int, group_size: int, questions: list[str] | None = None,
                         trajectories: list[str] | None = None, columns: list[str] | None = None) -> TensorBatch:
    """Pack finished completions into the rollout TensorBatch described in the module docstring
    (``questions`` and ``trajectories``, ``Trajectory.to_json`` texts, are the optional strings a
    trajectory scorer reads; ``columns``, each problem's ``Problem.columns`` as JSON, what
    ``--reward.funcs`` and trajectory scorers get of the dataset row).

    Built on the host (from Python lists, explicitly): channels stage it on their backend's device and
    consumers move it to their own ``ctx.device``.
    """
    cpu = torch.device("cpu")
    rows = len(completions)
    lengths = [len(c.prompt_ids) + len(c.completion_ids) for c in completions]
    width = max(lengths, default=0)
    input_ids = torch.full((rows, width), pad_token_id, dtype=torch.int64, device=cpu)
    loss_mask = torch.zeros(rows, width, dtype=torch.uint8, device=cpu)
    behav_logp = torch.zeros(rows, width, dtype=torch.float32, device=cpu)
    versions = torch.full((rows, width), -1, dtype=torch.int64, device=cpu)
    for row, c in enumerate(completions):
        p, n = len(c.prompt_ids), len(c.completion_ids)
        input_ids[row, : p + n] = torch.tensor(c.prompt_ids + c.completion_ids, dtype=torch.int64, device=cpu)
        # Observation tokens an environment inserted are context, never trained (mask 0; the episode
        # runner gave them version -1 and log-prob 0).
        loss_mask[row, p : p + n] = torch.tensor(sampled_mask(c), dtype=torch.uint8, device=cpu)
        behav_logp[row, p : p + n] = torch.tensor(c.logprobs, dtype=torch.float32, device=cpu)
        versions[row, p : p + n] = torch.tensor(c.versions, dtype=torch.int64, device=cpu)
    batch = TensorBatch({
        "input_ids": input_ids, "loss_mask": loss_mask, "behav_logp": behav_logp, "versions": versions,
        "num_tokens": torch.tensor(lengths, dtype=torch.int64, device=cpu),
        "prompt_len": torch.tensor([len(c.prompt_ids) for c in completions], dtype=torch.int64, device=cpu),
        "completion_len": torch.tensor([len(c.completion_ids) for c in completions], dtype=torch.int64, device=cpu),
        "group_ids": torch.tensor(group_ids, dtype=torch.int64, device=cpu),
        "finish_stop": torch.tensor([c.finish_reason == "stop" for c in completions], device=cpu),
    }, {"group_size": group_size})
    batch.set_strings("completion", texts)
    batch.set_strings("reference", references)
    if questions is not None:
        batch.set_strings("question", questions)
    if trajectories is not None:
        batch.set_strings("trajectory", trajectories)
    if columns is not None:
        batch.set_strings("columns", columns)
    return batch


GENERATOR_METRICS = {
    "gen_seconds": MetricSpec("throughput", "max"),
    "gen_new_tokens": MetricSpec("throughput", "sum"),
    "gen_tokens_per_s": MetricSpec("throughput", "sum"),
    "gen_emitted_samples": MetricSpec("rollouts", "sum"),
    "gen_carried": MetricSpec("rollouts", "sum"),
    "gen_restarted_stale": MetricSpec("rollouts", "sum"),
    "env_tool_calls": MetricSpec("environment", "sum"),
    "env_tool_errors": MetricSpec("environment", "sum"),
    "env_tool_timeouts": MetricSpec("environment", "sum"),
    "env_tool_calls_total": MetricSpec("environment", "sum"),
    "env_tool_errors_total": MetricSpec("environment", "sum"),
    "env_tool_timeouts_total": MetricSpec("environment", "sum"),
    "env_samples_with_observation": MetricSpec("environment", "sum"),
    "env_turns_mean": MetricSpec("environment", "mean", weight="gen_emitted_samples"),
    "env_truncated": MetricSpec("environment", "sum"),
    "gen_version": MetricSpec("rollouts", "max"),
    "gen_engine_wake_ups": MetricSpec("throughput", "max"),
    "gen_data_position": MetricSpec("data", "max"),
    "gen_skipped_prompts": MetricSpec("data", "sum"),
    "data_skipped_rows": MetricSpec("data", "max"),
    **DYNAMIC_SAMPLING_METRICS,
}
"""The generator's metrics and their reduction over its ranks: work and counters add up over the
data-parallel replicas (TP peers do not report them, see ``_PER_REPLICA``); the data position and
the version are shared. The ``env_*`` metrics are per tick (this tick's tool calls, errors and
timeouts, emitted episodes with an observation, turns per emitted episode) except the
``env_tool_*_total`` counters, cumulative over the run (a resumed run continues them)."""
_PER_REPLICA = ("gen_new_tokens", "gen_tokens_per_s", "gen_carried", "gen_restarted_stale", "gen_skipped_prompts",
                "env_tool_calls", "env_tool_errors", "env_tool_timeouts", "env_truncated",
                "env_tool_calls_total", "env_tool_errors_total", "env_tool_timeouts_total",
                "dynamic_sampling_kept", "dynamic_sampling_dropped")


class GeneratorExecutor(Executor):
    """Rollout generation with the engine ``--generator.engine`` names, held through the engine
    contract (llamarl/engines/base.py); weights arrive through a WeightsChannel."""

    metric_specs: ClassVar[dict] = GENERATOR_METRICS

    @property
    def num_threads(self) -> int:
        """``--generator.num-threads``, set by the controller before each step."""
        return self.config.num_threads

    def __init__(self, ctx, *, model_config: ModelConfig, config: GeneratorConfig, task: Sampler,
                 prompt_fn: PromptFn, output_name: str = "rollouts", seed: int = 0,
                 max_sequence_tokens: int | None = None, algo: AlgoConfig | None = None,
                 expected_lag: int = 1, env: EnvConfig | None = None, lora: LoraSpec | None = None,
                 dynamic: DynamicSampling | None = None) -> None:
        """``algo``: its ``max_staleness`` / ``stale_policy`` (None: no staleness control here).
        ``env``: with a ``name`` (or ``tools``), every sample is an episode of that environment
        (``Episodes``, llamarl/executors/sample_source.py); None or neither: one completion per sample.
        ``lora``: the trainer's adapters (``--trainer.lora.*``): the weights channel then brings only
        them, merged into this rank's generation weights in place (``models/lora_merge.py``,
        ``weight_arrival.py``).
        ``expected_lag``: trainer versions between the weights a sample is generated with and the
        optimizer step that trains it, at most: the schedule's lag in ticks (async 2 or 1, sync and
        colocated 0) with ``--trainer.num-minibatches`` 1; with k minibatches, lag * k + k - 1
        (the last minibatch of the batch). An under-estimate leaves the trainer stale samples to
        drop (counted there); ValueError when ``wait``'s eta is below it (no sample could be kept).
        ``dynamic``: dynamic sampling with refill (``--algo.max-refill``,
        ``llamarl/executors/dynamic_sampling.py``): groups whose rewards tie are dropped and refilled."""
        super().__init__(ctx)
        if expected_lag < 0:
            raise ValueError(f"expected_lag must be >= 0, got {expected_lag}")
        self.algo, self.expected_lag = algo, expected_lag
        self.wait = algo is not None and algo.stale_policy == "wait" and algo.max_staleness is not None
        check_wait_meets_lag(algo, expected_lag)
        if self.wait and config.token_budget is not None:
            steps = math.ceil(config.max_new_tokens / config.token_budget)
            if steps - 1 + expected_lag > algo.max_staleness:
                logger.warning("--algo.stale-policy wait: a completion of more than %d tokens spans more generator "
                               "steps than --algo.max-staleness %d allows once the trainer steps every tick; such "
                               "groups are restarted until they finish sooner (a bias toward short completions)",
                               (algo.max_staleness - expected_lag + 1) * config.token_budget, algo.max_staleness)
        self.model_config, self.config, self.task, self.prompt_fn = model_config, config, task, prompt_fn
        self.output_name, self.seed = output_name, seed
        self.version = 0
        # The groups in flight between steps: carried samples, unfinished groups, the data position.
        self.groups = GroupBuffer(config.samples_per_prompt)
        # Prompt + max_new_tokens must fit this (the trainer's micro-batch budget, the model's
        # context); a longer prompt is skipped with a warning and counted, never a mid-run crash.
        self.max_sequence_tokens = max_sequence_tokens
        self.env = env
        self.lora = lora
        self.dynamic = dynamic
        self._new_tokens = 0  # this tick's sampled tokens, over its rounds (``_sample``)

    def _tp_first_rank(self):
        """(this rank's TP group, its first rank's global rank); (None, 0) without TP."""
        if self.ctx.tp_size == 1:
            return None, 0
        return self.ctx.tp_mesh.get_group(), self.ctx.ranks[self.ctx.executor][self.ctx.dp_rank * self.ctx.tp_size]

    def _shares_ranks(self) -> bool:
        """Whether another executor runs on any of this executor's ranks (and so on its GPUs)."""
        mine = set(self.ctx.ranks[self.ctx.executor])
        return any(set(ranks) & mine for name, ranks in self.ctx.ranks.items() if name != self.ctx.executor)

    def init(self) -> None:
        if self.config.tp != self.ctx.tp_size:
            raise ValueError(f"--generator.tp is {self.config.tp} but the generator's mesh has tp={self.ctx.tp_size}; "
                             "pass ExecutorSpec(..., tp=config.generator.tp)")
        torch.set_num_threads(self.config.num_threads)
        # How the weights arrive (in place, streamed into the engine, LoRA adapters merged, merged then
        # streamed: llamarl/executors/weight_arrival.py), chosen once from the engine config's class
        # flags and the trainer's adapters; it loads the model the engine is built from.
        engine_config = self.config.engine_config()
        self.arrival = choose_weight_arrival(engine_config, self.lora)
        self.model, self.tokenizer = self.arrival.load(
            self.model_config.name, dtype=getattr(torch, self.config.dtype), device=self.ctx.device,
            tp_mesh=self.ctx.tp_mesh if self.ctx.tp_size > 1 else None)
        eos = stop_token_ids(self.model, self.tokenizer)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(eos, default=0)
        tp_group, tp_src = self._tp_first_rank()
        self.engine = build_engine(self.config.engine, EngineSetup(
            model=self.model, model_path=self.model_config.name, dtype=self.config.dtype, eos_token_ids=eos,
            pad_token_id=pad, seed=self.seed * 1000 + self.ctx.dp_rank, device=self.ctx.device,
            max_num_seqs=self.config.max_num_seqs, tp_group=tp_group, tp_src=tp_src,
            shares_device=self._shares_ranks(), tokenizer=self.tokenizer), engine_config)
        self.arrival.bind(self.engine)  # the engine itself, before an episode runner wraps it
        # The optional capabilities (llamarl/engines/base.py), looked up once: an engine built to
        # sleep (sharing its GPU with another executor: the trainer gets the memory between steps),
        # and one that reports counters.
        self.sleeping_engine = self.engine if isinstance(self.engine, Sleeps) and self.engine.sleep_mode else None
        self.counting_engine = self.engine if isinstance(self.engine, ReportsCounters) else None
        # How a sample is produced (one completion, or an episode of ``--env``'s environment:
        # llamarl/executors/sample_source.py), chosen once; from here on ``engine`` is what generates
        # (the episode runner has the engine's contract: step and evaluate use it alike).
        self.source = choose_sample_source(self.engine, self.env, tokenizer=self.tokenizer,
                                           problem_of=self.groups.problem, device=self.ctx.device,
                                           tp_group=tp_group, tp_src=tp_src)
        self.engine, self.prompt_fn = self.source.engine, self.source.prompt_fn(self.prompt_fn)
        # Seeded by the DP replica, not the rank: TP peers must draw the same samples.
        # On ctx.device: the sampler draws its uniforms on the logits' device.
        self.rng = torch.Generator(device=self.ctx.device).manual_seed(self.seed * 1000 + self.ctx.dp_rank)
        if self.dynamic is not None:  # the scorer's pool, on the rank that emits (a TP group's first)
            self.dynamic.init(scores=self.ctx.tp_rank == 0)

    def save_checkpoint(self, directory: Path) -> None:
        """Data position, weight version, carried-over samples, unfinished groups, RNG, pending output."""
        super().save_checkpoint(directory)
        rank = self.ctx.local_rank
        state = self.groups.state_dict()
        write_json(directory / f"state_rank{rank}.json", {
            "data_position": state.pop("data_position"), "version": self.version, **state,
            "tools": self.source.counts(),
        })
        save_rng(directory / f"rng_rank{rank}.safetensors", self.rng)

    def load_checkpoint(self, directory: Path) -> None:
        super().load_checkpoint(directory)
        rank = self.ctx.local_rank
        state = read_json(directory / f"state_rank{rank}.json")
        self.version = int(state["version"])
        self.source.restore_counts(state.get("tools", {}))
        self.groups.load_state_dict(state)
        load_rng(directory / f"rng_rank{rank}.safetensors", self.rng)

    @property
    def data_position(self) -> int:
        """Prompts consumed so far by every replica (``GroupBuffer.claim``)."""
        return self.groups.data_position

    # The weights channel's side (``WeightSink``, llamarl/runtime/executor.py), answered by the way the
    # weights arrive (llamarl/executors/weight_arrival.py).

    def get_model(self) -> torch.nn.Module:
        """What the weights channel writes: the generation model, or under LoRA the adapters' receive
        buffers (merged into the model by ``set_weights_version``)."""
        return self.arrival.receiver()

    def get_weight_slices(self) -> dict[str, tuple[int, int, int]] | None:
        """Under LoRA with TP, which slice of each adapter this rank's merge needs (``AdapterMerger``);
        None otherwise (the model's TP DTensors describe themselves)."""
        return self.arrival.slices()

    def weight_sink(self):
        """The weight channels' streaming entry (``llamarl/channels/weights.py``): for an engine that
        streams its weights (vLLM), a callable that loads an iterator of ``(name, full tensor)`` into
        it as it is consumed (``get_model()`` then only describes the layout); None for one that
        samples from the model (the native engine), whose parameters the channels write in place, and
        under LoRA (the adapters are written in place, then merged)."""
        return self.arrival.sink()

    def set_weights_version(self, version: int) -> None:
        """Called by the weight channel after the new weights are in place (written into the
        model, or already streamed into the engine): merged (LoRA), streamed or announced to the
        engine as the way they arrive requires, then this is the weights' version."""
        self.arrival.landed()
        self.version = version

    def close(self) -> None:
        """Shut the engine down (vLLM holds threads and memory)."""
        if getattr(self, "engine", None) is not None:
            self.engine.close()
        if self.dynamic is not None:
            self.dynamic.close()

    def sampling(self) -> SamplingParams:
        c = self.config
        return SamplingParams(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, max_new_tokens=c.max_new_tokens)

    # One step, top to bottom: restart stale groups, sample the carried and new requests, take the
    # finished groups (dropping and refilling tied ones), emit them, report.

    def step(self) -> None:
        start = time.perf_counter()
        counts_before = self.source.counts()  # the env_tool_* metrics are this tick's calls
        self._restart_stale_groups()
        self._new_tokens, self._refill_seconds = 0, 0.0
        self._sample(self.groups.take_carried() + self._new_requests())
        seconds = time.perf_counter() - start
        groups, dynamic_metrics = self._keep_informative(self.groups.take_done())
        seconds += self._refill_seconds
        completions = [c for _, outs, _ in groups for c in outs]
        # TP peers hold the same samples: only the TP group's first rank emits them.
        emits = self.ctx.tp_rank == 0
        if completions and emits:
            self.outputs[self.output_name] = self._rollout_batch(groups)
        self.metrics = {**dynamic_metrics, **self._step_metrics(seconds, completions, emits=emits)}
        self.metrics.update(self.source.metrics(counts_before, completions, emits=emits))  # env_*, with episodes
        if not emits:  # a TP peer repeats its group's first rank's work: counted there only
            for key in _PER_REPLICA:
                self.metrics.pop(key, None)  # env_* only exist with an environment
        if self.counting_engine is not None:  # e.g. vLLM asleep between steps: wake-ups, 2 a tick once weights arrive
            self.metrics.update({f"gen_engine_{key}": float(value) for key, value in self.counting_engine.counters().items()})
        if self.sleeping_engine is not None:  # the trainer on these ranks gets the engine's memory until the next use
            self.sleeping_engine.sleep()

    def _restart_stale_groups(self) -> None:
        """``--algo.stale-policy wait``: restart (from the prompt, every sample of it) each group with
        an unfinished sample whose oldest token would be more than eta versions behind the trainer
        when the group is trained, were it emitted now (see the module docstring)."""
        if not self.wait:
            return
        oldest_allowed = self.version + self.expected_lag - self.algo.max_staleness
        stale = self.groups.restart_stale(oldest_allowed)
        if stale:
            logger.info("%d groups restarted from their prompt: a token older than version %d would be more than "
                        "--algo.max-staleness %d versions behind when trained", len(stale), oldest_allowed,
                        self.algo.max_staleness)

    def _new_requests(self) -> list[Request]:
        """This replica's ``--generator.num-prompts-per-step`` prompts of the tick (module docstring)."""
        c = self.config
        return self._requests(self.groups.claim([c.num_prompts_per_step] * self.ctx.dp_size, replica=self.ctx.dp_rank))

    def _requests(self, indices: range) -> list[Request]:
        """``samples_per_prompt`` requests for each prompt of ``indices``; a prompt too long for the
        trainer's budget is skipped, counted and warned about."""
        c = self.config
        requests = []
        for index in indices:
            problem = self.task.sample(index)
            prompt_ids = self.prompt_fn(self.tokenizer, problem.question)
            if self.max_sequence_tokens is not None and len(prompt_ids) + c.max_new_tokens > self.max_sequence_tokens:
                self.groups.skip()
                logger.warning("prompt %d skipped: %d tokens + --generator.max-new-tokens %d > %d (the trainer's "
                               "micro-batch budget or the model's context)", index, len(prompt_ids),
                               c.max_new_tokens, self.max_sequence_tokens)
                continue
            requests += self.groups.open(index, problem, prompt_ids)
        return requests

    def _sample(self, requests: list[Request], *, partial: bool = True) -> float:
        """Generate ``requests`` with this tick's weights and, when ``partial``, its token budget
        (``--generator.token-budget``): unfinished samples are carried, finished ones join their group
        (``GroupBuffer.add``), new sampled tokens are added to ``_new_tokens`` (observations excluded).
        Returns the generation's seconds."""
        if not requests:
            return 0.0
        start = time.perf_counter()
        try:
            outputs = self.engine.generate(requests, sampling=self.sampling(), version=self.version,
                                           generator=self.rng,
                                           token_budget=self.config.token_budget if partial else None)
        except NonFiniteLogits as exc:  # an engine that checks while drawing: name the weights version
            raise NonFiniteLogits(f"weights version {self.version}: {exc}") from None
        check_finite_logprobs(outputs, version=self.version)
        seconds = time.perf_counter() - start
        previous = {r.sample_id: sum(sampled_mask(r)) for r in requests}
        self._new_tokens += sum(sum(sampled_mask(o)) - previous[o.sample_id] for o in outputs)
        self.groups.add(outputs)
        return seconds

    def _keep_informative(self, groups: list[Group]) -> tuple[list[Group], dict[str, float]]:
        """With dynamic sampling (``dynamic_sampling.py``): drop the groups whose rewards tie and refill
        them (``_refill``, its seconds in ``_refill_seconds``), with its metrics; otherwise ``groups``."""
        if self.dynamic is None:
            return groups, {}
        return self.dynamic.fill(groups, sample=self._refill, to_batch=self._rollout_batch,
                                 agree=lambda missing: agree_counts(missing, ctx=self.ctx))

    def _refill(self, counts: list[int]) -> list[Group]:
        """One refill round (``dynamic_sampling.py``): ``counts`` new prompts per replica, this replica's
        run of them after the lower replicas', the data position past all of them, sampled to the end
        (no token budget: a group that replaces a dropped one is scored within the tick); the groups
        that finished."""
        indices = self.groups.claim(counts, replica=self.ctx.dp_rank)
        self._refill_seconds += self._sample(self._requests(indices), partial=False)
        return self.groups.take_done()

    def _rollout_batch(self, groups: list[Group]) -> TensorBatch:
        """The rollout batch (module docstring) of finished ``groups``."""
        completions = [c for _, outs, _ in groups for c in outs]
        group_ids = [g for g, outs, _ in groups for _ in outs]
        problems = [p for _, outs, p in groups for _ in outs]
        texts = self.tokenizer.batch_decode([c.completion_ids for c in completions], skip_special_tokens=True)
        return completions_to_batch(
            completions, group_ids=group_ids, references=[p.answer for p in problems], texts=texts,
            pad_token_id=self.engine.pad_token_id, group_size=self.config.samples_per_prompt,
            questions=[p.question for p in problems],
            trajectories=[trajectory_of(c, self.tokenizer).to_json() for c in completions],
            columns=[json.dumps(p.columns) for p in problems] if any(p.columns for p in problems) else None)

    def _step_metrics(self, seconds: float, completions: list[Completion], *, emits: bool) -> dict[str, float]:
        """The tick's generation metrics (``GENERATOR_METRICS``)."""
        num_new_tokens = self._new_tokens
        return {"gen_seconds": seconds, "gen_new_tokens": float(num_new_tokens),
                "gen_tokens_per_s": num_new_tokens / max(seconds, 1e-9),
                "gen_carried": float(self.groups.num_carried), "gen_version": float(self.version),
                "gen_emitted_samples": float(len(completions) if emits else 0),
                # Prompts consumed so far by every replica: resumes must neither skip nor repeat one.
                "gen_data_position": float(self.groups.data_position),
                "gen_skipped_prompts": float(self.groups.skipped_prompts),
                "gen_restarted_stale": float(self.groups.restarted_stale),
                "data_skipped_rows": float(getattr(self.task, "num_skipped_rows", 0))}

    @torch.no_grad()
    def evaluate(self, problems: list[Problem], score: Callable[[str, str], float], *, chunk: int = 64,
                 samples_path: Path | None = None) -> float:
        """Greedy accuracy of the current weights on ``problems`` (fraction scored 1.0).

        With ``tp > 1`` it is collective over this rank's TP group: every rank of the group must
        call it with the same problems (each returns the same accuracy). ``samples_path`` gets one
        JSON line per problem (question, reference, completion, score, and ``turns``: the completion
        split into the policy's text and the environment's observations, ``llamarl.runtime.sample_log``).
        The generator's first rank draws its progress bar (``llamarl.runtime.progress.eval_bar``).
        """
        greedy = SamplingParams(temperature=0.0, max_new_tokens=self.config.max_new_tokens)
        prompts = [list(self.prompt_fn(self.tokenizer, p.question)) for p in problems]
        segments: list = []
        # Episodes start from these problems; the training's counters do not see the evaluation's calls.
        with self.source.evaluating(problems):
            scores, texts = score_samples(self.engine, self.tokenizer, problems=problems, prompts=prompts,
                                          score=score, sampling=greedy, chunk=chunk, version=self.version,
                                          segments=segments if samples_path is not None else None,
                                          progress=f"eval of weights version {self.version}"
                                          if self.ctx.local_rank == 0 else None)
        correct = sum(s[0] for s in scores)
        if samples_path is not None:
            samples_path.write_text("".join(
                json.dumps({"question": p.question, "reference": p.answer, "completion": t, "score": s[0],
                            "turns": turns_of(g)}) + "\n"
                for p, t, s, g in zip(problems, texts, scores, segments)))
        return correct / max(len(problems), 1)
