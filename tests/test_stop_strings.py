"""Stop strings (``SamplingParams.stop``, llamarl/engines/stop_text.py) on every engine, against a
reference that decodes the full text of the same sampling run without stops.

The engines: the native one on the fused CPU decoder, on the static decoder run eagerly on CPU
(its looks every few steps: the CUDA-graph loop's host side, tokens past a stop drawn and cut), on
HF's modules, and with continuous batching; vLLM through a stand-in ``vllm`` that records the
calls and ends a request as vLLM does (its new text reaching a stop; the completing token kept).
The stops come from each request's own reference text: one spread over several tokens, one ending
inside a token (that token kept, the text cut), one at the first token. The reference: the full
text of the unstopped completion, the stop that ends first in it, the fewest ids whose text
starts with the text kept, their log-probs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from model_families import build_family, chat_tokenizer

from llamarl.engines.base import Completion, Request, SamplingParams
from llamarl.engines.torch_engine import TorchEngine
from llamarl.engines.vllm_engine import VLLMEngine

NEW = 20
ENGINES = {
    "fused": {},
    "static": {"static_decode": "eager", "eos_check_every": 4},
    "hf": {"fused_decode": False, "static_decode": "off"},
    "static-batching": {"static_decode": "eager", "eos_check_every": 3, "max_num_seqs": 2},
}


def decode(ids: list[int]) -> str:
    return chat_tokenizer().decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def model():
    return build_family("llama-tied")


def requests() -> list[Request]:
    tok = chat_tokenizer()
    texts = ["2 + 2 =", "Write the product of 347 and 23, then stop.", "The tool says", "Once upon a time"]
    return [Request(sample_id=i, prompt_ids=tok(t)["input_ids"]) for i, t in enumerate(texts)]


def native(model, kind: str = "hf", **kw) -> TorchEngine:
    return TorchEngine(model, eos_token_ids=[], pad_token_id=chat_tokenizer().pad_token_id, tokenizer=chat_tokenizer(),
                       **{**ENGINES[kind], **kw})


def run(engine, sampling: SamplingParams, reqs=None, *, token_budget=None) -> list[Completion]:
    """Every request to its end (carried ones resubmitted), one seeded generator per call."""
    reqs = reqs if reqs is not None else requests()
    done: dict[int, Completion] = {}
    while reqs:
        outs = engine.generate(reqs, sampling=sampling, version=1, generator=torch.Generator().manual_seed(0),
                               token_budget=token_budget)
        reqs = [o.to_request() for o in outs if o.finish_reason == "carried"]
        done.update({o.sample_id: o for o in outs if o.finish_reason != "carried"})
    return [done[i] for i in sorted(done)]


def piece(ids: list[int], start: int, stop: int) -> str:
    """The text tokens ``start .. stop - 1`` add to the decoded prefix."""
    return decode(ids[:stop])[len(decode(ids[:start])):]


def cases_of(reference: list[Completion]) -> dict[str, str]:
    """A stop per case, from the requests' own texts: spread over tokens 5-7 of request 0, ending
    one character into a token of two or more characters of request 1, the first character of
    request 2's first token."""
    ids = [r.completion_ids for r in reference]
    inside = next(t for t in range(4, NEW) if len(piece(ids[1], t, t + 1)) >= 2)
    return {"spread": piece(ids[0], 5, 8),
            "inside": piece(ids[1], inside - 2, inside) + piece(ids[1], inside, inside + 1)[0],
            "first": piece(ids[2], 0, 1)[0]}


def tokens_spanned(ids: list[int], text: str, stop: str) -> int:
    """How many of ``ids`` (cut at ``stop``, kept) the stop's first occurrence spans."""
    start = text.find(stop)
    before = max(k for k in range(len(ids) + 1) if len(decode(ids[:k])) <= start)
    return len(ids) - before


