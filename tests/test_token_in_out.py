"""Token in, token out, guaranteed (issue 49, item 4): a property test over real chat templates.

The trained ids of a multi-turn tool episode (llamarl/environments/episode_engine.py) are the ids the
engine sampled, in order, never a re-tokenisation of the transcript; the ids between them are the
observations, exactly the ids the chat template renders for the tool messages (from the end of
the call message to the next assistant header, the contract of llamarl/environments/function_tools.py),
with loss mask 0 and no gradient.

Templates: the real ones of Qwen2.5-Instruct, Llama-3.1-Instruct, Mistral-7B-Instruct-v0.3 and
Gemma-2-it (tests/chat_templates/, each headed by where it came from) on SmolLM2's byte-level BPE
with each model's special tokens added (a tiny tokenizer with the real template), and SmolLM2's own
tokenizer and template (no tool support: the default format). The engine is scripted: seeded random
episodes whose turns are random text, tool calls in the format the template speaks (several per
turn, unknown tools, answers with quotes, new lines and non-ASCII text), answers cut by a text stop
string, and turns cut by the token budget; its ids are chosen so that they do not round-trip through
decode + encode (each piece of text encoded alone), so any re-tokenisation would show.
"""

from __future__ import annotations

import copy
import functools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from tools_for_tests import convert, shout

from llamarl.algorithms.losses import aipo_loss
from llamarl.data.prompts import Problem, build_chat_prompt
from llamarl.engines.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    Completion,
    Request,
    SamplingParams,
    check_request,
    sampled_mask,
    stop_ids,
    turn_start,
)
from llamarl.engines.stop_text import TextStops
from llamarl.environments.building import build_environment
from llamarl.environments.episode_engine import EpisodeRunner
from llamarl.environments.function_tools import DEFAULT_TOOLS_SYSTEM, presenting_tools, tools_reference
from llamarl.environments.tool_formats import ToolCall, choose_tool_format
from llamarl.environments.tool_workers import ToolRunner
from llamarl.executors.generator import completions_to_batch

TEMPLATES = Path(__file__).parent / "chat_templates"
TOOLS = "tools_for_tests:convert,tools_for_tests:shout"
STOP = "STOP!"
MAX_TURNS = 3
UNKNOWN_TOOL_ERROR = "[tool error: ValueError: unknown tool 'teleport'; the tools are ['convert', 'shout']]"


@dataclass(frozen=True)
class Family:
    """A model's chat template on a tokenizer with its special tokens."""

    template: str | None  # a file of tests/chat_templates; None: SmolLM2's own
    specials: tuple[str, ...] = ()
    bos: str | None = None
    eos: str | None = None
    end_of_message: str = "<|im_end|>"  # what the policy samples to end a message
    engine_eos: tuple[str, ...] = ()  # the ids that end a completion (tokenizer EOS + generation config)
    single_tokens: tuple[str, ...] = ()  # format texts the policy may sample as one added token


FAMILIES = {
    "smollm2": Family(None, engine_eos=("<|im_end|>",)),
    "qwen2.5": Family("qwen2.5-instruct.jinja", ("<tool_call>", "</tool_call>"), eos="<|im_end|>",
                      engine_eos=("<|im_end|>", "<|endoftext|>"), single_tokens=("<tool_call>", "</tool_call>")),
    "llama3.1": Family("llama-3.1-instruct.jinja",
                       ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
                       bos="<|begin_of_text|>", eos="<|eot_id|>", end_of_message="<|eot_id|>",
                       engine_eos=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"), single_tokens=("<|python_tag|>",)),
    "mistral-v0.3": Family("mistral-7b-instruct-v0.3.jinja",
                           ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                            "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
                           bos="<s>", eos="</s>", end_of_message="</s>", engine_eos=("</s>",),
                           single_tokens=("[TOOL_CALLS]",)),
    # Gemma-2's tokenizer ends sequences with <eos>, its messages with <end_of_turn> (both in its
    # generation config's eos_token_id).
    "gemma2": Family("gemma-2-it.jinja", ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), bos="<bos>",
                     eos="<eos>", end_of_message="<end_of_turn>", engine_eos=("<eos>", "<end_of_turn>")),
}


