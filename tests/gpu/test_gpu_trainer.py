"""One FSDP2 trainer step on CUDA (NCCL, one rank) against the CPU single-process reference."""

import json

import torch
from launch import check, run_torchrun
from safetensors import safe_open
from test_trainer import adamw_step, reference_gradients, setup  # noqa: F401 - setup is a fixture


def test_one_cuda_trainer_step_matches_the_cpu_reference(setup):  # noqa: F811
    tmp, model_dir, batch = setup
    out = tmp / "cuda_step.safetensors"
    check(run_torchrun("trainer_world.py", nproc=1,
                       args=[str(model_dir), str(tmp / "batch.safetensors"), str(out), "4096", "aipo"]))
    expected_grads, expected_loss = reference_gradients(model_dir, batch, "aipo")
    with safe_open(str(out), "pt") as f:
        metrics = json.loads(f.metadata()["metrics"])
        saved = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    largest = max(g.abs().max().item() for g in expected_grads.values())
    for name, grad in expected_grads.items():
        # TF32 / cuBLAS reductions: looser than the CPU-vs-CPU parity test.
        torch.testing.assert_close(saved[f"grad.{name}"], grad, rtol=1e-2, atol=1e-3 * largest, msg=name)
    stepped = adamw_step(model_dir, {k.removeprefix("grad."): v for k, v in saved.items() if k.startswith("grad.")})
    for name, weight in stepped.items():
        torch.testing.assert_close(saved[name], weight, rtol=1e-5, atol=1e-6, msg=name)
    assert abs(metrics["loss"] - expected_loss) < 1e-3