def expected(reference: Completion, stops: list[str], *, include: bool):
    """(ids, log-probs, stop, text): the full text's first stop to end, the fewest ids covering the
    kept text; without a stop in the text, the whole reference (stop and text None)."""
    text = decode(reference.completion_ids)
    if not any(s in text for s in stops):
        return reference.completion_ids, reference.logprobs, None, None
    found = min((text.find(s) + len(s), text.find(s), s) for s in stops if s in text)
    end, start, stop = found
    cut = text[: end if include else start]
    kept = next(k for k in range(len(reference.completion_ids) + 1)
                if decode(reference.completion_ids[:k]).startswith(cut))
    return reference.completion_ids[:kept], reference.logprobs[:kept], stop, cut


def assert_stopped(outs: list[Completion], reference: list[Completion], stops: list[str], *, include: bool) -> None:
    for out, ref in zip(outs, reference):
        ids, lps, stop, text = expected(ref, stops, include=include)
        assert out.completion_ids == ids, (out.sample_id, stop)
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(lps), atol=1e-4, rtol=0)
        assert len(out.versions) == len(out.loss_mask) == len(ids)
        if stop is None:
            assert (out.finish_reason, out.stop_text, out.text) == (ref.finish_reason, None, None)
            continue
        assert (out.finish_reason, out.stop_text, out.text) == ("stop", stop, text)
        # The ids end where the text does: the kept ids' text starts with it, one fewer's does not.
        assert decode(ids).startswith(text) and (not ids or not decode(ids[:-1]).startswith(text))


@pytest.mark.parametrize("include", [True, False], ids=["keep-stop", "drop-stop"])
@pytest.mark.parametrize("kind", list(ENGINES))
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_stop_string_cuts_the_completion_where_the_full_text_reaches_it(model, kind, include, temperature):
    reference = run(native(model), SamplingParams(temperature=temperature, max_new_tokens=NEW))
    assert all(r.finish_reason == "length" for r in reference)
    for case, stop in cases_of(reference).items():
        stops = [stop, "\x01 never sampled"]
        sampling = SamplingParams(temperature=temperature, max_new_tokens=NEW, stop=stops, include_stop_text=include)
        assert_stopped(run(native(model, kind), sampling), reference, stops, include=include)
        if not include:
            continue
        # Each case happens where it was taken from: several tokens, inside a token, the first token.
        ids, _, _, text = expected(reference[{"spread": 0, "inside": 1, "first": 2}[case]], stops, include=True)
        if case == "spread":
            assert tokens_spanned(ids, text, stop) >= 2
        elif case == "inside":
            assert decode(ids) != text  # the token is kept, the text cut inside it
        else:
            assert len(ids) == 1


def test_a_stop_split_by_a_carry_is_found_in_the_next_call(model):
    reference = run(native(model), SamplingParams(temperature=0.0, max_new_tokens=NEW))
    stops = [cases_of(reference)["spread"]]  # tokens 5-7 of request 0: a budget of 6 splits them
    sampling = SamplingParams(temperature=0.0, max_new_tokens=NEW, stop=stops)
    for kind in ("fused", "static"):
        assert_stopped(run(native(model, kind), sampling, token_budget=6), reference, stops, include=True)


