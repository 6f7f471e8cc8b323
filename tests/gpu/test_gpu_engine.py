"""The native engine on CUDA: greedy equals HF generate, sampled log-probs match a forward."""

import pytest
import torch
from tiny_model import build_tiny_llama

from llamarl.engines.base import Request, SamplingParams
from llamarl.engines.torch_engine import TorchEngine

DEVICE = "cuda"


def prompts():
    g = torch.Generator(device="cpu").manual_seed(1)
    return [torch.randint(3, 128, (n,), generator=g, device="cpu").tolist() for n in (3, 9, 1, 14, 6)]


def forward_logprobs(model, completion, temperature):
    ids = torch.tensor([completion.prompt_ids + completion.completion_ids], device=DEVICE)
    with torch.no_grad():
        logits = model(ids).logits[0, len(completion.prompt_ids) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(completion.completion_ids, device=DEVICE)[:, None]).squeeze(-1).cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_equals_hf_generate_on_cuda(dtype):
    model = build_tiny_llama(seed=0).to(device=DEVICE, dtype=dtype)
    engine = TorchEngine(model, eos_token_ids=[2], pad_token_id=0)
    out = engine.generate([Request(i, p) for i, p in enumerate(prompts())],
                          sampling=SamplingParams(temperature=0, max_new_tokens=12), version=0)
    for comp in out:
        ref = model.generate(torch.tensor([comp.prompt_ids], device=DEVICE), do_sample=False, max_new_tokens=12,
                             eos_token_id=2, pad_token_id=0)[0, len(comp.prompt_ids):].tolist()
        if 2 in ref:
            ref = ref[: ref.index(2) + 1]
        assert comp.completion_ids == ref


def test_sampled_logprobs_match_a_forward_within_bf16_tolerance():
    model = build_tiny_llama(seed=0).to(device=DEVICE, dtype=torch.bfloat16)
    engine = TorchEngine(model, eos_token_ids=[5, 17, 40], pad_token_id=0)
    rng = torch.Generator(device=DEVICE).manual_seed(3)
    out = engine.generate([Request(i, p) for i, p in enumerate(prompts())],
                          sampling=SamplingParams(temperature=0.7, max_new_tokens=16), version=0, generator=rng)
    for comp in out:
        # bf16 logits: a cached decode and a full forward round differently, ~1e-2 in log-prob.
        assert (forward_logprobs(model, comp, 0.7) - torch.tensor(comp.logprobs)).abs().max() < 5e-2


def test_a_cpu_generator_with_a_cuda_model_is_a_clear_error():
    model = build_tiny_llama(seed=0).to(DEVICE)
    engine = TorchEngine(model, eos_token_ids=[2], pad_token_id=0)
    with pytest.raises(ValueError, match="torch.Generator\\(device=ctx.device\\)"):
        engine.generate([Request(0, [3, 4])], sampling=SamplingParams(temperature=1.0, max_new_tokens=2),
                        version=0, generator=torch.Generator(device="cpu"))
