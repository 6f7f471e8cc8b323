"""``--trainer.compile layers`` (llamarl/models/sharding.py ``compile_layers``): each decoder layer's
forward compiled on its instance, HF names kept, the trainer's shared-prompt log-probs (segment
attention: a graph break, not a failure) and their gradients equal to eager ones in fp32, with and
without per-layer checkpointing, and one compile serving every layer and later batches; the
``compile_seconds`` clock. The 2-rank FSDP2 world: tests/worlds/checkpointing_world.py."""

from __future__ import annotations

import pytest
import torch
from tiny_model import build_tiny_llama

from llamarl.executors.config import TrainerConfig
from llamarl.executors.trainer_metrics import CompileClock
from llamarl.models.sharding import checkpoint_layers, compile_layers, decoder_layers, is_compiled
from llamarl.models.shared_prefix import shared_prefix_logprobs


def batch(seed: int, *, rows: int = 4, width: int = 14, prompt: int = 5):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 120, (rows, width), generator=gen)
    ids[1, :prompt] = ids[0, :prompt]  # a group: rows 0 and 1 share their prompt
    lengths = torch.randint(prompt + 2, width + 1, (rows,), generator=gen)
    attention = (torch.arange(width) < lengths[:, None]).long()
    loss_mask = attention.clone()
    loss_mask[:, :prompt] = 0
    weights = torch.randn(rows, width + 1, generator=gen)
    return ids, attention, loss_mask, weights


def step(model, data):
    ids, attention, loss_mask, weights = data
    model.zero_grad(set_to_none=True)
    logp = shared_prefix_logprobs(model, ids, attention, loss_mask, temperature=0.8, chunk_tokens=8)
    (logp * weights[:, : logp.shape[1]]).sum().backward()
    return logp.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_layers_match_eager_log_probs_and_gradients(checkpointing):
    torch._dynamo.reset()
    eager, compiled = build_tiny_llama(seed=0).train(), build_tiny_llama(seed=0).train()
    if checkpointing:
        checkpoint_layers(eager)
        checkpoint_layers(compiled)
    assert compile_layers(compiled, backend="aot_eager") == 2 and compile_layers(compiled, backend="aot_eager") == 2
    assert all(is_compiled(layer) for layer in decoder_layers(compiled))
    assert not any(is_compiled(layer) for layer in decoder_layers(eager))
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    assert compiled.state_dict().keys() == eager.state_dict().keys()
    torch._dynamo.utils.counters.clear()
    graphs = []
    for seed in (1, 2, 3, 4):  # batches of different lengths and segment layouts
        data = batch(seed, width=14 + 3 * seed)
        (logp, grads), (ref_logp, ref_grads) = step(compiled, data), step(eager, data)
        torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-5)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    # Each layer compiled in two graphs around segment attention (a graph break: its host loop
    # runs eagerly), static shapes at the first batch, symbolic from the second; new lengths and
    # layouts compile nothing more (the spans are not guarded on).
    breaks = torch._dynamo.utils.counters["graph_break"]
    assert any("_segments" in reason for reason in breaks), dict(breaks)
    assert graphs == [4, 8, 8, 8], graphs
    with torch.no_grad():  # a no-grad forward (proximal, reference) runs through it too
        ids = batch(4)[0]
        torch.testing.assert_close(compiled(input_ids=ids).logits, eager(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_compile_backend_is_checked():
    with pytest.raises(ValueError, match="--trainer.compile-backend"):
        compile_layers(build_tiny_llama(seed=0), backend="nvfuser")
    with pytest.raises(ValueError, match="--trainer.compile must be"):
        TrainerConfig(compile="model")
    with pytest.raises(ValueError, match="--trainer.compile-backend"):
        TrainerConfig(compile_backend="tvm")


def test_compile_clock_counts_compiles_inside_running_only():
    torch._dynamo.reset()
    clock = CompileClock()

    def f(x):
        return torch.sin(x) * 2

    torch.compile(f, backend="aot_eager")(torch.ones(3))  # outside running(): not counted
    assert clock.take() == 0.0
    with clock.running():
        torch.compile(lambda x: torch.cos(x) + 1, backend="aot_eager")(torch.ones(3))
    first = clock.take()
    assert first > 0.0 and clock.take() == 0.0