@functools.cache
def family_tokenizer(name: str):
    from model_families import chat_tokenizer

    family = FAMILIES[name]
    tokenizer = copy.deepcopy(chat_tokenizer())  # SmolLM2-135M-Instruct's real tokenizer (byte-level BPE)
    if family.template is None:
        return tokenizer
    tokenizer.add_special_tokens({"additional_special_tokens": list(family.specials)})
    tokenizer.add_special_tokens({f"{kind}_token": text for kind, text in (("bos", family.bos), ("eos", family.eos))
                                  if text is not None})
    tokenizer.chat_template = (TEMPLATES / family.template).read_text()
    return tokenizer


def token_id(tokenizer, text: str) -> int:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1, (text, ids)
    return ids[0]


def as_ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if not isinstance(encoded, list) else encoded)


# --- the scripted policy -------------------------------------------------------------------------

LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
TEXT = LETTERS + "0123456789     ,.;:?-'\"\n" + "éßü日本🙂"


def random_text(rng: random.Random, low: int, high: int) -> str:
    """Starts with a letter (no format reads it as a call); no '!' (STOP cannot occur by chance)."""
    return rng.choice(LETTERS) + "".join(rng.choice(TEXT) for _ in range(rng.randint(low, high) - 1))


def pieces_ids(tokenizer, parts: list, rng: random.Random, single: dict[str, int], *, longest: int = 4) -> list[int]:
    """Ids for ``parts`` (texts and ids) that do not round-trip: each text cut into pieces of 1-4
    characters, each piece encoded alone; a format text of ``single`` sampled as its one token or
    as pieces."""
    ids: list[int] = []
    for part in parts:
        if isinstance(part, int):
            ids.append(part)
            continue
        if part in single and rng.random() < 0.7:
            ids.append(single[part])
            continue
        at = 0
        while at < len(part):
            step = rng.randint(1, longest)
            ids += tokenizer(part[at:at + step], add_special_tokens=False)["input_ids"]
            at += step
    return ids


@dataclass
class PlannedTurn:
    kind: str  # "call", "answer", "stop" (an answer cut by the stop string), "long" (cut by the budget)
    ids: list[int]
    calls: list[ToolCall] = field(default_factory=list)
    results: list[str] = field(default_factory=list)  # what the tool runner answers, one per message


def plan_call(family: str, tokenizer, rng: random.Random, single: dict[str, int]) -> PlannedTurn:
    fmt = choose_tool_format(tokenizer)
    calls = []
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3])):
        which = rng.random()
        if which < 0.35:
            calls.append(ToolCall("convert", {"value": rng.randint(1, 9), "from_unit": rng.choice(["m", "km"]),
                                              "to_unit": rng.choice(["cm", "m"])}))
        elif which < 0.93:
            text = random_text(rng, 1, 14) + (" stop! " if rng.random() < 0.3 else "")
            calls.append(ToolCall("shout", {"text": text}))
        else:
            calls.append(ToolCall("teleport", {}))
    end = token_id(tokenizer, FAMILIES[family].end_of_message)
    if fmt.name == "mistral":  # as Mistral-v0.3's template writes calls: [TOOL_CALLS] [{...}, ...]
        body = " " + json.dumps([{"name": c.name, "arguments": c.arguments} for c in calls])
        parts = [single["[TOOL_CALLS]"], body, end]
    elif fmt.name == "llama3":
        parts = ([single["<|python_tag|>"]] if rng.random() < 0.3 else []) + [fmt.render(calls), end]
    else:
        prose = random_text(rng, 2, 12) + "\n" if rng.random() < 0.6 else ""
        parts = [prose + fmt.render(calls).split("<tool_call>")[0]]
        for k, call in enumerate(calls):  # each tag a part: sampled as its one token or as pieces
            parts += (["\n"] if k else []) + ["<tool_call>", "\n" + json.dumps({"name": call.name,
                                                                                 "arguments": call.arguments}) + "\n",
                                              "</tool_call>"]
        parts.append(end)
    if any(c.name == "teleport" for c in calls):
        results = [UNKNOWN_TOOL_ERROR]
    else:
        results = [shout(**c.arguments) if c.name == "shout" else json.dumps(convert(**c.arguments)) for c in calls]
    return PlannedTurn("call", pieces_ids(tokenizer, parts, rng, single), calls, results)


