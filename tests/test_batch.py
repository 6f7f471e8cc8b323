"""TensorBatch helpers and the pickle-free wire format: round-trip and rejection of bad input."""

import json

import pytest
import torch

from llamarl.runtime.batch import TensorBatch, WireFormatError


def sample_batch() -> TensorBatch:
    batch = TensorBatch({
        "ids": torch.arange(6, dtype=torch.int64).reshape(3, 2),
        "logp": torch.randn(3, 4).to(torch.bfloat16),
        "half": torch.randn(3).half(),
        "mask": torch.tensor([True, False, True]),
        "small": torch.tensor([[1], [2], [3]], dtype=torch.int8),
    }, {"step": 7, "tag": "x"})
    batch.set_strings("text", ["", "héllo\x00world", "数学"])
    return batch


def test_round_trip_keeps_every_dtype_shape_value_and_string():
    batch = sample_batch()
    decoded = TensorBatch.decode(*batch.encode())
    for name, tensor in batch.fields.items():
        assert decoded[name].dtype == tensor.dtype and torch.equal(decoded[name], tensor), name
    assert decoded.get_strings("text") == ["", "héllo\x00world", "数学"]
    assert decoded.metadata["step"] == 7


def test_empty_batch_round_trips():
    decoded = TensorBatch.decode(*TensorBatch({}, {"a": 1}).encode())
    assert len(decoded) == 0 and decoded.metadata == {"a": 1}


def test_concat_select_split():
    a, b = sample_batch(), sample_batch()
    b.fields["ids"] = torch.arange(9, dtype=torch.int64).reshape(3, 3)  # wider: padded on concat
    cat = TensorBatch.concat([a, TensorBatch(), b])
    assert len(cat) == 6 and cat["ids"].shape == (6, 3)
    assert torch.equal(cat["ids"][:3, 2], torch.zeros(3, dtype=torch.int64))
    assert cat.get_strings("text")[3:] == b.get_strings("text")
    first, second = cat.split([2, 4])
    assert len(first) == 2 and torch.equal(second["ids"], cat["ids"][2:])
    assert cat.select([5, 0]).get_strings("text") == [cat.get_strings("text")[5], ""]
    with pytest.raises(ValueError, match="do not sum"):
        cat.split([1, 1])


def test_mismatched_rows_and_bad_metadata_are_rejected():
    with pytest.raises(ValueError, match="row count"):
        TensorBatch({"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match="JSON"):
        TensorBatch({"a": torch.zeros(2)}, {"obj": object()}).encode()


@pytest.mark.parametrize("header_bytes", [
    b"\x80\x04\x95garbage",                       # a pickle stream is not a header
    b"not json",
    json.dumps({"version": 1, "fields": "x", "metadata": {}}).encode(),
    json.dumps({"version": 2, "fields": [], "metadata": {}}).encode(),
    json.dumps({"version": 1, "fields": [{"name": "a", "dtype": "object", "shape": [1],
                                          "offset": 0, "nbytes": 8}], "metadata": {}}).encode(),
    json.dumps({"version": 1, "fields": [{"name": "a", "dtype": "float32", "shape": [100],
                                          "offset": 0, "nbytes": 400}], "metadata": {}}).encode(),
    json.dumps({"version": 1, "fields": [{"name": "a", "dtype": "float32", "shape": [2],
                                          "offset": 0, "nbytes": 4}], "metadata": {}}).encode(),
])
def test_invalid_headers_fail_with_a_clear_error(header_bytes):
    header = torch.tensor(list(header_bytes), dtype=torch.uint8)
    with pytest.raises(WireFormatError, match="rank 5"):
        TensorBatch.decode(header, torch.zeros(16, dtype=torch.uint8), source="rank 5")


def test_wrong_header_dtype_is_rejected():
    with pytest.raises(WireFormatError):
        TensorBatch.decode(torch.zeros(4, dtype=torch.int32), torch.zeros(0, dtype=torch.uint8))
