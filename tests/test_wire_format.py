"""Malformed or oversized wire messages: always a one-line WireFormatError naming the channel and peer.

Unit tests feed ``TensorBatch.decode`` and ``check_wire_sizes`` hostile input directly; one real
2-rank gloo world (spawned here) drives a ``CommunicationChannel`` against a forging peer, to show
the channel's receive path names itself and refuses an oversized announcement before allocating.
"""

import json
import re
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llamarl.channels.base import BROADCAST, CommunicationChannel
from llamarl.runtime.batch import (
    MAX_DATA_BYTES,
    MAX_HEADER_BYTES,
    MAX_METADATA_DEPTH,
    TensorBatch,
    WireFormatError,
    check_wire_sizes,
)
from llamarl.runtime.world import ExecutorContext

SOURCE = "channel 'rollouts' from rank 3"


def field_header(**overrides) -> bytes:
    """A valid one-field header (uint8 'a' of shape [2] at offset 0) with some keys overridden."""
    spec = {"name": "a", "dtype": "uint8", "shape": [2], "offset": 0, "nbytes": 2} | overrides
    return json.dumps({"version": 1, "fields": [spec], "metadata": {}}).encode()


def nested_metadata_header(depth: int) -> bytes:
    return b'{"version": 1, "fields": [], "metadata": {"a": ' + b"[" * depth + b"]" * depth + b"}}"


def decode(header_bytes: bytes, data: torch.Tensor | None = None) -> TensorBatch:
    header = torch.tensor(list(header_bytes), dtype=torch.uint8)
    data = torch.zeros(16, dtype=torch.uint8) if data is None else data
    return TensorBatch.decode(header, data, source=SOURCE)


def assert_one_line_naming_source(err: WireFormatError) -> None:
    message = str(err)
    assert message.startswith(f"{SOURCE}: "), message
    assert "\n" not in message and len(message) < 400, message


BAD_HEADERS = {
    "shape [0, 2**70]": field_header(shape=[0, 2**70], nbytes=0),
    "shape [0, 2**62, 4] (too many elements)": field_header(shape=[0, 2**62, 4], nbytes=0),
    "negative dim": field_header(shape=[-2], nbytes=0),
    "negative dim times negative dim": field_header(shape=[-1, -2]),
    "float dim": field_header(shape=[2.0]),
    "infinite dim": field_header(shape=[1], nbytes=2).replace(b"[1]", b"[Infinity]"),
    "bool dim": field_header(shape=[True, True], nbytes=1),
    "string shape": field_header(shape="2"),
    "0-d shape": field_header(shape=[], nbytes=1),
    "65 dims": field_header(shape=[1] * 65, nbytes=1),
    "huge int dim": field_header(shape=[1], nbytes=2).replace(b"[1]", b"[" + b"9" * 5000 + b"]"),
    "negative offset": field_header(offset=-1),
    "string nbytes": field_header(nbytes="2"),
    "bool nbytes": field_header(shape=[1], nbytes=True),
    "past the buffer": field_header(offset=15),
    "nbytes not shape x itemsize": field_header(dtype="float32"),
    "unknown dtype": field_header(dtype="object"),
    "unhashable dtype": field_header(dtype=["uint8"]),
    "non-string name": field_header(name=7),
    "field spec not an object": json.dumps({"version": 1, "fields": [3], "metadata": {}}).encode(),
    "duplicate field": json.dumps({"version": 1, "metadata": {}, "fields": [
        {"name": "a", "dtype": "uint8", "shape": [2], "offset": 0, "nbytes": 2}] * 2}).encode(),
    "header is a list": b"[1, 2]",
    "version true": json.dumps({"version": True, "fields": [], "metadata": {}}).encode(),
    "metadata a list": json.dumps({"version": 1, "fields": [], "metadata": []}).encode(),
    "string fields not a list": json.dumps({"version": 1, "fields": [],
                                            "metadata": {"__string_fields__": 5}}).encode(),
    "metadata nested 10000 deep": nested_metadata_header(10_000),
    "metadata nested 500 deep": nested_metadata_header(500),
    "not UTF-8": b"\xff\xfe{}",
    "truncated JSON": b'{"version": 1, "fields": [',
    "empty header": b"",
}


@pytest.mark.parametrize("header_bytes", BAD_HEADERS.values(), ids=BAD_HEADERS.keys())
def test_every_malformed_header_is_a_one_line_wire_format_error(header_bytes):
    with pytest.raises(WireFormatError) as info:
        decode(header_bytes)
    assert_one_line_naming_source(info.value)


