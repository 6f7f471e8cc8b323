"""Sections b (``decode``) and c (``capture``): the native engine on the device, in this process.

Both build a random-init model of SmolLM2-135M's shape (``--smoke``: a tiny one on the CPU). The
graph path is ``static_decode="auto"`` on CUDA (the static step captured as CUDA graphs); on the CPU
(``--smoke``) ``"eager"``, the same static loop without graphs, so its counters are read too.
"""

from __future__ import annotations

import contextlib
import logging
import time

from gpu_check.common import (
    IdsTokenizer,
    Sizes,
    build_model,
    decoder_counters,
    device_peaks,
    num_params,
    synchronize,
)


def graph_mode(sizes: Sizes) -> str:
    return "auto" if sizes.device.startswith("cuda") else "eager"


def copy_bandwidth_gbps(device: str, nbytes: int, repeats: int = 10) -> float:
    """HBM bandwidth of a ``nbytes`` device-to-device copy, read + write bytes over its median time
    (CUDA events on a GPU)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            start_s = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start_s)
    del src, dst
    seconds = sorted(times)[len(times) // 2]
    return 2 * nbytes / max(seconds, 1e-9) / 1e9


def hf_generate_step_ms(model, tok, prompts: list[list[int]], *, new_tokens: int, repeats: int, device: str) -> float:
    """ms per decode step of HF ``model.generate`` over ``prompts`` (left-padded, sampled at T = 1,
    no early stop), as generation.py times the engine: ``(wall(n) - wall(1)) / (n - 1)``, best of
    ``repeats`` each."""
    import generation
    import torch

    ids, mask = generation.left_padded(tok, prompts)
    ids, mask = ids.to(device), mask.to(device)

    def once(n: int, seed: int) -> float:
        torch.manual_seed(seed)
        synchronize(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=n, min_new_tokens=n, pad_token_id=tok.pad_token_id)
        synchronize(device)
        seconds = time.perf_counter() - start
        generation._expect_tokens(out[:, ids.shape[1]:].numel(), rows=len(prompts), new_tokens=n, label="HF generate")
        return seconds

    once(2, 0)  # warm-up
    full = min(once(new_tokens, s) for s in range(repeats))
    first = min(once(1, s) for s in range(repeats))
    return 1000 * max(full - first, 0.0) / (new_tokens - 1)


def kernels_per_step(model, *, rows: int, device: str, steps: int = 4) -> dict | None:
    """Device kernels one uncaptured static decode step of ``rows`` rows launches (torch.profiler's
    CUDA events over ``steps`` steps, divided): what a captured graph replays, and on a small
    model what a step's time is bound by; ``{"per_step": n, "names": {kernel: per step}}`` (the
    20 most frequent names). None off CUDA."""
    import torch

    from llamarl.engines.static_decode import StaticDecoder

    if not device.startswith("cuda"):
        return None
    decoder = StaticDecoder(model, cuda_graphs=False)
    state = decoder.new_state(capacity=rows, positions=128)
    for _ in range(2):  # lazy init, allocator warm
        decoder.step(state, rows)
    torch.cuda.synchronize()
    activity = torch.profiler.ProfilerActivity.CUDA
    with torch.profiler.profile(activities=[activity]) as profile:
        for _ in range(steps):
            decoder.step(state, rows)
        torch.cuda.synchronize()
    kernels = [e.name for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    state.release()
    names: dict[str, int] = {}
    for name in kernels:
        names[name] = names.get(name, 0) + 1
    top = sorted(names.items(), key=lambda item: -item[1])[:20]
    return {"per_step": len(kernels) / steps, "names": {name[:120]: count / steps for name, count in top}}


@contextlib.contextmanager
def engine_warnings():
    """The engine's warnings while inside (a static path that fell back to HF's modules says so)."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler, logger = Keep(level=logging.WARNING), logging.getLogger("llamarl.engines.torch_engine")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def _release(engine) -> None:
    import torch

    close = getattr(engine, "close", None)
    if close is not None:
        close()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _time_path(out: dict, *, path: str, mode: str, model, tok, rows: list[int], sizes: Sizes) -> None:
    """``out[path]``: ``decode_scaling``'s ms per step of a TorchEngine with ``static_decode=mode``, its
    decoder's counters and the wall time of the whole timing (compiles and captures included)."""
    import generation

    from llamarl.engines.torch_engine import TorchEngine

    engine = None
    try:
        engine = TorchEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id, static_decode=mode,
                             fused_decode=path != "hf_modules")
        start = time.perf_counter()
        with engine_warnings() as warnings:
            timed = generation.decode_scaling(model, tok, batches=rows, new_tokens=sizes.decode_new_tokens,
                                              repeats=sizes.hf_repeats if path == "hf_modules" else sizes.decode_repeats,
                                              static_decode=mode, engine=engine, device=sizes.device)
        counters = decoder_counters(engine)
        out[path] = {"step_ms": {str(r): ms for r, (ms, _) in timed.items()}, "wall_s": time.perf_counter() - start,
                     "probe_bound_ms": {str(r): least for r, (_, least) in timed.items()},
                     "decoder": counters, "warnings": warnings}
        if path != "hf_modules" and not counters["num_steps"]:
            out["errors"][path] = ("the static decoder ran no step: the graph path fell back to HF's modules "
                                   f"({'; '.join(warnings) or 'no warning logged'}); its times are not the graphs'")
    except Exception as error:  # noqa: BLE001 - recorded; the other paths still run
        out["errors"][path] = f"{type(error).__name__}: {error}"
    finally:
        if engine is not None:
            _release(engine)


