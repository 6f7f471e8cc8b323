"""benchmarks/async_speedup.py and async_quality.py without running a model: argument parsing, the
commands they would launch, reading a (synthetic) run directory, the LlamaRL §7 model, the tables,
and the uncorrected policy loss of async_quality. generation.py and weight_sync.py on tiny models:
each fails unless what it timed happened (tokens produced; bytes received and generator weights
changed by every sync). No test asserts a duration."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import BENCH, load_benchmark

sys.path.insert(0, str(Path(__file__).parent))
from tiny_model import build_tiny_llama, tiny_tokenizer

speedup = load_benchmark("async_speedup")
quality = load_benchmark("async_quality")


def test_parse_and_commands():
    args = speedup.build_parser().parse_args(["--ticks", "3", "--workloads", "arithmetic",
                                              "--schedules", "colocated,async-lag1-partial", "--async-threads", "1,1"])
    assert args.workloads == ["arithmetic"] and args.schedules == ["colocated", "async-lag1-partial"]
    with pytest.raises(SystemExit):
        speedup.build_parser().parse_args(["--schedules", "colocated,bogus"])
    with pytest.raises(SystemExit):
        speedup.build_parser().parse_args(["--async-threads", "0,1"])
    colocated = speedup.run_spec("colocated", "arithmetic", args)
    assert (colocated.nproc, colocated.gen_threads, colocated.train_threads) == (1, 2, 2)
    partial = speedup.run_spec("async-lag1-partial", "gsm8k", args)
    assert partial.nproc == 3 and partial.flags[-2:] == ["--generator.token-budget", "128"]
    cmd = speedup.command(partial, Path("/tmp/x"), args, ticks=3)
    assert cmd[cmd.index("--nproc-per-node") + 1] == "3"
    assert cmd[cmd.index("-m", 3) + 1:][:4] == ["recipes.gsm8k", "cpu-smoke", "--data.path", speedup.GSM8K_DATA]
    assert "--export.no-final" in cmd and cmd[cmd.index("--run.async-lag") + 1] == "1"
    variant = speedup.run_spec("async-lag1+dppo-loglinear-mb4", "arithmetic", args)
    assert "--trainer.num-minibatches" in variant.flags and "loglinear" in variant.flags
    qargs = quality.build_parser().parse_args(["--seeds", "1", "--ticks", "3"])
    assert qargs.configs == list(quality.DEFAULT_CONFIGS)
    qcmd, threads = quality.command("async-uncorrected", 0, Path("/tmp/y"), qargs)
    assert qcmd[qcmd.index("--nproc-per-node") + 2:][:2] == [str(BENCH / "async_quality.py"), "--recipe-worker"]
    assert qcmd[qcmd.index("--algo.loss") + 1] == "pg_uncorrected" and threads == 1
    scmd, threads = quality.command("sync", 1, Path("/tmp/y"), qargs)
    assert "recipes.arithmetic" in scmd and threads == 2 and scmd[scmd.index("--run.seed") + 1] == "1"


def _fake_run(root: Path, *, ticks: list[float], phases: dict[str, float], executors: dict[str, int]) -> Path:
    """A run directory with generator / trainer metrics and timeline spans of the given durations."""
    (root / "metrics").mkdir(parents=True)
    (root / "timeline").mkdir()
    t, gen, trainer, spans = 1000.0, [], [], {rank: [] for rank in executors.values()}
    for step, seconds in enumerate(ticks):
        t += seconds
        gen.append({"step": step, "time": t, "gen_emitted_samples": 64.0, "gen_new_tokens": 640.0,
                    "step_seconds": seconds - 0.5, "channel_seconds": 0.5})
        trainer.append({"step": step, "time": t, **({"skipped": 1.0} if step == 0 else {"staleness_mean": 1.0})})
        for executor, rank in executors.items():
            spans[rank].append({"executor": executor, "rank": rank, "step": step, "start": t - seconds,
                                "end": t - seconds + phases[executor], "kind": "step"})
            spans[rank].append({"executor": executor, "rank": rank, "step": step, "start": t - 0.1, "end": t,
                                "kind": "weights"})
    (root / "metrics" / "generator.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gen))
    (root / "metrics" / "trainer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trainer))
    for rank, rank_spans in spans.items():
        (root / "timeline" / f"rank{rank}.json").write_text(json.dumps(rank_spans))
    return root


def test_measure_speed_section7_and_table(tmp_path):
    sync_dir = _fake_run(tmp_path / "sync", ticks=[30, 12, 10, 10, 10],
                         phases={"generator": 4.0, "reward": 0.5, "trainer": 5.0},
                         executors={"generator": 0, "reward": 1, "trainer": 2})
    async_dir = _fake_run(tmp_path / "async", ticks=[30, 9, 8, 8, 8],
                          phases={"generator": 7.5, "reward": 0.5, "trainer": 7.0},
                          executors={"generator": 0, "reward": 1, "trainer": 2})
    sync, asy = speedup.measure_speed(sync_dir, warmup=2), speedup.measure_speed(async_dir, warmup=2)
    assert sync["steady_ticks"] == [2, 3, 4] and sync["tick_median_s"] == pytest.approx(10.0)
    assert sync["samples_per_s"] == pytest.approx(6.4) and sync["gen_tokens_per_s"] == pytest.approx(64.0)
    assert sync["phases_median_s"] == pytest.approx({"gen": 4.0, "reward": 0.5, "train": 5.0})
    assert sync["trained_ticks"] == 3 and sync["staleness_mean"] == 1.0
    model = speedup.section7(sync["phases_median_s"], asy["phases_median_s"])
    assert model["S_model"] == pytest.approx(9.5 / 5.0) and model["S_split"] == pytest.approx(9.5 / 7.5)
    assert speedup.section7({"gen": 0.0, "reward": 0.0, "train": 0.0})["S_model"] is None
    results = [{"name": "sync", "workload": "arithmetic", "schedule": "sync", "nproc": 3, "gen_threads": 2,
                "train_threads": 2, "speed": sync},
               {"name": "async-lag1", "workload": "arithmetic", "schedule": "async", "nproc": 3, "gen_threads": 1,
                "train_threads": 1, "speed": asy},
               {"name": "async-lag1+dppo-recompute-mb4", "workload": "gsm8k", "schedule": "async", "nproc": 3,
                "gen_threads": 1, "train_threads": 1, "skipped": "skipped: flag not available"}]
    speedup.add_ratios(results)
    assert results[1]["vs_sync"] == pytest.approx(10 / 8) and results[1]["vs_colocated"] is None
    assert results[1]["section7"]["S_measured"] == pytest.approx(10 / 8)
    text = speedup.table(results)
    assert "| arithmetic | async-lag1 | 3 | 1/1 | 8.0 | 8.00 |" in text and "skipped: flag not available" in text
    # tick 0 from its first span (30 s), tick 1 (12 s); with an evaluation after 3 ticks, ticks 2 and 3
    # are replaced by the median of the untouched ones (30, 12, 10) = 12
    assert speedup.training_seconds(sync_dir, [])[2] == pytest.approx(42.0)
    assert speedup.training_seconds(sync_dir, [3])[5] == pytest.approx(30 + 12 + 12 + 12 + 10)
    evals = [{"step": 0, "accuracy": 0.1, "train_seconds": 0.0}, {"step": 5, "accuracy": 0.72, "train_seconds": 50.0}]
    assert speedup.time_to_target(evals, 0.7)["time_to_target_s"] == 50.0
    assert speedup.time_to_target(evals, 0.9)["steps_to_target"] is None
    accuracy = {"evals": evals, "base_accuracy": 0.1, "final_accuracy": 0.72, **speedup.time_to_target(evals, 0.7)}
    text = speedup.table([{"name": "sync", "workload": "arithmetic-accuracy", "accuracy": accuracy},
                          {"name": "async-lag2", "workload": "arithmetic-accuracy", "returncode": 1}], target=0.7)
    assert "| sync | 0.10 -> 0.72 | 0: 0.10, 5: 0.72 | 5 | 50 | - |" in text and "| async-lag2 | failed (exit 1) |" in text


def test_colocated_phases_from_metrics(tmp_path):
    run = _fake_run(tmp_path / "c", ticks=[5, 5, 5], phases={"colocated": 4.0}, executors={"colocated": 0})
    (run / "metrics" / "reward.jsonl").write_text("".join(
        json.dumps({"step": k, "time": 0, "reward_seconds": 0.1}) + "\n" for k in range(3)))
    lines = [json.loads(x) for x in (run / "metrics" / "generator.jsonl").read_text().splitlines()]
    (run / "metrics" / "generator.jsonl").write_text("".join(json.dumps({**r, "gen_seconds": 2.0}) + "\n" for r in lines))
    assert speedup.phase_seconds(run, [1, 2]) == pytest.approx({"gen": 2.0, "reward": 0.1, "train": 0.0})


def test_quality_aggregate_and_table():
    def run(final, curve):
        return {"final_accuracy": final, "wall_seconds": 100.0, "evals": [{"step": s, "accuracy": a} for s, a in curve],
                "diagnostics": {"staleness_mean": 2.0, "importance_weight_mean": 1.0}}
    a = quality.aggregate([run(0.6, [(0, 0.1), (40, 0.6)]), run(0.8, [(0, 0.1), (40, 0.8)]), {"returncode": 1}])
    assert a["n"] == 2 and a["mean"] == pytest.approx(0.7) and a["std"] == pytest.approx(0.1414, abs=1e-3)
    assert a["curve"] == pytest.approx({0: 0.1, 40: 0.7}) and a["staleness_mean"] == 2.0
    text = quality.table({"async-aipo": a, "sync": quality.aggregate([])}, ticks=40)
    assert "| async-aipo | 2 | 0.700 ± 0.141 | 0.60..0.80 |" in text and "| sync | 0 | failed |" in text


def test_uncorrected_loss_is_aipo_without_the_weight():
    torch.manual_seed(0)
    logp = torch.randn(3, 5).clamp(max=0).requires_grad_()
    behav = logp.detach() + 0.3 * torch.randn(3, 5)  # off-policy: ratios far from 1
    adv, mask = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    algo = SimpleNamespace(rho=4.0)
    loss, metrics = quality.pg_uncorrected_loss(logp=logp, behav_logp=behav, prox_logp=None, advantages=adv,
                                                mask=mask, algo=algo, num_loss_tokens=20)
    loss.backward()
    expected = (-(adv[:, None] * mask) / 20.0)
    assert torch.allclose(logp.grad, expected)
    assert {"importance_weight_mean", "approx_kl", "clip_fraction"} <= set(metrics)
    from llamarl.algorithms.losses import aipo_loss
    on_policy, _ = aipo_loss(logp=logp.detach(), behav_logp=logp.detach(), advantages=adv, mask=mask, num_loss_tokens=20)
    mine, _ = quality.pg_uncorrected_loss(logp=logp.detach(), behav_logp=logp.detach(), prox_logp=None,
                                          advantages=adv, mask=mask, algo=algo, num_loss_tokens=20)
    assert torch.allclose(on_policy, mine)


def test_decode_scaling_prints_one_row_per_batch_size(capsys):
    """benchmarks/generation.py --decode-scaling on a tiny model: one row per batch size, ratios to
    the smallest batch, and a one-line error for a token count that leaves no decode step to time."""
    generation = load_benchmark("generation")
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    model = build_tiny_llama(seed=0, vocab_size=128).eval()
    result = generation.decode_scaling(model, tok, batches=[1, 4], new_tokens=3, repeats=1)
    probes, header, *rows = capsys.readouterr().out.splitlines()
    assert probes.startswith("bound probes (after each row count") and "x bound" in header and [int(r.split()[0]) for r in rows] == [1, 4]
    # The bound: the weights read once per step, or the rows' matmuls, whichever takes longer.
    bound = generation.hardware_bound(model, repeats=1)
    params = {id(p): p for p in model.parameters()}.values()
    assert bound["weight_bytes"] == sum(p.numel() * p.element_size() for p in params)
    assert bound["flops_per_row"] == 2 * sum(m.weight.numel() for m in model.modules()
                                             if isinstance(m, torch.nn.Linear))
    assert generation.bound_ms(bound, 10**6) == pytest.approx(
        1000 * 10**6 * bound["flops_per_row"] / (bound["matmul_gflops"] * 1e9))
    assert sorted(result) == [1, 4] and all(least > 0 for _, least in result.values())
    # The +KV bound adds the cache a step reads: layers x (key, value) x KV heads x head_dim x bytes
    # per position, at each row's mean context over the timed steps (prompt + new_tokens / 2).
    config = model.config
    per_position = config.num_hidden_layers * 2 * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * next(model.parameters()).element_size()
    prompts = generation._prompts(tok, batch=4)
    assert generation.kv_cache_bytes(model, prompts, new_tokens=3) == pytest.approx(
        per_position * sum(len(p) + 1.5 for p in prompts))
    assert "+KV ms" in header and "GB/s" in header and all(len(r.split()) == 9 for r in rows)
    with pytest.raises(ValueError, match="--new-tokens must be >= 2"):
        generation.decode_scaling(model, tok, batches=[1], new_tokens=1, repeats=1)
    # The static loop (uncompiled here: the compile is tested in test_static_decode.py) times its own steps.
    capsys.readouterr()
    static = generation.decode_scaling(model, tok, batches=[2], new_tokens=3, repeats=1, static_decode="eager")
    assert sorted(static) == [2]


def test_cpu_linears_times_every_projection_of_a_step_and_checks_them(monkeypatch):
    """benchmarks/cpu_linears.py on a tiny bf16 model: the projections a fused step runs (four per
    layer and the LM head), both paths timed, and a GEMM whose outputs differ fails the timing."""
    from llamarl.engines.cpu import cpu_kernels

    linears = load_benchmark("cpu_linears")
    model = build_tiny_llama(seed=0, vocab_size=128).to(torch.bfloat16).eval()
    weights = linears.step_weights(model)
    assert len(weights) == 4 * len(model.model.layers) + 1
    assert weights[0][0].shape[0] == sum(p.weight.shape[0] for p in (model.model.layers[0].self_attn.q_proj,
                                                                      model.model.layers[0].self_attn.k_proj,
                                                                      model.model.layers[0].self_attn.v_proj))
    if not cpu_kernels.gemm_available():
        pytest.skip("the C GEMM needs a CPU with AVX512-BF16")
    pytorch_ms, gemm_ms = linears.time_linears(weights, rows=3, repeats=1)
    assert pytorch_ms > 0 and gemm_ms > 0
    monkeypatch.setattr(cpu_kernels, "linear", lambda x, w, b=None: torch.zeros(x.shape[0], w.out_features,
                                                                                 dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="disagree at 3 rows"):
        linears.time_linears(weights, rows=3, repeats=1)


def test_generation_counts_the_tokens_it_timed():
    """Each timed call returns the tokens it produced, rows x new_tokens; an early stop raises."""
    generation = load_benchmark("generation")
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    model = build_tiny_llama(seed=0, vocab_size=128).eval()
    prompts = generation._prompts(tok, batch=3)
    engine = generation.TorchEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id)
    assert generation._time_engine(engine, prompts, new_tokens=4, seed=0)[2] == 12
    assert generation._time_hf(model, tok, prompts, new_tokens=4, seed=0)[2] == 12
    every_id_stops = generation.TorchEngine(model, eos_token_ids=list(range(128)),
                                            pad_token_id=tok.pad_token_id)
    with pytest.raises(RuntimeError, match="completions of lengths"):
        generation._time_engine(every_id_stops, prompts, new_tokens=4, seed=0)
    with pytest.raises(RuntimeError, match="produced 0 tokens"):
        generation._expect_tokens(0, rows=0, new_tokens=4, label="x")


def test_generation_workloads_time_both_decode_paths():
    """--workloads on a tiny model: both workloads, both decode paths, tokens/s and the speed-up."""
    generation = load_benchmark("generation")
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    model = build_tiny_llama(seed=0, vocab_size=128).eval()
    result = generation.workloads(model, tok, repeats=1, gsm8k_new_tokens=16)
    assert sorted(result) == ["gsm8k", "make-run"]
    assert all(row["fused_tokens_per_s"] > 0 and row["hf_tokens_per_s"] > 0 and row["speedup"] > 0
               for row in result.values())


def test_generation_partial_rollouts_time_whole_recomputed_and_kept(capsys):
    """--partial-rollouts on a tiny model: the whole generation in one call, the budgeted ones in
    several, each variant's seconds and its ratio to the whole one."""
    generation = load_benchmark("generation")
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    model = build_tiny_llama(seed=0, vocab_size=128).eval()
    result = generation.partial_rollouts(model, tok, repeats=1, budget=4, new_tokens=16)
    header, *rows = capsys.readouterr().out.splitlines()
    assert "x whole" in header and [r.split()[0] for r in rows] == ["whole", "recompute", "keep"]
    calls = {r.split()[0]: int(r.split()[1]) for r in rows}
    assert calls["whole"] == 1 and calls["recompute"] > 1 and calls["keep"] > 1
    assert all(seconds > 0 for seconds in result.values())