def test_the_reported_cases_name_what_is_wrong():
    with pytest.raises(WireFormatError, match=r"shape \[0, 1180591620717411303424\] is not a list"):
        decode(field_header(shape=[0, 2**70], nbytes=0))
    with pytest.raises(WireFormatError, match="nested too deeply"):
        decode(nested_metadata_header(10_000))
    with pytest.raises(WireFormatError, match=f"deeper than {MAX_METADATA_DEPTH} levels"):
        decode(nested_metadata_header(MAX_METADATA_DEPTH))  # plus the metadata dict: one level too many


def test_bad_bool_bytes_and_bad_buffers_are_rejected():
    with pytest.raises(WireFormatError, match="bytes other than 0 and 1") as info:
        decode(field_header(dtype="bool"), torch.tensor([1, 2], dtype=torch.uint8))
    assert_one_line_naming_source(info.value)
    with pytest.raises(WireFormatError, match="data must be a 1-D uint8") as info:
        decode(field_header(), torch.zeros(4))
    with pytest.raises(WireFormatError, match="header must be a 1-D uint8"):
        TensorBatch.decode(torch.zeros(MAX_HEADER_BYTES + 1, dtype=torch.uint8),
                           torch.zeros(0, dtype=torch.uint8))


def test_the_deepest_allowed_metadata_round_trips_and_deeper_is_refused_when_encoding():
    deepest: object = []
    for _ in range(MAX_METADATA_DEPTH - 2):
        deepest = [deepest]
    batch = TensorBatch({"x": torch.arange(3)}, {"deep": deepest})  # the dict itself is level 1
    decoded = TensorBatch.decode(*batch.encode(), source=SOURCE)
    assert decoded.metadata == batch.metadata and torch.equal(decoded["x"], batch["x"])
    with pytest.raises(ValueError, match="nests deeper"):
        TensorBatch({}, {"deep": [deepest]}).encode()
    looped: dict = {}
    looped["self"] = looped
    with pytest.raises(ValueError, match="nests deeper"):  # not RecursionError
        TensorBatch({}, looped).encode()


def test_empty_fields_with_large_dims_still_round_trip():
    batch = TensorBatch({"e": torch.empty(0, 1 << 40, dtype=torch.int64)})
    assert TensorBatch.decode(*batch.encode())["e"].shape == (0, 1 << 40)


@pytest.mark.parametrize("header_bytes, data_bytes, match", [
    (0, 0, "header of 0 bytes"),
    (-5, 0, "header of -5 bytes"),
    (MAX_HEADER_BYTES + 1, 0, f"header of {MAX_HEADER_BYTES + 1} bytes"),
    (100, -1, "announced -1 data bytes"),
    (100, 1 << 40, "announced 1099511627776 data bytes"),
    (100, MAX_DATA_BYTES + 1, "refused before allocating"),
])
def test_announced_sizes_are_checked(header_bytes, data_bytes, match):
    with pytest.raises(WireFormatError, match=match) as info:
        check_wire_sizes(header_bytes, data_bytes, source=SOURCE)
    assert_one_line_naming_source(info.value)


def test_announced_sizes_within_the_limits_pass():
    assert check_wire_sizes(1, 0, source=SOURCE) == (1, 0)
    limits = (MAX_HEADER_BYTES, MAX_DATA_BYTES)
    assert check_wire_sizes(*limits, source=SOURCE) == limits
    assert check_wire_sizes(10, 64, source=SOURCE, max_data_bytes=64) == (10, 64)
    with pytest.raises(WireFormatError, match="outside 0..63"):
        check_wire_sizes(10, 64, source=SOURCE, max_data_bytes=63)


def test_channel_rejects_a_bad_limit():
    with pytest.raises(ValueError, match="max_data_bytes"):
        CommunicationChannel("rollouts", "a", "b", max_data_bytes=-1)
    assert CommunicationChannel("rollouts", "a", "b").max_data_bytes == MAX_DATA_BYTES


# ----- a real 2-rank gloo world: rank 0 receives on channel 'rollouts', rank 1 sends or forges -----

LIMIT = 4096  # the channel's max_data_bytes in the world below


def world_batch(rows: int) -> TensorBatch:
    batch = TensorBatch({"ids": torch.arange(rows * 4, dtype=torch.int64).reshape(rows, 4)}, {"step": 3})
    batch.set_strings("text", [f"row {i} é" for i in range(rows)])
    return batch


class Endpoint:
    """The executor on either end: rank 1 outputs ``self.outgoing``, rank 0 keeps what arrives."""

    def __init__(self) -> None:
        self.outgoing, self.received = TensorBatch(), None

    def get_output(self, name: str) -> TensorBatch:
        return self.outgoing

    def set_input(self, name: str, batch: TensorBatch) -> None:
        self.received = batch


