"""The static decoder's CUDA graphs across ``generate`` calls (llamarl/engines/static_decode.py):
captured once for the engine's life, a weight written in place read by the next call's replays, and
no host synchronisation in the steps between two EOS checks."""

import pytest
import torch
from tiny_model import build_tiny_llama, tiny_llama_config

from llamarl.engines.base import Request, SamplingParams
from llamarl.engines.scheduler import Scheduler
from llamarl.engines.torch_engine import TorchEngine

DEVICE = "cuda"


def smollm2_shaped(dtype):
    """A random-init Llama with SmolLM2-135M's dimensions, on the GPU."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                               intermediate_size=1536, tie_word_embeddings=True, max_position_embeddings=2048)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device(DEVICE):
            model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def requests():
    g = torch.Generator(device="cpu").manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=g, device="cpu").tolist() for n in (3, 9, 1, 14, 6)]
    return [Request(i, p) for i, p in enumerate(prompts)]


def decoder_of(engine):
    """``engine.static_decoder`` (``engine._static`` where that property does not exist yet)."""
    decoder = getattr(engine, "static_decoder", None)
    return decoder if decoder is not None else getattr(engine, "_static", None)


def eager_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens of a plain loop of full HF forwards (no cache, no graphs, one row)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids], device=DEVICE)).logits[0, -1]
            ids.append(int(logits.float().argmax()))
    return ids[len(prompt):]


def test_a_second_call_after_an_in_place_update_captures_nothing_and_reads_the_new_weights():
    """Two ``generate`` calls on one engine (SmolLM2's shape), the MLP weights rewritten in place
    between them (what a weight sync does): the second call replays the first call's graphs
    (``num_captures`` unchanged) and its greedy tokens are those of a fresh eager forward loop over
    the updated weights. fp32: at bf16 a batched graph step and a one-row forward round differently
    and a random model's near-ties part them (test_gpu_engine.py's greedy test explains)."""
    model = smollm2_shaped(torch.float32)
    engine = TorchEngine(model, eos_token_ids=[], pad_token_id=0)  # static_decode="auto": graphs on CUDA
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    first = engine.generate(requests(), sampling=greedy, version=0)
    decoder = decoder_of(engine)
    assert decoder is not None and decoder.num_steps > 0, "the static path fell back to HF's modules"
    assert decoder.cuda_graphs and decoder.num_captures > 0
    captures, steps = decoder.num_captures, decoder.num_steps

    with torch.no_grad():  # in place, same addresses
        for layer in model.model.layers:
            layer.mlp.up_proj.weight.copy_(torch.randn_like(layer.mlp.up_proj.weight) * 0.05)
    second = engine.generate(requests(), sampling=greedy, version=1)
    assert decoder_of(engine) is decoder and decoder.num_steps > steps
    assert decoder.num_captures == captures, "the second call captured graphs again"
    assert [c.completion_ids for c in second] != [c.completion_ids for c in first], "the update changed nothing"
    for comp in second:
        assert comp.completion_ids == eager_greedy(model, comp.prompt_ids, 16), f"request {comp.sample_id}"


def test_steps_between_eos_checks_do_not_synchronise(monkeypatch):
    """The steady state of the static loop (graph replays, sampling, the device-side bookkeeping of
    ``decode_loop.decode``) under ``torch.cuda.set_sync_debug_mode("error")``: any host
    synchronisation there raises. The mode is on only between the loop's host checks (its
    ``Scheduler.look``, which reads the finished rows and admits, prefills, compacts: synchronising is its
    job), in a second call, whose graphs the first call captured."""

    model = build_tiny_llama(seed=0).to(device=DEVICE, dtype=torch.bfloat16)
    engine = TorchEngine(model, eos_token_ids=[], pad_token_id=0, eos_check_every=8)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=33)  # 4 checks with 8 steps after each

    def call():
        return engine.generate(requests_tiny(), sampling=sampling, version=0,
                               generator=torch.Generator(device=DEVICE).manual_seed(0))

    call()  # captures the graphs
    decoder = decoder_of(engine)
    assert decoder is not None and decoder.num_steps > 0, "the static path fell back to HF's modules"
    try:  # the mode works here: a read of a device value raises
        torch.cuda.set_sync_debug_mode("error")
        with pytest.raises(RuntimeError, match="synchroniz"):
            torch.ones(1, device=DEVICE).item()
    finally:
        torch.cuda.set_sync_debug_mode(0)

    checks, original = [], Scheduler.look

    def check(self):
        torch.cuda.set_sync_debug_mode(0)
        rows = original(self)
        checks.append(rows)
        if rows:  # steps follow: none of them may synchronise
            torch.cuda.set_sync_debug_mode("error")
        return rows

    monkeypatch.setattr(Scheduler, "look", check)
    steps = decoder.num_steps
    try:
        out = call()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert [len(c.completion_ids) for c in out] == [33] * len(out)
    assert len(checks) >= 4 and checks[-1] == 0
    assert decoder.num_steps - steps >= 32  # the steps ran under the mode


def requests_tiny():
    g = torch.Generator(device="cpu").manual_seed(1)
    return [Request(i, torch.randint(3, 128, (n,), generator=g, device="cpu").tolist())
            for i, n in enumerate((3, 9, 1, 14, 6))]