def test_weight_sync_checks_catch_a_sync_that_moved_nothing():
    """The per-sync check (skip, bytes, version, values) and the memcpy floor, on synthetic inputs."""
    ws = load_benchmark("weight_sync")
    assert len({ws.pattern_value(i, 3) for i in range(251)}) == 251  # distinct per parameter
    assert all(ws.pattern_value(i, 3) != ws.pattern_value(i, 4) for i in range(251))  # and per version
    model = ws.meta_llama("tiny", dtype=torch.bfloat16).to_empty(device="cpu")
    holder = ws._Holder(model)
    ws._set_version(holder, 5)  # a trainer's refill; here it stands for a generator that received it
    nbytes = sum(ws.local_bytes(p) for p in model.parameters())
    ctx = SimpleNamespace(executor="generator")

    def check(*, skipped=False, received=nbytes, version=5):
        channel = SimpleNamespace(last_skipped=skipped, bytes_received={(1, 0): received})
        return ws._check_sync(ctx, channel, holder, version=version, expected_bytes=nbytes)

    assert check() is None
    assert "skipped" in check(skipped=True)
    assert "received" in check(received=nbytes // 2)
    holder.version = 4  # set_weights_version not called with the new version
    assert "told version 4" in check()
    holder.version = 5
    with torch.no_grad():
        model.lm_head.weight[0, 0] = 0.0  # one element that did not arrive
    assert "lm_head.weight holds values in [0.0" in check()
    floor = ws.BOUND_CHECK_MIN_S
    assert ws.check_floor([3 * floor, 2 * floor], [floor, 1.5 * floor], label="ddma") is None
    assert "below the memcpy bound" in ws.check_floor([3 * floor, floor / 2], [floor], label="ddma")
    assert ws.check_floor([0.0], [floor / 2], label="ddma") is None  # bound too small to enforce
    assert ws.check_floor([0.0], None, label="ddma") is None


def test_weight_sync_lora_merge_check_catches_a_missed_or_stale_merge():
    """--lora-rank: a generator's merged weights must be base + scale * B A of the version received."""
    ws, lora = load_benchmark("weight_sync"), load_benchmark("weight_sync_lora")
    ctx = SimpleNamespace(device=torch.device("cpu"))
    _, merger = lora.build_generator(ctx, ws.meta_llama("tiny", dtype=torch.bfloat16), 4, tp=False, fill=0.02)
    holder = ws._Holder(merger.view())
    ws._set_version(holder, 5)  # the adapters of version 5, as a sync leaves them
    assert "merged model.layers.0.self_attn.q_proj.weight" in lora.check_merged(merger, version=5, value=ws.pattern_value)
    merger.merge()
    assert lora.check_merged(merger, version=5, value=ws.pattern_value) is None
    ws._set_version(holder, 6)  # version 6 received, the merge not redone
    assert "expected base" in lora.check_merged(merger, version=6, value=ws.pattern_value)
    merger.merge()
    assert lora.check_merged(merger, version=6, value=ws.pattern_value) is None


def test_weight_sync_runs_real_syncs(tmp_path, monkeypatch, capsys):
    """weight_sync.py end to end on the tiny size, 1 trainer -> 2 TP generator ranks, 2 repeats, with
    LoRA rank 4: every sync (and merge) was checked inside the run, and each row records the bytes its
    layout must move."""
    ws = load_benchmark("weight_sync")
    out = tmp_path / "ws.json"
    monkeypatch.setattr(sys, "argv", ["weight_sync.py", "--sizes", "tiny", "--layouts", "1->2tp",
                                      "--repeats", "2", "--out", str(out), "--plot", str(tmp_path / "ws.png"),
                                      "--timeout", "120", "--lora-rank", "4"])
    ws.main()
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    assert set(rows) == set(ws.MODES) | set(ws.LORA_MODES)
    per_rank = ws.generator_numels("tiny", generators=2, tp=True)
    full = ws.generator_numels("tiny", generators=1, tp=False)[0]
    assert per_rank[0] < full  # a real TP split: ddma moves less than gather_broadcast
    assert rows["memcpy_bound"]["bytes_per_sync"] == per_rank[0] * 2  # bf16: generator rank 0's shard
    assert rows["ddma"]["bytes_per_sync"] == sum(per_rank) * 2
    assert rows["gather_broadcast"]["bytes_per_sync"] == 2 * full * 2  # the whole model to each rank
    for mode in ws.MODES:
        assert len(rows[mode]["seconds"]) == 2 and isinstance(rows[mode]["memcpy_ratio"], float)
        assert isinstance(rows[mode]["floor_checked"], bool)
    # Adapters only: r (in + out) per decoder linear, bf16; each TP rank its slices (ddma) or all (gb).
    adapters = 2 * 4 * (2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 128)) * 2  # q o, k v, gate up down
    assert rows["gather_broadcast_lora"]["bytes_per_sync"] == 2 * adapters
    assert adapters < rows["ddma_lora"]["bytes_per_sync"] < 2 * adapters  # A of column-parallel whole on both
    for mode in ws.LORA_MODES:
        row = rows[mode]
        assert row["lora_rank"] == 4 and len(row["seconds"]) == 2 and len(row["merge_seconds"]) == 2
        assert row["bytes_ratio_to_full"] == row["bytes_per_sync"] / rows["ddma"]["bytes_per_sync"] < 0.2
        assert row["seconds_ratio_to_full"] > 0 and row["merge_seconds_median"] > 0
    table = capsys.readouterr().out
    assert "ddma MB" in table and "ddma x cp" in table and "+merge/full" in table


