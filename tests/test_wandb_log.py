"""Weights & Biases (issue 38 item 5): a tiny colocated run with ``--run.wandb-project`` under
``WANDB_MODE=offline`` writes its offline run (every metric with its tick, each evaluation's
accuracy and rollout table); a resumed run continues the same W&B run; with ``wandb`` unimportable
the run says so in one line and completes."""

from __future__ import annotations

import json
import struct

from conftest import read_jsonl
from launch import REPO, check, run_colocated_runs

from llamarl.run.wandb_log import RUN_ID_FILE, TABLE_COLUMNS, rollout_rows, run_id

ENV = {"LLAMARL_TEST_SCORER": "scorers_for_tests:first_char_even"}


def flags(model_dir, out, *extra):
    return ["--model.name", str(model_dir), "--run.schedule", "colocated", "--run.max-steps", "2",
            "--run.num-eval-problems", "3", "--run.output-dir", str(out), "--generator.num-prompts-per-step", "2",
            "--generator.max-new-tokens", "12", "--reward.num-workers", "0", "--run.device-guard", *extra]


def wandb_records(path):
    """The protobuf ``Record``s of an offline run's ``.wandb`` file (the LevelDB-style log wandb
    writes: a 7-byte header, then 32 KiB blocks of records, each a 7-byte header and a chunk)."""
    from wandb.proto import wandb_internal_pb2

    raw, pos, block, chunks = path.read_bytes(), 7, 32768, b""
    assert raw[:4] == b":W&B", raw[:7]
    while pos + 7 <= len(raw):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        chunks += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record
        elif kind == 0:
            break


def test_rollout_rows_split_the_turns():
    rows = rollout_rows(3, [{"question": "q", "reference": "r", "score": 1.0, "completion": "a ok b",
                             "turns": [{"policy": "a", "observation": " ok"}, {"policy": " b", "observation": None}]},
                            {"question": "q2", "reference": "r2", "score": 0.0, "completion": "plain"}],
                        score_key="score")
    assert [dict(zip(TABLE_COLUMNS, r)) for r in rows] == [
        {"step": 3, "question": "q", "reference": "r", "policy": "a\n---\n b", "observation": " ok",
         "turns": json.dumps([{"policy": "a", "observation": " ok"}, {"policy": " b", "observation": None}]),
         "score": 1.0},
        {"step": 3, "question": "q2", "reference": "r2", "policy": "plain", "observation": "",
         "turns": json.dumps([{"policy": "plain", "observation": None}]), "score": 0.0}]


def offline_env(wandb_dir):
    wandb_dir.mkdir()
    env = {**ENV, "WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_CONFIG_DIR": str(wandb_dir / "config"),
           "WANDB_CACHE_DIR": str(wandb_dir / "cache"), "WANDB_DATA_DIR": str(wandb_dir / "data")}
    env.pop("WANDB_API_KEY", None)
    return env


def history_of(run) -> dict[int, dict]:
    history: dict[int, dict] = {}
    for record in wandb_records(next(run.glob("run-*.wandb"))):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(record.history.step.num, {}).update(items)
    return history


