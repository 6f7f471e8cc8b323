"""Shared by the GSM8K and MATH recipes (a library piece, so that no recipe imports another): the
``--data`` section's shape, the ``Task`` of a train / test split (``split_task``), the pass@k
evaluation section and the run directory it reads (``prepare_pass_k``, ``run_pass_k``), and the
GPU presets' common shape (``qwen_1gpu``, ``qwen_8gpu``: each recipe passes what differs for its data).
A dataset recipe runs as ``split_task``, ``prepare_pass_k``, ``run_rl``, ``run_pass_k``.

pass@k needs samples from the final policy; ``run_rl`` evaluates greedy accuracy only, so the
recipe measures pass@k after the run, on global rank 0, from the final HF export
(``<run>/hf/final``, written by the runner with ``--export.final``), with the native engine.
Results are added to ``summary.json`` as ``base_pass@k`` / ``final_pass@k`` (and the greedy
accuracy of the reloaded policies as a cross-check: ``base_greedy_reload`` / ``final_greedy_reload``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from llamarl.algorithms.config import AlgoConfig
from llamarl.data.gsm8k import Problems
from llamarl.data.problem_list import ListTask
from llamarl.data.prompts import Problem, PromptFn
from llamarl.engines.engine_configs import VLLMEngineConfig
from llamarl.executors.config import GeneratorConfig, RewardConfig, TrainerConfig
from llamarl.executors.evaluation_loop import evaluate_policy, load_policy
from llamarl.models.config import ModelConfig
from llamarl.rl.config import RLConfig
from llamarl.rl.task import Task
from llamarl.run.config import CheckpointConfig, RunConfig


@dataclass
class DatasetConfig:
    """What the dataset recipes' ``--data`` sections share: local JSONL splits, a training subset, and
    ``load_split`` (local file, else the hub); each recipe adds its hub datasets and its loaders
    (``load_local``, ``load_hub``, and ``default_test_path`` when it has one)."""

    max_train_problems: int | None = None
    """Use only the first this many training problems (None: all)."""
    path: str | None = None
    """Training JSONL in the recipe's format (GSM8K: ``{"question", "answer"}`` a line, the answer
    ending in ``#### N``; MATH: ``problem``/``question`` + ``answer``, or a ``solution`` whose last
    ``\\boxed{}`` is the answer); None loads the recipe's hub dataset."""
    test_path: str | None = None
    """Test JSONL in the same format; None: the recipe's default (GSM8K: ``test.jsonl`` beside
    ``--data.path``), else its hub test split."""

    def load_local(self, path: str) -> list[Problem]:
        """The problems of a local JSONL file (the recipe's format)."""
        raise NotImplementedError

    def load_hub(self, split: str) -> list[Problem]:
        """The problems of the recipe's hub dataset's ``split``."""
        raise NotImplementedError

    def default_test_path(self) -> str | None:
        """The test file used when ``--data.test-path`` is not given (None: the hub's test split)."""
        return None

    def load_split(self, split: str) -> list[Problem]:
        """The ``train`` (its subset) or ``test`` problems: the local file when there is one, else the hub."""
        path = self.path if split == "train" else self.test_path or self.default_test_path()
        problems = self.load_local(path) if path is not None else self.load_hub(split)
        return self.train_subset(problems) if split == "train" else problems

    def __post_init__(self) -> None:
        if self.max_train_problems is not None and self.max_train_problems < 1:
            raise ValueError(f"--data.max-train-problems must be >= 1, got {self.max_train_problems}")

    def train_subset(self, problems: list[Problem]) -> list[Problem]:
        """The first ``max_train_problems`` of ``problems`` (all when None), keeping the loader's
        ``num_skipped_rows`` count (the generator reports it as ``data_skipped_rows``)."""
        if not self.max_train_problems:
            return problems
        subset = Problems(problems[: self.max_train_problems])
        subset.num_skipped_rows = getattr(problems, "num_skipped_rows", 0)
        return subset