def plan_episode(family: str, tokenizer, rng: random.Random, budget: int) -> list[PlannedTurn]:
    single = {text: token_id(tokenizer, text) for text in FAMILIES[family].single_tokens}
    end = token_id(tokenizer, FAMILIES[family].end_of_message)
    turns = []
    for _ in range(MAX_TURNS + 1):
        roll = rng.random()
        if roll < 0.62:
            turns.append(plan_call(family, tokenizer, rng, single))
            continue
        if roll < 0.77:
            turns.append(PlannedTurn("answer", pieces_ids(tokenizer, [random_text(rng, 3, 30), end], rng, single)))
        elif roll < 0.9:
            text = [random_text(rng, 2, 20) + " " + STOP + random_text(rng, 1, 10), end]
            turns.append(PlannedTurn("stop", pieces_ids(tokenizer, text, rng, single)))
        else:  # no end: the budget cuts it
            text = random_text(rng, budget, budget + 20)  # at least a token a character
            turns.append(PlannedTurn("long", pieces_ids(tokenizer, [text], rng, single, longest=1)))
        break
    return turns


class ScriptedEngine:
    """An engine (llamarl/engines/base.py's contract) that "samples" each episode's planned turns:
    a turn ends at a stop id (EOS or ``stop_token_ids``), at a stop string (``TextStops``, as the
    real engines: the turn's text from its last observation on, cut after the token completing
    it) or at ``max_new_tokens``. Records every id it returned as sampled, per turn."""

    def __init__(self, tokenizer, plans: dict[int, list[PlannedTurn]], eos_ids: list[int], seed: int) -> None:
        self.tokenizer, self.plans, self.eos_ids = tokenizer, plans, eos_ids
        self.pad_token_id = tokenizer.pad_token_id
        self.rng = random.Random(seed)
        self.sampled: dict[int, list[list[int]]] = {sid: [] for sid in plans}
        self.logprobs: dict[int, list[float]] = {sid: [] for sid in plans}

    def generate(self, requests, *, sampling: SamplingParams, version: int, generator=None, token_budget=None):
        assert token_budget is None
        stops = stop_ids(self.eos_ids, sampling)
        text_stops = TextStops(self.tokenizer, sampling.stop, include=sampling.include_stop_text) if sampling.stop \
            else None
        outputs = []
        for req in requests:
            check_request(req, sampling=sampling, eos_token_ids=self.eos_ids, vocab=len(self.tokenizer))
            turn = self.plans[req.sample_id][len(self.sampled[req.sample_id])]
            ids, lps, versions = list(req.completion_ids), list(req.logprobs), list(req.versions)
            mask, start = sampled_mask(req), turn_start(req)
            finish, stop_text, text = None, None, None
            for tok in turn.ids:
                if len(ids) >= sampling.max_new_tokens:
                    break
                ids.append(tok)
                lps.append(-self.rng.uniform(0.01, 5.0))
                versions.append(version)
                mask.append(1)
                if tok in stops:
                    finish = FINISH_STOP
                    break
                found = text_stops.search(ids[start:], checked=len(ids) - start - 1) if text_stops else None
                if found is not None:
                    kept = start + found[0]
                    ids, lps, versions, mask = ids[:kept], lps[:kept], versions[:kept], mask[:kept]
                    finish, stop_text, text = FINISH_STOP, found[1], text_stops.turn_text(ids[start:])
                    break
            if finish is None:
                assert len(ids) >= sampling.max_new_tokens, "a planned turn ends at a stop or past the budget"
                finish = FINISH_LENGTH
            self.sampled[req.sample_id].append(ids[len(req.completion_ids):])
            self.logprobs[req.sample_id] += lps[len(req.completion_ids):]
            outputs.append(Completion(sample_id=req.sample_id, prompt_ids=list(req.prompt_ids), completion_ids=ids,
                                      logprobs=lps, versions=versions, finish_reason=finish, loss_mask=mask,
                                      episode=dict(req.episode), stop_text=stop_text, text=text))
        return outputs

    def weights_updated(self, model) -> None: ...

    def close(self) -> None: ...


# --- what the template renders -------------------------------------------------------------------


