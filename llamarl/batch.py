"""TensorBatch: the typed payload every data channel carries, and its pickle-free wire format.

A batch is a set of named tensors that share a leading (row) dimension plus a small
JSON-serialisable metadata dict. Strings travel as UTF-8 byte tensors (``set_strings`` /
``get_strings``). On the wire a batch is a JSON header (field names, dtypes, shapes, byte
offsets, metadata) encoded as a uint8 tensor, followed by one flat uint8 buffer holding every
field's bytes. Decoding only ever parses JSON and reinterprets bytes with a whitelisted dtype,
so a peer cannot make this rank execute code by sending data.

Conventions other modules rely on:

- ``group_ids`` (int64 [N]): rows with the same value are samples of one prompt; SCATTER never
  splits them.
- ``num_tokens`` (int64 [N]): per-row token count used to balance SCATTER; 1 per row if absent.
- ``balance_tokens`` (int64 [N], optional): overrides ``num_tokens`` for balancing only.
- Ragged fields (token sequences, strings) are right-padded 2-D tensors; ``concat`` pads the
  second dimension with zeros to the widest input, so carry a length or mask field alongside.

Devices: a batch's fields live on one device (``device``; CPU for an empty batch). Helpers create
their tensors on that device explicitly, never on torch's default. ``encode(device=...)`` stages the
flat data buffer on the given device (CUDA under NCCL, CPU under gloo) and ``decode`` returns fields
on the device of the buffer it is given, so a payload crosses NCCL without a host round trip; only
the small JSON header always goes through the host.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

# Whitelist: the only dtypes a header may name. Keys are what goes on the wire.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_STRING_KEY = "__string_fields__"
MAX_HEADER_BYTES = 1 << 24


class WireFormatError(ValueError):
    """A received header or buffer is not a valid TensorBatch encoding."""


@dataclass
class TensorBatch:
    """Named tensors sharing a leading dimension, plus JSON metadata.

    ``fields`` maps a name to a tensor whose dim 0 is the row count; ``metadata`` must be
    JSON-serialisable (it is checked when encoded). An empty batch (no fields) has 0 rows.
    """

    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {name: t.shape[0] if t.dim() > 0 else None for name, t in self.fields.items()}
        for name, size in sizes.items():
            if size is None:
                raise ValueError(f"TensorBatch field {name!r} is 0-d; every field needs a leading row dim")
            if self.fields[name].dtype not in _DTYPE_NAMES:
                raise ValueError(f"TensorBatch field {name!r} has unsupported dtype {self.fields[name].dtype}")
        if len(set(sizes.values())) > 1:
            raise ValueError(f"TensorBatch fields disagree on the row count: {sizes}")

    # ----- shape -----
    def __len__(self) -> int:
        for tensor in self.fields.values():
            return tensor.shape[0]
        return 0

    @property
    def device(self) -> torch.device:
        """The device of the batch's fields (CPU for an empty batch)."""
        for tensor in self.fields.values():
            return tensor.device
        return torch.device("cpu")

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.fields[name]

    def __contains__(self, name: str) -> bool:
        return name in self.fields

    @property
    def string_fields(self) -> list[str]:
        return list(self.metadata.get(_STRING_KEY, []))

    # ----- strings -----
    def set_strings(self, name: str, values: list[str]) -> None:
        """Store ``values`` as a right-padded uint8 [N, L] field plus an int64 length field.

        The lengths live in ``f"{name}__nbytes"`` so any string (NUL bytes included) round-trips.
        """
        encoded = [v.encode("utf-8") for v in values]
        width = max((len(b) for b in encoded), default=0)
        # Strings are built on the host (from Python bytes), then join the batch's device.
        data = torch.zeros(len(encoded), width, dtype=torch.uint8, device="cpu")
        for row, raw in enumerate(encoded):
            if raw:
                data[row, : len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self.fields[name] = data.to(self.device)
        self.fields[f"{name}__nbytes"] = torch.tensor([len(b) for b in encoded], dtype=torch.int64, device=self.device)
        if name not in self.string_fields:
            self.metadata[_STRING_KEY] = self.string_fields + [name]
        self.__post_init__()

    def get_strings(self, name: str) -> list[str]:
        """Decode a field written by ``set_strings`` back into Python strings."""
        if name not in self.string_fields:
            raise KeyError(f"{name!r} is not a string field of this batch (have {self.string_fields})")
        data, lengths = self.fields[name], self.fields[f"{name}__nbytes"].tolist()
        return [bytes(data[row, :n].tolist()).decode("utf-8") for row, n in enumerate(lengths)]

    def to(self, device: torch.device | str) -> TensorBatch:
        """The same batch with every field on ``device`` (no copy for fields already there)."""
        return TensorBatch({k: v.to(device) for k, v in self.fields.items()}, dict(self.metadata))

    # ----- row helpers -----
    def select(self, indices: list[int] | torch.Tensor) -> TensorBatch:
        """Rows ``indices`` (in that order) of every field; metadata is shared (shallow copy)."""
        index = torch.as_tensor(indices, dtype=torch.long, device=self.device)
        return TensorBatch({k: v.index_select(0, index) for k, v in self.fields.items()}, dict(self.metadata))

    def split(self, sizes: list[int]) -> list[TensorBatch]:
        """Consecutive row chunks of the given sizes (which must sum to ``len(self)``)."""
        if sum(sizes) != len(self):
            raise ValueError(f"split sizes {sizes} do not sum to the batch's {len(self)} rows")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [self.select(list(range(s, s + n))) for s, n in zip(starts, sizes)]

    def row_token_counts(self) -> torch.Tensor:
        """Per-row token counts used for balancing: ``balance_tokens`` (the work a row will cost its
        consumer, e.g. 0 for a sample the trainer skips) if present, else ``num_tokens``, else ones."""
        if "balance_tokens" in self.fields:
            return self.fields["balance_tokens"].to(torch.int64)
        if "num_tokens" in self.fields:
            return self.fields["num_tokens"].to(torch.int64)
        return torch.ones(len(self), dtype=torch.int64, device=self.device)

    def row_group_ids(self) -> torch.Tensor:
        """Per-row prompt-group ids (``group_ids`` field, else every row its own group)."""
        if "group_ids" in self.fields:
            return self.fields["group_ids"].to(torch.int64)
        return torch.arange(len(self), dtype=torch.int64, device=self.device)

    @staticmethod
    def concat(batches: list[TensorBatch]) -> TensorBatch:
        """Row-wise concatenation; empty batches are ignored; ragged dim 1 is zero-padded.

        All non-empty batches must have the same field names and dtypes. Metadata is merged
        left to right (later keys win), except the string-field list, which is unioned.
        """
        non_empty = [b for b in batches if b.fields]
        metadata: dict[str, Any] = {}
        for b in batches:
            metadata.update({k: v for k, v in b.metadata.items() if k != _STRING_KEY})
        strings = sorted({s for b in batches for s in b.string_fields})
        if strings:
            metadata[_STRING_KEY] = strings
        if not non_empty:
            return TensorBatch({}, metadata)
        names = list(non_empty[0].fields)
        for b in non_empty[1:]:
            if set(b.fields) != set(names):
                raise ValueError(f"cannot concat batches with fields {sorted(names)} and {sorted(b.fields)}")
        out = {}
        for name in names:
            parts = [b.fields[name] for b in non_empty]
            if len({p.dtype for p in parts}) > 1:
                raise ValueError(f"cannot concat field {name!r}: dtypes {[p.dtype for p in parts]}")
            if parts[0].dim() >= 2 and len({p.shape[1] for p in parts}) > 1:
                width = max(p.shape[1] for p in parts)
                parts = [torch.nn.functional.pad(p, (0, 0) * (p.dim() - 2) + (0, width - p.shape[1])) for p in parts]
            out[name] = torch.cat(parts, dim=0)
        return TensorBatch(out, metadata)

    # ----- wire format -----
    def encode(self, *, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Encode into (header uint8 tensor on the host, data uint8 tensor on ``device``). See ``decode``."""
        specs, chunks, offset = [], [], 0
        for name, tensor in self.fields.items():
            raw = tensor.detach().to(device).contiguous().reshape(-1).view(torch.uint8)
            specs.append({"name": name, "dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                          "offset": offset, "nbytes": raw.numel()})
            chunks.append(raw)
            offset += raw.numel()
        try:
            text = json.dumps({"version": 1, "fields": specs, "metadata": self.metadata})
        except TypeError as exc:
            raise ValueError(f"TensorBatch metadata is not JSON-serialisable: {exc}") from None
        header = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
        data = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=device)
        return header, data

    @staticmethod
    def decode(header: torch.Tensor, data: torch.Tensor, *, source: str = "peer") -> TensorBatch:
        """Inverse of ``encode``; raises ``WireFormatError`` naming ``source`` on any bad input.

        ``header`` is read on the host; the fields are views-turned-copies of ``data`` on its device.
        """
        if header.dtype != torch.uint8 or header.dim() != 1 or header.numel() > MAX_HEADER_BYTES:
            raise WireFormatError(f"{source}: header must be a 1-D uint8 tensor of <= {MAX_HEADER_BYTES} bytes")
        try:
            spec = json.loads(bytes(header.tolist()).decode("utf-8"))
            fields_spec, metadata = spec["fields"], spec["metadata"]
            if spec.get("version") != 1 or not isinstance(fields_spec, list) or not isinstance(metadata, dict):
                raise ValueError("unexpected header layout")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise WireFormatError(f"{source}: invalid TensorBatch header ({exc})") from None
        fields: dict[str, torch.Tensor] = {}
        for item in fields_spec:
            try:
                name, dtype = str(item["name"]), DTYPES[item["dtype"]]
                shape = [int(s) for s in item["shape"]]
                offset, nbytes = int(item["offset"]), int(item["nbytes"])
            except (KeyError, TypeError, ValueError) as exc:
                raise WireFormatError(f"{source}: invalid field spec {item!r} ({exc!r})") from None
            numel = 1
            for s in shape:
                numel *= s
            itemsize = dtype.itemsize
            if min(shape, default=0) < 0 or numel * itemsize != nbytes or offset < 0 or offset + nbytes > data.numel():
                raise WireFormatError(f"{source}: field {name!r} shape {shape} / {nbytes} bytes does not fit the buffer")
            fields[name] = data[offset : offset + nbytes].clone().view(dtype).reshape(shape)
        try:
            return TensorBatch(fields, metadata)
        except ValueError as exc:
            raise WireFormatError(f"{source}: {exc}") from None
