"""Loading the trainer's model straight into FSDP2 shards (llamarl/models/sharded_loading.py), in a
real 3-rank gloo world (this file is also that world's script; 3 ranks: uneven shards). Per
checkpoint (untied, one file; tied, several files with an index): the full load is never called,
each rank holds only its rows, and the gathered weights, the buffers and the logits equal
``load_causal_lm``'s."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from launch import check, run_torchrun
from tiny_model import build_tiny_llama, save_tiny_model, tiny_tokenizer

WORLD = "../" + Path(__file__).name


def world_main() -> None:
    """usage: test_sharded_loading.py OUT MODEL_DIR...; rank r writes OUT/<i>-rank<r>.json per model."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from llamarl.models import sharded_loading
    from llamarl.models.loading import load_causal_lm
    from llamarl.models.sharding import full_named_parameters

    out, model_dirs = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def forbidden(*args, **kwargs):
        raise AssertionError("the full load ran")

    for index, model_dir in enumerate(model_dirs):
        sharded_loading.load_causal_lm = forbidden
        model, tokenizer = sharded_loading.load_sharded_causal_lm(model_dir, dtype=torch.float32, mesh=mesh,
                                                                 device=torch.device("cpu"))
        sharded_loading.load_causal_lm = load_causal_lm
        reference, _ = load_causal_lm(model_dir)
        local_rows = {n: int(p.to_local().shape[0]) for n, p in model.named_parameters()}
        full = full_named_parameters(model)  # collective
        ids = torch.tensor([[5, 9, 17, 33, 2, 71]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits  # collective (FSDP2 all-gathers)
            reference_logits = reference(input_ids=ids).logits
        result = {
            "names_equal": sorted(full) == sorted(n for n, _ in reference.named_parameters()),
            "weights_equal": all(torch.equal(full[n], p) for n, p in reference.named_parameters()),
            "buffers_equal": all(torch.equal(model.get_buffer(n), b) for n, b in reference.named_buffers()),
            "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "reference_tied": reference.lm_head.weight is reference.model.embed_tokens.weight,
            "local_rows": local_rows,
            "full_rows": {n: int(p.shape[0]) for n, p in reference.named_parameters()},
            "logits_max_diff": float((logits - reference_logits).abs().max()),
            "pad_token": tokenizer.pad_token,
        }
        (out / f"{index}-rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_the_trainer_model_loads_shard_by_shard(tmp_path):
    from llamarl.models.export import export_hf

    untied = save_tiny_model(tmp_path / "untied")
    tied = tmp_path / "tied"
    export_hf(tied, model=build_tiny_llama(seed=3, vocab_size=128, tie_word_embeddings=True),
              tokenizer=tiny_tokenizer(), writer=True, max_shard_bytes=20_000)
    assert len(list(tied.glob("model-*.safetensors"))) > 1
    check(run_torchrun(WORLD, nproc=3, args=[str(tmp_path), str(untied), str(tied)], timeout_s=180))
    for index, is_tied in ((0, False), (1, True)):
        results = [json.loads((tmp_path / f"{index}-rank{r}.json").read_text()) for r in range(3)]
        for result in results:
            assert result["names_equal"] and result["weights_equal"] and result["buffers_equal"], result
            assert result["tied"] == result["reference_tied"] == is_tied
            assert result["logits_max_diff"] <= 1e-5
            assert result["pad_token"] is not None
        for name, full_rows in results[0]["full_rows"].items():
            rows = [result["local_rows"][name] for result in results]
            assert sum(rows) == full_rows and max(rows) < full_rows, (name, rows)  # nobody holds it whole


if __name__ == "__main__":
    world_main()
