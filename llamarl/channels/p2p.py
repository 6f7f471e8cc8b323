"""Point-to-point exchange of TensorBatches between global ranks, without pickle.

One ``exchange`` call moves any number of batches between any pairs of ranks in three rounds of
``batch_isend_irecv``: sizes (int64[2]: header bytes, data bytes), headers (uint8 JSON) and data
(one flat uint8 buffer per batch). Every rank names what it sends and from whom it receives,
so both sides post matching operations and nothing waits on an unexpected message.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llamarl.runtime.batch import MAX_DATA_BYTES, MAX_HEADER_BYTES, TensorBatch, check_wire_sizes


def _run(ops: list[dist.P2POp]) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def exchange(
    sends: dict[int, TensorBatch],
    recv_from: list[int],
    *,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    label: str = "channel",
    max_data_bytes: int = MAX_DATA_BYTES,
) -> dict[int, TensorBatch]:
    """Send ``sends[dst]`` to each global rank ``dst`` and receive one batch from each ``recv_from``.

    All ranks taking part must call this with matching arguments (a rank that sends to ``r``
    must appear in ``r``'s ``recv_from``). Buffers are staged on ``device``: ``ctx.device``, i.e.
    CUDA under NCCL (which moves device memory only) and the host under gloo, and the received
    batches stay there (no device -> host -> device round trip). Every operation goes through
    ``group`` (None: WORLD), ranks staying global: ``ctx.link_group(peer)``, the GPU-only group of a
    mixed world between two GPU executors (``llamarl/runtime/placement.py``: ``p2p_group``). Returns
    ``{src: batch}``.

    A malformed size, header or buffer from a peer raises ``WireFormatError`` naming ``label`` and
    the source rank; the announced sizes are checked against ``MAX_HEADER_BYTES`` and
    ``max_data_bytes`` before any receive buffer is allocated. A batch of our own over those
    limits raises ``ValueError`` here after its sizes went out, so its receivers raise too rather
    than wait for it.
    """
    encoded = {dst: batch.encode(device=device) for dst, batch in sends.items()}
    size_out = {dst: torch.tensor([h.numel(), d.numel()], dtype=torch.int64, device=device)
                for dst, (h, d) in encoded.items()}
    size_in = {src: torch.zeros(2, dtype=torch.int64, device=device) for src in recv_from}
    _run([dist.P2POp(dist.isend, t, dst, group=group) for dst, t in size_out.items()]
         + [dist.P2POp(dist.irecv, t, src, group=group) for src, t in size_in.items()])

    for dst, (h, d) in encoded.items():
        if h.numel() > MAX_HEADER_BYTES or d.numel() > max_data_bytes:
            raise ValueError(f"{label}: the batch for rank {dst} has a {h.numel()}-byte header and "
                             f"{d.numel()} data bytes, over the limits {MAX_HEADER_BYTES} / {max_data_bytes}")
    # Checked before the header and data buffers below are allocated from these numbers.
    sizes = {src: check_wire_sizes(*t.tolist(), source=f"{label} from rank {src}",
                                   max_data_bytes=max_data_bytes)
             for src, t in size_in.items()}

    headers_in = {src: torch.empty(h, dtype=torch.uint8, device=device) for src, (h, _) in sizes.items()}
    _run([dist.P2POp(dist.isend, h.to(device), dst, group=group) for dst, (h, _) in encoded.items()]
         + [dist.P2POp(dist.irecv, t, src, group=group) for src, t in headers_in.items()])

    data_in = {src: torch.empty(d, dtype=torch.uint8, device=device) for src, (_, d) in sizes.items()}
    # Zero-byte messages are legal on gloo but not on every backend: skip them on both sides.
    _run([dist.P2POp(dist.isend, d.to(device), dst, group=group) for dst, (_, d) in encoded.items() if d.numel() > 0]
         + [dist.P2POp(dist.irecv, t, src, group=group) for src, t in data_in.items() if t.numel() > 0])

    # The JSON header is parsed on the host; the data buffer stays on ``device``.
    return {src: TensorBatch.decode(headers_in[src].cpu(), data_in[src], source=f"{label} from rank {src}")
            for src in recv_from}
