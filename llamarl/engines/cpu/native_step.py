"""All the decoder layers of a bf16 CPU decode step in one C call (``csrc/decode_step.c``).

``FusedDecoder._step_native`` runs a step's layers through the C kernels; called kernel by kernel
that is ~8 Python calls per layer (240 for SmolLM2), each a few microseconds of interpreter, more
when each projection has just streamed megabytes of weights through the caches, and with more than
one thread a fork and join of the OpenMP team per call. ``decode_layers`` makes it one call: the
same kernel bodies in the same order (so the same bits, tested), the team forked once per step.
Measured on SmolLM2-135M-Instruct, bf16, Intel Xeon with AMX: see docs/benchmarks.md.

What it checks: everything the C code indexes, before it runs. The per-layer tables (packed
weights, biases, norm weights, KV caches) are checked when they are built (``LayerTables``; the
caller rebuilds them when one of those tensors is another object); each step checks its own.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from llamarl.engines.cpu import cpu_kernels

_TABLES = ("qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "gate_up_b", "down_w", "down_b", "input_norm", "post_norm",
           "keys", "values", "q_norm", "k_norm")
"""The rows of the per-layer address table, in ``csrc/decode_step.c``'s order."""


class _Args(ctypes.Structure):
    """``decode_layers_args`` of ``csrc/decode_step.c``, field for field."""

    _fields_ = [(name, ctypes.c_int64) for name in ("rows", "layers", "dim", "heads", "kv_heads", "head_dim", "width",
                                                    "inter", "threads", "amx")] \
        + [("eps", ctypes.c_float), ("scaling", ctypes.c_float)] \
        + [(name, ctypes.c_void_p) for name in ("hidden", "x", "qkv", "attended", "delta", "gate_up", "act", "cos",
                                                "sin", "final_norm", "positions", "scratch", "tables")]


def available() -> bool:
    """True when the library here has the whole-step entry point's GEMM (AVX512-BF16 or AMX)."""
    return cpu_kernels.gemm_available()


