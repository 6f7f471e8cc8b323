"""llamarl vs TRL's GRPOTrainer on the same machine, task, prompts and hyper-parameters.

    .venv/bin/python benchmarks/vs_trl.py --trl-venv /work/trl-venv   # table on stdout; runs/vs_trl/vs_trl.{json,png}
    .venv/bin/python benchmarks/vs_trl.py --trl-venv /work/trl-venv --seeds 0,1,2 --jobs 2 --threads 1 \
        --out runs/vs_trl3                                     # + mean +- std over seeds: vs_trl_seeds.{json,png}

Both sides: SmolLM2-135M-Instruct, two-digit addition in the chat format of ``recipes.arithmetic``,
the same prompts in the same order (llamarl's ``ArithmeticTask(seed)`` stream, TRL with
``shuffle_dataset=False``), 16 prompts x 4 samples an optimizer step, 12 new tokens, temperature
0.8, AdamW at a constant lr 1.5e-5, gradient clip 1.0, no KL, GRPO group mean/std advantages,
token-mean loss, one update per generation (on-policy), bf16 compute with fp32 master weights,
one process with ``--threads`` torch threads each (llamarl: ``--run.schedule colocated``, so
generation, scoring and training share the process as in TRL).

TRL (``trl==1.16.0``) lives in its own virtual environment (``--trl-venv``, or ``$LLAMARL_TRL_VENV``;
an existing one with trl 1.16.0 importable is used as is, otherwise it is created and TRL installed
on first use; never a project dependency) and runs ``benchmarks/trl_grpo_worker.py`` there. TRL
defaults that differ and are set to match: ``gradient_checkpointing`` (True -> False),
``bf16`` (auto -> True, as llamarl's bf16 compute), ``lr_scheduler_type`` (linear decay ->
constant), ``learning_rate`` (1e-6 -> 1.5e-5), ``optim`` (fused AdamW -> ``adamw_torch``, llamarl's
``torch.optim.AdamW``), ``per_device_train_batch_size`` (8 -> 64 = 16 prompts x 4),
``num_generations`` (8 -> 4), ``max_completion_length`` (512 -> 12), ``temperature`` (1.0 -> 0.8),
``shuffle_dataset`` (True -> False), ``disable_dropout`` (False -> True; SmolLM2 has no dropout
anyway), ``loss_type`` (kept at its default "dapo": token-level mean over the batch, which is what
llamarl's loss does); ``beta`` 0 (no KL), ``scale_rewards="group"``, ``num_iterations`` 1 are TRL's
defaults already. llamarl runs its default loss, AIPO (rho 4): on-policy its ratio is 1 up to the
bf16 generator's rounding, so its gradient is TRL's (``benchmarks/grad_parity.py`` measures one
step on the same batch: cosine 0.995 to TRL's gradient, TRL's own bf16 autocast is at 0.999 of the
fp32 objective; the norms differ by TRL's unbiased group std, a constant 0.866 at 4 samples, which
the gradient clip and AdamW's normalisation remove). TRL generates with HF ``generate`` on the
training model (no vLLM on CPU); llamarl with its own KV-cached engine on a bf16 copy updated in place.
TRL's chunked (fused) output layer for log-probs is always on in 1.16 and cannot be turned off; it
computes the same log-probs as a full ``lm_head`` (less memory, similar time at 12 tokens).

Measured per optimizer step (generation + scoring + training, excluding checkpoint saves and
evaluations): steady-state samples/s and completion tokens/s (median over steps after the first
``--warmup`` steps). Accuracy: greedy accuracy on the same 100 held-out problems, measured by the
same code (``llamarl.executors.evaluation_loop.evaluate_policy``) on the policies both sides saved every
``--eval-every`` steps; time to ``--target`` accuracy is the cumulative step time at the first
evaluated step that reaches it. The JSON also records ``uptime`` before and after (the machine may
be shared), the wall time of each side, the exact llamarl command, and where a step's time goes
(generation, scoring, training, weight sync) on both sides.

``--seeds 0,1,2``: the same comparison at each seed (the same seed on both sides: prompt stream,
held-out problems, sampling and trainer seeds), each in ``<out>/seed<s>`` with its own single-seed
report, then the mean and sample std over seeds of each side's accuracy at every evaluated step,
the llamarl - TRL difference paired by seed, and whether llamarl trails by more than one std
(``vs_trl_seeds.{json,png}``, table on stdout). An interrupted run resumes: finished sides and
evaluated checkpoints are kept. ``--jobs 2`` runs two (seed, side) trainings at once, each with
``--threads`` threads (accuracy does not depend on it: every side is on-policy and synchronous; the
step times then come from a machine shared with the other side's run).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
import venv
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llamarl.data.arithmetic import ArithmeticTask
from llamarl.data.prompts import ARITHMETIC_INSTRUCTION, build_chat_prompt
from llamarl.executors.evaluation_loop import evaluate_policy, load_policy
from llamarl.models.loading import resolve_model_path
from llamarl.rewards.arithmetic import score

TRL_REQUIREMENTS = [f"torch=={torch.__version__.split('+')[0]}", "trl==1.16.0", "transformers>=5.16.1,<5.20"]
MODEL = "smollm2-135m-instruct"


def ensure_trl_venv(path: Path) -> Path:
    """The TRL environment's python: an existing venv where trl 1.16.0 imports is used as is; else the
    venv is created and TRL installed (once; a marker file records it)."""
    python = path / "bin" / "python"
    marker = path / ".llamarl-trl-installed"
    if python.exists() and not marker.exists():
        check = subprocess.run([str(python), "-c", "import trl, sys; sys.exit(trl.__version__ != '1.16.0')"],
                               capture_output=True, env={**os.environ, "PYTHONPATH": ""}, check=False)
        if check.returncode == 0:
            return python
    if not marker.exists():
        print(f"vs_trl: creating {path} and installing {' '.join(TRL_REQUIREMENTS)}", flush=True)
        venv.create(path, with_pip=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *TRL_REQUIREMENTS], check=True)
        marker.touch()
    return python


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def write_prompts(args, out: Path) -> Path:
    """``out/prompts.jsonl``: llamarl's prompt stream at ``args.seed``, in the order it draws them
    (TRL reads it unshuffled); makes ``out/trl`` and ``out/llamarl``."""
    task = ArithmeticTask(num_digits=2, seed=args.seed)
    (out / "trl").mkdir(parents=True, exist_ok=True)
    (out / "llamarl").mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": p.question, "answer": p.answer}) + "\n"
                               for p in (task.sample(i) for i in range(args.steps * args.prompts))))
    return prompts


def run_trl(args, python: Path, out: Path, prompts: Path, model_dir: Path) -> None:
    spec = {"repo": str(REPO), "model": str(model_dir), "prompts": str(prompts), "out": str(out),
            "instruction": ARITHMETIC_INSTRUCTION, "steps": args.steps, "eval_every": args.eval_every,
            "prompts_per_step": args.prompts, "samples_per_prompt": args.samples, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "lr": args.lr, "threads": args.threads, "seed": args.seed}
    (out / "spec.json").write_text(json.dumps(spec, indent=2))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    with (out / "log.txt").open("w") as log:
        subprocess.run([str(python), str(REPO / "benchmarks" / "trl_grpo_worker.py"), "--spec", str(out / "spec.json")],
                       env=env, stdout=log, stderr=subprocess.STDOUT, check=True)


def llamarl_command(args, out: Path) -> list[str]:
    return [str(REPO / ".venv" / "bin" / "torchrun"), "--standalone", "--nproc-per-node", "1", "-m", "recipes.arithmetic",
           "--run.schedule", "colocated", "--run.max-steps", str(args.steps), "--run.seed", str(args.seed),
           "--export.every", str(args.eval_every), "--run.output-dir", str(out),
           "--run.num-eval-problems", str(args.heldout),
           "--generator.num-prompts-per-step", str(args.prompts), "--generator.samples-per-prompt", str(args.samples),
           "--generator.max-new-tokens", str(args.max_new_tokens), "--generator.temperature", str(args.temperature),
           "--generator.num-threads", str(args.threads), "--generator.dtype", "bfloat16",
           "--trainer.num-threads", str(args.threads), "--trainer.param-dtype", "bfloat16", "--trainer.lr", str(args.lr),
           "--reward.num-workers", "0", "--algo.loss", "aipo"]


def run_llamarl(args, out: Path) -> None:
    cmd = llamarl_command(args, out)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    with (out / "log.txt").open("w") as log:
        subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)


def llamarl_steps(out: Path) -> list[dict]:
    """Per tick: seconds (the colocated step: generate + score + train + in-place sync), completion
    tokens, and the phases (from the generator / reward / trainer metric sections of the same tick)."""
    def read(section):
        path = out / "metrics" / f"{section}.jsonl"
        return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())} if path.exists() else {}

    generator, reward, trainer = read("generator"), read("reward"), read("trainer")
    return [{"step": step + 1, "seconds": r["step_seconds"] + r.get("channel_seconds", 0.0),
             "completion_tokens": r["gen_new_tokens"], "gen_seconds": r.get("gen_seconds", 0.0),
             "reward_seconds": reward.get(step, {}).get("reward_seconds", 0.0),
             "train_seconds": trainer.get(step, {}).get("train_seconds", 0.0),
             # samples whose group scored alike carry no gradient: llamarl does not forward them
             "zero_advantage_samples": trainer.get(step, {}).get("zero_advantage_samples", 0.0),
             "weight_sync_seconds": r.get("weight_sync_seconds", 0.0)}
            for step, r in sorted(generator.items())]


def trl_steps(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def accuracy_curve(args, checkpoints: dict[int, tuple[Path, Path | None]]) -> dict[int, float]:
    """Greedy held-out accuracy of each saved policy, same code for both sides.

    ``checkpoints``: step -> (model directory, weights-only directory loaded over it, or None).
    """
    torch.set_num_threads(args.threads)
    problems = ArithmeticTask(num_digits=2, seed=args.seed).heldout(args.heldout)

    def prompt(tokenizer, question):
        return build_chat_prompt(tokenizer, question, instruction_suffix=ARITHMETIC_INSTRUCTION)

    curve = {}
    for step, (directory, weights) in sorted(checkpoints.items()):
        model, tokenizer = load_policy(str(directory), weights_dir=weights, dtype=torch.bfloat16)
        result = evaluate_policy(model, tokenizer, problems=problems, prompt_fn=prompt, score=score, ks=[1],
                                 temperature=1.0, max_new_tokens=args.max_new_tokens, chunk=100)
        curve[step] = result["greedy_accuracy"]
        print(f"vs_trl: step {step} ({weights or directory}): greedy accuracy {curve[step]:.2f}", flush=True)
    return curve


def summarize(name: str, steps: list[dict], curve: dict[int, float], args) -> dict:
    batch = args.prompts * args.samples
    steady = [s for s in steps if s["step"] > args.warmup] or steps
    sps = statistics.median(batch / s["seconds"] for s in steady)
    tps = statistics.median(s["completion_tokens"] / s["seconds"] for s in steady)
    elapsed, cumulative = 0.0, {0: 0.0}
    for s in steps:
        elapsed += s["seconds"]
        cumulative[s["step"]] = elapsed
    reached = [step for step, acc in sorted(curve.items()) if acc >= args.target]
    phases = {key: statistics.median(s[key] for s in steady)
              for key in ("gen_seconds", "reward_seconds", "train_seconds", "weight_sync_seconds")
              if all(key in s for s in steady)}
    # On a shared machine the fastest steady step is the best estimate of the idle machine's speed.
    fastest = min(steady, key=lambda s: s["seconds"])
    return {"system": name, "samples_per_s": sps, "tokens_per_s": tps, "seconds_per_step": statistics.median(
        s["seconds"] for s in steady), "fastest_step": fastest, "fastest_samples_per_s": batch / fastest["seconds"],
        "phase_seconds_median": phases, "accuracy": curve,
        "final_accuracy": curve[max(curve)], "time_to_target_s": cumulative[reached[0]] if reached else None,
        "steps_to_target": reached[0] if reached else None, "cumulative_s": cumulative, "steps": steps}


def table(results: list[dict], args) -> str:
    lines = [(f"| system | s/step | samples/s | completion tokens/s | fastest step: s (samples/s) "
              f"| held-out acc. after {args.steps} steps ({args.steps * args.prompts * args.samples} samples) "
              f"| time to {args.target:.2f} |"),
             "|---|---|---|---|---|---|---|"]
    for r in results:
        to_target = f"{r['time_to_target_s']:.0f} s" if r["time_to_target_s"] is not None else "not reached"
        if r["steps_to_target"] is not None:
            to_target += f" ({r['steps_to_target']} steps)"
        lines.append(f"| {r['system']} | {r['seconds_per_step']:.1f} | {r['samples_per_s']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {r['fastest_step']['seconds']:.1f} ({r['fastest_samples_per_s']:.2f}) | "
                     f"{r['accuracy'][0]:.0%} -> {r['final_accuracy']:.0%} | {to_target} |")
    lines += ["", "Median seconds per step, by phase:", "",
              "| system | generation | scoring | training (fwd/bwd + AdamW) | weight sync | step |",
              "|---|---|---|---|---|---|"]
    for r in results:
        ph = r["phase_seconds_median"]
        cells = [f"{ph[key]:.2f}" if key in ph else "-"
                 for key in ("gen_seconds", "reward_seconds", "train_seconds", "weight_sync_seconds")]
        lines.append(f"| {r['system']} | {' | '.join(cells)} | {r['seconds_per_step']:.2f} |")
    if len(results) == 2:
        a, b = results
        lines.append(f"\nllamarl / TRL steady-state samples/s: {a['samples_per_s'] / b['samples_per_s']:.2f}x (median "
                     f"steps), {a['fastest_samples_per_s'] / b['fastest_samples_per_s']:.2f}x (fastest steps)")
        if a["time_to_target_s"] and b["time_to_target_s"]:
            lines.append(f"TRL / llamarl time to {args.target:.2f}: {b['time_to_target_s'] / a['time_to_target_s']:.2f}x")
    return "\n".join(lines)


def plot(results: list[dict], path: Path, *, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        steps = sorted(r["accuracy"])
        left.plot([r["cumulative_s"][s] for s in steps], [r["accuracy"][s] for s in steps], "o-", label=r["system"])
        right.bar(r["system"], r["samples_per_s"])
    left.set_xlabel("training time (s, evaluations excluded)")
    left.set_ylabel("held-out greedy accuracy")
    left.axhline(target, color="grey", ls=":", label=f"target {target:.2f}")
    left.legend()
    right.set_ylabel("steady-state samples/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/vs_trl"), help="output directory")
    parser.add_argument("--trl-venv", type=Path,
                        default=Path(os.environ.get("LLAMARL_TRL_VENV", Path.home() / ".cache" / "llamarl" / "trl-venv")),
                        help="virtual environment for TRL (used as is if trl 1.16.0 imports there; else created)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps on each side")
    parser.add_argument("--eval-every", type=int, default=2, help="save + evaluate the policy every this many steps")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--lr", type=float, default=1.5e-5)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the single process on each side")
    parser.add_argument("--heldout", type=int, default=100, help="held-out problems for the accuracy")
    parser.add_argument("--target", type=float, default=0.65, help="accuracy for the time-to-target column")
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of the steady-state rates")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=str, default=None,
                        help="comma-separated seeds (e.g. 0,1,2): both sides for each, the same seed on both (prompt "
                             "stream, held-out problems, sampling / trainer seeds); per-seed runs in <out>/seed<s>, "
                             "resumable (a finished side or evaluation is not redone); mean +- std per evaluated step")
    parser.add_argument("--jobs", type=int, default=1,
                        help="with --seeds: training runs (each followed by its evaluations) at once, each with "
                             "--threads threads; >1 runs the two sides side by side, so per-step times are not "
                             "those of an otherwise idle machine")
    parser.add_argument("--skip", choices=["trl", "llamarl"], action="append", default=[],
                        help="reuse that side's results already in --out")
    parser.add_argument("--report-only", action="store_true",
                        help="rebuild the table, JSON and PNG from --out (its runs and vs_trl.json's accuracies); run nothing")
    args = parser.parse_args()
    if args.steps % args.eval_every:
        parser.error("--steps must be a multiple of --eval-every")
    start = time.time()
    out = args.out.resolve()
    if args.seeds is not None:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
        if len(set(seeds)) != len(seeds) or not seeds:
            parser.error("--seeds must list distinct integers")
        if args.skip:
            parser.error("--skip is for single-seed runs (--seeds resumes by itself)")
        if args.report_only:
            report_seeds(args, out, seeds, json.loads((out / "vs_trl_seeds.json").read_text()).get("record", {}))
        else:
            run_seeds(args, out, seeds)
        return
    if args.report_only:
        report(args, out, json.loads((out / "vs_trl.json").read_text()))
        return

    uptime_start = uptime()
    print(f"vs_trl: uptime at start: {uptime_start}", flush=True)
    model_dir = resolve_model_path(MODEL)
    prompts = write_prompts(args, out)
    walls, uptimes = {}, {}
    if "llamarl" not in args.skip:
        print("vs_trl: running llamarl:", shlex.join(llamarl_command(args, out / "llamarl")), flush=True)
        t0 = time.time()
        run_llamarl(args, out / "llamarl")
        walls["llamarl"] = time.time() - t0
        uptimes["after_llamarl"] = uptime()
    if "trl" not in args.skip:
        print("vs_trl: running TRL", flush=True)
        t0 = time.time()
        run_trl(args, ensure_trl_venv(args.trl_venv), out / "trl", prompts, model_dir)
        walls["trl"] = time.time() - t0
        uptimes["after_trl"] = uptime()
    print("vs_trl: evaluating the saved policies", flush=True)
    t0 = time.time()
    saved = range(args.eval_every, args.steps + 1, args.eval_every)
    # The base model is the same on both sides: evaluated once. llamarl's exports are complete HF
    # directories; TRL's worker saves weights only, loaded over the base model.
    base = accuracy_curve(args, {0: (model_dir, None)})
    curves = {
        "llamarl": {**base, **accuracy_curve(args, {s: (out / "llamarl" / "hf" / f"step_{s}", None) for s in saved})},
        "trl": {**base, **accuracy_curve(args, {s: (model_dir, out / "trl" / f"step_{s}") for s in saved})},
    }
    walls["evaluation"] = time.time() - t0
    summary_path = out / "llamarl" / "summary.json"
    llamarl_summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    uptime_end = uptime()
    print(f"vs_trl: uptime at end: {uptime_end}", flush=True)
    walls["total"] = time.time() - start
    report(args, out, {
        "args": {k: str(v) for k, v in vars(args).items()},
        "command": shlex.join([sys.executable, *sys.argv]),
        "llamarl_command": shlex.join(llamarl_command(args, out / "llamarl")),
        "uptime_start": uptime_start, "uptime_end": uptime_end, "uptime_between": uptimes, "cpu_count": os.cpu_count(),
        "wall_seconds": walls,
        # llamarl's own in-run evaluations (its generation model, same problems): a cross-check.
        "llamarl_own_evals": llamarl_summary.get("evals"),
        "curves": curves})


def llamarl_done(args, out: Path) -> bool:
    """llamarl's run in ``out`` finished: every step's metrics, the last export and its summary."""
    return ((out / "llamarl" / "summary.json").exists() and (out / "llamarl" / "hf" / f"step_{args.steps}").is_dir()
            and len(llamarl_steps(out / "llamarl")) >= args.steps)


def trl_done(args, out: Path) -> bool:
    path = out / "trl" / "steps.jsonl"
    return ((out / "trl" / f"step_{args.steps}" / "model.safetensors").exists() and path.exists()
            and len(path.read_text().splitlines()) >= args.steps)


def run_seeds(args, out: Path, seeds: list[int]) -> None:
    """Both sides at each seed in ``out/seed<s>`` (the single-seed layout), then mean +- std over seeds.

    Resumable: a side whose run finished is not run again (an unfinished one is wiped and rerun from
    scratch, so its step times stay those of one uninterrupted run), and each evaluated checkpoint's
    accuracy is kept in ``seed<s>/accuracy.json``. A job is one (seed, side): train it if needed, then
    evaluate its checkpoints (the base model once per seed, with llamarl's side: the held-out problems
    depend on the seed). ``--jobs 1``: one job at a time; more: TRL's jobs in one lane, one after
    another (memory), llamarl's in ``jobs - 1`` lanes beside it. Evaluations take turns.
    """
    import copy
    import shutil
    import threading
    from concurrent.futures import ThreadPoolExecutor

    start = time.time()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_path(MODEL)
    python = ensure_trl_venv(args.trl_venv)  # once, before any worker
    lock, evaluating = threading.Lock(), threading.Lock()
    seed_args = {}
    for seed in seeds:
        sargs = copy.copy(args)
        sargs.seed, sargs.out = seed, out / f"seed{seed}"
        seed_args[seed] = sargs
        if not (sargs.out / "prompts.jsonl").exists():
            write_prompts(sargs, sargs.out)

    def update(path: Path, fn) -> dict:
        with lock:
            data = json.loads(path.read_text()) if path.exists() else {}
            fn(data)
            path.write_text(json.dumps(data, indent=2))
            return data

    def job(seed: int, side: str) -> None:
        sargs = seed_args[seed]
        sout = sargs.out
        record_path, accuracy_path = sout / "record.json", sout / "accuracy.json"
        done = llamarl_done if side == "llamarl" else trl_done
        if not done(sargs, sout):
            shutil.rmtree(sout / side, ignore_errors=True)
            (sout / side).mkdir(parents=True)
            before = uptime()
            print(f"vs_trl: seed {seed}: running {side}"
                  + (f": {shlex.join(llamarl_command(sargs, sout / 'llamarl'))}" if side == "llamarl" else ""), flush=True)
            t0 = time.time()
            if side == "llamarl":
                run_llamarl(sargs, sout / "llamarl")
            else:
                run_trl(sargs, python, sout / "trl", sout / "prompts.jsonl", model_dir)
            wall, after = time.time() - t0, uptime()

            def note(data):
                data.setdefault("wall_seconds", {})[side] = wall
                data.setdefault("ended_at", {})[side] = time.time()
                data.setdefault("uptime_between", {})[f"before_{side}"] = before
                data["uptime_between"][f"after_{side}"] = after
            update(record_path, note)
            print(f"vs_trl: seed {seed}: {side} finished in {wall:.0f} s", flush=True)
        saved = {s: ((sout / "llamarl" / "hf" / f"step_{s}", None) if side == "llamarl" else
                     (model_dir, sout / "trl" / f"step_{s}"))
                 for s in range(args.eval_every, args.steps + 1, args.eval_every)}
        todo = [("base", 0, (model_dir, None))] if side == "llamarl" else []
        todo += [(side, step, where) for step, where in saved.items()]
        with lock:
            cached = json.loads(accuracy_path.read_text()) if accuracy_path.exists() else {}
        t0 = time.time()
        for key, step, where in todo:
            if str(step) in cached.get(key, {}):
                continue
            with evaluating:  # one at a time: HF loading is not thread-safe (its meta-device init is global)
                acc = accuracy_curve(sargs, {step: where})[step]

            def store(data, key=key, step=step, acc=acc):
                data.setdefault(key, {})[str(step)] = acc
            update(accuracy_path, store)
        update(record_path, lambda data: data.setdefault("evaluation_seconds", {}).__setitem__(
            side, data.get("evaluation_seconds", {}).get(side, 0.0) + time.time() - t0))

    print(f"vs_trl: seeds {seeds}, {args.jobs} job(s) at once, {args.threads} thread(s) each; uptime {uptime()}",
          flush=True)
    if args.jobs <= 1:
        for seed in seeds:
            for side in ("trl", "llamarl"):
                job(seed, side)
    else:
        # TRL's process peaks at ~10 GB resident here (two at once were OOM-killed on a 24 GB
        # machine): its runs go one after another in one lane, llamarl's in the other lane(s).
        def lane(side: str) -> None:
            for seed in seeds:
                job(seed, side)

        def llamarl_lane(part: list[int]) -> None:
            for seed in part:
                job(seed, "llamarl")

        workers = max(args.jobs - 1, 1)
        with ThreadPoolExecutor(max_workers=workers + 1) as pool:
            futures = [pool.submit(lane, "trl")]
            futures += [pool.submit(llamarl_lane, seeds[i::workers]) for i in range(workers)]
            errors = []
            for future in futures:  # every lane runs to its end; then the first failure is raised
                try:
                    future.result()
                except Exception as exc:  # noqa: BLE001 -- re-raised below, after the other lanes
                    errors.append(exc)
            if errors:
                raise errors[0]
    # A resumed run adds its invocation to those before it (their walls add up to the measurement's).
    previous = out / "vs_trl_seeds.json"
    invocations = json.loads(previous.read_text()).get("record", {}).get("invocations", []) if previous.exists() else []
    invocations.append({"command": shlex.join([sys.executable, *sys.argv]), "wall_seconds": time.time() - start,
                        "uptime_end": uptime()})
    record = {"cpu_count": os.cpu_count(), "jobs": args.jobs, "threads": args.threads, "invocations": invocations,
              "wall_seconds_total": sum(i["wall_seconds"] for i in invocations)}
    report_seeds(args, out, seeds, record)


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1; 0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def report_seeds(args, out: Path, seeds: list[int], record: dict) -> None:
    """Per-seed reports (``seed<s>/vs_trl.json``, as a single-seed run writes) and the mean +- std
    over seeds of each side's held-out accuracy per evaluated step: ``vs_trl_seeds.{json,png}``."""
    import copy

    per_seed, curves = {}, {"llamarl": {}, "trl": {}}
    for seed in seeds:
        sargs = copy.copy(args)
        sargs.seed = seed
        sout = out / f"seed{seed}"
        accuracy = json.loads((sout / "accuracy.json").read_text())
        seed_record = json.loads((sout / "record.json").read_text()) if (sout / "record.json").exists() else {}
        between, ended = seed_record.get("uptime_between", {}), seed_record.get("ended_at", {})
        first = min(ended, key=lambda side: ended[side] - seed_record["wall_seconds"][side], default="trl")
        seed_record.setdefault("uptime_start", between.get(f"before_{first}"))
        seed_record.setdefault("uptime_end", between.get(f"after_{max(ended, key=ended.get, default='llamarl')}"))
        seed_curves = {side: {int(k): v for k, v in {**accuracy["base"], **accuracy[side]}.items()}
                       for side in ("llamarl", "trl")}
        print(f"\n== seed {seed} ==")
        report(sargs, sout, {**seed_record, "llamarl_command": shlex.join(llamarl_command(sargs, sout / "llamarl")),
                             "curves": seed_curves})
        results = json.loads((sout / "vs_trl.json").read_text())["results"]
        per_seed[seed] = {side: {"accuracy": seed_curves[side], "samples_per_s": r["samples_per_s"],
                                 "fastest_samples_per_s": r["fastest_samples_per_s"],
                                 "seconds_per_step": r["seconds_per_step"], "steps_to_target": r["steps_to_target"],
                                 "time_to_target_s": r["time_to_target_s"]}
                          for side, r in zip(("llamarl", "trl"), results)}
        for side, curve in seed_curves.items():
            curves[side][seed] = curve
    steps = sorted(set.intersection(*(set(c) for side in curves.values() for c in side.values())))
    accuracy = {side: {step: dict(zip(("mean", "std"), mean_std([curves[side][s][step] for s in seeds])),
                             values=[curves[side][s][step] for s in seeds]) for step in steps}
                for side in curves}
    paired = {step: dict(zip(("mean", "std"), mean_std([curves["llamarl"][s][step] - curves["trl"][s][step]
                                                       for s in seeds]))) for step in steps}
    speed = {side: {key: dict(zip(("mean", "std"), mean_std([per_seed[s][side][key] for s in seeds])))
                    for key in ("samples_per_s", "fastest_samples_per_s", "seconds_per_step")} for side in curves}
    reached = {side: [per_seed[s][side]["steps_to_target"] for s in seeds] for side in curves}
    summary = {"seeds": seeds, "std": "sample standard deviation over seeds (n - 1)",
               "args": {k: str(v) for k, v in vars(args).items()}, "record": record,
               "accuracy": {side: {str(k): v for k, v in a.items()} for side, a in accuracy.items()},
               "paired_difference_llamarl_minus_trl": {str(k): v for k, v in paired.items()},
               "speed": speed, "steps_to_target": reached, "per_seed": per_seed}
    (out / "vs_trl_seeds.json").write_text(json.dumps(summary, indent=2))
    print(f"\n== {len(seeds)} seeds ({', '.join(map(str, seeds))}): held-out greedy accuracy, mean +- std over seeds ==\n")
    print(seeds_table(args, seeds, accuracy, paired))
    for side, name in (("llamarl", "llamarl"), ("trl", "TRL")):
        sp = speed[side]
        hits = [r for r in reached[side] if r is not None]
        print(f"{name}: samples/s (median step) {sp['samples_per_s']['mean']:.2f} +- {sp['samples_per_s']['std']:.2f}, "
              f"fastest step {sp['fastest_samples_per_s']['mean']:.2f} +- {sp['fastest_samples_per_s']['std']:.2f}; "
              f"reached {args.target:.2f} in {len(hits)}/{len(seeds)} seeds (steps {reached[side]})")
    walls = record.get("wall_seconds_total")
    print(f"\njson + png in {out}" + (f"; wall {walls:.0f} s" if walls else ""))
    plot_seeds(accuracy, curves, seeds, out / "vs_trl_seeds.png", target=args.target)


