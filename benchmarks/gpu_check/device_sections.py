"""The engine part's section, one per shape (``shape:<name>``), in a process of its own on a GPU.

Per shape (a random-init model built on the device, ``common.build_model``): the probes
(probes.py); then, for each state width (512, 1024: the engine's state grown to it by a call of one
row whose prompt fills it, every bucket captured again), the decode step at 64 and 256 rows, greedy
and sampled, through ``TorchEngine.generate`` (the engine's contract, whatever its decoder is):
``(wall(n) - wall(1)) / (n - 1)`` over prompts of ``prompt_tokens`` random ids, so the live lengths
are the same at both widths; each step over its bound with the live KV read (bounds.py) and over
its kernel floor; prefill tokens/s (the one-token calls) over the GEMM probe's rate; the seconds the
ladder's captures took per width; one profiled step (kernels, graph launches, a kernel-time
histogram: two profiled calls one step apart). On the CPU (``--smoke``) the same code runs on the
tiny shape with ``static_decode="eager"`` (no graphs) and top-level aten ops in place of kernels.
"""

from __future__ import annotations

import random
import time
from collections import Counter

from gpu_check import bounds
from gpu_check.common import SHAPES, Sizes, build_model, decoder_counters, head_dim, num_params, synchronize
from gpu_check.probes import probes

MODES = {"greedy": 0.0, "sampled": 1.0}  # temperature; sampled: the whole softmax, no top-k / top-p


def graph_mode(sizes: Sizes) -> str:
    return "auto" if sizes.device.startswith("cuda") else "eager"


class Caller:
    """``engine.generate`` over prompts, timed, checking every row produced what was asked;
    ``last_steps``: the decode steps the last call ran (the static decoder's ``num_steps``; None
    without one). The loop looks for finished rows every few steps, so a call may run more steps
    than its tokens need: a step's time is divided by the steps run."""

    def __init__(self, engine, device: str) -> None:
        self.engine, self.device = engine, device
        self.last_steps: int | None = None

    def __call__(self, prompts: list[list[int]], *, new_tokens: int, mode: str, seed: int = 0) -> float:
        import torch

        from llamarl.engines.base import Request, SamplingParams

        reqs = [Request(sample_id=i, prompt_ids=p) for i, p in enumerate(prompts)]
        sampling = SamplingParams(temperature=MODES[mode], max_new_tokens=new_tokens)
        before = decoder_counters(self.engine)["num_steps"]
        synchronize(self.device)
        start = time.perf_counter()
        done = self.engine.generate(reqs, sampling=sampling, version=0,
                                    generator=torch.Generator(device=self.device).manual_seed(seed))
        synchronize(self.device)
        seconds = time.perf_counter() - start
        after = decoder_counters(self.engine)["num_steps"]
        self.last_steps = None if after is None else after - (before or 0)
        produced = sum(len(c.completion_ids) for c in done)
        if produced != len(prompts) * new_tokens:
            raise RuntimeError(f"{len(prompts)} rows x {new_tokens} new tokens asked, {produced} produced")
        return seconds


