"""A non-finite loss skips the update on every trainer rank, is counted, and K in a row end the run."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from launch import check, run_torchrun
from test_trainer import setup  # noqa: F401 - a fixture: tiny model + batch


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_nan_step_is_skipped_everywhere_and_counted(setup, tmp_path, nproc):  # noqa: F811
    tmp, model_dir, _ = setup
    out = tmp_path / "records.json"
    check(run_torchrun("nonfinite_world.py", nproc=nproc,
                       args=["--model-dir", str(model_dir), "--batch", str(tmp / "batch.safetensors"),
                             "--out", str(out), "--pattern", "fnf", "--max-nonfinite", "3"]))
    first, poisoned, last = json.loads(out.read_text())
    assert first["changed"] and first["metrics"]["version"] == 1 and first["metrics"]["nonfinite_steps"] == 0
    # Only one rank held the NaN row, yet no rank stepped: the decision uses all-reduced values.
    assert not poisoned["changed"]
    assert poisoned["metrics"] == {"skipped_nonfinite": 1.0, "nonfinite_steps": 1.0, "version": 1.0}
    assert last["changed"] and last["metrics"]["version"] == 2 and last["metrics"]["nonfinite_steps"] == 1


def test_consecutive_nonfinite_steps_end_the_run_with_a_clear_message(setup, tmp_path):  # noqa: F811
    tmp, model_dir, _ = setup
    proc = run_torchrun("nonfinite_world.py", nproc=2,
                        args=["--model-dir", str(model_dir), "--batch", str(tmp / "batch.safetensors"),
                              "--out", str(tmp_path / "r.json"), "--pattern", "nnn", "--max-nonfinite", "2"])
    assert proc.returncode != 0
    assert "2 consecutive non-finite training steps (last: loss nan, grad norm nan) at trainer version 0; " \
           "--trainer.max-nonfinite-steps is 2" in proc.stderr


def test_max_nonfinite_steps_must_be_positive():
    from llamarl.executors.config import TrainerConfig

    with pytest.raises(ValueError, match="--trainer.max-nonfinite-steps must be >= 1, got 0"):
        TrainerConfig(max_nonfinite_steps=0)


def test_non_finite_logits_do_not_crash_the_sampler_and_name_the_weights_version():
    """Non-finite logits reached the sampler unchecked and died there with `index 192 is out of
    bounds` (a NaN total searches past the last block); now the token stays in range with a NaN
    log-prob, and the generator's check stops with one line naming the weights version."""
    import torch

    from llamarl.engines.base import Completion, NonFiniteLogits, SamplingParams, check_finite_logprobs
    from llamarl.engines.sampling import sample_tokens

    logits = torch.randn(3, 49152)
    logits[1, 7] = float("nan")
    logits[2, :] = float("nan")
    for sampling in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7),
                     SamplingParams(temperature=0.0)):
        tokens, logprobs = sample_tokens(logits, sampling=sampling, uniforms=torch.rand(3, dtype=torch.float64))
        assert ((tokens >= 0) & (tokens < 49152)).all()
        assert torch.isfinite(logprobs[0]) and not torch.isfinite(logprobs[1:]).any()
    outputs = [Completion(sample_id=i, prompt_ids=[1], completion_ids=[int(t)], logprobs=[float(lp)], versions=[5],
                          finish_reason="length") for i, (t, lp) in enumerate(zip(tokens, logprobs))]
    with pytest.raises(NonFiniteLogits, match=r"weights version 5 gave non-finite logits .* for 2 of 3 samples"):
        check_finite_logprobs(outputs, version=5)
    check_finite_logprobs(outputs[:1], version=5)