def padded_rows(rows: int) -> int:
    """Rows the buffers the GEMMs read (x, attended, act) must hold: ``rows`` rounded up to 16 (the
    AMX tiles read 16 rows at a time)."""
    return -(-rows // 16) * 16


@dataclass(frozen=True)
class Shape:
    """A decoder's dimensions, as the C code takes them."""

    dim: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int

    @property
    def qkv_width(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim


class LayerTables:
    """The address table of every layer's tensors (``_TABLES``), checked once: ``projections`` are
    per layer the packed ``(weight, bias)`` of q/k/v, o, gate/up and down; ``norms`` per layer
    (input, post-attention); ``keys`` / ``values`` the layers' caches ``[capacity, kv_heads, width,
    head_dim]``; ``qk_norms`` per layer the (q_norm, k_norm) weights ``[head_dim]`` of a model that
    normalizes its query and key heads (Qwen3), or None. Holds the tensors (``held``), so an address
    in the table stays valid while it lives."""

    def __init__(self, *, shape: Shape, projections: list, norms: list[tuple[torch.Tensor, torch.Tensor]],
                 keys: list[torch.Tensor], values: list[torch.Tensor],
                 qk_norms: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        layers = len(projections)
        if not (layers == len(norms) == len(keys) == len(values)) or layers < 1 or \
                (qk_norms is not None and len(qk_norms) != layers):
            raise ValueError(f"native_step: {layers} layers of projections, {len(norms)} of norms, {len(keys)} / "
                             f"{len(values)} of caches, {'no' if qk_norms is None else len(qk_norms)} of q / k norms")
        features = {"qkv": (shape.qkv_width, shape.dim), "o": (shape.dim, shape.heads * shape.head_dim),
                    "gate_up": (2 * shape.inter, shape.dim), "down": (shape.dim, shape.inter)}
        capacity, _, width, _ = keys[0].shape
        rows: dict[str, list[int]] = {name: [] for name in _TABLES}
        for index, (layer, (input_norm, post_norm), k, v) in enumerate(zip(projections, norms, keys, values)):
            for (name, (out_features, in_features)), (weight, bias) in zip(features.items(), layer, strict=True):
                if (weight.out_features, weight.in_features) != (out_features, in_features):
                    raise ValueError(f"native_step: layer {index}'s {name} projection is {weight.out_features} x "
                                     f"{weight.in_features}; the decoder's shape needs {out_features} x {in_features}")
                rows[f"{name}_w"].append(weight.data.data_ptr())
                rows[f"{name}_b"].append(0 if bias is None else cpu_kernels._checked(f"layer {index}'s {name} bias", bias,
                                                                                   (out_features,)))
            rows["input_norm"].append(cpu_kernels._checked(f"layer {index}'s input norm", input_norm, (shape.dim,)))
            rows["post_norm"].append(cpu_kernels._checked(f"layer {index}'s post norm", post_norm, (shape.dim,)))
            cache = (capacity, shape.kv_heads, width, shape.head_dim)
            rows["keys"].append(cpu_kernels._checked(f"layer {index}'s keys", k, cache))
            rows["values"].append(cpu_kernels._checked(f"layer {index}'s values", v, cache))
            for name, weight in zip(("q_norm", "k_norm"), qk_norms[index] if qk_norms is not None else (None, None)):
                rows[name].append(0 if weight is None else cpu_kernels._checked(f"layer {index}'s {name}", weight,
                                                                              (shape.head_dim,)))
        self.shape, self.capacity, self.width, self.num_layers = shape, capacity, width, layers
        self.held = (projections, norms, list(keys), list(values), qk_norms)
        # On the caches' device (the CPU, checked above): never the default device, which a run's
        # device guard points at the meta device.
        self.table = torch.tensor([rows[name] for name in _TABLES], dtype=torch.int64, device=keys[0].device)


def decode_layers(tables: LayerTables, *, hidden: torch.Tensor, buffers: dict[str, torch.Tensor],
                  cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, final_norm: torch.Tensor,
                  eps: float, scaling: float, scratch: torch.Tensor) -> None:
    """Run every layer of a decode step (``csrc/decode_step.c``): ``hidden`` ``[rows, dim]`` (bf16)
    becomes the residual stream after the last layer, in place, and ``buffers["x"]`` its final norm
    (the LM head's input). ``buffers``: bf16 ``x`` / ``delta`` ``[>= padded_rows(rows), dim]``,
    ``qkv``, ``attended``, ``gate_up``, ``act``, each of their width and at least ``padded_rows``
    rows (its first ``rows`` rows used; ``x``, ``attended`` and ``act`` are read in place by the
    GEMMs, up to ``padded_rows``); ``cos`` / ``sin`` ``[rows, head_dim]``; ``positions`` int64
    ``[rows]``, each row's column in the caches; ``scratch`` fp32, at least ``threads x
    attention_scratch`` floats. Raises ``ValueError`` before anything is written on a bad input."""
    library = cpu_kernels._need()
    shape = tables.shape
    rows = hidden.shape[0] if hidden.dim() == 2 else -1
    if not 1 <= rows <= tables.capacity:
        raise ValueError(f"native_step: {rows} rows for caches of {tables.capacity} slots")
    padded, threads = padded_rows(rows), cpu_kernels._threads()
    widths = {"x": shape.dim, "delta": shape.dim, "qkv": shape.qkv_width, "attended": shape.heads * shape.head_dim,
              "gate_up": 2 * shape.inter, "act": shape.inter}
    pointers = {}
    for name, width in widths.items():
        buffer = buffers[name]
        if buffer.dim() != 2 or buffer.shape[0] < padded:
            raise ValueError(f"native_step: buffer {name} has shape {tuple(buffer.shape)}; {rows} rows need "
                             f"[>= {padded}, {width}]")
        pointers[name] = cpu_kernels._checked(f"buffer {name}", buffer, (buffer.shape[0], width))
    per_thread = cpu_kernels.attention_scratch(num_heads=shape.heads, num_kv_heads=shape.kv_heads,
                                               head_dim=shape.head_dim, width=tables.width)
    if scratch.dtype != torch.float32 or not scratch.is_contiguous() or scratch.numel() < threads * per_thread \
            or scratch.device.type != "cpu":
        raise ValueError(f"native_step: scratch must be a contiguous fp32 CPU tensor of >= {threads * per_thread} "
                         f"floats; got {scratch.numel()} {scratch.dtype}")
    args = _Args(rows=rows, layers=tables.num_layers, dim=shape.dim, heads=shape.heads, kv_heads=shape.kv_heads,
                 head_dim=shape.head_dim, width=tables.width, inter=shape.inter, threads=threads,
                 amx=int(library.amx_ready), eps=eps, scaling=scaling,
                 hidden=cpu_kernels._checked("hidden", hidden, (rows, shape.dim)),
                 cos=cpu_kernels._checked("cos", cos, (rows, shape.head_dim)),
                 sin=cpu_kernels._checked("sin", sin, (rows, shape.head_dim)),
                 final_norm=cpu_kernels._checked("final norm", final_norm, (shape.dim,)),
                 positions=cpu_kernels._checked("positions", positions, (rows,), torch.int64),
                 scratch=scratch.data_ptr(), tables=tables.table.data_ptr(), **pointers)
    status = library.llamarl_decode_layers_bf16(ctypes.byref(args))
    if status == 1:
        raise ValueError(f"native_step: a position in {positions.tolist()} is outside the caches' {tables.width} "
                         f"columns")
    if status != 0:
        raise RuntimeError(f"native_step: the step's kernels refused its shapes (status {status}: head dimension "
                           f"{shape.head_dim} over 512, or a library without a GEMM)")
