"""TensorBatch: the typed payload every data channel carries, and its pickle-free wire format.

A batch is a set of named tensors that share a leading (row) dimension plus a small
JSON-serialisable metadata dict. Strings travel as UTF-8 byte tensors (``set_strings`` /
``get_strings``). On the wire a batch is a JSON header (field names, dtypes, shapes, byte
offsets, metadata) encoded as a uint8 tensor, followed by one flat uint8 buffer holding every
field's bytes. Decoding only ever parses JSON and reinterprets bytes with a whitelisted dtype,
so a peer cannot make this rank execute code by sending data. Every size and number a peer sends is
checked against bounds (``MAX_HEADER_BYTES``, ``MAX_DATA_BYTES``, ``MAX_METADATA_DEPTH``) before
it sizes an allocation; any violation is a one-line ``WireFormatError`` naming the source.

Conventions other modules rely on:

- ``group_ids`` (int64 [N]): rows with the same value are samples of one prompt; SCATTER never
  splits them.
- ``num_tokens`` (int64 [N]): per-row token count used to balance SCATTER; 1 per row if absent.
- ``balance_tokens`` (int64 [N], optional): overrides ``num_tokens`` for balancing only;
  ``set_balance_tokens`` sets it from ``rewards`` (0 for a group that scored alike).
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
import math
import reprlib
from collections.abc import Callable
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
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_STRING_KEY = "__string_fields__"

MAX_HEADER_BYTES = 1 << 24
"""Largest JSON header (16 MiB) a receiver accepts: field specs and metadata only, never tensor data."""

MAX_DATA_BYTES = 8 << 30
"""Default largest data buffer (8 GiB) a receiver allocates for one batch from one peer.

The receiver learns a batch's size from the peer and allocates the buffer before it can look at
the contents, so this bound is all that stands between a corrupt or hostile size and an
out-of-memory kill (or a GPU allocation that starves the model). 8 GiB is about ten times a
large rollout batch (1024 samples x 32k tokens x ids, log-probs and masks is ~0.8 GiB) while
still fitting beside a model on an 80 GB accelerator. Channels that need more raise their own
``max_data_bytes``.
"""

MAX_METADATA_DEPTH = 64
"""Deepest nesting of dicts / lists allowed in metadata (the metadata dict itself is level 1).

Deeper JSON would hit Python's recursion limit when parsed or re-encoded; real metadata (steps,
tags, weight layouts) nests a handful of levels.
"""

MAX_FIELD_DIMS = 64
"""Most dimensions a field's shape may have on the wire."""

_MAX_ELEMENTS = (1 << 63) - 1  # torch sizes are int64: larger shapes cannot even be described


class WireFormatError(ValueError):
    """A received size, header or buffer is not a valid TensorBatch encoding.

    The message is one line starting with the source it came from (e.g. ``channel 'rollouts'
    from rank 3``), so the bad peer is named without a traceback.
    """


def check_wire_sizes(header_bytes: int, data_bytes: int, *, source: str,
                     max_data_bytes: int = MAX_DATA_BYTES) -> tuple[int, int]:
    """Validate the (header, data) byte counts a peer announced, before anything is allocated.

    Returns them as ints. Raises ``WireFormatError`` naming ``source`` unless
    ``0 < header_bytes <= MAX_HEADER_BYTES`` and ``0 <= data_bytes <= max_data_bytes``.
    """
    if not 0 < header_bytes <= MAX_HEADER_BYTES:
        raise WireFormatError(f"{source}: announced a header of {header_bytes} bytes, "
                              f"outside 1..{MAX_HEADER_BYTES}")
    if not 0 <= data_bytes <= max_data_bytes:
        raise WireFormatError(f"{source}: announced {data_bytes} data bytes, outside 0..{max_data_bytes} "
                              f"(the receiver's max_data_bytes); refused before allocating")
    return int(header_bytes), int(data_bytes)


def _metadata_too_deep(metadata: Any, limit: int = MAX_METADATA_DEPTH) -> bool:
    """Whether dicts / lists nest deeper than ``limit``; iterative, so any depth is safe to check."""
    stack = [(metadata, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > limit:
                return True  # also ends the walk of a (sender-side) self-referencing structure
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, depth + 1) for child in children)
    return False