def seeds_table(args, seeds, accuracy, paired) -> str:
    def cell(a):
        return f"{100 * a['mean']:.1f} ± {100 * a['std']:.1f}"

    lines = [(f"| step (samples) | llamarl mean ± std (%) | TRL mean ± std (%) | llamarl − TRL, paired by seed (%) "
              f"| llamarl trails by > 1 std | per seed {'/'.join(map(str, seeds))}: llamarl; TRL |"),
             "|---|---|---|---|---|---|"]
    for step in sorted(accuracy["llamarl"]):
        lo, tr = accuracy["llamarl"][step], accuracy["trl"][step]
        gap = tr["mean"] - lo["mean"]
        trails = "yes" if gap > max(lo["std"], tr["std"]) else "no"
        values = "/".join(f"{100 * v:.0f}" for v in lo["values"]) + "; " + "/".join(f"{100 * v:.0f}" for v in tr["values"])
        lines.append(f"| {step} ({step * args.prompts * args.samples}) | {cell(lo)} | {cell(tr)} | "
                     f"{cell(paired[step])} | {trails} | {values} |")
    return "\n".join(lines)


def plot_seeds(accuracy, curves, seeds, path: Path, *, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for side, name, color in (("llamarl", "llamarl", "C0"), ("trl", "TRL 1.16", "C1")):
        steps = sorted(accuracy[side])
        mean = [accuracy[side][s]["mean"] for s in steps]
        std = [accuracy[side][s]["std"] for s in steps]
        ax.plot(steps, mean, "o-", color=color, label=f"{name} (mean ± std, {len(seeds)} seeds)")
        ax.fill_between(steps, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)],
                        color=color, alpha=0.2)
        for seed in seeds:
            ax.plot(steps, [curves[side][seed][s] for s in steps], "-", color=color, alpha=0.35, lw=0.8)
    ax.axhline(target, color="grey", ls=":", label=f"target {target:.2f}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out greedy accuracy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(args, out: Path, record: dict) -> None:
    """Summaries from the runs in ``out`` and the accuracy curves in ``record``; writes vs_trl.json / .png,
    prints the table. ``record`` is the measurement's metadata (a previous vs_trl.json for --report-only)."""
    curves = record.get("curves") or {key: r["accuracy"] for key, r in zip(("llamarl", "trl"), record["results"])}
    curves = {side: {int(step): acc for step, acc in curve.items()} for side, curve in curves.items()}
    results = [summarize("llamarl (colocated, 1 process)", llamarl_steps(out / "llamarl"), curves["llamarl"], args),
               summarize("TRL 1.16 GRPOTrainer (1 process)", trl_steps(out / "trl"), curves["trl"], args)]
    record = {k: v for k, v in record.items() if k not in ("curves", "results")}
    (out / "vs_trl.json").write_text(json.dumps({**record, "results": results}, indent=2))
    plot(results, out / "vs_trl.png", target=args.target)
    print(table(results, args))
    walls = record.get("wall_seconds", {})
    print(f"\nwall: {', '.join(f'{k} {v:.0f} s' for k, v in walls.items())}; load: {record.get('uptime_start')} "
          f"-> {record.get('uptime_end')}; json + png in {out}")


if __name__ == "__main__":
    main()