def test_logprob_memory_runs_every_chunk_size_and_checks_the_results_agree():
    """benchmarks/logprob_memory.py on a small shape: one row per chunk size, each from its own
    process, every variant's log-probs and head gradient checked against the unchunked run."""
    import subprocess

    out = subprocess.run([sys.executable, "benchmarks/logprob_memory.py", "--tokens", "64", "--vocab", "512",
                          "--layers", "1", "--chunks", "0,16"], capture_output=True, text=True, timeout=300, check=False,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and not line.startswith("| --")]
    assert [row.split("|")[1].strip() for row in rows] == ["whole (0)", "16"]


def test_load_memory_measures_both_loads_of_the_same_weights(tmp_path):
    """benchmarks/load_memory.py on a small shape: both torchrun worlds report every rank, their
    gathered weights equal the checkpoint's (the benchmark fails otherwise), one row per load."""
    import subprocess

    out = subprocess.run([sys.executable, "benchmarks/load_memory.py", "--ranks", "2", "--layers", "1", "--hidden", "64",
                          "--out", str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=300, check=False,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split("|")[1].strip() for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows == ["load", "full", "sharded"]


def test_sampler_benchmark_times_both_samplers(capsys):
    """benchmarks/generation.py --sampler on a small vocabulary: a row per row count, both samplers
    timed (it fails if they pick different tokens for the same uniforms)."""
    generation = load_benchmark("generation")
    result = generation.sampler([1, 4], vocab=600, repeats=1)
    assert sorted(result) == [1, 4] and all(a > 0 and b > 0 for a, b in result.values())
    assert len(capsys.readouterr().out.splitlines()) == 4
