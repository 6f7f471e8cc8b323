"""Colocated arithmetic runs on one GPU (tiny model; a random-init model of SmolLM2's shape), and
split async runs over NCCL where there are at least two / three GPUs."""

import json

import pytest
import torch
from launch import check, run_torchrun
from tiny_model import save_tiny_model, tiny_llama_config, tiny_tokenizer


def smollm2_shaped(directory):
    """A random-init Llama with SmolLM2-135M's dimensions (its weights do not fit a device carry).

    The tests' character tokenizer knows ~100 of its 49,152 ids; a plain random init samples an id
    it cannot decode nearly every time, so every completion decodes empty, every group scores
    alike and the trainer never steps (what failed on an H200, 2026-11-26). The (tied) embedding
    rows of the other ids are zeroed and the tokenizer's own scaled by 3: sampled ids are then
    mostly decodable and their first characters varied (measured on CPU with HF ``generate``)."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                               intermediate_size=1536, tie_word_embeddings=True, max_position_embeddings=2048)
    tokenizer = tiny_tokenizer()
    config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[len(tokenizer):] = 0
        model.model.embed_tokens.weight[: len(tokenizer)] *= 3
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("shape", ["tiny", "smollm2"])
def test_colocated_run_on_one_gpu(tmp_path, shape):
    model = save_tiny_model(tmp_path / "model") if shape == "tiny" else smollm2_shaped(tmp_path / "model")
    out = tmp_path / "run"
    check(run_torchrun("e2e_arithmetic.py", nproc=1, timeout_s=600,
                       env={"LLAMARL_TEST_SCORER": "scorers_for_tests:first_char_even"}, args=[
        "--model.name", str(model), "--run.schedule", "colocated", "--run.max-steps", "5",
        "--run.num-eval-problems", "16", "--run.output-dir", str(out), "--reward.num-workers", "0"]))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["schedule"] == "colocated" and summary["num_steps"] == 5
    assert summary["gen_tokens_per_s_mean"] > 0 and summary["train_tokens_per_s_mean"] > 0
    print(json.dumps({"shape": shape, **summary}))  # the numbers for the README (pytest -s)


def test_colocated_over_nccl_on_two_gpus(tmp_path):
    """FSDP2 over two GPUs and the parameter-by-parameter in-place sync, over NCCL."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, torch.cuda.device_count() is {torch.cuda.device_count()}")
    model = save_tiny_model(tmp_path / "model")
    out = tmp_path / "run"
    check(run_torchrun("e2e_arithmetic.py", nproc=2, timeout_s=600,
                       env={"LLAMARL_TEST_SCORER": "scorers_for_tests:first_char_even"}, args=[
        "--model.name", str(model), "--run.schedule", "colocated", "--run.max-steps", "4",
        "--run.num-eval-problems", "8", "--run.output-dir", str(out), "--reward.num-workers", "0"]))
    assert json.loads((out / "summary.json").read_text())["num_steps"] == 4


@pytest.mark.parametrize(("nproc", "split"), [(2, "1:1"), (3, "1:2")])
def test_ddma_over_nccl_is_bitwise(tmp_path, nproc, split):
    """The DDMA weight channel's generator weights equal the trainer's bitwise over NCCL
    (the CPU suite's weights world, run on GPUs)."""
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA devices, torch.cuda.device_count() is {torch.cuda.device_count()}")
    from safetensors.torch import load_file
    from test_weights import expected_local, load_generator
    from worlds.weights_world import cases

    check(run_torchrun("weights_world.py", nproc=nproc, args=["--out", str(tmp_path), "--splits", split], timeout_s=300))
    generators, trainers = (int(x) for x in split.split(":"))
    out = tmp_path / f"{trainers}to{generators}"
    for case, config in cases(generators).items():
        full = load_file(out / f"{case}_trainer.safetensors")
        for index in range(generators):
            got, info = load_generator(out, case, index)
            for name, tensor in got.items():
                want = expected_local(full[name], getattr(torch, config["dtype"]), info["slices"].get(name))
                assert torch.equal(tensor.cpu(), want.cpu()), f"{case} generator {index}: {name}"


def test_split_async_run_over_nccl(tmp_path):
    """generator | reward | trainer on three GPUs, async, DDMA weights, a checkpoint."""
    if torch.cuda.device_count() < 3:
        pytest.skip(f"needs 3 CUDA devices, torch.cuda.device_count() is {torch.cuda.device_count()}")
    model = save_tiny_model(tmp_path / "model")
    out = tmp_path / "run"
    check(run_torchrun("e2e_arithmetic.py", nproc=3, timeout_s=600,
                       env={"LLAMARL_TEST_SCORER": "scorers_for_tests:first_char_even"}, args=[
        "--model.name", str(model), "--run.max-steps", "4", "--run.num-eval-problems", "8",
        "--run.output-dir", str(out), "--reward.num-workers", "0", "--run.checkpoint-every", "4"]))
    assert json.loads((out / "summary.json").read_text())["num_steps"] == 4
