"""report.txt: the JSON report as text, each number next to its target."""

from __future__ import annotations

from gpu_check.common import LETTERS


def _f(value, spec: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _tests(r: dict) -> list[str]:
    if "counts" not in r:
        return []
    c = r["counts"]
    lines = [f"{c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('error', 0)} errors, "
             f"{c.get('skipped', 0)} skipped" + ("" if r.get("complete") else " (cut short: the tests that finished)")]
    lines += [f"FAILED {f['test']}" + (f" - {f['reason']}" if f["reason"] else "") for f in r.get("failures", [])]
    skips = r.get("skip_reasons", [])
    lines += [f"skipped: {s}" for s in skips[:6]] + ([f"... {len(skips) - 6} more skip reasons"] if len(skips) > 6 else [])
    return lines


def _decode(r: dict) -> list[str]:
    if "rows" not in r:
        return []
    hbm = r.get("hbm", {})
    lines = [(f"{r['model']}, {r['dtype']}, {r['params'] / 1e6:.1f}M parameters ({r['weight_bytes'] / 1e6:.0f} MB), "
             f"{r['new_tokens']} new tokens, prompts of ~{r['prompt_tokens'][0]} tokens; graph path: "
             f"static_decode={r['graph_mode']!r}"),
             (f"HBM: {_f(hbm.get('copy_gbps'), '.0f')} GB/s measured (a {hbm.get('copy_bytes', 0) / 2**30:.2f} GiB device "
             f"copy, read + write), {_f(hbm.get('nominal_gbps'), '.0f')} GB/s data sheet; weights-read bound "
             f"{_f(r.get('bound_ms'), '.3f')} ms a step (data sheet: {_f(r.get('bound_nominal_ms'), '.3f')} ms)"),
             (f"{'rows':>6} {'graph ms':>9} {'HF modules':>11} {'HF generate':>12} {'bound ms':>9} "
             f"{'graph/HF gen':>13} {'graph/bound':>12}")]
    for rows in r["rows"]:
        key = str(rows)
        ratio = r.get("ratios", {}).get(key, {})
        lines.append(f"{rows:>6} {_f(r.get('graph', {}).get('step_ms', {}).get(key), '.2f'):>9} "
                     f"{_f(r.get('hf_modules', {}).get('step_ms', {}).get(key), '.2f'):>11} "
                     f"{_f(r.get('hf_generate', {}).get('step_ms', {}).get(key), '.2f'):>12} "
                     f"{_f(r.get('bound_ms'), '.3f'):>9} {_f(ratio.get('graph_vs_hf_generate'), '.3f'):>13} "
                     f"{_f(ratio.get('graph_vs_bound'), '.1f'):>12}")
    kernels = r.get("kernels_per_step") or {}
    if any(v is not None for v in kernels.values()):
        lines.append("kernels per uncaptured static step (what a graph replays): "
                     + ", ".join(f"{k} rows {_f(v['per_step'], '.0f')}" for k, v in kernels.items() if v))
    compiled = r.get("graph_compiled")
    if compiled:
        lines.append("compiled graphs (static_decode='compiled'), ms per step: "
                     + ", ".join(f"{k} rows {_f(v, '.2f')}" for k, v in compiled.get("step_ms", {}).items())
                     + f"; the whole timing incl. compiling every bucket {_f(compiled.get('wall_s'), '.0f')} s; "
                     + ", ".join(f"{k} rows / HF generate {_f(v.get('compiled_vs_hf_generate'), '.3f')}"
                                 for k, v in r.get("ratios", {}).items()))
    decoder = r.get("graph", {}).get("decoder")
    if decoder:
        lines.append("graph path's decoder: " + ", ".join(f"{k} {v}" for k, v in decoder.items()))
    lines += [f"error in {k}: {v}" for k, v in r.get("errors", {}).items()]
    return lines


def _capture(r: dict) -> list[str]:
    lines = []
    first = r.get("first_call")
    if first:
        lines.append(f"first call: {first['graphs']} graphs captured in {_f(first['capture_seconds'], '.2f')} s "
                     f"(capture_seconds), the call {first['wall_s']:.2f} s; static_decode={r['graph_mode']!r}, "
                     f"stop ids: {r['stop_ids']}")
    if r.get("calls"):
        lines.append(f"{'call':<40} {'rows':>5} {'tokens':>7} {'lengths':>9} {'wall s':>7} {'graphs':>6} "
                     f"{'capture s':>9} {'s/graph':>8}")
    for c in r.get("calls", []):
        lines.append(f"{c['call']:<40} {c['rows']:>5} {c['tokens']:>7} {'..'.join(map(str, c['lengths'])):>9} "
                     f"{c['wall_s']:>7.2f} {_f(c['new_captures'], 'd'):>6} {_f(c['capture_seconds'], '.2f'):>9} "
                     f"{_f(c['seconds_per_graph'], '.3f'):>8}")
        lines += [f"  warning: {w}" for w in c.get("warnings", [])]
    return lines


def _recipe(r: dict) -> list[str]:
    lines = [f"model: {r['model']}"] if "model" in r else []
    if r.get("note"):
        lines.append(f"note: {r['note']}")
    if "evals" in r:
        lines.append("held-out accuracy (step: accuracy @ training s): " + ", ".join(
            f"{e['step']}: {e['accuracy']:.2f} @ {_f(e.get('train_seconds'), '.1f')}" for e in r["evals"]))
        reached = ("not reached" if r.get("seconds_to_0.70") is None else
                   f"{r['seconds_to_0.70']:.1f} training s (model load and evaluations left out), "
                   f"{_f(r.get('wall_to_0.70'), '.1f')} s of wall, step {r.get('steps_to_0.70')}")
        lines.append(f"to 0.70: {reached}; launch to first tick {_f(r.get('launch_to_first_tick_s'), '.1f')} s; "
                     f"median tick {_f(r.get('tick_median_s'), '.2f')} s; whole run {_f(r.get('wall_s'), '.0f')} s")
        lines.append(f"generation {_f(r.get('gen_tokens_per_s_mean'), '.0f')} tokens/s, trainer "
                     f"{_f(r.get('train_tokens_per_s_mean'), '.0f')} tokens/s (means over ticks); peak memory "
                     f"{_f(r.get('peak_gpu_memory_gib'), '.2f')} GiB")
    return lines


def _tick(r: dict) -> list[str]:
    if "gen_tokens_per_s" not in r:
        return [f"{r['samples']} samples x {r['new_tokens']} new tokens, {r['ticks']} ticks"] if "samples" in r else []
    lines = [(f"{r['samples']} samples x {r['new_tokens']} new tokens a tick, {r['ticks']} ticks (medians of the "
             f"{r['steady_ticks']} after the first); {r['params'] / 1e6:.1f}M parameters; scorer {r['scorer']}"),
             (f"generation: {_f(r['gen_tokens_per_s'], ',.0f')} tokens/s ({_f(r['gen_new_tokens'], '.0f')} tokens in "
             f"{_f(r['gen_seconds'], '.2f')} s)"),
             f"trainer: {_f(r['train_tokens_per_s'], ',.0f')} tokens/s (prompt + completion tokens; step "
             f"{_f(r['train_seconds'], '.2f')} s), MFU {_f(r.get('mfu'), '.3f')} = 6 x parameters x tokens/s / "
             f"{_f(r.get('peak_bf16_tflops'), '.0f')} TFLOPS ({r['device']}'s bf16 peak)" + (
                 f"; {r['mfu_note']}" if r.get("mfu_note") else ""),
             f"peak memory (torch.cuda.max_memory_allocated): {_f(r.get('peak_gpu_memory_gib'), '.2f')} GiB"]
    lines += [f"  tick {s}: " + ", ".join(f"{k} {_f(v, '.1f')}" for k, v in t.items()) for s, t in r.get("per_tick", {}).items()]
    return lines


RENDER = {"tests": _tests, "decode": _decode, "capture": _capture, "recipe": _recipe, "tick": _tick}


def render(report: dict) -> str:
    from gpu_check.cli import TITLES

    env = report["environment"]
    lines = [f"llamarl gpu-check, {report['created']}" + (
        "  --  SMOKE: a CPU dry run on a tiny model; its numbers mean nothing" if report["smoke"] else "")]
    lines.append(f"device: {env['device']}" + (
        f" ({env.get('device_memory_gib')} GiB; data sheet: {_f(env.get('peak_bf16_tflops'), '.0f')} bf16 TFLOPS, "
        f"{_f(env.get('peak_hbm_tbps'), '.2f')} TB/s)" if env["device"] != "cpu" else "")
        + f"; torch {env['torch']} (CUDA {env['cuda']}); Python {env['python']} ({env['executable']}); git {env['git']}")
    lines.append("packages: " + ", ".join(f"{k} {v or 'MISSING'}" for k, v in env["packages"].items()))
    tally = {True: 0, False: 0, None: 0}
    for name, section in report["sections"].items():
        lines.append("")
        timing = f" ({section['seconds']} s, timeout {section['timeout_s']} s)" if "seconds" in section else ""
        lines.append(f"{LETTERS[name]}. {TITLES[name]}: {section['status'].upper()}{timing}")
        if section.get("reason"):
            lines.append(f"   skipped: {section['reason']}")
        if section.get("error"):
            lines += [f"   error: {line}" for line in section["error"].splitlines()[:14]]
        try:
            lines += [f"   {line}" for line in RENDER[name](section.get("result", {}))]
        except Exception as error:  # noqa: BLE001 - a partial result the renderer did not expect
            lines.append(f"   (partial result, see report.json: {type(error).__name__}: {error})")
        for check in section.get("checks", []):
            verdict = {True: "met", False: "MISSED", None: "not measured"}[check["met"]]
            value = check["value"]
            shown = (_f(value, ",.0f" if abs(value) >= 1000 else ".3g") if isinstance(value, float)
                     else "-" if value is None else str(value))
            lines.append(f"   target: {check['what']}: {shown} (target {check['target']}): {verdict}")
            tally[check["met"]] += 1
    lines += ["", f"targets: {tally[True]} met, {tally[False]} missed, {tally[None]} not measured; sections: " + ", ".join(
        f"{LETTERS[n]} {s['status']}" for n, s in report["sections"].items())]
    return "\n".join(lines) + "\n"