def test_a_stopped_row_is_retired_at_the_next_look(model):
    """Request 0 alone on the static loop (looks every 4 steps): its stop is seen at the first look
    after the token that completes it and the row retired there, not at its budget's end."""
    reference = run(native(model), SamplingParams(temperature=0.0, max_new_tokens=NEW))
    stops = [cases_of(reference)["spread"]]
    kept = len(expected(reference[0], stops, include=True)[0])
    steps = {}
    for stop in ([], stops):
        engine = native(model, "static")
        run(engine, SamplingParams(temperature=0.0, max_new_tokens=NEW, stop=stop), requests()[:1])
        steps[bool(stop)] = engine.static_decoder.num_steps
    every = ENGINES["static"]["eos_check_every"]  # steps between looks; the first token is the prefill's
    assert steps[False] == -(-(NEW - 1) // every) * every
    assert steps[True] == -(-(kept - 1) // every) * every < steps[False]


def test_stop_strings_need_a_tokenizer_and_are_strings(model):
    engine = TorchEngine(model, eos_token_ids=[], pad_token_id=chat_tokenizer().pad_token_id)
    with pytest.raises(ValueError, match=r"stop strings \['x'\] need the tokenizer"):
        engine.generate(requests(), sampling=SamplingParams(stop=["x"]), version=0)
    for bad in ("x", [""], [3]):
        with pytest.raises(ValueError, match="stop must be a list of non-empty strings"):
            SamplingParams(stop=bad)


# -- vLLM, through a stand-in module -----------------------------------------------------------


class FakeLLM:
    """``vllm.LLM.generate`` continuing each context as ``reference`` does, ending a request as vLLM
    does: a stop id (kept), ``max_tokens``, or its new text reaching a stop string (the token that
    completes it kept in ``token_ids``). Records every request's sampling parameters."""

    def __init__(self, reference: list[Completion]) -> None:
        self.reference, self.params = reference, []

    def generate(self, prompts, params, use_tqdm=False):
        outputs = []
        for prompt, p in zip(prompts, params):
            self.params.append(p.kwargs)
            context = prompt["prompt_token_ids"]
            ref = next(r for r in self.reference if (r.prompt_ids + r.completion_ids)[: len(context)] == context)
            offset = len(context) - len(ref.prompt_ids)
            ids = []
            for token in ref.completion_ids[offset:][: p.kwargs["max_tokens"]]:
                ids.append(token)
                if token in p.kwargs["stop_token_ids"]:
                    break
                if any(s in decode(ids) for s in p.kwargs.get("stop", [])):
                    break
            lps = ref.logprobs[offset: offset + len(ids)]
            flat = SimpleNamespace(logprobs=lps, start_indices=list(range(len(ids))))
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=flat)]))
        return outputs


def fake_vllm_engine(reference: list[Completion]) -> VLLMEngine:
    engine = VLLMEngine.__new__(VLLMEngine)  # the generation path only: no vLLM to build
    engine._vllm = SimpleNamespace(SamplingParams=lambda **kwargs: SimpleNamespace(kwargs=kwargs))
    engine._tokens_prompt = dict
    engine.llm, engine.tokenizer = FakeLLM(reference), chat_tokenizer()
    engine.eos_token_ids, engine.pad_token_id, engine.seed_requests = [], 0, False
    engine.vocab_size, engine.max_model_len, engine._asleep = len(chat_tokenizer()), 4096, set()
    return engine


@pytest.mark.parametrize("include", [True, False], ids=["keep-stop", "drop-stop"])
def test_vllm_passes_the_stops_and_cuts_its_ids_as_the_native_engine(model, include):
    reference = run(native(model), SamplingParams(temperature=0.0, max_new_tokens=NEW))
    stops = list(cases_of(reference).values())
    engine = fake_vllm_engine(reference)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=NEW, stop=stops, include_stop_text=include)
    assert_stopped(run(engine, sampling), reference, stops, include=include)
    assert all(p["stop"] == stops and p["include_stop_str_in_output"] and p["detokenize"] for p in engine.llm.params)
    # A stop split by a carry: vLLM's check of the new text misses it; the cut over the turn finds it.
    engine.llm.params.clear()
    assert_stopped(run(engine, sampling, token_budget=6), reference, stops, include=include)
    # Without stop strings nothing is detokenised and vLLM gets no stop.
    engine.llm.params.clear()
    plain = run(engine, SamplingParams(temperature=0.0, max_new_tokens=NEW))
    assert [o.completion_ids for o in plain] == [r.completion_ids for r in reference]
    assert all(not p["detokenize"] and "stop" not in p for p in engine.llm.params)
    assert all(o.stop_text is None and o.text is None for o in plain)


# -- an environment whose stop text is several tokens ----------------------------------------