@dataclass
class EvalConfig:
    pass_k: list[int] = field(default_factory=list)
    """k values of pass@k measured on the test split before and after training (empty: greedy
    accuracy only, which ``--run.num-eval-problems`` controls). n = max(k) samples per problem."""
    pass_k_problems: int = 100
    """Test problems (a prefix of the test split) used for pass@k."""
    temperature: float = 1.0
    """Sampling temperature of the pass@k samples."""
    chunk: int = 64
    """Sequences decoded together in the pass@k evaluation (raise it on a GPU)."""

    def __post_init__(self) -> None:
        if any(k < 1 for k in self.pass_k):
            raise ValueError(f"--eval.pass-k values must be >= 1, got {self.pass_k}")
        if self.pass_k_problems < 1:
            raise ValueError(f"--eval.pass-k-problems must be >= 1, got {self.pass_k_problems}")
        if self.temperature <= 0:
            raise ValueError(f"--eval.temperature must be > 0, got {self.temperature}")
        if self.chunk < 1:
            raise ValueError(f"--eval.chunk must be >= 1, got {self.chunk}")


@dataclass
class DatasetRecipeConfig(RLConfig):
    """What a dataset recipe's top config adds to ``RLConfig``: the pass@k section (each recipe adds
    its ``--data`` section)."""

    eval: EvalConfig = field(default_factory=EvalConfig)


def prepare_pass_k(config: RLConfig, eval_config: EvalConfig, recipe: str) -> None:
    """Make the run keep what pass@k reads: the final HF export in a run directory known up front.

    Mutates ``config.run.output_dir`` when unset; a no-op without ``--eval.pass-k``. Raises
    ValueError when ``--export.final`` is off.
    """
    if not eval_config.pass_k:
        return
    if not config.export.final:
        raise ValueError("--eval.pass-k evaluates the final policy: it needs --export.final True")
    run = config.run
    if run.output_dir is None:
        # Every rank must pick the same directory before the world exists: torchrun's run id is
        # shared by all agents (a uuid under --standalone, --rdzv-id across nodes).
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        suffix = run_id[:8] if run_id and int(os.environ.get("WORLD_SIZE", "1")) > 1 else time.strftime("%H%M%S")
        run.output_dir = str(Path("runs") / f"{recipe}-{time.strftime('%Y%m%d')}-{suffix}")


