"""Per-layer activation checkpointing under FSDP2: the same names, log-probs and gradients.

usage: checkpointing_world.py --out OUT.json   (under torchrun, 2 ranks, gloo)

Every rank builds the tiny Llama (seed 0, fp32) and computes, as the unsharded single-process
reference, the trainer's shared-prefix log-probs of one batch (a 4D mask, the chunked head) and the
gradients of a weighted sum of them. Then, for an FSDP2 world of 2 (both ranks) and of 1 (each rank
alone, a mesh over its own rank), it shards fresh copies with ``activation_checkpointing`` False and
True, runs the same batch (the same on every rank, so FSDP2's averaged gradients are the batch's),
and records: parameter names (``named_parameters`` and ``get_model_state_dict``), the largest
difference of log-probs and of the whole gradients from the reference, and how many times each
decoder layer's MLP started (2 per step when checkpointed: the forward and its recompute); and
checkpointed with each layer compiled (``compile_backend="aot_eager"``: ``--trainer.compile layers``,
shared-prompt segment attention a graph break). Rank 0 writes ``{"<world>-<off|on|compiled>": {...}}``
to OUT.
"""

import argparse
import json

import torch
import torch.distributed as dist
from tiny_model import build_tiny_llama
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from llamarl.models.sharding import decoder_layers, is_compiled, shard_model
from llamarl.models.shared_prefix import shared_prefix_logprobs


def batch():
    gen = torch.Generator().manual_seed(3)
    rows, width = 4, 14
    ids = torch.randint(3, 120, (rows, width), generator=gen)
    ids[1, :5] = ids[0, :5]  # a group: rows 0 and 1 share their 5-token prompt
    lengths = torch.tensor([12, 14, 9, 11])
    attention = (torch.arange(width) < lengths[:, None]).long()
    loss_mask = attention.clone()
    loss_mask[:, :5] = 0
    weights = torch.randn(rows, width + 1, generator=gen)
    return ids, attention, loss_mask, weights


def step(model, data):
    """Log-probs and the whole gradients of one backward (collective for a sharded model)."""
    ids, attention, loss_mask, weights = data
    model.train()
    logp = shared_prefix_logprobs(model, ids, attention, loss_mask, temperature=0.8, chunk_tokens=8)
    (logp * weights[:, : logp.shape[1]]).sum().backward()
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
             for name, p in model.named_parameters()}
    return logp.detach(), grads


def count_mlp_calls(model) -> list[int]:
    """A list that counts, per decoder layer, the starts of its MLP's forward from now on."""
    calls = [0] * len(decoder_layers(model))
    for i, layer in enumerate(decoder_layers(model)):
        # A pre-hook: the recompute stops early, once the last tensor the backward needs is back,
        # before the MLP's forward returns (a forward hook would not see it).
        layer.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def largest(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    data = batch()
    reference = build_tiny_llama(seed=0)
    names = [name for name, _ in reference.named_parameters()]
    ref_logp, ref_grads = step(reference, data)
    results = {}
    meshes = {"world2": DeviceMesh("cpu", [0, 1])}
    for r in range(dist.get_world_size()):  # new_group is collective: every rank creates every 1-rank mesh
        mesh = DeviceMesh("cpu", [r])
        if r == rank:
            meshes["world1"] = mesh
    for world, mesh in meshes.items():
        for mode in ("off", "on", "compiled"):
            model = shard_model(build_tiny_llama(seed=0), mesh, activation_checkpointing=mode != "off",
                                compile_backend="aot_eager" if mode == "compiled" else None)
            mlp_calls = count_mlp_calls(model) if mode != "compiled" else None  # hooks traced: not counted
            logp, grads = step(model, data)
            results[f"{world}-{mode}"] = {
                "names_equal": [n for n, _ in model.named_parameters()] == names,
                "state_dict_names_equal": sorted(get_model_state_dict(model)) == sorted(names),
                "logp_diff": (logp - ref_logp).abs().max().item(), "grad_diff": largest(grads, ref_grads),
                "largest_grad": max(g.abs().max().item() for g in ref_grads.values()), "mlp_calls": mlp_calls,
                "compiled": all(is_compiled(layer) for layer in decoder_layers(model))}
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
