"""TRL side of benchmarks/vs_trl.py; runs inside the separate TRL virtual environment, never imported.

    <trl-venv>/bin/python benchmarks/trl_grpo_worker.py --spec spec.json

``spec.json`` (written by vs_trl.py): model directory, prompts file (JSONL ``question`` / ``answer``
in the exact order llamarl draws them), out directory, and the matched hyper-parameters. Trains with
``trl.GRPOTrainer`` in order (no shuffling), 16 prompts x 4 samples an optimizer step, and writes:

- ``<out>/steps.jsonl``: per optimizer step, its wall seconds (``on_step_begin`` -> ``on_step_end``:
  generation + scoring + training), where they went (``gen_seconds``: ``GRPOTrainer._generate``,
  HF ``generate``; ``reward_seconds``: ``_calculate_rewards``; ``prepare_seconds``: all of
  ``_generate_and_score_completions``, i.e. both of those plus advantages; the rest of the step is
  the loss forward / backward and the optimizer step), the completion tokens and TRL's logged metrics;
- ``<out>/step_<n>/model.safetensors``: the policy after step n, every ``eval_every`` steps (saved
  outside the timed spans; vs_trl.py evaluates them with the same code as llamarl's checkpoints).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


def grpo_config(spec: dict, out: Path, **overrides) -> GRPOConfig:
    """The matched ``GRPOConfig`` (``overrides`` replace fields: benchmarks/grad_parity.py turns off the
    gradient clip, or bf16, to compare one step's gradient)."""
    batch = spec["prompts_per_step"] * spec["samples_per_prompt"]
    kwargs = {
        "output_dir": str(out / "trainer"), "use_cpu": True, "seed": spec["seed"], "report_to": [], "save_strategy": "no",
        "logging_steps": 1, "max_steps": spec["steps"], "num_train_epochs": 1,
        # Same batch: 16 prompts x 4 samples per optimizer step, one generation per step, no accumulation.
        "per_device_train_batch_size": batch, "num_generations": spec["samples_per_prompt"], "steps_per_generation": 1,
        "gradient_accumulation_steps": 1, "shuffle_dataset": False,
        "max_completion_length": spec["max_new_tokens"], "temperature": spec["temperature"], "top_p": 1.0, "top_k": 0,
        # Matched optimizer: AdamW, constant lr, no warmup / decay, same clip and weight decay.
        "learning_rate": spec["lr"], "lr_scheduler_type": "constant", "warmup_steps": 0, "weight_decay": 0.0,
        "max_grad_norm": 1.0, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8,
        "optim": "adamw_torch",  # TRL's default is the fused AdamW; llamarl's is torch.optim.AdamW (foreach)
        # TRL defaults that differ from llamarl's run, set to match: gradient checkpointing on by
        # default (off here), bf16 autocast (llamarl: bf16 compute, fp32 master weights: the same).
        "gradient_checkpointing": False, "bf16": True,
        # The loss: one policy update per generation (ratio 1, on-policy, as llamarl colocated), no KL,
        # GRPO group mean/std, token-level mean over the batch ("dapo", TRL's default; llamarl's AIPO
        # also divides by the global token count).
        "num_iterations": 1, "beta": 0.0, "scale_rewards": "group", "loss_type": "dapo", "epsilon": 0.2,
        "mask_truncated_completions": False, "disable_dropout": True,
        "dataloader_num_workers": 0, "remove_unused_columns": False,
    }
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


def prompt_dataset(spec: dict) -> Dataset:
    """The prompts file as TRL's conversational dataset: one user turn, question + instruction (the
    chat prompt llamarl's ``build_chat_prompt`` makes), in file order."""
    rows = [json.loads(line) for line in Path(spec["prompts"]).read_text().splitlines()]
    return Dataset.from_list([
        {"prompt": [{"role": "user", "content": f"{r['question']} {spec['instruction']}"}], "answer": r["answer"]}
        for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", required=True)
    spec = json.loads(Path(parser.parse_args().spec).read_text())
    sys.path.insert(0, spec["repo"])  # the same scorer as llamarl (pure Python)
    from llamarl.rewards.arithmetic import score

    torch.set_num_threads(spec["threads"])
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    dataset = prompt_dataset(spec)

    def reward(completions, answer, **kwargs):
        return [score(c[-1]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]

    batch = spec["prompts_per_step"] * spec["samples_per_prompt"]
    args = grpo_config(spec, out)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    class Timing(TrainerCallback):
        def __init__(self):
            self.start, self.records, self.logs = 0.0, [], {}
            self.phases = {"gen_seconds": 0.0, "reward_seconds": 0.0, "prepare_seconds": 0.0}

        def timed(self, key, method):
            def wrapper(*a, **kw):
                start = time.perf_counter()
                try:
                    return method(*a, **kw)
                finally:
                    self.phases[key] += time.perf_counter() - start
            return wrapper

        def on_step_begin(self, args, state, control, **kwargs):
            self.phases = dict.fromkeys(self.phases, 0.0)
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self.start
            self.records.append({"step": state.global_step, "seconds": seconds, **self.phases,
                                 "train_seconds": seconds - self.phases["prepare_seconds"]})
            if state.global_step % spec["eval_every"] == 0 or state.global_step == spec["steps"]:
                target = out / f"step_{state.global_step}"
                target.mkdir(exist_ok=True)
                params = {name: p.detach().contiguous().cpu() for name, p in kwargs["model"].named_parameters()}
                save_file(params, str(target / "model.safetensors"), metadata={"format": "pt"})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and self.records and "loss" in logs:
                # TRL 1.16 hands numbers to callbacks already formatted as strings.
                parsed = {}
                for key, value in logs.items():
                    try:
                        parsed[key] = float(value)
                    except (TypeError, ValueError):
                        continue
                self.records[-1]["logs"] = parsed
                self.records[-1]["completion_tokens"] = parsed.get("completions/mean_length", 0.0) * batch
                with (out / "steps.jsonl").open("a") as f:  # one line per step, so a cut-short run still counts
                    f.write(json.dumps(self.records[-1]) + "\n")

    timing = Timing()
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timing])
    # Where a step's time goes (instance attributes shadow the methods; TRL calls them via self).
    trainer._generate = timing.timed("gen_seconds", trainer._generate)
    trainer._calculate_rewards = timing.timed("reward_seconds", trainer._calculate_rewards)
    trainer._generate_and_score_completions = timing.timed("prepare_seconds", trainer._generate_and_score_completions)
    print(f"trl_grpo_worker: torch threads {torch.get_num_threads()}, OMP_NUM_THREADS "
          f"{os.environ.get('OMP_NUM_THREADS')}", flush=True)
    (out / "steps.jsonl").unlink(missing_ok=True)
    trainer.train()


if __name__ == "__main__":
    main()