def profile_step(call: Caller, prompts: list[list[int]], *, mode: str, device: str, new_tokens: int = 9) -> dict:
    """Kernels of a decode step: two profiled calls, of ``new_tokens`` and of 1 new tokens (the
    same prefill, ``new_tokens - 1`` steps apart: the loop's steps between two looks, 8), differenced
    and divided by the steps run: kernels and CUDA-graph launches a step, the kernel-time histogram,
    the kernels that took most of the step's time. On the CPU: top-level aten ops."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def run(new_tokens: int):
        call(prompts, new_tokens=new_tokens, mode=mode)  # warm, outside the profile
        with profile(activities=activities) as prof:
            call(prompts, new_tokens=new_tokens, mode=mode)
        events = prof.events()
        if cuda:
            kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        else:
            kernels = [e for e in events if e.cpu_parent is None and e.name.startswith("aten::")]
        launches = sum(1 for e in events if e.name == "cudaGraphLaunch")
        return [(e.name, e.time_range.elapsed_us()) for e in kernels], launches, call.last_steps

    with_step, launches_with, steps_with = run(new_tokens)
    without, launches_without, steps_without = run(1)
    steps = new_tokens - 1 if steps_with is None or steps_without is None else steps_with - steps_without
    steps = max(steps, 1)
    time_by_name, count_by_name = Counter(), Counter()
    for items, sign in ((with_step, 1), (without, -1)):
        for name, us in items:
            time_by_name[name[:100]] += sign * us / steps
            count_by_name[name[:100]] += sign / steps
    top = sorted(time_by_name.items(), key=lambda item: -item[1])[:12]
    return {"rows": len(prompts), "mode": mode, "unit": "CUDA kernels" if cuda else "top-level aten ops (CPU)",
            "steps": steps, "kernels_per_step": (len(with_step) - len(without)) / steps,
            "graph_launches_per_step": (launches_with - launches_without) / steps,
            "kernel_us_per_step": (sum(us for _, us in with_step) - sum(us for _, us in without)) / steps,
            "histogram": bounds.histogram([us for _, us in with_step], [us for _, us in without], steps=steps),
            "top": [{"name": name, "us": us, "count": count_by_name[name]} for name, us in top]}


def uncaptured_kernels(model, *, rows: int, device: str, positions: int = 128,
                       kernels: str | None = None) -> int | None:
    """Kernels one uncaptured static step launches (what its graph replays), where the profiler
    does not see a graph's kernels; None off CUDA or where the decoder's API is not the one read
    here (``StaticDecoder(model, cuda_graphs=False)``, ``new_state``, ``step``). ``kernels``: the
    step's kernel set (None: the decoder's choice)."""
    import torch

    if not device.startswith("cuda"):
        return None
    from llamarl.engines.static_decode import StaticDecoder

    decoder = StaticDecoder(model, cuda_graphs=False, kernels=kernels)
    state = decoder.new_state(capacity=rows, positions=positions)
    for _ in range(2):
        decoder.step(state, rows)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        decoder.step(state, rows)
        torch.cuda.synchronize()
    state.release()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def kernel_sets(model, *, rows: int, width: int, device: str, steps: int = 20) -> dict:
    """The static step with each kernel set (llamarl/engines/step_kernels.py: ``fused``, Triton on
    CUDA; ``torch``, aten), greedy logits only, at ``rows`` x ``width``: ms a step (a captured graph
    replayed ``steps`` times on CUDA; the eager step elsewhere) and, on CUDA, the kernels of one
    uncaptured step. What the fused kernels buy on this GPU, measured side by side."""
    from llamarl.engines.static_decode import StaticDecoder

    out = {}
    for kernels in ("fused", "torch"):
        decoder = StaticDecoder(model, kernels=kernels)
        state = decoder.reserve(capacity=rows, positions=width)
        decoder.step(state, rows)  # captured on CUDA
        synchronize(device)
        begin = time.perf_counter()
        for _ in range(steps):
            decoder.step(state, rows)
        synchronize(device)
        step_ms = 1000 * (time.perf_counter() - begin) / steps
        decoder.release()
        out[kernels] = {"step_ms": step_ms, "kernels_per_step": uncaptured_kernels(
            model, rows=rows, device=device, positions=width, kernels=kernels)}
    out["rows"], out["width"] = rows, width
    out["fused_vs_torch"] = bounds.ratio(out["fused"]["step_ms"], out["torch"]["step_ms"])
    return out


def shape_section(name: str, sizes: Sizes, save) -> dict:
    """One shape (module docstring): ``{probes, params, weight_bytes, widths, steps, profile, ...}``,
    saved after every measurement (a timeout keeps what was measured)."""
    import torch

    from llamarl.engines.torch_engine import TorchEngine

    device = sizes.device
    family, shape = SHAPES[name]
    kv = {"layers": shape["num_hidden_layers"], "kv_heads": shape["num_key_value_heads"],
          "head_dim": head_dim(shape), "dtype_bytes": bounds.DTYPE_BYTES[sizes.dtype]}
    out: dict = {"shape": name, "family": family, "config": shape, "dtype": sizes.dtype, "graph_mode": graph_mode(sizes),
                 "rows": list(sizes.rows), "widths_asked": list(sizes.widths), "modes": list(sizes.modes),
                 "prompt_tokens": sizes.prompt_tokens, "new_tokens": sizes.new_tokens, "kv": kv, "widths": {},
                 "steps": [], "errors": {}}
    out["probes"] = probes(device, copy_bytes=sizes.copy_bytes, gemm_size=sizes.gemm_size,
                           replay_kernels=sizes.replay_kernels)
    save(out)
    start = time.perf_counter()
    model = build_model(name, dtype=sizes.dtype, device=device)
    synchronize(device)
    out.update(build_s=time.perf_counter() - start, params=num_params(model),
               weight_bytes=bounds.model_weights_read_bytes(model),
               kv_bytes_per_token=bounds.kv_bytes_per_token(**kv))
    save(out)
    rng = random.Random(0)
    vocab = shape["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(sizes.prompt_tokens)] for _ in range(max(sizes.rows))]
    engine = TorchEngine(model, eos_token_ids=[], pad_token_id=0, static_decode=graph_mode(sizes))
    call = Caller(engine, device)
    live = bounds.mean_live(sizes.prompt_tokens, sizes.new_tokens)
    probe = out["probes"]
    try:
        for width in sizes.widths:
            before = decoder_counters(engine)
            begin = time.perf_counter()
            # Grow the state to this width (one row whose prompt fills it), then capture at the most rows.
            call([[rng.randrange(3, vocab) for _ in range(width - 1)]], new_tokens=1, mode="greedy")
            call(prompts, new_tokens=2, mode="greedy")
            after = decoder_counters(engine)
            delta = {k: (after[k] - (before[k] or 0)) if after[k] is not None else None
                     for k in ("num_captures", "capture_seconds")}
            out["widths"][str(width)] = {"state_width": after["width"], "slots": after["slots"],
                                         "graphs": delta["num_captures"], "capture_s": delta["capture_seconds"],
                                         "grow_and_warm_s": time.perf_counter() - begin, "counters": after}
            save(out)
            for rows in sorted(sizes.rows, reverse=True):
                for mode in sizes.modes:
                    full = min(call(prompts[:rows], new_tokens=sizes.new_tokens, mode=mode, seed=s)
                               for s in range(sizes.repeats))
                    steps = call.last_steps
                    first = min(call(prompts[:rows], new_tokens=1, mode=mode, seed=s) for s in range(sizes.repeats))
                    steps = sizes.new_tokens - 1 if steps is None or call.last_steps is None else steps - call.last_steps
                    step_ms = 1000 * max(full - first, 0.0) / max(steps, 1)
                    need = bounds.step_bytes(weight_bytes=out["weight_bytes"], live=live, rows=rows, **kv)
                    bound = bounds.bound_ms(need, probe["copy_gbps"])
                    out["steps"].append({
                        "rows": rows, "width": width, "mode": mode, "step_ms": step_ms, "steps": steps, "live": live,
                        "step_bytes": need, "bound_ms": bound, "vs_bound": bounds.ratio(step_ms, bound),
                        "weights_only_bound_ms": bounds.bound_ms(out["weight_bytes"], probe["copy_gbps"]),
                        "tokens_per_s": bounds.ratio(1000.0 * rows, step_ms),
                        "prefill_s": first, "prefill_tokens_per_s": rows * sizes.prompt_tokens / first})
                    save(out)
            # The graphs are captured lazily, one per (bucket, attention span, sampling) at its first
            # step (llamarl/engines/static_decode.py): count every capture of this width's calls.
            after = decoder_counters(engine)
            if after["num_captures"] is not None:
                out["widths"][str(width)].update(
                    graphs=after["num_captures"] - (before["num_captures"] or 0),
                    capture_s=after["capture_seconds"] - (before["capture_seconds"] or 0.0))
                save(out)
            if width == sizes.widths[0]:
                rows = min(sizes.profile_rows, max(sizes.rows))
                try:
                    out["profile"] = profile_step(call, prompts[:rows], mode="sampled", device=device)
                    out["profile"]["width"] = width
                except Exception as error:  # noqa: BLE001 - a count, not a verdict
                    out["errors"]["profile"] = f"{type(error).__name__}: {error}"
                save(out)
        out["counters"] = decoder_counters(engine)
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    try:
        out["kernel_sets"] = kernel_sets(model, rows=min(64, max(sizes.rows)), width=sizes.widths[0], device=device)
    except Exception as error:  # noqa: BLE001 - a comparison, not a verdict
        out["errors"]["kernel_sets"] = f"{type(error).__name__}: {error}"
    save(out)
    profile = out.get("profile")
    if profile and device.startswith("cuda") and profile["graph_launches_per_step"] > 0:
        try:  # the profiler may not see a replayed graph's kernels: count an uncaptured step's
            profile["uncaptured_kernels_per_step"] = uncaptured_kernels(model, rows=profile["rows"], device=device)
        except Exception as error:  # noqa: BLE001
            out["errors"]["uncaptured_kernels"] = f"{type(error).__name__}: {error}"
    summarize(out)
    save(out)
    del model, engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def summarize(out: dict) -> None:
    """The shape's ratios to this GPU, from its steps and probes: per step its kernel floor
    (kernels a step x µs per replayed kernel) and the step over it; the prefill over the GEMM probe's
    rate (2 x parameters FLOPs a token); the longest ladder capture."""
    probe, profile = out["probes"], out.get("profile") or {}
    kernels = profile.get("uncaptured_kernels_per_step") or profile.get("kernels_per_step")
    floor = kernels * probe["us_per_kernel"] / 1000.0 if kernels else None
    for step in out["steps"]:
        step["kernel_floor_ms"] = floor
        step["vs_kernel_floor"] = bounds.ratio(step["step_ms"], floor)
    prefill = max((s["prefill_tokens_per_s"] for s in out["steps"]), default=None)
    gemm_rate = probe["gemm_tflops"] * 1e12 / (2 * out["params"]) if out.get("params") else None
    out["prefill"] = {"tokens_per_s": prefill, "gemm_tokens_per_s": gemm_rate, "vs_gemm": bounds.ratio(prefill, gemm_rate)}
    captures = [w["capture_s"] for w in out["widths"].values() if w.get("capture_s") is not None]
    out["capture_s_max"] = max(captures) if captures else None
    if kernels:
        out["kernels_per_layer"] = kernels / out["kv"]["layers"]
