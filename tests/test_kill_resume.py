"""Exact resume, the one end-to-end test of it on three ranks: SIGKILL the generator mid-run; the
job ends with a named line; ``--checkpoint.resume latest`` continues it, and the consumed prompts,
per-step rewards and losses equal an uninterrupted run's, and so does the final policy, bitwise.

The checkpoints hold carried-over partial samples (5-token budget), rollouts in flight (async lag 2)
and trained weights + AdamW state, so all of it must round-trip. (One-process colocated resume:
tests/test_model_families.py for each family, tests/test_default_model.py for SmolLM2, and
tests/test_resume_semantics.py for what a resume does to the run directory.)"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from conftest import read_jsonl
from launch import REPO, check, run_torchrun
from tiny_model import save_tiny_model

from recipes.arithmetic import prompt_fn

STEPS = 24
# Whichever notices first: the heartbeat naming the dead rank, a peer whose exchange with it failed,
# or a peer that torchrun stopped (its line maps torchrun's "root cause: rank 0" to the generator).
NAMED_LINE = re.compile(r"llamarl: (rank 0 \(executor 'generator'\) stopped responding at step \d+"
                        r"|executor '\w+' \(rank \d, local rank \d\) failed at step \d+ during [^\n]*generator"
                        r"|executor '\w+' \(rank \d, local rank \d\) stopped at step \d+ during [^\n]*"
                        r"executors by rank: generator \[0\])")


def args(model_dir, out):
    return ["--model.name", str(model_dir), "--run.max-steps", str(STEPS), "--run.num-eval-problems", "4",
            "--run.output-dir", str(out), "--generator.num-prompts-per-step", "2", "--reward.num-workers", "1",
            "--checkpoint.every", "2", "--generator.token-budget", "5", "--trainer.lr", "1e-3",
            "--run.async-lag", "2",  # rollouts in flight across every checkpoint
            "--generator.dtype", "float32",  # fp32 both sides: the export's greedy text must match
            "--run.liveness-timeout-s", "20"]


def per_step(out, executor, key):
    return {r["step"]: r[key] for r in map(json.loads, (out / "metrics" / f"{executor}.jsonl").read_text().splitlines())
            if key in r}


def test_sigkill_then_resume_latest_equals_an_uninterrupted_run(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model")
    env = {"LLAMARL_TEST_SCORER": "scorers_for_tests:first_char_even"}
    straight = tmp_path / "straight"
    check(run_torchrun("e2e_arithmetic.py", nproc=3, env=env, args=args(model_dir, straight)))

    killed = tmp_path / "killed"
    pids = tmp_path / "pids"
    pids.mkdir()
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}",
                "HF_HUB_OFFLINE": "1", "LLAMARL_TEST_PID_DIR": str(pids), **env}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
                             "--monitor-interval=0.5", str(REPO / "tests" / "worlds" / "e2e_arithmetic.py"),
                             *args(model_dir, killed)], cwd=REPO, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        marker = killed / "checkpoints" / "step_4" / "COMPLETE.json"
        while not marker.is_file():
            if proc.poll() is not None:
                pytest.fail(f"the run ended before its step-4 checkpoint:\n{proc.stderr.read()[-4000:]}")
            time.sleep(0.05)
        os.kill(int((pids / "rank0.pid").read_text()), signal.SIGKILL)  # rank 0 is the generator
        # The job must end within 60 s of the kill (gloo fails the dead peer's exchanges at once; the
        # heartbeat's 20 s bound covers ranks not talking to it); a hang fails the test here.
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert NAMED_LINE.search(stderr), stderr[-4000:]
    print(NAMED_LINE.search(stderr).group(0))
    assert not (killed / "summary.json").exists()

    latest = max(int(p.name[5:]) for p in (killed / "checkpoints").glob("step_*")
                 if (p / "COMPLETE.json").is_file())
    state = json.loads((killed / "checkpoints" / f"step_{latest}" / "runner_state.json").read_text())
    check(run_torchrun("e2e_arithmetic.py", nproc=3, env=env,
                       args=[*args(model_dir, killed), "--checkpoint.resume", "latest"]))
    # What the killed run did after its last checkpoint is archived: each tick is logged once.
    for executor in ("generator", "reward", "trainer"):
        lines = (killed / "metrics" / f"{executor}.jsonl").read_text().splitlines()
        logged = [json.loads(line)["step"] for line in lines]
        assert logged == sorted(set(logged)), executor
    for executor, key in (("generator", "gen_data_position"), ("reward", "reward_mean"), ("trainer", "loss")):
        expected, got = per_step(straight, executor, key), per_step(killed, executor, key)
        assert sorted(got) == sorted(expected) and len(expected) >= STEPS // 2, (executor, sorted(got))
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-9), executor
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["num_steps"] == STEPS and summary["resumed_from_step"] == [latest]
    # The base evaluation of the killed run and the final one of the resumed run; wall time of both.
    assert [e["step"] for e in summary["evals"]] == [0, STEPS]
    assert summary["base_accuracy"] == json.loads((straight / "summary.json").read_text())["base_accuracy"]
    assert summary["wall_seconds"] > state["elapsed_seconds"]
    # The final policy, bitwise; the exports are plain safetensors HF directories.
    final_straight = load_file(str(straight / "hf" / "final" / "model.safetensors"))
    final_resumed = load_file(str(killed / "hf" / "final" / "model.safetensors"))
    assert final_straight.keys() == final_resumed.keys()
    for name, tensor in final_straight.items():
        assert torch.equal(final_resumed[name], tensor), name
    # from_pretrained + its tokenizer give the greedy text the generator produced with the trainer's
    # final weights in the run's final evaluation.
    hf_model = AutoModelForCausalLM.from_pretrained(straight / "hf" / "final")
    tokenizer = AutoTokenizer.from_pretrained(straight / "hf" / "final")
    for record in read_jsonl(straight / "eval_final.jsonl"):
        ids = torch.tensor([prompt_fn(tokenizer, record["question"])])
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        assert tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == record["completion"]
    # keep-K (default 2) kept the last two, both complete; nothing partial is left.
    assert sorted(p.name for p in (straight / "checkpoints").iterdir()) == [f"step_{STEPS - 2}", f"step_{STEPS}"]
    assert all((straight / "checkpoints" / f"step_{s}" / "COMPLETE.json").is_file() for s in (STEPS - 2, STEPS))
