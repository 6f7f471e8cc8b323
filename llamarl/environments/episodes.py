"""Multi-turn generation: an engine wrapped so that each request is an environment episode.

``EpisodeRunner.generate`` has the engine's signature and contract (llamarl/engines/base.py), so
the generator's training step and its evaluation use it in place of the engine. Per call it runs
every episode as far as it goes: generate until a turn ends; for each turn that ended on one of the
environment's stop ids, ``step`` in the tool workers (all of them at once), append the observation
tokens (loss mask 0, log-prob 0, version -1) and generate again; until no episode continues.

An episode ends ("stop") when the policy samples EOS or one of the environment's end ids, or
``step`` says ``done``; ("length") at
``max_turns`` policy turns, or when the transcript has no room left under ``max_new_tokens`` for
the observation and one more token (the observation is then not appended). A request that comes back
"carried" (``token_budget``) is returned as is with its episode state; resubmitted later, possibly
after a weight update, it continues where it stopped (tokens after the update carry the new version).
An empty observation ends the episode (a turn must be followed by something, or it is the answer).
An environment that presents tools (``PresentsTools``, llamarl/environments/function_tools.py) has
each observation rendered as a ``role: "tool"`` message by the chat template (from the end of the
tool call to the next assistant header); a tool error's observation is rendered the same way.
``reset`` returning a state that is not a JSON object stops the run (``EnvironmentContractError``).

The episode's JSON state travels with the sample (``Request.episode``: the environment's ``state``,
``turns`` taken, ``turn_start`` where the current policy turn began), so checkpoints keep it and
resume it exactly. ``problem_of(sample_id)`` gives the problem a new episode is ``reset`` with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from llamarl.data.prompts import Problem
from llamarl.engines.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    Completion,
    GenerationEngine,
    Request,
    SamplingParams,
    sampled_mask,
)
from llamarl.environments.base import (
    Environment,
    check_state,
    check_tool_schemas,
    observation_ids,
    stop_token_ids,
)
from llamarl.environments.tools import ToolRunner


class EpisodeRunner:
    """See the module docstring."""

    def __init__(self, engine: GenerationEngine, *, environment: Environment, tools: ToolRunner, tokenizer,
                 max_turns: int, problem_of: Callable[[int], Problem]) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.engine, self.environment, self.tools, self.tokenizer = engine, environment, tools, tokenizer
        self.max_turns, self.problem_of = max_turns, problem_of
        self.turn_stop_ids = stop_token_ids(environment, tokenizer)
        self.end_ids = stop_token_ids(environment, tokenizer, ending=True)
        self.pad_token_id = engine.pad_token_id
        self.num_turns = 0  # policy turns that called a tool, since the runner was made
        # An environment presenting tools: its observations are tool messages, framed by the template.
        self.tool_schemas = check_tool_schemas(tools.name, environment)
        self.observation_frame = ("", "")
        if self.tool_schemas is not None:
            from llamarl.environments.function_tools import tool_observation_format

            self.observation_frame = tool_observation_format(tokenizer, self.tool_schemas)

    def weights_updated(self, model: torch.nn.Module) -> None:
        self.engine.weights_updated(model)

    def close(self) -> None:
        self.tools.close()
        self.engine.close()

    def generate(self, requests: list[Request], *, sampling: SamplingParams, version: int,
                 generator: torch.Generator | None = None, token_budget: int | None = None) -> list[Completion]:
        """Every request as an episode (module docstring); one ``Completion`` per request, in order."""
        sampling = dataclasses.replace(
            sampling, stop_token_ids=[*sampling.stop_token_ids, *self.turn_stop_ids, *self.end_ids])
        for req in requests:
            if not req.episode:
                state = check_state(self.tools.name, "reset", self.environment.reset(self.problem_of(req.sample_id)))
                req.episode = {"state": state, "turns": 0, "turn_start": len(req.completion_ids)}
        order = [r.sample_id for r in requests]
        done: dict[int, Completion] = {}
        while requests:
            kwargs = {"generator": generator} if generator is not None else {}
            outputs = self.engine.generate(requests, sampling=sampling, version=version,
                                           token_budget=token_budget, **kwargs)
            calls = []
            for out in outputs:
                if out.finish_reason == FINISH_STOP and out.completion_ids[-1] in self.turn_stop_ids:
                    calls.append(out)
                else:  # EOS, length or carried: the episode ends or waits as it is
                    done[out.sample_id] = out
            turns = self.tools.run([(out.episode["state"], self.tokenizer.decode(
                out.completion_ids[out.episode["turn_start"]:])) for out in calls]) if calls else []
            requests = []
            for out, turn in zip(calls, turns):
                self.num_turns += 1
                episode = {**out.episode, "state": turn.state, "turns": out.episode["turns"] + 1}
                if turn.reward is not None:
                    episode["reward"] = turn.reward
                out.episode = episode
                before, after = self.observation_frame
                obs = observation_ids(self.tokenizer, f"{before}{turn.observation}{after}" if self.tool_schemas is not None
                                      else turn.observation)
                if turn.done or not obs:
                    done[out.sample_id] = out  # finish_reason "stop": the episode's own end
                    continue
                if episode["turns"] >= self.max_turns or len(out.completion_ids) + len(obs) >= sampling.max_new_tokens:
                    out.finish_reason = FINISH_LENGTH
                    done[out.sample_id] = out
                    continue
                req = out.to_request()
                req.completion_ids += obs
                req.logprobs += [0.0] * len(obs)
                req.versions += [-1] * len(obs)
                req.loss_mask = sampled_mask(out) + [0] * len(obs)
                req.episode["turn_start"] = len(req.completion_ids)
                requests.append(req)
        return [done[sample_id] for sample_id in order]