class SplitStopEnv:
    """Its turn ends at ``stop`` (set by the test: several tokens of SmolLM2's tokenizer); ``step``
    keeps the turns' texts in the state."""

    stop = ""

    def stop_texts(self) -> list[str]:
        return [SplitStopEnv.stop]

    def end_texts(self) -> list[str]:
        return []

    def reset(self, problem) -> dict:
        return {"turns": []}

    def step(self, state: dict, turn: str):
        from llamarl.environments.base import Turn

        return Turn(observation=" OK.", state={"turns": [*state["turns"], turn]})


def test_an_environment_stop_text_of_several_tokens_ends_the_turn_as_a_stop_string(model, monkeypatch):
    from llamarl.data.prompts import Problem
    from llamarl.environments.base import observation_ids
    from llamarl.environments.episode_engine import EpisodeRunner
    from llamarl.environments.tool_workers import ToolRunner

    reference = run(native(model), SamplingParams(temperature=0.0, max_new_tokens=NEW))
    stop = cases_of(reference)["spread"]
    assert len(observation_ids(chat_tokenizer(), stop)) > 1  # not one token: a stop string
    monkeypatch.setattr(SplitStopEnv, "stop", stop)
    name = "test_stop_strings:SplitStopEnv"
    runner = EpisodeRunner(native(model, "fused"), environment=SplitStopEnv(), tokenizer=chat_tokenizer(),
                           tools=ToolRunner(name, timeout_s=5.0, num_workers=0), max_turns=2,
                           problem_of=lambda sample_id: Problem(question="q", answer="a"))
    out = runner.generate(requests()[:1], sampling=SamplingParams(temperature=0.0, max_new_tokens=NEW), version=2)[0]
    ids, _, _, text = expected(reference[0], [stop], include=True)
    obs = observation_ids(chat_tokenizer(), " OK.")
    first = len(ids) + len(obs)  # the first turn, cut at the stop, and the observation; a second turn follows
    assert out.completion_ids[:first] == ids + obs and len(out.completion_ids) > first
    assert out.loss_mask == [1] * len(ids) + [0] * len(obs) + [1] * (len(out.completion_ids) - first)
    assert out.episode["state"]["turns"][0] == text and text.endswith(stop)  # step read the turn cut at the stop


@pytest.mark.parametrize("mask", [False, True], ids=["marked", "masked"])
def test_a_turn_the_budget_cuts_is_marked_truncated_and_maskable(model, monkeypatch, mask):
    """The first turn ends at the stop string (a call), the second runs into ``max_new_tokens``: the
    episode is marked truncated; ``mask_truncated`` zeroes the loss mask of that turn only."""
    from llamarl.data.prompts import Problem
    from llamarl.environments.base import observation_ids
    from llamarl.environments.episode_engine import EpisodeRunner
    from llamarl.environments.tool_workers import ToolRunner

    reference = run(native(model), SamplingParams(temperature=0.0, max_new_tokens=NEW))
    monkeypatch.setattr(SplitStopEnv, "stop", cases_of(reference)["spread"])
    name = "test_stop_strings:SplitStopEnv"
    runner = EpisodeRunner(native(model, "fused"), environment=SplitStopEnv(), tokenizer=chat_tokenizer(),
                           tools=ToolRunner(name, timeout_s=5.0, num_workers=0), max_turns=2, mask_truncated=mask,
                           problem_of=lambda sample_id: Problem(question="q", answer="a"))
    ids = expected(reference[0], [SplitStopEnv.stop], include=True)[0]
    first = len(ids) + len(observation_ids(chat_tokenizer(), " OK."))
    out = runner.generate(requests()[:1], sampling=SamplingParams(temperature=0.0, max_new_tokens=first + 2),
                          version=2)[0]
    assert out.finish_reason == "length" and out.episode["truncated"] and len(out.completion_ids) == first + 2
    assert out.loss_mask[:first] == [1] * len(ids) + [0] * (first - len(ids))
    assert out.loss_mask[first:] == ([0, 0] if mask else [1, 1])
