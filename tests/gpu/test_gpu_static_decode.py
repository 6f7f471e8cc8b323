"""The static decode loop on CUDA (llamarl/engines/static_decode.py): the eager step captured as CUDA
graphs for the engine's life (what ``--generator.torch.static-decode auto`` runs on a GPU), against
the HF modules' loop on the same GPU: the same tokens in fp32 greedy and for a seeded sample,
nothing recompiled or re-captured by a second call, and a weight written in place read by the next
call's graphs."""

import torch
from tiny_model import build_tiny_llama

from llamarl.engines.base import Request, SamplingParams
from llamarl.engines.torch_engine import TorchEngine

DEVICE = "cuda"


def requests():
    g = torch.Generator(device="cpu").manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=g, device="cpu").tolist() for n in (3, 9, 1, 14, 6)]
    return [Request(i, p) for i, p in enumerate(prompts)]


def run(engine, sampling, seed=0):
    return engine.generate(requests(), sampling=sampling, version=0,
                           generator=torch.Generator(device=DEVICE).manual_seed(seed))


def test_cuda_graph_steps_give_the_hf_loops_tokens():
    model = build_tiny_llama(seed=0).to(DEVICE)
    static = TorchEngine(model, eos_token_ids=[5, 17], pad_token_id=0, eos_check_every=4)  # auto: static on CUDA
    hf = TorchEngine(model, eos_token_ids=[5, 17], pad_token_id=0, static_decode="off")
    for sampling in (SamplingParams(temperature=0.0, max_new_tokens=24),
                     SamplingParams(temperature=1.0, max_new_tokens=24)):
        got, expected = run(static, sampling), run(hf, sampling)
        assert [c.completion_ids for c in got] == [c.completion_ids for c in expected]
        for a, b in zip(got, expected):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)
    decoder = static._static
    assert decoder is not None and decoder.cuda_graphs and decoder.num_steps > 0 and decoder.num_captures > 0
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    captures = decoder.num_captures
    run(static, SamplingParams(temperature=1.0, max_new_tokens=24))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # nothing compiled
    assert decoder.num_captures == captures  # the same graphs, replayed

    with torch.no_grad():  # what a weight channel does: in place, same addresses
        for layer in model.model.layers:
            layer.mlp.up_proj.weight.copy_(torch.randn_like(layer.mlp.up_proj.weight))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    assert [c.completion_ids for c in run(static, greedy)] == [c.completion_ids for c in run(hf, greedy)]


def test_bf16_static_steps_track_the_hf_loop():
    model = build_tiny_llama(seed=0).to(device=DEVICE, dtype=torch.bfloat16)
    static = TorchEngine(model, eos_token_ids=[], pad_token_id=0)
    hf = TorchEngine(model, eos_token_ids=[], pad_token_id=0, static_decode="off")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    got, expected = run(static, greedy), run(hf, greedy)
    # bf16 kernels round differently: the first tokens agree; later ones may part at a near-tie.
    assert [c.completion_ids[:2] for c in got] == [c.completion_ids[:2] for c in expected]
    assert static._static.num_captures > 0