def decode(sizes: Sizes, save) -> dict:
    """Section b (module docstring of gpu_check): step ms per path and row count, the bound, ratios."""
    import generation
    import torch

    device, rows, new_tokens = sizes.device, list(sizes.decode_rows), sizes.decode_new_tokens
    model = build_model(sizes.shape, dtype=sizes.dtype, device=device)
    tok = IdsTokenizer(sizes.shape["vocab_size"])
    weight_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    out: dict = {"model": "SmolLM2-135M shape, random init" if not sizes.smoke else "tiny random Llama",
                 "dtype": sizes.dtype, "params": num_params(model), "weight_bytes": weight_bytes, "rows": rows,
                 "new_tokens": new_tokens, "prompt_tokens": [len(p) for p in generation._prompts(tok, batch=1)],
                 "graph_mode": graph_mode(sizes), "errors": {}}
    copy_gbps = copy_bandwidth_gbps(device, sizes.copy_bytes)
    _, nominal_tbps = device_peaks(torch.cuda.get_device_name()) if device.startswith("cuda") else (None, None)
    out["hbm"] = {"copy_bytes": sizes.copy_bytes, "copy_gbps": copy_gbps,
                  "nominal_gbps": None if nominal_tbps is None else 1000 * nominal_tbps}
    out["bound_ms"] = 1000 * weight_bytes / (copy_gbps * 1e9)
    out["bound_nominal_ms"] = None if nominal_tbps is None else 1000 * weight_bytes / (nominal_tbps * 1e12)
    try:
        out["kernels_per_step"] = {str(r): kernels_per_step(model, rows=r, device=device) for r in rows}
    except Exception as error:  # noqa: BLE001 - a count, not a verdict
        out["errors"]["kernels_per_step"] = f"{type(error).__name__}: {error}"
    save(out)
    for path, mode in (("graph", graph_mode(sizes)), ("hf_modules", "off")):
        _time_path(out, path=path, mode=mode, model=model, tok=tok, rows=rows, sizes=sizes)
        save(out)
    out["hf_generate"] = {"step_ms": {}}
    for r in rows:
        try:
            out["hf_generate"]["step_ms"][str(r)] = hf_generate_step_ms(
                model, tok, generation._prompts(tok, batch=r), new_tokens=new_tokens, repeats=sizes.hf_repeats,
                device=device)
        except Exception as error:  # noqa: BLE001
            out["errors"][f"hf_generate_{r}"] = f"{type(error).__name__}: {error}"
        save(out)
    if sizes.decode_compiled:  # last: compiling every bucket may take what is left of the timeout
        _time_path(out, path="graph_compiled", mode="compiled", model=model, tok=tok, rows=rows[:1], sizes=sizes)
        save(out)
    out["ratios"] = {}
    for r in rows:
        graph = out.get("graph", {}).get("step_ms", {}).get(str(r))
        hf = out["hf_generate"]["step_ms"].get(str(r))
        out["ratios"][str(r)] = {
            "graph_vs_hf_generate": graph / hf if graph is not None and hf else None,
            "graph_vs_bound": graph / out["bound_ms"] if graph is not None else None,
            "hf_modules_vs_hf_generate": (out["hf_modules"]["step_ms"][str(r)] / hf
                                          if "hf_modules" in out and hf else None)}
        compiled = out.get("graph_compiled", {}).get("step_ms", {}).get(str(r))
        if compiled is not None and hf:
            out["ratios"][str(r)]["compiled_vs_hf_generate"] = compiled / hf
    save(out)
    if out["errors"]:
        raise RuntimeError("; ".join(f"{k}: {v}" for k, v in out["errors"].items()))
    return out


