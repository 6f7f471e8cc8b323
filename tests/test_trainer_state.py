"""Trainer state on disk for what users run: tied embeddings, and a save before the first update."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from launch import check, run_torchrun
from tiny_model import save_tiny_model
from trainer_reference import make_batch

from llamarl.models.loading import load_causal_lm


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tiny Llama whose lm_head is its embedding (as SmolLM2, Qwen2/3, Gemma), and a batch for it."""
    tmp = tmp_path_factory.mktemp("tied")
    model_dir = save_tiny_model(tmp / "model", tie_word_embeddings=True)
    model, _ = load_causal_lm(str(model_dir))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    save_file(make_batch(model), str(tmp / "batch.safetensors"))
    return tmp, model_dir


def world(tmp, model_dir, nproc, *jobs):
    """Run ``reshard_world.py`` jobs ``(ckpt, out, mode)`` in one world; the tensors each OUT holds."""
    args = ["--model-dir", str(model_dir), "--batch", str(tmp / "batch.safetensors")]
    for ckpt, out, mode in jobs:
        args += ["--job", str(ckpt), str(out), mode]
    check(run_torchrun("reshard_world.py", nproc=nproc, args=args))
    results = []
    for _, out, mode in jobs:
        if mode in ("save", "load", "train", "save-train", "save-lora", "load-lora"):
            with safe_open(str(out), "pt") as f:
                results.append({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 - not iterable
    return results


@pytest.fixture(scope="module")
def worlds(tied, tmp_path_factory):
    """Every world of this module, three in all (each a start-up paid once for several jobs):

    1. 2 ranks: a step, then a save (``ckpt_2``); a no-grad forward (``whole.json``).
    2. 1 rank: a step; a save before the step, then the step; a load of that save; batches the trainer
       must refuse; a step and a save (``ckpt_1``); a load of ``ckpt_2``.
    3. 2 ranks: loads of ``ckpt_1`` and ``ckpt_2``.

    Returns the directory, ``{"one_rank": (plain, saved_first, loaded, error lines)}`` and the
    ``(before, after)`` tensors of each (save ranks, load ranks)."""
    tmp, model_dir = tied
    out = tmp_path_factory.mktemp("worlds")
    saved_2, saved_lora = world(tmp, model_dir, 2, (out / "ckpt_2", out / "saved_2.st", "save"),
                                (out / "unused", out / "whole.json", "no-grad"),
                                (out / "ckpt_lora", out / "saved_lora.st", "save-lora"))
    plain, saved_first, loaded, saved_1, loaded_2_1, loaded_lora = world(
        tmp, model_dir, 1, (out / "unused", out / "plain.st", "train"),
        (out / "ckpt", out / "saved_first.st", "save-train"), (out / "ckpt", out / "loaded.st", "load"),
        (out / "unused", out / "errors.txt", "bad-groups"),
        (out / "ckpt_1", out / "saved_1.st", "save"), (out / "ckpt_2", out / "loaded_2_1.st", "load"),
        (out / "ckpt_lora", out / "loaded_lora.st", "load-lora"))
    loaded_1_2, loaded_2_2 = world(tmp, model_dir, 2, (out / "ckpt_1", out / "loaded_1_2.st", "load"),
                                   (out / "ckpt_2", out / "loaded_2_2.st", "load"))
    return out, {"one_rank": (plain, saved_first, loaded, (out / "errors.txt").read_text().splitlines()),
                 (2, 1): (saved_2, loaded_2_1), (1, 2): (saved_1, loaded_1_2), (2, 2): (saved_2, loaded_2_2),
                 "lora": (saved_lora, loaded_lora)}


@pytest.fixture(scope="module")
def one_rank(worlds):
    """The 1-rank world's checks: a step; a save before the step, then the step; a load of that save;
    batches the trainer must refuse. ``(plain, saved_first, loaded, error lines)``."""
    return worlds[1]["one_rank"]


@pytest.mark.parametrize(("save_ranks", "load_ranks"), [(2, 1), (1, 2), (2, 2)])
def test_tied_model_saves_once_and_reloads_bitwise_on_any_ranks(worlds, save_ranks, load_ranks):
    """Weights and every AdamW moment saved by N ranks load onto M ranks unchanged."""
    out, results = worlds
    ckpt = out / f"ckpt_{save_ranks}"
    before, after = results[save_ranks, load_ranks]
    assert sorted(before) == sorted(after) and "exp_avg.model.embed_tokens.weight" in before
    assert any(k.startswith("exp_avg_sq.") for k in before)
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), key
    # Nothing in the checkpoint needs unpickling: only safetensors and JSON files.
    assert {p.suffix for p in (ckpt / "state").iterdir()} == {".safetensors", ".json"}
    # The tied tensor is stored once; the other key is recorded as its alias.
    with safe_open(str(ckpt / "state" / "rank0.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert "model/model.embed_tokens.weight" in stored and "model/lm_head.weight" not in stored


def test_a_lora_checkpoint_holds_the_adapters_alone_and_reloads_bitwise_on_other_ranks(worlds):
    """--trainer.lora.rank: 2 ranks save the adapters and their AdamW moments only (the frozen base is
    the model directory's), and 1 rank loads them back unchanged."""
    out, results = worlds
    before, after = results["lora"]
    assert sorted(before) == sorted(after) and any(k.startswith("exp_avg.") for k in before)
    assert all(".lora_" in k for k in before), sorted(before)[:3]
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), key
    assert any(k.endswith("lora_B.weight") and not k.startswith(("exp_avg", "step")) and before[k].any()
               for k in before), "the step did not move B"
    for rank in (0, 1):
        with safe_open(str(out / "ckpt_lora" / "state" / f"rank{rank}.safetensors"), "pt") as f:
            keys = list(f.keys())
        assert keys and all(".lora_" in k for k in keys), keys[:3]


def test_a_save_before_the_first_step_does_not_change_the_step(tied, one_rank):
    """AdamW state must not be created by a save: the first update is then the same as without it."""
    _, model_dir = tied
    plain, saved_first, loaded, _ = one_rank
    assert sorted(plain) == sorted(saved_first)
    for key, tensor in plain.items():
        assert torch.equal(saved_first[key], tensor), key
    assert plain["step.model.embed_tokens.weight"].item() == 1
    # ...and that checkpoint loads (model only; the optimizer starts fresh, as it had not stepped).
    assert not any(k.startswith("exp_avg") for k in loaded)
    initial, _ = load_causal_lm(str(model_dir))
    for name, param in initial.named_parameters():
        assert torch.equal(loaded[name], param.detach()), name


def test_the_trainer_refuses_batches_whose_groups_it_cannot_trust(one_rank):
    no_size, partial = one_rank[3]
    assert no_size.startswith("trainer input: the batch has no metadata['group_size']")
    # The test batch's first group (id 7) is rows 0-1; without row 0 it has one row.
    assert partial.startswith("trainer input: group 7 has 1 rows, but the batch's group_size is 2")


def test_a_forward_without_backward_leaves_every_parameter_sharded(worlds):
    """FSDP2 keeps the root's parameters whole after a forward until a backward; a no-grad forward
    (the proximal policy's, a reference policy's) has none, and a weight read would copy wrong rows."""
    out = worlds[0] / "whole.json"  # 2 ranks
    for rank in (0, 1):
        assert json.loads(Path(f"{out}.rank{rank}").read_text()) == []
