"""report.txt: the JSON report as text, each figure beside its ratio to this GPU and each target
marked met / MISSED / not measured."""

from __future__ import annotations

from gpu_check.checks import method_name, tally

TITLES = {"shape": "decode at the shape of", "tick": "colocated tick at", "train": "trainer steps at the shape of",
          "tests": "tests/gpu", "recipe": "default recipe, colocated: time to 0.70 held-out accuracy"}


def _f(value, spec: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _probes(p: dict) -> str:
    return (f"probes: copy {_f(p.get('copy_gbps'), ',.0f')} GB/s (read + write, {p.get('copy_bytes', 0) / 2**20:.0f} MiB), "
            f"bf16 GEMM {_f(p.get('gemm_tflops'), '.0f')} TFLOPS ({p.get('gemm_size')}^3), "
            f"{_f(p.get('us_per_kernel'), '.2f')} us per replayed kernel ({p.get('replay_kernels')} in a graph)")


def _shape(r: dict) -> list[str]:
    lines = [_probes(r["probes"])] if "probes" in r else []
    if "params" not in r:
        return lines
    lines.append(f"{r['params'] / 1e6:,.1f}M parameters, {r['dtype']}, built in {_f(r.get('build_s'), '.1f')} s; a step "
                 f"reads {r['weight_bytes'] / 1e9:.3f} GB of weights + {r['kv_bytes_per_token'] / 1e3:.1f} kB of KV per "
                 f"live position; prompts of {r['prompt_tokens']} tokens, {r['new_tokens']} new (mean live "
                 f"{r['prompt_tokens'] + r['new_tokens'] / 2:.0f}); static_decode={r['graph_mode']!r}")
    for width, w in r.get("widths", {}).items():
        lines.append(f"width {width}: state {w.get('slots')} slots x {w.get('state_width')} columns, "
                     f"{_f(w.get('graphs'), 'd')} graphs captured in {_f(w.get('capture_s'), '.2f')} s")
    if r.get("steps"):
        lines.append(f"{'rows':>5} {'width':>6} {'mode':>8} {'ms/step':>8} {'bound ms':>9} {'x bound':>8} "
                     f"{'weights ms':>10} {'x kernels':>9} {'tok/s':>10} {'prefill tok/s':>14}")
    for s in r.get("steps", []):
        lines.append(f"{s['rows']:>5} {s['width']:>6} {s['mode']:>8} {s['step_ms']:>8.3f} {s['bound_ms']:>9.3f} "
                     f"{_f(s.get('vs_bound'), '.2f'):>8} {s['weights_only_bound_ms']:>10.3f} "
                     f"{_f(s.get('vs_kernel_floor'), '.2f'):>9} {_f(s.get('tokens_per_s'), ',.0f'):>10} "
                     f"{s['prefill_tokens_per_s']:>14,.0f}")
    prefill = r.get("prefill")
    if prefill:
        lines.append(f"prefill: {_f(prefill['tokens_per_s'], ',.0f')} tokens/s, {_f(prefill['vs_gemm'], '.2f')} of the "
                     f"GEMM probe's rate ({_f(prefill['gemm_tokens_per_s'], ',.0f')} tokens/s at 2 x parameters FLOPs)")
    p = r.get("profile")
    if p:
        uncaptured = p.get("uncaptured_kernels_per_step")
        lines.append(f"a profiled step ({p['rows']} rows, {p['mode']}, width {p.get('width')}, mean of {p.get('steps')}): "
                     f"{p['kernels_per_step']:.0f} {p['unit']} ({_f(r.get('kernels_per_layer'), '.1f')} a layer), "
                     f"{p['graph_launches_per_step']:.1f} graph "
                     f"launches, {p['kernel_us_per_step']:,.0f} us of kernels"
                     + (f"; an uncaptured step: {uncaptured} kernels" if uncaptured is not None else ""))
        lines.append("  kernel time histogram (kernels / us per step): " + ", ".join(
            f"<{_f(b['upto_us'], 'g', 'inf')}us {b['kernels']:.0f}/{b['us']:.0f}" for b in p["histogram"] if b["kernels"]))
        lines += [f"  {t['us']:>9,.0f} us {t['count']:>5.1f}x {t['name']}" for t in p.get("top", [])[:8]]
    sets = r.get("kernel_sets")
    if sets:
        lines.append(f"kernel sets at {sets['rows']} rows, width {sets['width']}: fused {sets['fused']['step_ms']:.3f} ms "
                     f"({_f(sets['fused']['kernels_per_step'], '.0f')} kernels) vs aten {sets['torch']['step_ms']:.3f} ms "
                     f"({_f(sets['torch']['kernels_per_step'], '.0f')} kernels): {_f(sets['fused_vs_torch'], '.2f')}x")
    lines += [f"error in {k}: {v}" for k, v in r.get("errors", {}).items()]
    return lines


def _tick(r: dict) -> list[str]:
    lines = [f"{r['samples']} samples x {r['new_tokens']} new tokens a tick, {r['ticks']} ticks"] if "samples" in r else []
    if r.get("shims"):
        lines.append(f"stood in for (not installed): {', '.join(r['shims'])}")
    if r.get("copy_gbps"):
        lines.append(f"probes: copy {r['copy_gbps']:,.0f} GB/s, bf16 GEMM {_f(r.get('gemm_tflops'), '.0f')} TFLOPS; "
                     f"model written in {_f(r.get('model_write_s'), '.1f')} s; prompts of "
                     f"{_f(r.get('prompt_tokens_mean'), '.0f')} tokens")
    if r.get("gen_tokens_per_s") is not None:
        lines.append(f"generation: {_f(r['gen_tokens_per_s'], ',.0f')} tokens/s (medians of the {r['steady_ticks']} ticks "
                     f"after the first), {_f(r.get('gen_vs_bound'), '.2f')} of its bound "
                     f"({_f(r.get('tick_bound_tokens_per_s'), ',.0f')} tokens/s: weights + live KV at the copy rate)")
        lines.append(f"trainer: {_f(r.get('train_tokens_per_s'), ',.0f')} tokens/s, MFU {_f(r.get('mfu'), '.3f')} of the "
                     f"data sheet, {_f(r.get('mfu_vs_gemm'), '.3f')} of the GEMM probe; peak memory "
                     f"{_f(r.get('peak_gpu_memory_gib'), '.2f')} GiB")
        lines += [f"  tick {s}: " + ", ".join(f"{k} {_f(v, '.1f')}" for k, v in t.items())
                  for s, t in r.get("per_tick", {}).items()]
    return lines


def _train(r: dict) -> list[str]:
    if "gemm_tflops" not in r:
        return []
    lines = [(f"probe: bf16 GEMM {_f(r['gemm_tflops'], '.0f')} TFLOPS; data sheet {_f(r.get('peak_tflops'), '.0f')} "
              f"TFLOPS; {r['groups']} groups x {r['group_size']} samples x ({r['prompt_tokens']} prompt + "
              f"{r['completion_tokens']} completion) tokens a step, micro-batches of <= {r['microbatch_tokens']:,} "
              f"tokens, {r['dtype']} compute; {r['warmup']} warm-up + {r['steps']} timed steps a case")]
    for entry in r.get("methods", {}).values():
        lines.append(f"{method_name(entry)}: {entry['params'] / 1e6:,.1f}M parameters, {entry['trainable'] / 1e6:,.1f}M "
                     f"trained (AdamW), activation checkpointing {'on' if entry['activation_checkpointing'] else 'off'}, "
                     f"init {_f(entry.get('init_s'), '.1f')} s")
        if entry.get("cases"):
            lines.append(f"  {'shared':>6} {'compile':>7} {'mbs':>4} {'fwd tokens':>10} {'s/step':>7} {'tokens/s':>10} "
                         f"{'TFLOP/s':>8} {'MFU':>6} {'x GEMM':>7} {'peak GiB':>9} {'of device':>9}")
        for c in entry.get("cases", []):
            compiled = f"{c.get('compile_s', 0.0):.0f} s" if c.get("compiled") else "off"
            lines.append(f"  {'on' if c['share_prompts'] else 'off':>6} {compiled:>7} {c['microbatches']:>4} "
                         f"{c['forwarded_tokens']:>10,.0f} {c['step_s']:>7.3f} {c['tokens_per_s']:>10,.0f} {c['tflops_per_s']:>8.1f} "
                         f"{_f(c.get('mfu'), '.3f'):>6} {_f(c.get('mfu_vs_gemm'), '.3f'):>7} "
                         f"{_f(c.get('peak_memory_gib'), '.1f'):>9} {_f(c.get('peak_memory_fraction'), '.2f'):>9}")
    return lines


def _tests(r: dict) -> list[str]:
    if "counts" not in r:
        return []
    c = r["counts"]
    lines = [f"{c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('error', 0)} errors, "
             f"{c.get('skipped', 0)} skipped" + ("" if r.get("complete") else " (cut short: the tests that finished)")]
    lines += [f"FAILED {f['test']}" + (f" - {f['reason']}" if f["reason"] else "") for f in r.get("failures", [])]
    skips = r.get("skip_reasons", [])
    return lines + [f"skipped: {s}" for s in skips[:6]] + ([f"... {len(skips) - 6} more"] if len(skips) > 6 else [])


def _recipe(r: dict) -> list[str]:
    lines = [f"model: {r['model']}"] if "model" in r else []
    if r.get("note"):
        lines.append(f"note: {r['note']}")
    if "evals" in r:
        lines.append("held-out accuracy (step: accuracy @ training s): " + ", ".join(
            f"{e['step']}: {e['accuracy']:.2f} @ {_f(e.get('train_seconds'), '.1f')}" for e in r["evals"]))
        lines.append(f"median tick {_f(r.get('tick_median_s'), '.2f')} s; launch to first tick "
                     f"{_f(r.get('launch_to_first_tick_s'), '.1f')} s; whole run {_f(r.get('wall_s'), '.0f')} s; peak "
                     f"memory {_f(r.get('peak_gpu_memory_gib'), '.2f')} GiB")
    return lines


RENDER = {"shape": _shape, "tick": _tick, "train": _train, "tests": _tests, "recipe": _recipe}


def _shown(value) -> str:
    if isinstance(value, float):
        return format(value, ",.0f" if abs(value) >= 1000 else ".3g")
    return "-" if value is None else str(value)


def render(report: dict) -> str:
    env, plan = report["environment"], report["plan"]
    lines = [f"llamarl gpu-check, part {report['part']}, {report['created']}" + (
        "  --  SMOKE: a CPU dry run on a tiny model; its numbers mean nothing" if report["smoke"] else "")]
    lines.append(f"device: {env['device']}" + (
        f" ({env.get('device_memory_gib')} GiB; data sheet: {_f(env.get('peak_bf16_tflops'), '.0f')} bf16 TFLOPS, "
        f"{_f(env.get('peak_hbm_tbps'), '.2f')} TB/s)" if env["device"] != "cpu" else "")
        + f"; torch {env['torch']} (CUDA {env['cuda']}); Python {env['python']} ({env['executable']}); git {env['git']}")
    lines.append("packages: " + ", ".join(f"{k} {v or 'MISSING'}" for k, v in env["packages"].items()))
    lines.append(f"plan: {len(plan['sections'])} sections, timeouts {plan['seconds']:.0f} s, at most {plan['most_s']:.0f} s"
                 + (f" of its {plan['budget_s']:.0f} s" if plan.get("budget_s") else " (optional part, no budget)"))
    every = []
    for name, section in report["sections"].items():
        kind, _, shape = name.partition(":")
        lines.append("")
        timing = f" ({section['seconds']} s, timeout {section['timeout_s']} s)" if "seconds" in section else ""
        lines.append(f"{name}: {TITLES[kind]}{' ' + shape if shape else ''}: {section['status'].upper()}{timing}")
        if section.get("reason"):
            lines.append(f"   skipped: {section['reason']}")
        if section.get("error"):
            lines += [f"   error: {line}" for line in section["error"].splitlines()[:14]]
        try:
            lines += [f"   {line}" for line in RENDER[kind](section.get("result", {}))]
        except Exception as error:  # noqa: BLE001 - a partial result the renderer did not expect
            lines.append(f"   (partial result, see report.json: {type(error).__name__}: {error})")
        for check in section.get("checks", []):
            verdict = {True: "met", False: "MISSED", None: "not measured"}[check["met"]]
            lines.append(f"   target: {check['what']}: {_shown(check['value'])} (target {check['target']}): {verdict}")
            every.append(check)
    counts = tally(every)
    lines += ["", f"targets: {counts['met']} met, {counts['missed']} MISSED, {counts['not measured']} not measured; "
              "sections: " + ", ".join(f"{n} {s['status']}" for n, s in report["sections"].items())]
    return "\n".join(lines) + "\n"