def forge(sizes: list[int], header: bytes = b"") -> None:
    """Post, as rank 1, exactly the size (and header) messages of a forged exchange to rank 0."""
    messages = [torch.tensor(sizes, dtype=torch.int64)]
    if header:
        messages.append(torch.tensor(list(header), dtype=torch.uint8))
    for tensor in messages:
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, 0)]):
            work.wait()


def world_main(rank: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    largest = [0]
    real_empty = torch.empty

    def recording_empty(*args, **kwargs):
        # Every receive buffer comes from torch.empty: record the largest one ever asked for.
        size = args[0] if args else kwargs.get("size", 0)
        largest[0] = max(largest[0], size if isinstance(size, int) else 0)
        return real_empty(*args, **kwargs)

    torch.empty = recording_empty
    ctx = ExecutorContext(rank=rank, world_size=2, executor="b" if rank == 0 else "a", ranks={"a": [1], "b": [0]},
                          group=None, mesh=None, device=torch.device("cpu"))
    channel = CommunicationChannel("rollouts", "a", "b", BROADCAST, max_data_bytes=LIMIT)
    endpoint = Endpoint()
    results = {}
    cases = {
        "round_trip": lambda: setattr(endpoint, "outgoing", world_batch(5)),
        "oversize_announced": lambda: forge([64, 1 << 40]),
        "negative_announced": lambda: forge([64, -8]),
        "huge_shape": lambda: forge([len(h := field_header(shape=[0, 2**70], nbytes=0)), 0], h),
        "deep_metadata": lambda: forge([len(h := nested_metadata_header(10_000)), 0], h),
        "sender_over_limit": lambda: setattr(endpoint, "outgoing", world_batch(200)),
    }
    for case, act_as_sender in cases.items():
        start, largest[0] = time.perf_counter(), 0
        try:
            if rank == 1:
                act_as_sender()
                if case in ("round_trip", "sender_over_limit"):
                    channel.communicate(ctx, endpoint)
            else:
                channel.communicate(ctx, endpoint)
            results[case] = {"ok": True}
        except Exception as exc:  # noqa: BLE001 - the test inspects every outcome
            results[case] = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
        results[case] |= {"seconds": time.perf_counter() - start, "largest_empty": largest[0]}
        dist.barrier()
    if rank == 0:
        header, data = endpoint.received.encode()
        Path(out, "received.header").write_bytes(bytes(header.tolist()))
        Path(out, "received.data").write_bytes(bytes(data.tolist()))
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("wire_world")
    mp.spawn(world_main, args=(str(out),), nprocs=2, join=True)
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_channel_round_trip_under_a_limit(world):
    out, (receiver, sender) = world
    assert receiver["round_trip"]["ok"] and sender["round_trip"]["ok"]
    got = TensorBatch.decode(torch.tensor(list((out / "received.header").read_bytes()), dtype=torch.uint8),
                             torch.tensor(list((out / "received.data").read_bytes()), dtype=torch.uint8))
    sent = world_batch(5)
    assert torch.equal(got["ids"], sent["ids"]) and got.get_strings("text") == sent.get_strings("text")


@pytest.mark.parametrize("case, match", [
    ("oversize_announced", "announced 1099511627776 data bytes, outside 0..4096"),
    ("negative_announced", "announced -8 data bytes"),
    ("huge_shape", r"field 'a': shape \[0, 1180591620717411303424\]"),
    ("deep_metadata", "nested too deeply"),
    ("sender_over_limit", "data bytes, outside 0..4096"),
])
def test_channel_receiver_raises_wire_format_error_naming_channel_and_peer(world, case, match):
    _, (receiver, _) = world
    result = receiver[case]
    assert not result["ok"] and result["type"] == "WireFormatError", result
    assert result["message"].startswith("channel 'rollouts' from rank 1: "), result["message"]
    assert re.search(match, result["message"]), result["message"]
    assert "\n" not in result["message"]


def test_oversize_is_refused_before_allocating(world):
    _, (receiver, _) = world
    # 1 TiB was announced: refused at once, before even the header buffer was allocated.
    assert receiver["oversize_announced"]["seconds"] < 10
    assert receiver["oversize_announced"]["largest_empty"] == 0
    assert receiver["round_trip"]["largest_empty"] > 0  # what is recorded: the receive buffers


def test_a_sender_over_the_limit_raises_too_instead_of_hanging(world):
    _, (_, sender) = world
    result = sender["sender_over_limit"]
    assert not result["ok"] and result["type"] == "ValueError", result
    assert result["message"].startswith("channel 'rollouts': the batch for rank 0"), result["message"]
