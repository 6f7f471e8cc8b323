"""One FSDP2 trainer step on CUDA (NCCL, one rank) against the CPU single-process reference."""

import torch
from launch import check, run_torchrun
from test_trainer import setup  # noqa: F401 - a fixture: tiny model + batch
from trainer_reference import adamw_step, read_update, reference_gradients, world_args


def test_one_cuda_trainer_step_matches_the_cpu_reference(setup):  # noqa: F811
    tmp, model_dir, batch = setup
    out = tmp / "cuda_step.safetensors"
    check(run_torchrun("trainer_world.py", nproc=1, args=world_args(
        model_dir, tmp / "batch.safetensors", out, "--budget", "4096", "--loss", "aipo")))
    expected_grads, expected_loss = reference_gradients(model_dir, batch, "aipo")
    metrics, weights, grads = read_update(out)
    largest = max(g.abs().max().item() for g in expected_grads.values())
    for name, grad in expected_grads.items():
        # TF32 / cuBLAS reductions: looser than the CPU-vs-CPU parity test.
        torch.testing.assert_close(grads[name], grad, rtol=1e-2, atol=1e-3 * largest, msg=name)
    stepped = adamw_step(model_dir, grads)
    for name, weight in stepped.items():
        torch.testing.assert_close(weights[name], weight, rtol=1e-5, atol=1e-6, msg=name)
    assert abs(metrics["loss"] - expected_loss) < 1e-3