def capture(sizes: Sizes, save) -> dict:
    """Section c: the static decoder's graph captures: a first call (rows ending at different steps,
    so the loop compacts into smaller buckets), the same call again, again after an in-place weight
    update (nothing new to capture either time), then a larger call (a new ladder of buckets)."""
    import generation
    import torch

    from llamarl.engines.base import Request, SamplingParams
    from llamarl.engines.torch_engine import TorchEngine

    device = sizes.device
    model = build_model(sizes.shape, dtype=sizes.dtype, device=device)
    tok = IdsTokenizer(sizes.shape["vocab_size"])
    stops = list(range(3, sizes.shape["vocab_size"], sizes.capture_eos_every))
    engine = TorchEngine(model, eos_token_ids=stops, pad_token_id=tok.pad_token_id, static_decode=graph_mode(sizes))
    out: dict = {"graph_mode": graph_mode(sizes), "stop_ids": f"every {sizes.capture_eos_every}th id", "calls": []}

    def call(name: str, rows: int, new_tokens: int) -> dict:
        before = decoder_counters(engine)
        reqs = [Request(sample_id=i, prompt_ids=p) for i, p in enumerate(generation._prompts(tok, batch=rows))]
        synchronize(device)
        start = time.perf_counter()
        with engine_warnings() as warnings:
            done = engine.generate(reqs, sampling=SamplingParams(temperature=1.0, max_new_tokens=new_tokens), version=0,
                                   generator=torch.Generator(device=device).manual_seed(0))
        synchronize(device)
        wall = time.perf_counter() - start
        after = decoder_counters(engine)

        def delta(key):
            return None if after[key] is None else after[key] - (before[key] or 0)

        record = {"call": name, "rows": rows, "new_tokens": new_tokens, "wall_s": wall,
                  "tokens": sum(len(c.completion_ids) for c in done),
                  "lengths": [min(len(c.completion_ids) for c in done), max(len(c.completion_ids) for c in done)],
                  "new_captures": delta("num_captures"), "capture_seconds": delta("capture_seconds"),
                  "steps": delta("num_steps"), "counters": after, "warnings": warnings}
        n, seconds = record["new_captures"], record["capture_seconds"]
        record["seconds_per_graph"] = seconds / n if n and seconds is not None else None
        out["calls"].append(record)
        save(out)
        if after["num_steps"] is None:
            raise RuntimeError(f"{name}: no static decoder after the call (it fell back to HF's modules: "
                               f"{'; '.join(warnings) or 'no warning logged'})")
        return record

    first = call("first", sizes.capture_rows, sizes.capture_new_tokens)
    out["first_call"] = {"graphs": first["counters"]["num_captures"], "capture_seconds": first["counters"]["capture_seconds"],
                         "wall_s": first["wall_s"]}
    save(out)
    call("second, same requests", sizes.capture_rows, sizes.capture_new_tokens)
    with torch.no_grad():  # what a weight channel does: in place, same addresses
        for layer in model.model.layers:
            layer.mlp.up_proj.weight.mul_(1.01)
    call("after an in-place weight update", sizes.capture_rows, sizes.capture_new_tokens)
    call("larger: more rows than the state holds", sizes.capture_grow_rows, 3)
    _release(engine)
    return out