def test_wandb_offline_run_has_the_metrics_and_rollout_tables(tmp_path, model_dir):
    out, wandb_dir = tmp_path / "run", tmp_path / "wandb_home"
    env = offline_env(wandb_dir)
    proc = run_colocated_runs([flags(model_dir, out, "--run.wandb-project", "llamarl-test", "--run.eval-every", "1",
                                     "--run.log-samples", "2", "--run.wandb-run-name", "tiny")],
                              plan_file=tmp_path / "plan.json", env=env)
    check(proc)
    runs = list((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list(wandb_dir.rglob("*"))[:20]
    run = runs[0]
    # One rollout table per evaluation: the base model, after tick 1, the final policy.
    tables = sorted((run / "files" / "media" / "table" / "eval").glob("rollouts_*.table.json"))
    assert len(tables) == 3, tables
    for path in tables:
        table = json.loads(path.read_text())
        assert table["columns"] == TABLE_COLUMNS and len(table["data"]) == 3
        for row in table["data"]:
            turns = json.loads(row[TABLE_COLUMNS.index("turns")])
            assert row[TABLE_COLUMNS.index("question")].startswith("What is") and turns
            assert row[TABLE_COLUMNS.index("policy")] == "\n---\n".join(t["policy"] for t in turns)
    assert list((run / "files" / "media" / "table" / "train").glob("samples_*.table.json"))

    history: dict[int, dict] = {}
    config = {}
    for record in wandb_records(next(run.glob("run-*.wandb"))):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(record.history.step.num, {}).update(items)
        elif kind == "run":
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
            assert record.run.display_name == "tiny"
    assert config.get("run", {}).get("wandb_project") == "llamarl-test", config.keys()
    assert sorted(history) == [0, 1, 2], sorted(history)
    # The metrics of every executor, under their TensorBoard tags and ticks, as in metrics/*.jsonl.
    for executor in ("generator", "reward", "trainer"):
        for line in read_jsonl(out / "metrics" / f"{executor}.jsonl"):
            logged = history[line["step"]]
            for key in ("gen_tokens_per_s", "reward_mean", "loss"):
                if key in line:
                    tag = next(k for k in logged if k.endswith(f"/{key}"))
                    assert tag.startswith(f"{executor}/") and logged[tag] == line[key], (tag, logged[tag], line[key])
    accuracies = {step: h["eval/accuracy"] for step, h in history.items() if "eval/accuracy" in h}
    summary = json.loads((out / "summary.json").read_text())
    assert accuracies == {e["step"]: e["accuracy"] for e in summary["evals"]}, (accuracies, summary["evals"])


def test_a_resumed_run_continues_its_wandb_run(tmp_path, model_dir):
    """Two segments of one run directory (2 ticks, then resumed from tick 1's checkpoint to 3): one
    W&B run id for both, the second segment's history starting after its checkpoint."""
    out, wandb_dir = tmp_path / "run", tmp_path / "wandb_home"
    env = offline_env(wandb_dir)
    wandb = ["--run.wandb-project", "llamarl-test", "--checkpoint.every", "1"]
    proc = run_colocated_runs([flags(model_dir, out, *wandb),
                               [*flags(model_dir, out, *wandb), "--run.max-steps", "3",
                                "--checkpoint.resume", str(out / "checkpoints" / "step_1")]],
                              plan_file=tmp_path / "plan.json", env=env)
    check(proc)
    recorded = (out / RUN_ID_FILE).read_text().strip()
    runs = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(run.name.endswith(f"-{recorded}") for run in runs), (recorded, runs)
    first, second = (history_of(run) for run in runs)
    assert sorted(first) == [0, 1, 2] and min(second) >= 1 and max(second) == 3, (sorted(first), sorted(second))
    assert "continued" in proc.stdout + proc.stderr


def test_the_run_id_file(tmp_path, caplog):
    fresh, continued = run_id(tmp_path, resumed=False)
    assert not continued and (tmp_path / RUN_ID_FILE).read_text().strip() == fresh
    assert run_id(tmp_path, resumed=True) == (fresh, True)
    other, continued = run_id(tmp_path, resumed=False)  # a fresh run in the same directory: a new W&B run
    assert not continued and other != fresh
    (tmp_path / RUN_ID_FILE).write_text("not an id!\n")
    renewed, continued = run_id(tmp_path, resumed=True)
    assert not continued and renewed != other and "does not hold a W&B run id" in caplog.text
    (tmp_path / RUN_ID_FILE).unlink()
    assert run_id(tmp_path, resumed=True)[1] is False


def test_without_wandb_one_line_and_the_run_completes(tmp_path, model_dir):
    blocker = tmp_path / "blocked"
    (blocker / "wandb").mkdir(parents=True)
    (blocker / "wandb" / "__init__.py").write_text('raise ImportError("wandb blocked by the test")\n')
    out = tmp_path / "run"
    env = {**ENV, "PYTHONPATH": f"{blocker}:{REPO}:{REPO / 'tests'}"}
    proc = run_colocated_runs([flags(model_dir, out, "--run.wandb-project", "llamarl-test")],
                              plan_file=tmp_path / "plan.json", env=env)
    check(proc)
    output = proc.stdout + proc.stderr
    lines = [line for line in output.splitlines() if "wandb" in line.replace(str(tmp_path), "").lower()]
    assert len(lines) == 1 and "wandb cannot be imported" in lines[0] and "TensorBoard only" in lines[0], lines
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_steps"] == 2 and "final_accuracy" in summary
    assert list((out / "tensorboard").iterdir())
