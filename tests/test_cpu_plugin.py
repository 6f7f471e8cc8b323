"""The CPU plugin's boundary (llamarl/engines/cpu/): the engine, the general sampler and the static
decode loop import no part of it (a CUDA run never loads the C kernels), and on the CPU the engine
samples through it (bf16 logits drawn in C, the general sampler's draws)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from llamarl.engines.base import SamplingParams


def test_the_engine_and_the_general_sampler_import_no_cpu_plugin():
    code = ("import json, sys, torch; import llamarl.engines, llamarl.engines.torch_engine as t, "
            "llamarl.engines.sampling, llamarl.engines.static_decode, llamarl.engines.decode_loop, llamarl.engines.decoder, llamarl.engines.hf_decoder; "
            "assert t._sampler(torch.device('cuda')) is llamarl.engines.sampling.sample_tokens; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('llamarl.engines.cpu'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_the_engine_samples_cpu_logits_through_the_plugin(monkeypatch):
    from llamarl.engines import sampling
    from llamarl.engines.cpu import cpu_kernels
    from llamarl.engines.cpu.sampling import sample_tokens_cpu
    from llamarl.engines.torch_engine import TorchEngine, _sampler

    assert _sampler(torch.device("cpu")) is sample_tokens_cpu
    if not cpu_kernels.available():
        return
    calls = []
    sample = cpu_kernels.sample
    monkeypatch.setattr(cpu_kernels, "sample", lambda x, u: calls.append(x.shape) or sample(x, u))
    engine = TorchEngine(torch.nn.Linear(1, 1), eos_token_ids=[], pad_token_id=0)
    logits = (torch.randn(3, 500, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    uniforms = torch.rand(3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    params = SamplingParams(temperature=1.0)
    tokens, logprobs = engine._sample(logits, sampling=params, uniforms=uniforms)
    assert calls == [(3, 500)]
    general = sampling.sample_tokens(logits, sampling=params, uniforms=uniforms)
    assert torch.equal(tokens, general[0])
    torch.testing.assert_close(logprobs, general[1], rtol=0, atol=1e-5)