def run_pass_k(config: RLConfig, eval_config: EvalConfig, *, summary: dict | None, task: Task) -> dict | None:
    """On the rank that got ``summary`` (global rank 0): pass@k of the base and the final policy on
    ``task``'s held-out problems (its prompt, its scorer), merged into ``summary`` and
    ``summary.json``. Returns the summary (None on other ranks)."""
    if summary is None or not eval_config.pass_k:
        return summary
    problems, prompt_fn, score = list(task.heldout), task.prompt_fn, task.score
    run_dir = Path(config.run.output_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if config.generator.dtype == "bfloat16" else torch.float32
    torch.set_num_threads(max(config.generator.num_threads, config.trainer.num_threads))
    for label, policy in (("base", config.model.name), ("final", str(run_dir / "hf" / "final"))):
        model, tokenizer = load_policy(policy, dtype=dtype, device=device)
        result = evaluate_policy(model, tokenizer, problems=problems[: eval_config.pass_k_problems],
                                 prompt_fn=prompt_fn, score=score, ks=eval_config.pass_k,
                                 temperature=eval_config.temperature, max_new_tokens=config.generator.max_new_tokens,
                                 seed=config.run.seed, chunk=eval_config.chunk,
                                 samples_path=run_dir / f"passk_{label}.jsonl", progress=f"pass@k of the {label} policy")
        for key, value in result.items():
            summary[f"{label}_{key}" if key != "greedy_accuracy" else f"{label}_greedy_reload"] = value
        del model
    summary["pass_k_problems"] = min(eval_config.pass_k_problems, len(problems))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    ks = ", ".join(f"pass@{k} {summary[f'base_pass@{k}']:.1%} -> {summary[f'final_pass@{k}']:.1%}"
                   for k in sorted(set(eval_config.pass_k)))
    print(f"llamarl: {ks} on {summary['pass_k_problems']} test problems", flush=True)
    return summary


def split_task(config: RLConfig, *, train: list[Problem], test: list[Problem], scorer: str,
               prompt_fn: PromptFn) -> Task:
    """A dataset recipe's task (GSM8K, MATH): ``train`` (seeded by ``--run.seed``), the greedy
    held-out accuracy on the first ``--run.num-eval-problems`` of ``test`` (pass@k: on its first
    ``--eval.pass-k-problems``), scored by ``scorer`` (a registered name). ValueError (a config
    error) when the test split has fewer problems than asked for."""
    if config.run.num_eval_problems > len(test):
        raise ValueError(f"--run.num-eval-problems ({config.run.num_eval_problems}) exceeds the "
                         f"{len(test)} test problems")
    return Task(ListTask(train, seed=config.run.seed), heldout=test, prompt_fn=prompt_fn, scorer=scorer)


def qwen_1gpu(config_class: type[RLConfig], *, max_new_tokens: int, lr: float, max_steps: int,
              num_test_problems: int, **sections) -> RLConfig:
    """Qwen2.5-0.5B-Instruct colocated on one GPU with vLLM (64 prompts x 8 samples a tick, bf16,
    16,384-token micro-batches with log-probs in 4,096-token chunks, eight scoring processes, a checkpoint every 50 ticks; greedy accuracy and pass@1/8 on the first
    ``num_test_problems`` test problems). ``sections``: the recipe's own (``data=...``)."""
    return config_class(
        model=ModelConfig(name="Qwen/Qwen2.5-0.5B-Instruct"),
        generator=GeneratorConfig(engine="vllm", vllm=VLLMEngineConfig(kv_cache_gib=20.0), num_prompts_per_step=64,
                                  samples_per_prompt=8, max_new_tokens=max_new_tokens, temperature=1.0,
                                  dtype="bfloat16"),
        reward=RewardConfig(num_workers=8),
        trainer=TrainerConfig(full_lr=lr, param_dtype="bfloat16", max_tokens_per_microbatch=16384,
                              logprob_chunk_tokens=4096),
        run=RunConfig(schedule="colocated", max_steps=max_steps, num_eval_problems=num_test_problems),
        checkpoint=CheckpointConfig(every=50),
        eval=EvalConfig(pass_k=[1, 8], pass_k_problems=num_test_problems, chunk=512), **sections)


def qwen_8gpu(config_class: type[RLConfig], *, samples_per_prompt: int, max_new_tokens: int, reward: RewardConfig,
              trainer: TrainerConfig, algo: AlgoConfig, num_test_problems: int, **sections) -> RLConfig:
    """Qwen2.5-1.5B-Instruct on one 8-GPU node, async: 4 vLLM generator replicas (64 prompts each a
    tick: 256), 4 FSDP2 trainer ranks which also score (``reward``'s workers on each), a checkpoint
    every 50 ticks, greedy accuracy and pass@1/8 on the first ``num_test_problems`` test problems.
    ``trainer`` gets bf16 parameters, a 32,768-token microbatch and its log-probs in 4,096-token
    chunks (one fp32 copy of a whole micro-batch's logits over Qwen's vocabulary would be 18.5 GiB);
    ``sections``: the recipe's own."""
    return config_class(
        model=ModelConfig(name="Qwen/Qwen2.5-1.5B-Instruct"),
        generator=GeneratorConfig(num_ranks=4, engine="vllm", vllm=VLLMEngineConfig(kv_cache_gib=40.0),
                                  num_prompts_per_step=64, samples_per_prompt=samples_per_prompt,
                                  max_new_tokens=max_new_tokens, temperature=1.0, dtype="bfloat16"),
        reward=reward, trainer=replace(trainer, param_dtype="bfloat16", max_tokens_per_microbatch=32768,
                                       logprob_chunk_tokens=4096), algo=algo,
        run=RunConfig(schedule="async", max_steps=300, num_eval_problems=num_test_problems),
        checkpoint=CheckpointConfig(every=50),
        eval=EvalConfig(pass_k=[1, 8], pass_k_problems=num_test_problems, chunk=512), **sections)
