"""Multi-turn generation: an engine wrapped so that each request is an environment episode.

``EpisodeRunner.generate`` has the engine's signature and contract (llamarl/engines/base.py), so
the generator's training step and its evaluation use it in place of the engine. Per call it runs
every episode as far as it goes: generate until a turn ends; for each turn that ended on one of the
environment's stop texts (a stop id, or a stop string matched in the turn's text: the engine cuts
the turn at the token that completes it, llamarl/engines/stop_text.py), or at EOS with a turn the
environment reads as a tool call (``CallsAtEnd``), ``step`` in the tool workers (all of them at
once), append the observation tokens (loss mask 0, log-prob 0, version -1) and generate again;
until no episode continues. ``step`` reads the turn's text (the engine's ``Completion.text`` after a
stop string, else its decoded ids).

An episode ends ("stop") when the policy samples EOS (a turn without a call) or one of the
environment's end texts, or ``step`` says ``done``; ("length") at
``max_turns`` policy turns, or when the transcript has no room left under ``max_new_tokens`` for
the observation and one more token (the observation is then not appended). A request that comes back
"carried" (``token_budget``) is returned as is with its episode state; resubmitted later, possibly
after a weight update, it continues where it stopped (tokens after the update carry the new version).
An empty observation ends the episode (a turn must be followed by something, or it is the answer).
A turn the engine cut at ``max_new_tokens`` (no stop, no EOS: neither a call nor an answer) is
marked ``episode["truncated"]`` (the generator counts them per tick, ``env_truncated``); with
``mask_truncated`` its tokens get loss mask 0 (kept as context, never trained).
An environment that presents tools (``PresentsTools``, llamarl/environments/function_tools.py) has
each observation rendered as a ``role: "tool"`` message by the chat template (from the end of the
call message to the next assistant header), one per answer of a turn with several calls
(``Turn.tool_results``); a tool error's observation is rendered as one.
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
    CallsAtEnd,
    Environment,
    check_state,
    check_tool_schemas,
    observation_ids,
    stop_tokens,
)
from llamarl.environments.tool_workers import ToolRunner


class EpisodeRunner:
    """See the module docstring."""

    def __init__(self, engine: GenerationEngine, *, environment: Environment, tools: ToolRunner, tokenizer,
                 max_turns: int, problem_of: Callable[[int], Problem], mask_truncated: bool = False) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.engine, self.environment, self.tools, self.tokenizer = engine, environment, tools, tokenizer
        self.max_turns, self.problem_of, self.mask_truncated = max_turns, problem_of, mask_truncated
        self.turn_stop_ids, self.turn_stop_texts = stop_tokens(environment, tokenizer)
        self.end_ids, self.end_texts = stop_tokens(environment, tokenizer, ending=True)
        self.calls_at_end = environment.is_call if isinstance(environment, CallsAtEnd) else None
        self.pad_token_id = engine.pad_token_id
        self.num_turns = 0  # policy turns that called a tool, since the runner was made
        # An environment presenting tools: its observations are tool messages, framed by the template.
        self.tool_schemas = check_tool_schemas(tools.name, environment)
        self.observation_frames: dict[int, list[str]] = {}  # answers per turn -> the template's texts around them
        if self.tool_schemas is not None:
            self._frame(1)  # checked at start: a template that cannot answer tools is refused here

    def _frame(self, count: int) -> list[str]:
        if count not in self.observation_frames:
            from llamarl.environments.function_tools import tool_observation_segments

            self.observation_frames[count] = tool_observation_segments(self.tokenizer, self.tool_schemas, count=count)
        return self.observation_frames[count]

    def _turn_text(self, out: Completion) -> str:
        return out.text if out.text is not None else self.tokenizer.decode(out.completion_ids[out.episode["turn_start"]:])

    def _calls_tool(self, out: Completion) -> bool:
        """Whether ``out``'s turn ended on a stop text, or at EOS holding a call (module docstring)."""
        if out.finish_reason != FINISH_STOP or not out.completion_ids:
            return False
        if out.stop_text is not None:
            return out.stop_text in self.turn_stop_texts
        last = out.completion_ids[-1]
        if last in self.turn_stop_ids:
            return True
        if last in self.end_ids or self.calls_at_end is None:
            return False
        return bool(self.calls_at_end(self._turn_text(out)))

    def weights_updated(self, model: torch.nn.Module) -> None:
        self.engine.weights_updated(model)

    def close(self) -> None:
        self.tools.close()
        self.engine.close()

    def generate(self, requests: list[Request], *, sampling: SamplingParams, version: int,
                 generator: torch.Generator | None = None, token_budget: int | None = None) -> list[Completion]:
        """Every request as an episode (module docstring); one ``Completion`` per request, in order."""
        sampling = dataclasses.replace(
            sampling, stop_token_ids=[*sampling.stop_token_ids, *self.turn_stop_ids, *self.end_ids],
            stop=[*sampling.stop, *self.turn_stop_texts, *self.end_texts])
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
                if self._calls_tool(out):
                    calls.append(out)
                    continue
                if out.finish_reason == FINISH_LENGTH:  # the budget cut the turn: no call, no answer
                    out.episode = {**out.episode, "truncated": True}
                    if self.mask_truncated:
                        start = out.episode["turn_start"]
                        out.loss_mask = sampled_mask(out)[:start] + [0] * (len(out.completion_ids) - start)
                done[out.sample_id] = out  # EOS, length or carried: the episode ends or waits as it is
            turns = self.tools.run([(out.episode["state"], self._turn_text(out)) for out in calls]) if calls else []
            requests = []
            for out, turn in zip(calls, turns):
                self.num_turns += 1
                episode = {**out.episode, "state": turn.state, "turns": out.episode["turns"] + 1}
                if turn.reward is not None:
                    episode["reward"] = turn.reward
                out.episode = episode
                if self.tool_schemas is not None:
                    from llamarl.environments.function_tools import tool_observation_text

                    answers = turn.tool_results or [turn.observation]
                    obs = observation_ids(self.tokenizer, tool_observation_text(self.tokenizer, self.tool_schemas,
                                                                                answers))
                else:
                    obs = observation_ids(self.tokenizer, turn.observation)
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
