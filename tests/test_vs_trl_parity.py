"""benchmarks/vs_trl.py's multi-seed mode (``--seeds``) without TRL or a model: which runs count as
finished (resume), and the mean +- std over seeds of each side's held-out accuracy per evaluated step,
read from synthetic per-seed run directories laid out as the real runs write them."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import load_benchmark

vs_trl = load_benchmark("vs_trl")

STEPS, EVERY = 4, 2
# seed -> side -> accuracy per evaluated step (step 0: the base model, shared by both sides)
CURVES = {0: {"llamarl": {2: 0.30, 4: 0.50}, "trl": {2: 0.35, 4: 0.80}},
          1: {"llamarl": {2: 0.40, 4: 0.60}, "trl": {2: 0.30, 4: 0.90}},
          2: {"llamarl": {2: 0.20, 4: 0.70}, "trl": {2: 0.40, 4: 1.00}}}
BASE = {0: 0.10, 1: 0.12, 2: 0.14}


def _args(**kw):
    base = {"steps": STEPS, "eval_every": EVERY, "prompts": 2, "samples": 2, "warmup": 1, "target": 0.65,
            "seed": 0, "threads": 1, "jobs": 1, "heldout": 10, "max_new_tokens": 4, "temperature": 0.8, "lr": 1e-5}
    return SimpleNamespace(**{**base, **kw})


def _write_seed(root: Path, seed: int, *, llamarl_steps: int = STEPS, trl_steps: int = STEPS) -> Path:
    out = root / f"seed{seed}"
    metrics = out / "llamarl" / "metrics"
    metrics.mkdir(parents=True)
    (metrics / "generator.jsonl").write_text("".join(
        json.dumps({"step": s, "step_seconds": 2.0 + s, "gen_new_tokens": 40, "gen_seconds": 1.0}) + "\n"
        for s in range(llamarl_steps)))
    (metrics / "trainer.jsonl").write_text("".join(
        json.dumps({"step": s, "train_seconds": 1.0}) + "\n" for s in range(llamarl_steps)))
    (out / "llamarl" / "summary.json").write_text("{}")
    (out / "llamarl" / "hf" / f"step_{llamarl_steps}").mkdir(parents=True)
    (out / "trl").mkdir()
    (out / "trl" / "steps.jsonl").write_text("".join(
        json.dumps({"step": s + 1, "seconds": 10.0, "completion_tokens": 40, "gen_seconds": 4.0,
                    "reward_seconds": 0.0, "train_seconds": 6.0}) + "\n" for s in range(trl_steps)))
    (out / "trl" / f"step_{trl_steps}").mkdir()
    (out / "trl" / f"step_{trl_steps}" / "model.safetensors").write_bytes(b"")
    accuracy = {"base": {"0": BASE[seed]},
                **{side: {str(k): v for k, v in curve.items()} for side, curve in CURVES[seed].items()}}
    (out / "accuracy.json").write_text(json.dumps(accuracy))
    return out


def test_finished_runs_are_recognised(tmp_path):
    args = _args()
    done = _write_seed(tmp_path, 0)
    assert vs_trl.llamarl_done(args, done) and vs_trl.trl_done(args, done)
    cut = _write_seed(tmp_path, 1, llamarl_steps=STEPS - 1, trl_steps=STEPS - 1)
    assert not vs_trl.llamarl_done(args, cut) and not vs_trl.trl_done(args, cut)
    assert not vs_trl.llamarl_done(args, tmp_path / "missing") and not vs_trl.trl_done(args, tmp_path / "missing")


def test_mean_std_is_the_sample_std():
    mean, std = vs_trl.mean_std([0.5, 0.6, 0.7])
    assert math.isclose(mean, 0.6) and math.isclose(std, 0.1)
    assert vs_trl.mean_std([0.3]) == (0.3, 0.0)


def test_report_seeds_aggregates_per_step(tmp_path, capsys):
    seeds = [0, 1, 2]
    for seed in seeds:
        _write_seed(tmp_path, seed)
    vs_trl.report_seeds(_args(), tmp_path, seeds, {"command": "test"})
    summary = json.loads((tmp_path / "vs_trl_seeds.json").read_text())
    assert summary["seeds"] == seeds and (tmp_path / "vs_trl_seeds.png").exists()
    for side in ("llamarl", "trl"):
        assert sorted(summary["accuracy"][side], key=int) == ["0", "2", "4"]
        for step in (2, 4):
            values = [CURVES[s][side][step] for s in seeds]
            cell = summary["accuracy"][side][str(step)]
            assert cell["values"] == values
            assert math.isclose(cell["mean"], sum(values) / 3)
            assert math.isclose(cell["std"], vs_trl.statistics.stdev(values))
    assert math.isclose(summary["accuracy"]["trl"]["0"]["mean"], 0.12)  # the base model, the same on both sides
    paired = summary["paired_difference_llamarl_minus_trl"]["2"]
    assert math.isclose(paired["mean"], (-0.05 + 0.1 - 0.2) / 3)
    # TRL reaches 0.65 at step 4 in every seed; llamarl in seed 2 only
    assert summary["steps_to_target"] == {"llamarl": [None, None, 4], "trl": [4, 4, 4]}
    assert (tmp_path / "seed1" / "vs_trl.json").exists()  # each seed also gets the single-seed report
    table = capsys.readouterr().out
    # step 2: 5 points behind, within one std; step 4: 30 points behind, stds of 10
    assert "| 2 (8) | 30.0 ± 10.0 | 35.0 ± 5.0 | -5.0 ± 15.0 | no | 30/40/20; 35/30/40 |" in table
    assert "| 4 (16) | 60.0 ± 10.0 | 90.0 ± 10.0 | -30.0 ± 0.0 | yes | 50/60/70; 80/90/100 |" in table


@pytest.mark.parametrize("flags", [["--seeds", "1,1"], ["--seeds", "0,1", "--skip", "trl"]])
def test_bad_seed_flags(flags, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["vs_trl.py", *flags])
    with pytest.raises(SystemExit):
        vs_trl.main()