def rendered_observation(tokenizer, family: str, schemas: list[dict], results: list[str]) -> tuple[str, list[int]]:
    """The observation of ``results`` as the tokenizer's own chat template renders it: the text of
    [user, call message, tool message(s)] + the next assistant header after the call message's
    end (what the policy sampled last), and the ids of that tail in the template's own tokenised
    rendering (``apply_chat_template(tokenize=True)``)."""
    user = {"role": "user", "content": "q"}
    if "tools" in (tokenizer.chat_template or ""):
        calls = [{"id": f"c{k:08d}", "type": "function", "function": {"name": "shout", "arguments": {}}}
                 for k in range(len(results))]
        answers = [{"role": "tool", "name": "shout", "tool_call_id": f"c{k:08d}", "content": r}
                   for k, r in enumerate(results)]
        history = [user, {"role": "assistant", "content": "", "tool_calls": calls}]
        kwargs = {"tools": schemas}
    else:  # the default format: a user message of <tool_response> blocks
        call_text = "\n".join('<tool_call>\n{"name": "shout", "arguments": {}}\n</tool_call>' for _ in results)
        history = [user, {"role": "assistant", "content": call_text}]
        answers = [{"role": "user", "content": "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)}]
        kwargs = {}
    before = tokenizer.apply_chat_template(history, tokenize=False, **kwargs)
    full = tokenizer.apply_chat_template([*history, *answers], tokenize=False, add_generation_prompt=True, **kwargs)
    assert full.startswith(before), "the template renders the history differently once tool messages follow"
    end = FAMILIES[family].end_of_message
    at = full.rindex(end, 0, len(before)) + len(end)
    text = full[at:]
    ids = as_ids(tokenizer.apply_chat_template([*history, *answers], tokenize=True, add_generation_prompt=True,
                                               **kwargs))
    own = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text, ids[len(ids) - len(own):]


def observation_for(tokenizer, family: str, schemas: list[dict], results: list[str]) -> tuple[str, list[int]]:
    try:
        return rendered_observation(tokenizer, family, schemas, results)
    except Exception:  # Llama-3.1's template refuses several calls: one tool message, a line each
        if len(results) == 1:
            raise
        return rendered_observation(tokenizer, family, schemas, ["\n".join(results)])


# --- the property ---------------------------------------------------------------------------------


@dataclass
class Tally:
    episodes: int = 0
    turns: int = 0
    tool_calls: int = 0
    observations: int = 0
    multi_observation_episodes: int = 0
    several_calls_turns: int = 0
    tool_errors: int = 0
    stop_strings: int = 0
    truncated: int = 0
    max_turns_or_budget: int = 0
    answers: int = 0
    non_round_trip_turns: int = 0
    sampled_tokens: int = 0
    observation_tokens: int = 0
    escaped_observations: int = 0  # the template wrote an answer other than as is (Llama's tojson)


def check_episode(out: Completion, plan: list[PlannedTurn], engine: ScriptedEngine, tokenizer, family: str,
                  schemas: list[dict], sampling: SamplingParams, mask_truncated: bool, version: int,
                  tally: Tally) -> None:
    sampled = engine.sampled[out.sample_id]
    expected_ids, expected_mask, expected_lps, expected_versions, trained_ids = [], [], [], [], []
    lps = iter(engine.logprobs[out.sample_id])
    answered = observations = 0
    for k, ids in enumerate(sampled):
        turn, last = plan[k], k == len(sampled) - 1
        tally.turns += 1
        tally.sampled_tokens += len(ids)
        if tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"] != ids:
            tally.non_round_trip_turns += 1
        # Cut by the budget before its end (no stop, no EOS): neither a call nor an answer.
        truncated = last and out.finish_reason == FINISH_LENGTH and ids != turn.ids
        trained = 0 if truncated and mask_truncated else 1
        expected_ids += ids
        expected_mask += [trained] * len(ids)
        trained_ids += ids if trained else []
        expected_lps += [next(lps) for _ in ids]
        expected_versions += [version] * len(ids)
        if turn.kind == "call" and ids == turn.ids:  # a whole call: the runner answers it
            answered += 1
            tally.tool_calls += len(turn.calls)
            tally.several_calls_turns += len(turn.calls) > 1
            tally.tool_errors += turn.results == [UNKNOWN_TOOL_ERROR]
            text, obs = observation_for(tokenizer, family, schemas, turn.results)
            tally.escaped_observations += any(r not in text for r in turn.results)
            if last:  # max_turns, or no room for the observation and one more token
                assert out.finish_reason == FINISH_LENGTH and "truncated" not in out.episode
                assert k + 1 == MAX_TURNS or len(expected_ids) + len(obs) >= sampling.max_new_tokens
                tally.max_turns_or_budget += 1
                continue
            observations += 1
            tally.observations += 1
            tally.observation_tokens += len(obs)
            expected_ids += obs
            expected_mask += [0] * len(obs)
            expected_lps += [0.0] * len(obs)
            expected_versions += [-1] * len(obs)
            continue
        assert last, "only a call is followed by another turn"
        if truncated:
            assert out.episode.get("truncated") is True
            tally.truncated += 1
        elif turn.kind == "stop":
            assert out.finish_reason == FINISH_STOP and out.stop_text == STOP and out.text.endswith(STOP)
            assert len(ids) < len(turn.ids) and "truncated" not in out.episode  # the ids after the stop: never sampled
            tally.stop_strings += 1
        else:
            assert turn.kind == "answer" and out.finish_reason == FINISH_STOP and "truncated" not in out.episode
            tally.answers += 1
    # Id by id: the sampled ids as sampled (no re-tokenisation), the template's ids between them.
    assert out.completion_ids == expected_ids
    assert out.loss_mask == expected_mask
    assert out.logprobs == expected_lps and out.versions == expected_versions
    assert [i for i, m in zip(out.completion_ids, sampled_mask(out)) if m] == trained_ids
    assert out.episode["turns"] == answered
    tally.episodes += 1
    tally.multi_observation_episodes += observations >= 2


def check_no_gradient_on_observations(outs: list[Completion], tokenizer, *, logits_rows: int) -> None:
    """The training rows (``completions_to_batch``, the trainer's loss mask) hold the transcript and
    mask 0 on observations; a loss's gradient w.r.t. the log-probs, and w.r.t. the logits predicting
    an observation token, is exactly 0 there."""
    batch = completions_to_batch(outs, group_ids=list(range(len(outs))), references=[""] * len(outs),
                                 texts=[""] * len(outs), pad_token_id=tokenizer.pad_token_id, group_size=1)
    observation = torch.zeros_like(batch["loss_mask"], dtype=torch.bool)
    for row, out in enumerate(outs):
        p, n = len(out.prompt_ids), len(out.completion_ids)
        assert batch["input_ids"][row, : p + n].tolist() == out.prompt_ids + out.completion_ids
        assert batch["loss_mask"][row, p: p + n].tolist() == sampled_mask(out)
        assert batch["loss_mask"][row, :p].sum() == 0 and batch["loss_mask"][row, p + n:].sum() == 0
        observation[row, p: p + n] = torch.tensor([m == 0 for m in sampled_mask(out)])
    mask = batch["loss_mask"].bool()
    generator = torch.Generator().manual_seed(0)
    logp = (-torch.rand(mask.shape, generator=generator) * 3).requires_grad_(True)
    loss, _ = aipo_loss(logp=logp, behav_logp=batch["behav_logp"], advantages=torch.randn(mask.shape,
                                                                                           generator=generator),
                        mask=mask)
    loss.backward()
    assert (logp.grad[observation] == 0).all() and (logp.grad[mask] != 0).all()
    # Through the logits (full vocabulary) of a few rows: the logits at t predict the token at t + 1.
    for row in [row for row in range(len(outs)) if observation[row].any()][:logits_rows]:
        ids = batch["input_ids"][row: row + 1, : int(batch["num_tokens"][row])]
        logits = torch.randn(1, ids.shape[1], len(tokenizer), generator=generator).requires_grad_(True)
        shifted = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        row_logp = torch.cat([torch.zeros_like(shifted[:, :1]), shifted], dim=1)
        row_mask = mask[row: row + 1, : ids.shape[1]]
        loss, _ = aipo_loss(logp=row_logp, behav_logp=batch["behav_logp"][row: row + 1, : ids.shape[1]],
                            advantages=torch.ones_like(row_logp), mask=row_mask)
        loss.backward()
        predicts_observation = observation[row, 1: ids.shape[1]]
        assert (logits.grad[0, :-1][predicts_observation] == 0).all()
        assert (logits.grad[0, :-1][row_mask[0, 1:]].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_trained_ids_are_the_sampled_ids_and_the_observations_the_templates(family):
    tokenizer = family_tokenizer(family)
    fmt = choose_tool_format(tokenizer)
    reference = tools_reference(TOOLS, tool_format=fmt.name)
    environment = build_environment(reference)
    schemas = environment.chat_tools()
    eos_ids = sorted({token_id(tokenizer, text) for text in FAMILIES[family].engine_eos})
    rng = random.Random(f"token-in-out/{family}")
    tally = Tally()
    questions = ["How many cm in 2 m?", 'Shout "hi"\nplease', "Wie viel ist 3 km in m? 日本"]
    for batch in range(10):
        budget = rng.choice([200, 300, 500, 800])
        mask_truncated = batch % 2 == 1
        problems = {sid: Problem(question=rng.choice(questions), answer="") for sid in range(8)}
        plans = {sid: plan_episode(family, tokenizer, rng, budget) for sid in problems}
        engine = ScriptedEngine(tokenizer, plans, eos_ids, seed=batch)
        tools = ToolRunner(reference, timeout_s=30.0, num_workers=0)
        runner = EpisodeRunner(engine, environment=environment, tools=tools, tokenizer=tokenizer,
                               max_turns=MAX_TURNS, problem_of=lambda sid: problems[sid],  # noqa: B023
                               mask_truncated=mask_truncated)
        prompt_of = presenting_tools(build_chat_prompt, schemas)
        requests = [Request(sample_id=sid, prompt_ids=prompt_of(tokenizer, p.question))
                    for sid, p in problems.items()]
        sampling = SamplingParams(max_new_tokens=budget, stop=[STOP])
        outs = runner.generate(requests, sampling=sampling, version=batch + 1)
        runner.close()
        assert [o.sample_id for o in outs] == list(problems)
        for out in outs:
            check_episode(out, plans[out.sample_id], engine, tokenizer, family, schemas, sampling, mask_truncated,
                          batch + 1, tally)
        check_no_gradient_on_observations(outs, tokenizer, logits_rows=1 if batch < 2 else 0)
    print(family, tally)
    # Not vacuous: every kind of turn ran, many times.
    assert tally.episodes == 80 and tally.turns >= 120 and tally.sampled_tokens >= 6000
    assert tally.tool_calls >= 60 and tally.observations >= 40 and tally.observation_tokens >= 1000
    assert tally.several_calls_turns >= 10 and tally.tool_errors >= 3 and tally.multi_observation_episodes >= 8
    assert tally.stop_strings >= 5 and tally.truncated >= 5 and tally.answers >= 5 and tally.max_turns_or_budget >= 3
    assert tally.non_round_trip_turns >= 0.8 * tally.turns
    if family == "llama3.1":  # its template writes a tool answer as a JSON string (quotes, escapes)
        assert tally.escaped_observations >= 5


def test_the_tools_are_presented_in_every_template():
    """The prompt of each template shows the tools (Gemma-2 has no system role: the default
    format's text opens the user message)."""
    for family in FAMILIES:
        tokenizer = family_tokenizer(family)
        schemas = build_environment(tools_reference(TOOLS)).chat_tools()
        text = tokenizer.decode(presenting_tools(build_chat_prompt, schemas)(tokenizer, "How many cm in 2 m?"))
        assert '"shout"' in text and "How many cm in 2 m?" in text, family
    gemma = family_tokenizer("gemma2")
    text = gemma.decode(presenting_tools(build_chat_prompt, schemas)(gemma, "q"))
    assert text.startswith("<bos><start_of_turn>user\n" + DEFAULT_TOOLS_SYSTEM.split("{tools}")[0].strip()[:40])


def test_an_answer_the_template_escapes_and_a_message_ending_at_end_of_turn():
    """The two drifts the property found: Llama-3.1's template writes a tool answer as a JSON string
    (quotes and new lines escaped), so the observation is rendered with the answer, not around it;
    Gemma-2's messages end at <end_of_turn>, not at its tokenizer's EOS <eos>."""
    from llamarl.environments.function_tools import tool_observation_text

    schemas = build_environment(tools_reference(TOOLS)).chat_tools()
    llama = family_tokenizer("llama3.1")
    assert tool_observation_text(llama, schemas, ['say "HI"\nnow']) == (
        '<|start_header_id|>ipython<|end_header_id|>\n\n"say \\"HI\\"\\nnow"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert tool_observation_text(llama, schemas, ["a", "b"]) == (  # one tool message, an answer a line
        '<|start_header_id|>ipython<|end_header_id|>\n\n"a\\nb"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n')
    gemma = family_tokenizer("gemma2")
    assert tool_observation_text(gemma, schemas, ["42"]) == (
        "\n<start_of_turn>user\n<tool_response>\n42\n</tool_response><end_of_turn>\n<start_of_turn>model\n")
