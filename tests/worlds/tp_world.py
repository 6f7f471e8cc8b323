"""Tensor-parallel generator (tp=2) next to a 1-rank trainer, in one 3-rank gloo world.

usage: tp_world.py --pair MODEL_DIR OUT_DIR [--pair MODEL_DIR OUT_DIR ...]

Each ``--pair`` (MODEL_DIR, OUT_DIR) is run in turn in the same world (the model-family matrix runs
every family through one world start-up).

Ranks 0-1 are the generator (``ExecutorSpec("generator", 2, tp=2)``: one TP group), rank 2 the
trainer. Every rank writes ``OUT_DIR/mesh<rank>.json`` (its mesh and coordinates; the first pair's
OUT_DIR). Then, for each pair:

1. greedy: the trainer runs ``PROMPTS`` (different lengths) through a plain model (TP=1), the
   generator ranks through ``GeneratorExecutor`` with the model sharded over TP=2; each writes
   ``greedy_<who>.json`` (per request: completion ids and log-probs);
2. step: one sampled ``GeneratorExecutor.step`` (temperature 1); each generator rank writes
   ``step_gen<r>.json`` (what its engine generated, and how many rows it emits);
3. ddma: the trainer shards a perturbed copy of the model (FSDP2, 1 rank) and syncs it through
   a DDMA ``WeightsChannel``; the trainer writes ``trainer.safetensors`` (full params), generator
   rank 0 ``generator_full.safetensors`` (``full_tensor`` of every param) and each generator rank
   ``generator_local<r>.safetensors`` plus its weight version; then greedy again on both sides
   (``greedy2_<who>.json``).
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from llamarl.channels.ddma_plan import local_tensor
from llamarl.channels.weights import WeightsChannel
from llamarl.data.prompts import Problem
from llamarl.engines.torch_engine import Request, SamplingParams, TorchEngine
from llamarl.environments.config import EnvConfig
from llamarl.executors.config import GeneratorConfig
from llamarl.executors.generator import GeneratorExecutor
from llamarl.models.config import ModelConfig
from llamarl.models.loading import load_causal_lm
from llamarl.models.sharding import full_named_parameters, shard_model
from llamarl.runtime.executor import Executor
from llamarl.runtime.world import ExecutorContext, ExecutorSpec

PROMPTS = ["1+1=", "what is 12 times 7?", "x", "The quick brown fox jumps over"]
MAX_NEW_TOKENS = 10
VERSION = 5


class Questions:
    """Task stand-in: problem ``i`` asks ``PROMPTS[i % len]``."""

    def sample(self, index: int) -> Problem:
        return Problem(question=PROMPTS[index % len(PROMPTS)], answer="0")


def encode(tokenizer, question: str) -> list[int]:
    return tokenizer.encode(question, add_special_tokens=False)


class Trainer(Executor):
    """Holds the FSDP2 model the weight channel reads."""

    def __init__(self, ctx, model):
        super().__init__(ctx)
        self.model, self.version = model, VERSION

    def get_model(self):
        return self.model


def greedy(engine: TorchEngine, tokenizer) -> list[dict]:
    requests = [Request(sample_id=i, prompt_ids=encode(tokenizer, p)) for i, p in enumerate(PROMPTS)]
    outs = engine.generate(requests, sampling=SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS),
                           version=0)
    return [{"ids": o.completion_ids, "logprobs": o.logprobs} for o in outs]


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data))


def run_trainer(ctx, model_dir: str, out: Path) -> None:
    model, tokenizer = load_causal_lm(model_dir)
    engine = TorchEngine(model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    write_json(out / "greedy_tp1.json", greedy(engine, tokenizer))
    sharded = shard_model(load_causal_lm(model_dir)[0], ctx.mesh)
    with torch.no_grad():  # a seeded perturbation, so only a correct routing reproduces it
        gen = torch.Generator().manual_seed(3)
        for param in sharded.parameters():
            local = local_tensor(param)
            local.add_(torch.randn(local.shape, generator=gen) * 0.05)
    WeightsChannel("weights", "trainer", "generator").communicate(ctx, Trainer(ctx, sharded))
    full = {n: t.contiguous() for n, t in full_named_parameters(sharded).items()}
    save_file(full, out / "trainer.safetensors")
    # named_parameters lists a tied lm_head once, as the embedding: it is the only key allowed missing.
    missing = model.load_state_dict(full, strict=False)
    assert not missing.unexpected_keys and set(missing.missing_keys) <= {"lm_head.weight"}, missing
    write_json(out / "greedy2_tp1.json", greedy(engine, tokenizer))
    with torch.no_grad():  # a second perturbation, sent the gather_broadcast way
        for param in sharded.parameters():
            local_tensor(param).mul_(1.5)
    WeightsChannel("weights_gb", "trainer", "generator", mode="gather_broadcast").communicate(ctx, Trainer(ctx, sharded))
    save_file({n: t.contiguous() for n, t in full_named_parameters(sharded).items()}, out / "trainer_gb.safetensors")


def run_generator(ctx, model_dir: str, out: Path) -> None:
    r = ctx.local_rank
    config = GeneratorConfig(num_ranks=2, tp=2, num_prompts_per_step=2, samples_per_prompt=2, temperature=1.0,
                             max_new_tokens=MAX_NEW_TOKENS)
    gen = GeneratorExecutor(ctx, model_config=ModelConfig(name=model_dir), config=config, task=Questions(),
                            prompt_fn=encode, seed=7)
    gen.init()
    write_json(out / f"greedy_gen{r}.json", greedy(gen.engine, gen.tokenizer))
    generated = []
    generate = gen.engine.generate

    def recording(*args, **kwargs):
        outs = generate(*args, **kwargs)
        generated.extend({"id": o.sample_id, "ids": o.completion_ids, "logprobs": o.logprobs} for o in outs)
        return outs

    gen.engine.generate = recording
    gen.step()
    gen.engine.generate = generate
    emitted = len(gen.get_output("rollouts"))
    write_json(out / f"step_gen{r}.json", {"generated": generated, "emitted": emitted})
    # Each TP peer with its own RNG stream: the tokens are still the group's first rank's.
    requests = [Request(sample_id=i, prompt_ids=encode(gen.tokenizer, p)) for i, p in enumerate(PROMPTS * 2)]
    outs = gen.engine.generate(requests, sampling=SamplingParams(temperature=1.5, max_new_tokens=MAX_NEW_TOKENS),
                               version=0, generator=torch.Generator(device=ctx.device).manual_seed(100 + r))
    write_json(out / f"diverged_gen{r}.json", [{"ids": o.completion_ids, "logprobs": o.logprobs} for o in outs])
    WeightsChannel("weights", "trainer", "generator").communicate(ctx, gen)
    full = full_named_parameters(gen.model)  # collective over the TP group
    if r == 0:
        save_file({n: t.contiguous() for n, t in full.items()}, out / "generator_full.safetensors")
    local = {n: local_tensor(p).detach().contiguous() for n, p in gen.model.named_parameters()}
    save_file(local, out / f"generator_local{r}.safetensors", metadata={"version": str(gen.version)})
    write_json(out / f"greedy2_gen{r}.json", greedy(gen.engine, gen.tokenizer))
    WeightsChannel("weights_gb", "trainer", "generator", mode="gather_broadcast").communicate(ctx, gen)
    full = full_named_parameters(gen.model)
    if r == 0:
        save_file({n: t.contiguous() for n, t in full.items()}, out / "generator_full_gb.safetensors")


def run_episodes(ctx, model_dir: str, out: Path) -> None:
    """A step of episodes of ``RankDigitsEnv`` (its tool names the rank it runs on) on the TP-2
    generator: both ranks record what they generated."""
    r = ctx.local_rank
    config = GeneratorConfig(num_ranks=2, tp=2, num_prompts_per_step=2, samples_per_prompt=2, temperature=1.0,
                             max_new_tokens=24)
    gen = GeneratorExecutor(ctx, model_config=ModelConfig(name=model_dir), config=config, task=Questions(),
                            prompt_fn=encode, seed=11,
                            env=EnvConfig(name="envs_for_tests:RankDigitsEnv", max_turns=3, num_tool_workers=0))
    gen.init()
    generated, generate = [], gen.engine.generate

    def recording(*args, **kwargs):
        outs = generate(*args, **kwargs)
        generated.extend({"ids": o.completion_ids, "mask": o.loss_mask, "text": gen.tokenizer.decode(o.completion_ids)}
                         for o in outs)
        return outs

    gen.engine.generate = recording
    gen.step()
    write_json(out / f"episodes_gen{r}.json", {"generated": generated, "emitted": len(gen.get_output("rollouts")),
                                               "tool_calls": gen.metrics.get("env_tool_calls")})
    gen.close()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--pair", nargs=2, action="append", required=True, metavar=("MODEL_DIR", "OUT_DIR"),
                        help="a model and the directory for its outputs; several run in turn in the same world")
    parser.add_argument("--episodes", action="store_true",
                        help="then a step of episodes on the TP-2 generator with the first pair's model")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    pairs = args.pair
    out = Path(pairs[0][1])  # the first pair's directory gets the mesh files
    ctx = ExecutorContext.create([ExecutorSpec("generator", 2, tp=2), ExecutorSpec("trainer", 1)], timeout_s=60)
    mesh = ctx.mesh
    tp_mesh = ctx.tp_mesh
    write_json(out / f"mesh{ctx.rank}.json", {
        "executor": ctx.executor, "ndim": mesh.ndim, "dim_names": list(mesh.mesh_dim_names or []),
        "mesh": mesh.mesh.tolist(), "tp_rank": ctx.tp_rank, "dp_rank": ctx.dp_rank, "tp_size": ctx.tp_size,
        "dp_size": ctx.dp_size, "tp_mesh": tp_mesh.mesh.tolist() if tp_mesh is not None else None,
        "tp_mesh_rank": tp_mesh.get_local_rank() if tp_mesh is not None else None})
    for model_dir, out in pairs:
        out = Path(out)
        if ctx.executor == "trainer":
            run_trainer(ctx, model_dir, out)
        else:
            run_generator(ctx, model_dir, out)
    if args.episodes and ctx.executor == "generator":
        run_episodes(ctx, pairs[0][0], Path(pairs[0][1]))
    ctx.destroy()


if __name__ == "__main__":
    main()