def _is_count(value: Any) -> bool:
    """A non-negative JSON integer (``bool`` is an ``int`` subclass in Python but not a count)."""
    return type(value) is int and value >= 0


_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother, _BRIEF.maxlong = 2, 60, 60, 40


def _brief(value: Any) -> str:
    """A short one-line repr of untrusted header content for error messages (never recurses deeply)."""
    return _BRIEF.repr(value)


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
            if self.fields[name].dtype not in DTYPE_NAMES:
                raise ValueError(f"TensorBatch field {name!r} has unsupported dtype "
                                 f"{self.fields[name].dtype}")
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
        self.fields[f"{name}__nbytes"] = torch.tensor([len(b) for b in encoded], dtype=torch.int64,
                                                      device=self.device)
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
                parts = [torch.nn.functional.pad(p, (0, 0) * (p.dim() - 2) + (0, width - p.shape[1]))
                         for p in parts]
            out[name] = torch.cat(parts, dim=0)
        return TensorBatch(out, metadata)

    # ----- wire format -----
    def encode(self, *, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Encode into (header uint8 tensor on the host, data uint8 tensor on ``device``). See ``decode``.

        Raises ``ValueError`` if the metadata is not JSON-serialisable or nests deeper than
        ``MAX_METADATA_DEPTH`` (the receiver would refuse it).
        """
        specs, chunks, offset = [], [], 0
        for name, tensor in self.fields.items():
            raw = tensor.detach().to(device).contiguous().reshape(-1).view(torch.uint8)
            specs.append({"name": name, "dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                          "offset": offset, "nbytes": raw.numel()})
            chunks.append(raw)
            offset += raw.numel()
        if _metadata_too_deep(self.metadata):
            raise ValueError(f"TensorBatch metadata nests deeper than {MAX_METADATA_DEPTH} levels")
        try:
            text = json.dumps({"version": 1, "fields": specs, "metadata": self.metadata})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"TensorBatch metadata is not JSON-serialisable: {exc}") from None
        header = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
        data = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=device)
        return header, data

    @staticmethod
    def decode(header: torch.Tensor, data: torch.Tensor, *, source: str = "peer") -> TensorBatch:
        """Inverse of ``encode``; raises a one-line ``WireFormatError`` naming ``source`` on any bad input.

        ``header`` (1-D uint8, at most ``MAX_HEADER_BYTES``) is read on the host; ``data`` (1-D uint8)
        stays on its device and the fields are copies of its slices. Every number in the header is
        checked before it sizes anything: each field needs a string name (no duplicates), a
        whitelisted dtype, a shape of 1 to ``MAX_FIELD_DIMS`` non-negative ints (bools and floats
        refused) describing at most 2**63-1 elements, and ``offset`` / ``nbytes`` that match the
        shape and lie inside ``data``; bool fields may only hold bytes 0 and 1. Metadata must be a
        JSON object nesting at most ``MAX_METADATA_DEPTH`` levels.
        """
        def bad(reason: str) -> WireFormatError:
            return WireFormatError(f"{source}: {reason}")

        if header.dtype != torch.uint8 or header.dim() != 1 or header.numel() > MAX_HEADER_BYTES:
            raise bad(f"header must be a 1-D uint8 tensor of <= {MAX_HEADER_BYTES} bytes, got {header.dtype} "
                      f"{list(header.shape)}")
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise bad(f"data must be a 1-D uint8 tensor, got {data.dtype} {list(data.shape)}")
        try:
            spec = json.loads(header.detach().cpu().contiguous().numpy().tobytes().decode("utf-8"))
        except RecursionError:
            # The C JSON parser recurses per nesting level; a deep header must not take this rank down.
            raise bad("invalid TensorBatch header (JSON nested too deeply)") from None
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise bad(f"invalid TensorBatch header ({exc})") from None
        if not isinstance(spec, dict) or type(spec.get("version")) is not int or spec["version"] != 1:
            raise bad("invalid TensorBatch header (not a version-1 header object)")
        fields_spec, metadata = spec.get("fields"), spec.get("metadata")
        if not isinstance(fields_spec, list) or not isinstance(metadata, dict):
            raise bad(f"invalid TensorBatch header ('fields' must be a list and 'metadata' an object, got "
                      f"{type(fields_spec).__name__} and {type(metadata).__name__})")
        if _metadata_too_deep(metadata):
            raise bad(f"invalid TensorBatch header (metadata nests deeper than {MAX_METADATA_DEPTH} levels)")
        strings = metadata.get(_STRING_KEY, [])
        if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
            raise bad(f"invalid TensorBatch header (metadata {_STRING_KEY!r} must be a list of strings)")
        fields: dict[str, torch.Tensor] = {}
        for item in fields_spec:
            name, dtype, shape, offset, nbytes = _check_field_spec(item, data.numel(), bad)
            if name in fields:
                raise bad(f"field {_brief(name)} appears twice")
            raw = data[offset : offset + nbytes]
            if dtype is torch.bool and bool((raw > 1).any()):
                raise bad(f"bool field {_brief(name)} holds bytes other than 0 and 1")
            fields[name] = raw.clone().view(dtype).reshape(shape)
        try:
            return TensorBatch(fields, metadata)
        except ValueError as exc:
            raise bad(str(exc)) from None


def set_balance_tokens(batch: TensorBatch) -> None:
    """Set ``balance_tokens`` from ``rewards``: 0 for every row of a prompt group whose samples all
    scored alike, else ``num_tokens``. Such a group has zero advantage, so the trainer does not
    forward it, and SCATTER balances trainer ranks by the tokens that will really be trained on.
    Any stage that sets or changes ``rewards``, or drops rows of a scored batch, calls it (the
    reward and reference executors, a recipe's filter or judge stage)."""
    group_ids, rewards = batch["group_ids"], batch["rewards"]
    same = torch.ones_like(group_ids, dtype=torch.bool)
    for gid in group_ids.unique().tolist():
        rows = group_ids == gid
        same[rows] = bool((rewards[rows] == rewards[rows][0]).all())
    batch.fields["balance_tokens"] = torch.where(same, torch.zeros_like(batch["num_tokens"]), batch["num_tokens"])


def _check_field_spec(item: Any, data_bytes: int,
                      bad: Callable[[str], WireFormatError]) -> tuple[str, torch.dtype, list[int], int, int]:
    """(name, dtype, shape, offset, nbytes) of one header field spec, or raise ``bad(reason)``.

    Checks run on Python ints only, before the numbers size or index any tensor.
    """
    if not isinstance(item, dict):
        raise bad(f"field spec must be an object, got {_brief(item)}")
    name, dtype_name, shape = item.get("name"), item.get("dtype"), item.get("shape")
    offset, nbytes = item.get("offset"), item.get("nbytes")
    if not isinstance(name, str):
        raise bad(f"field name must be a string, got {_brief(name)}")
    label = f"field {_brief(name)}"
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise bad(f"{label}: dtype {_brief(dtype_name)} is not one of {sorted(DTYPES)}")
    if (not isinstance(shape, list) or not 1 <= len(shape) <= MAX_FIELD_DIMS
            or not all(_is_count(s) and s <= _MAX_ELEMENTS for s in shape)):
        raise bad(f"{label}: shape {_brief(shape)} is not a list of 1 to {MAX_FIELD_DIMS} "
                  f"non-negative ints <= 2**63-1")
    # A zero dim makes the tensor empty whatever the others say, but torch still stores every dim as int64.
    if math.prod(s for s in shape if s) > _MAX_ELEMENTS:
        raise bad(f"{label}: shape {_brief(shape)} has more than 2**63-1 elements")
    if not _is_count(offset) or not _is_count(nbytes):
        raise bad(f"{label}: offset {_brief(offset)} and nbytes {_brief(nbytes)} must be non-negative ints")
    dtype = DTYPES[dtype_name]
    if math.prod(shape) * dtype.itemsize != nbytes or offset + nbytes > data_bytes:
        raise bad(f"{label}: shape {_brief(shape)} / {_brief(nbytes)} bytes at offset {_brief(offset)} "
                  f"does not fit the {data_bytes}-byte buffer")
    return name, dtype, shape, offset, nbytes
