"""recipes/task.py: a task defined in one file outside the repository (a dataset, a scorer) runs
through the generic recipe, and docs/your_own_task.md's commands run as written.

- The dataset loader (llamarl/data/task_dataset.py): JSONL, JSON, Parquet, Arrow and ``save_to_disk``
  directories give the same rows; a prompt template formats a row's fields; the held-out split is
  seeded and disjoint; every mistake is one line naming its flag.
- The references (``--reward.scorer`` / ``--reward.trajectory-scorer``): resolved before any rank
  starts, one line naming the flag (unknown module, unknown function, wrong signature).
- Worlds: the doc's single-turn and tool tasks (its ``my_task.py`` and its commands, run from a directory of
  their own, plus flags for the tiny model and two ticks); the doc's ``--env.tools`` command on the
  default model itself (SmolLM2's tokenizer, template and weights: tool calls made and answered); a task of the test's own whose
  trajectory scorer gives mixed rewards, so the policy really trains; the bad inputs through
  ``torchrun/local.sh`` (the doc's launch-script line): one line on stderr, exit 2, no rank started.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import read_jsonl

from llamarl.data.task_dataset import load_rows, rows_to_problems, split_heldout
from llamarl.executors.config import RewardConfig
from llamarl.rl.config_checks import check_scorers

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "your_own_task.md"
FLAGS = {"dataset": "--task.dataset", "prompt_field": "--task.prompt-field", "answer_field": "--task.answer-field",
         "prompt_template": "--task.prompt-template"}
ROWS = [{"question": f"What is {a} + {b}?", "a": a, "b": b, "answer": str(a + b)} for a in range(1, 6) for b in range(1, 5)]
# What every world of this file adds to a doc command: the tiny model, two short ticks.
TINY = ["--run.max-steps", "2", "--run.num-eval-problems", "4", "--generator.num-prompts-per-step", "2",
        "--generator.samples-per-prompt", "4", "--generator.max-new-tokens", "8", "--reward.num-workers", "1"]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def problems(rows, **kw):
    fields = {"prompt_field": "question", "answer_field": "answer", "prompt_template": None, **kw}
    return rows_to_problems(rows, flags=FLAGS, **fields)


# ----- the dataset --------------------------------------------------------------------------------

def test_every_file_format_gives_the_same_rows(tmp_path):
    import datasets

    dataset = datasets.Dataset.from_list(ROWS)
    dataset.to_parquet(str(tmp_path / "rows.parquet"))
    dataset.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    write_jsonl(tmp_path / "rows.jsonl", ROWS)
    for ref in ("rows.jsonl", "rows.json", "rows.parquet", "saved", str(arrow)):
        rows = load_rows(str(tmp_path / ref), flag="--task.dataset")
        assert list(rows) == ROWS, ref
    got = problems(load_rows(str(tmp_path / "rows.jsonl"), flag="--task.dataset"))
    assert (got[0].question, got[0].answer) == ("What is 1 + 1?", "2") and len(got) == len(ROWS)


def test_broken_lines_are_skipped_and_counted(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\nnot json\n[1, 2]\n\n" + json.dumps({"question": "q"}) + "\n")
    got = problems(load_rows(str(path), flag="--task.dataset"))
    assert [p.answer for p in got] == ["2"] and got.num_skipped_rows == 3  # bad JSON, a list, no answer


def test_a_prompt_template_formats_the_row_fields(tmp_path):
    rows = load_rows(str(write_jsonl(tmp_path / "r.jsonl", [{"x": 3, "u": "km", "y": 0.5, "answer": 3000}])),
                     flag="--task.dataset")
    [problem] = problems(rows, prompt_template="Convert {x} {u} (ratio {y:.2f}).")
    assert (problem.question, problem.answer) == ("Convert 3 km (ratio 0.50).", "3000")


@pytest.mark.parametrize(("ref", "kw", "message"), [
    ("missing.jsonl", {}, "--task.dataset {tmp}/missing.jsonl: no such file"),
    ("rows.jsonl", {"answer_field": "label"},
     "--task.answer-field label: no row of {tmp}/rows.jsonl has a field 'label' (its fields: a, answer, b, question)"),
    ("rows.jsonl", {"prompt_field": "prompt"}, "--task.prompt-field prompt: no row of {tmp}/rows.jsonl has a field 'prompt'"),
    ("rows.jsonl", {"prompt_template": "{question} in {unit}"},
     "--task.prompt-template '{{question}} in {{unit}}': no row of {tmp}/rows.jsonl has a field 'unit'"),
    ("rows.jsonl", {"prompt_template": "{} plus"}, "--task.prompt-template '{{}} plus': name each field"),
    ("rows.txt", {}, "--task.dataset {tmp}/rows.txt: unknown file type .txt"),
])
def test_dataset_mistakes_are_one_line_naming_the_flag(tmp_path, ref, kw, message):
    write_jsonl(tmp_path / "rows.jsonl", ROWS)
    (tmp_path / "rows.txt").write_text("x")
    with pytest.raises(ValueError) as caught:
        problems(load_rows(str(tmp_path / ref), flag="--task.dataset"), **kw)
    text = str(caught.value)
    assert "\n" not in text and text.startswith(message.format(tmp=tmp_path)), text


def test_a_hub_name_that_cannot_load_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"^--task.eval-dataset nobody/no-such-set:main@test: not a local file, "
                                         r"and the Hugging Face dataset 'nobody/no-such-set' \(config main, split test\)"):
        load_rows("nobody/no-such-set:main@test", flag="--task.eval-dataset", default_split="train")


def test_the_heldout_split_is_seeded_disjoint_and_never_everything():
    items = problems(load_rows_from(ROWS))
    train, heldout = split_heldout(items, fraction=0.25, seed=3)
    assert len(heldout) == 5 and len(train) == 15 and not set(heldout) & set(train)
    assert split_heldout(items, fraction=0.25, seed=3) == (train, heldout)
    assert split_heldout(items, fraction=0.25, seed=4)[1] != heldout
    assert split_heldout(items, fraction=0.0, seed=3) == (items, [])
    assert len(split_heldout(items[:1], fraction=0.5, seed=0)[0]) == 1  # never every row


def load_rows_from(rows):
    from llamarl.data.task_dataset import Rows

    out = Rows(rows)
    out.source = "rows"
    return out


# ----- the references -------------------------------------------------------------------------------

@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module ``user_scorers`` in a directory outside the repository, importable."""
    (tmp_path / "user_scorers.py").write_text(textwrap.dedent("""
        def score(completion, reference):
            return float(completion.strip() == reference)

        def one_argument(completion):
            return 0.0

        def by_trajectory(trajectory, problem):
            return 1.0

        NOT_A_FUNCTION = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path / "user_scorers.py"
    sys.modules.pop("user_scorers", None)


@pytest.mark.parametrize(("flags", "message"), [
    ({"scorer": "user_scorers:nope"}, ("--reward.scorer user_scorers:nope: {file} has no 'nope' (it defines: "
                                      "by_trajectory, one_argument, score)")),
    ({"scorer": "no_such_user_module:score"}, ("--reward.scorer no_such_user_module:score: no module named "
                                              "'no_such_user_module' (run from the directory that holds it")),
    ({"scorer": "user_scorers:one_argument"}, ("--reward.scorer user_scorers:one_argument: one_argument(completion) "
                                              "cannot be called as f(completion, reference)")),
    ({"scorer": "user_scorers:NOT_A_FUNCTION"}, ("--reward.scorer user_scorers:NOT_A_FUNCTION: NOT_A_FUNCTION in "
                                                "{file} is a int, not callable as a function")),
    ({"scorer": "exact"}, "--reward.scorer exact: not a registered scorer (arithmetic, gsm8k, math"),
    ({"trajectory_scorer": "user_scorers:missing"}, "--reward.trajectory-scorer user_scorers:missing: {file} has no"),
    ({"trajectory_scorer": "nope"}, "--reward.trajectory-scorer nope: not a registered scorer (env"),
])
def test_scorer_references_are_checked_naming_the_flag(user_module, flags, message):
    with pytest.raises(ValueError) as caught:
        check_scorers(RewardConfig(**flags))
    assert str(caught.value).startswith(message.format(file=user_module)), str(caught.value)


def test_good_references_pass_and_both_at_once_is_refused(user_module):
    check_scorers(RewardConfig(scorer="user_scorers:score"))
    check_scorers(RewardConfig(scorer="gsm8k"))
    check_scorers(RewardConfig(trajectory_scorer="user_scorers:by_trajectory"))
    check_scorers(RewardConfig(trajectory_scorer="env"))
    with pytest.raises(ValueError, match="each replace the recipe's scorer: set one"):
        RewardConfig(scorer="gsm8k", trajectory_scorer="env")


# ----- the doc and the worlds ---------------------------------------------------------------------------

def doc_file(name: str) -> str:
    """The doc's fenced python block whose first line is ``# <name>``."""
    for body in re.findall(r"^```python\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.MULTILINE | re.DOTALL):
        if body.startswith(f"# {name}\n"):
            return body
    raise AssertionError(f"docs/your_own_task.md has no python block starting with '# {name}'")


def doc_commands() -> list[list[str]]:
    """The doc's shell commands (its bash blocks, continuations joined), split into words."""
    text = DOC.read_text(encoding="utf-8")
    commands = []
    for body in re.findall(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        for line in re.sub(r"\\\n\s*", " ", body).splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def doc_command(program: str) -> list[str]:
    return next(words for words in doc_commands() if program in " ".join(words))


def user_env(directory: Path, **extra) -> dict[str, str]:
    """The environment of a user's shell in ``directory``: this checkout importable (as installed),
    offline, one thread a process."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", **extra}


def run_user_command(words: list[str], directory: Path, *extra: str, timeout: float = 300,
                     env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A doc command as the user types it in ``directory`` (``torchrun`` / ``python`` this venv's)."""
    program = {"torchrun": [sys.executable, "-m", "torch.distributed.run"], "python": [sys.executable]}
    argv = program.get(words[0], ["bash", words[0]] if words[0].endswith(".sh") else [words[0]]) + words[1:] + list(extra)
    return subprocess.run(argv, cwd=directory, env=env or user_env(directory), capture_output=True, text=True,
                          timeout=timeout, check=False)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.fixture
def units(tmp_path) -> Path:
    """The doc's single-turn task in a directory of its own: ``my_task.py`` and the dataset it makes
    with the doc's command."""
    directory = tmp_path / "units"
    directory.mkdir()
    (directory / "my_task.py").write_text(doc_file("my_task.py"))
    ok(run_user_command(doc_command("write_dataset"), directory, timeout=60))
    return directory


def test_the_docs_scorer_does_what_the_doc_says(units, monkeypatch):
    monkeypatch.syspath_prepend(str(units))
    sys.modules.pop("my_task", None)
    import my_task

    assert (my_task.score("There are 3000 m in 3 km.", "3000.0"), my_task.score("about 3 thousand", "3000.0")) == (1.0, 0.0)
    rows = [json.loads(line) for line in (units / "data.jsonl").read_text().splitlines()]
    assert len(rows) == 1000 and all(my_task.score(row["answer"], row["answer"]) == 1.0 for row in rows)
    sys.modules.pop("my_task", None)


def test_the_docs_single_turn_task_runs_as_written(units, model_dir):
    """The doc's torchrun command, from the task's directory, on the tiny model for two ticks: the
    user's scorer is imported by the reward workers and scores every sample without an error."""
    out = units / "run"
    ok(run_user_command(doc_command("torchrun --standalone"), units, "--model.name", str(model_dir),
                        "--run.output-dir", str(out), *TINY))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_steps"] == 2 and 0 <= summary["final_accuracy"] <= 1
    reward = read_jsonl(out / "metrics" / "reward.jsonl")
    assert len(reward) == 2 and all(r["reward_errors"] == 0 and r["reward_samples"] == 8 for r in reward)
    evaluated = read_jsonl(out / "eval_final.jsonl")
    assert len(evaluated) == 4 and all(re.fullmatch(r"How many \w+ is \d+ \w+\? Answer with just the number\.",
                                                    row["question"]) for row in evaluated), evaluated[:1]
    config = json.loads((out / "config.json").read_text())
    assert config["reward"]["scorer"] == "my_task:score" and config["run"]["num_eval_problems"] == 4


OWN_TASK = '''
"""A task of the test's own: any dataset, a trajectory scorer giving mixed rewards on a random model."""


def even_first_char(trajectory, problem) -> float:
    text = trajectory.policy_text
    return 1.0 if text and ord(text[0]) % 2 == 0 and problem.question.startswith("Add") else 0.0
'''


def test_a_task_in_one_file_outside_the_repository_trains(tmp_path, model_dir):
    """A dataset JSONL and a scorer file in a directory outside the repository, the eval rows in a
    file of their own: two colocated ticks that update the policy (mixed rewards)."""
    (tmp_path / "own_task.py").write_text(OWN_TASK)
    write_jsonl(tmp_path / "train.jsonl", [{"x": a, "y": b, "sum": a + b} for a in range(10) for b in range(10)])
    write_jsonl(tmp_path / "test.jsonl", [{"x": a, "y": 1, "sum": a + 1} for a in range(6)])
    out = tmp_path / "run"
    ok(run_user_command(["torchrun", "--standalone", "--nproc-per-node", "1", "-m", "recipes.task",
                         "--run.schedule", "colocated", "--task.dataset", "train.jsonl", "--task.eval-dataset",
                         "test.jsonl", "--task.prompt-template", "Add {x} and {y}.", "--task.answer-field", "sum",
                         "--reward.trajectory-scorer", "own_task:even_first_char", "--trainer.lr", "1e-3"],
                        tmp_path, "--model.name", str(model_dir), "--run.output-dir", str(out), *TINY))
    trainer = [r for r in read_jsonl(out / "metrics" / "trainer.jsonl") if "loss" in r]
    assert sum(r["optimizer_steps"] for r in trainer) >= 1, trainer
    assert json.loads((out / "summary.json").read_text())["num_steps"] == 2
    assert [row["question"] for row in read_jsonl(out / "eval_base.jsonl")] == [f"Add {a} and 1." for a in range(4)]


@pytest.mark.parametrize(("replace", "line"), [
    (("my_task:score", "my_tsk:score"), ("--reward.scorer my_tsk:score: no module named 'my_tsk' (run from the "
                                        "directory that holds it, or put that directory on PYTHONPATH)")),
    (("my_task:score", "my_task:scor"), ("--reward.scorer my_task:scor: {dir}/my_task.py has no 'scor' (it "
                                        "defines: ConvertEnv, answered_after_the_tool, brief, convert, correct, score, "
                                        "write_chat_dataset, write_dataset, write_tool_dataset)")),
    (("data.jsonl", "dta.jsonl"), "--task.dataset dta.jsonl: no such file"),
    (("{value}", "{amount}"), ("--task.prompt-template 'How many {{to_unit}} is {{amount}} {{from_unit}}?': no row "
                              "of data.jsonl has a field 'amount' (its fields: answer, from_unit, question, to_unit, value)")),
], ids=["unknown-module", "unknown-function", "missing-dataset", "missing-field"])
def test_bad_inputs_are_one_line_and_exit_2_before_any_rank(units, model_dir, replace, line):
    """The doc's launch-script command with one mistake: the preflight prints the one line and exits
    2; torchrun never starts (no rank, no run directory)."""
    words = [w.replace(*replace) for w in doc_command("torchrun/local.sh")]
    words = [str(REPO / "torchrun" / "local.sh") if w.endswith("torchrun/local.sh") else w for w in words]
    env = user_env(units, NPROC_PER_NODE="1", LLAMARL_PREFLIGHT="1",
                   TORCHRUN=f"{sys.executable} -m torch.distributed.run")
    proc = run_user_command([w for w in words if not w.startswith("NPROC_PER_NODE=")], units, "--model.name",
                            str(model_dir), "--run.output-dir", str(units / "run"), timeout=120, env=env)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", f"llamarl: config error: {line.format(dir=units)}\n")
    assert not (units / "run").exists()


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2 with Qwen2.5's chat template (tool support, ``</tool_call>`` one token)."""
    from tools_for_tests import qwen_tokenizer, tiny_qwen2

    directory = tmp_path_factory.mktemp("qwen") / "model"
    tokenizer = qwen_tokenizer()
    tiny_qwen2(tokenizer).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_the_docs_tool_task_runs_as_written(units, qwen_dir):
    """The doc's tool-task command (``--env.tools my_task:convert``, the trajectory scorer of the same
    file) from the task's directory, with the doc's ``--model.name`` aside (Qwen2.5: a template with
    tools) as a tiny Qwen2 with Qwen2.5's template, for two ticks: the tools are presented (a prompt
    without them would be refused), episodes run, every sample is scored."""
    ok(run_user_command(doc_command("write_tool_dataset"), units, timeout=60))
    out = units / "tools-run"
    ok(run_user_command(doc_command("--env.tools"), units, "--model.name", str(qwen_dir), "--run.output-dir", str(out),
                        *TINY, "--generator.max-new-tokens", "24", "--generator.dtype", "float32"))
    assert json.loads((out / "summary.json").read_text())["num_steps"] == 2
    generator = read_jsonl(out / "metrics" / "generator.jsonl")
    assert len(generator) == 2 and all("env_tool_calls" in r for r in generator)
    reward = read_jsonl(out / "metrics" / "reward.jsonl")
    assert all(r["reward_errors"] == 0 and r["reward_samples"] == 8 for r in reward)
    config = json.loads((out / "config.json").read_text())
    assert config["env"]["tools"] == "my_task:convert"
    assert config["reward"]["trajectory_scorer"] == "my_task:answered_after_the_tool"


@pytest.fixture(scope="module")
def default_model() -> Path:
    """SmolLM2-135M-Instruct's converted directory (the default ``--model.name``); the test skips
    where it is not converted (no network here to make it)."""
    from llamarl.models.config import ModelConfig
    from llamarl.models.loading import resolve_source

    try:
        return Path(resolve_source(ModelConfig().name))
    except (OSError, ValueError) as exc:
        pytest.skip(f"the default model is not available here: {exc}")


def test_the_docs_tool_task_trains_on_the_default_model(units, default_model):
    """The doc's ``--env.tools`` command as written, on the default model (SmolLM2-135M-Instruct:
    its real tokenizer, which splits ``</tool_call>``, and chat template, which has no tool support:
    the default format), colocated, two ticks of 1 prompt x 8 samples (only --run.* / prompt-count
    flags added): the policy writes ``<tool_call>`` JSON, ``convert`` runs in the tool workers and
    its answer comes back as a ``<tool_response>`` the policy replies after, the trajectory scorer
    scores every sample, the policy takes optimizer steps, summary.json has the held-out accuracy
    before and after. Fails if no call was parsed and answered (the tool path never ran)."""
    ok(run_user_command(doc_command("write_tool_dataset"), units, timeout=60))
    command = doc_command("--env.tools")
    assert "--model.name" not in command and "my_task:convert" in command, command
    out = units / "smollm2-tools-run"
    ok(run_user_command(command, units, "--run.output-dir", str(out), "--run.max-steps", "2",
                        "--run.num-eval-problems", "2", "--generator.num-prompts-per-step", "1",
                        "--generator.samples-per-prompt", "8", "--reward.num-workers", "1", timeout=600))
    from llamarl.models.loading import resolve_source

    assert Path(resolve_source(json.loads((out / "config.json").read_text())["model"]["name"])) == default_model
    generator = read_jsonl(out / "metrics" / "generator.jsonl")
    assert len(generator) == 2, generator
    calls, errors = (sum(r[key] for r in generator) for key in ("env_tool_calls", "env_tool_errors"))
    answered = sum(r["env_samples_with_observation"] for r in generator)
    assert calls > errors and answered > 0, generator  # calls parsed, convert ran, its answers appended
    reward = read_jsonl(out / "metrics" / "reward.jsonl")
    # 16 episodes: the untrained policy calls the tool in about half (docs/your_own_task.md), so a CPU
    # whose kernels sum in another order samples other tokens but still some right calls.
    assert len(reward) == 2 and all(r["reward_errors"] == 0 and r["reward_samples"] == 8 for r in reward), reward
    assert max(r["reward_mean"] for r in reward) > 0, reward  # a right reply after convert's answer
    trainer = [r for r in read_jsonl(out / "metrics" / "trainer.jsonl") if "loss" in r]
    assert sum(r["optimizer_steps"] for r in trainer) >= 1, trainer
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_steps"] == 2 and 0 <= summary["base_accuracy"] <= 1 and 0 <= summary["final_accuracy"] <= 1
    evaluated = read_jsonl(out / "eval_base.jsonl")
    assert len(evaluated) == 2 and json.loads(evaluated[0]["question"])[1]["content"].startswith("<tool_call>")


def test_the_docs_trl_reward_functions_and_conversational_rows_run_as_written(units, model_dir):
    """The doc's conversational command (``--reward.funcs`` weighted, ``--ref.kl-coef``, a cosine
    schedule) from the task's directory on the tiny model: the rows go through as messages, each
    function is called with the rows' columns and logged, the KL stage shapes the rewards."""
    ok(run_user_command(doc_command("write_chat_dataset"), units, timeout=60))
    out = units / "chat-run"
    ok(run_user_command(doc_command("--reward.funcs"), units, "--model.name", str(model_dir), "--run.output-dir",
                        str(out), *TINY))
    reward = read_jsonl(out / "metrics" / "reward.jsonl")
    assert len(reward) == 2 and all(r["reward_errors"] == 0 and r["reward_samples"] == 8 for r in reward), reward
    for r in reward:  # the weighted sum of the two functions' means (every sample gets a value from each)
        assert r["reward_fn_correct"] + 0.2 * r["reward_fn_brief"] == pytest.approx(r["reward_mean"])
    ref = read_jsonl(out / "metrics" / "ref.jsonl")
    assert len(ref) == 2 and all("kl_mean" in r and r["ref_samples"] == 8 for r in ref), ref
    trainer = [r for r in read_jsonl(out / "metrics" / "trainer.jsonl") if "lr" in r]
    assert trainer and all(r["lr"] == pytest.approx(1.5e-5 * r["version"] / 2) for r in trainer), trainer  # the 2 warm-up steps
    evaluated = read_jsonl(out / "eval_final.jsonl")
    assert json.loads(evaluated[0]["question"])[0]["role"] == "system", evaluated[0]


def test_the_docs_environment_class_for_the_default_model(units, monkeypatch):
    """``ConvertEnv`` as the doc writes it: each stop text one token of SmolLM2's tokenizer, the
    turns the doc shows ending on one of them, ``step`` answering a call and ending a non-call."""
    from llamarl.models.loading import resolve_source

    monkeypatch.syspath_prepend(str(units))
    sys.modules.pop("my_task", None)
    import my_task
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_source("smollm2-135m-instruct"))
    except (OSError, ValueError) as exc:  # the default model is not converted on this machine
        pytest.skip(f"SmolLM2's tokenizer is not available here: {exc}")
    env = my_task.ConvertEnv()
    stops = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in env.stop_texts()]
    assert all(len(ids) == 1 for ids in stops), stops
    for turn in ("convert(3.5, m, cm)=", "convert(3.5, m, cm) ="):
        assert tokenizer(turn, add_special_tokens=False)["input_ids"][-1] in {ids[0] for ids in stops}
        answer = env.step(env.reset(None), turn)
        assert (answer.observation, answer.done, answer.state) == (" 350.0", False, {"calls": 1})
    no_call = env.step({"calls": 0}, "so 3 + 4 =")
    assert (no_call.observation, no_call.done) == ("", True)
    sys.modules.pop("my_task", None)


def test_the_docs_trajectory_scorer_needs_an_answer_not_a_turn(units, monkeypatch):
    """``num_turns`` counts a turn whose ``=`` was no call: the doc's scorer reads the observations."""
    from llamarl.data.prompts import Problem
    from llamarl.rewards.trajectory import Segment, Trajectory

    monkeypatch.syspath_prepend(str(units))
    sys.modules.pop("my_task", None)
    import my_task

    problem = Problem(question="How many cm is 3.5 m?", answer="350.0")
    no_call = Trajectory([Segment("350.0 =", True), Segment("350.0", True)], num_turns=1)
    failed = Trajectory([Segment("convert(3.5, m, xx) =", True), Segment("[tool error: KeyError]", False),
                         Segment(" 350.0", True)], num_turns=1)
    answered = Trajectory([Segment("convert(3.5, m, cm) =", True), Segment(" 350.0", False),
                           Segment(" so 350.0 cm", True)], num_turns=1)
    assert [my_task.answered_after_the_tool(t, problem) for t in (no_call, failed, answered)] == [0.0, 0.0, 1.0]
    sys.modules.pop("my_task", None)
