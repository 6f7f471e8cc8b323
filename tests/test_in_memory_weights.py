"""The colocated weight hand-over (``InMemoryWeights``): written into the generator's model in place,
or, for a sink with ``weight_sink()`` (a vLLM generator: layout on the meta device), streamed one
full parameter at a time. One process (the FSDP gather of a world of one is the tensor itself); the
multi-rank gather is ``DTensor.full_tensor`` over the trainer's mesh, tested with DDMA in
tests/test_weights.py."""

from types import SimpleNamespace

import pytest
import torch
from tiny_model import build_tiny_llama

from llamarl.channels.in_memory import InMemoryWeights


class Source:
    def __init__(self, model, version):
        self.model, self.version = model, version

    def get_model(self):
        return self.model


class Sink:
    """A generator with no weights of its own: it keeps what each hand-over streams."""

    def __init__(self, layout, *, stop_after=None, raise_after=None):
        self.layout, self.stop_after, self.raise_after = layout, stop_after, raise_after
        self.ctx = SimpleNamespace(device=torch.device("cpu"))
        self.received, self.version, self.calls = {}, None, 0

    def get_model(self):
        return self.layout

    def weight_sink(self):
        def sink(named_tensors):
            self.calls += 1
            for index, (name, tensor) in enumerate(named_tensors):
                if index == self.stop_after:
                    return
                if index == self.raise_after:
                    raise ValueError("the engine refused a tensor")
                self.received[name] = tensor
        return sink

    def set_weights_version(self, version):
        self.version = version


def meta_layout(*, tied: bool, dtype: torch.dtype):
    layout = build_tiny_llama(seed=5, tie_word_embeddings=tied).to(dtype).to("meta")
    layout.tie_weights()
    return layout


@pytest.mark.parametrize("tied", [True, False])
def test_a_streaming_sink_gets_each_parameter_once_cast_to_its_dtype(tied):
    trainer = build_tiny_llama(seed=1, tie_word_embeddings=tied)
    sink = Sink(meta_layout(tied=tied, dtype=torch.bfloat16))
    channel = InMemoryWeights("weights", "trainer", "generator")
    channel.hand_over(Source(trainer, 3), sink)
    expected = dict(trainer.named_parameters())
    assert sorted(sink.received) == sorted(expected) and sink.version == 3
    for name, tensor in sink.received.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name].detach().to(torch.bfloat16))
        assert tensor.data_ptr() != expected[name].data_ptr()  # its own storage: a sink may keep it
    assert all(p.is_meta for p in sink.layout.parameters())
    assert channel.last_bytes_received == sum(p.numel() * 2 for p in expected.values())
    channel.hand_over(Source(trainer, 3), sink)  # the same version: nothing moves
    assert channel.last_skipped and sink.calls == 1 and channel.last_bytes_received == 0


def test_a_mismatched_layout_is_refused_before_anything_moves_and_an_early_stop_is_an_error():
    trainer = build_tiny_llama(seed=1)
    bad = Sink(build_tiny_llama(seed=5, vocab_size=130).to("meta"))
    with pytest.raises(ValueError, match="embed_tokens"):
        InMemoryWeights("weights", "trainer", "generator").hand_over(Source(trainer, 1), bad)
    assert bad.calls == 0 and bad.version is None
    early = Sink(meta_layout(tied=False, dtype=torch.float32), stop_after=2)
    with pytest.raises(RuntimeError, match="stopped"):
        InMemoryWeights("weights", "trainer", "generator").hand_over(Source(trainer, 1), early)
    assert len(early.received) == 2 and early.version is None


def test_a_sink_that_raises_still_lets_the_stream_run_to_its_end():
    """Each gathered parameter is a collective over the trainer's mesh: a sink that raises must not
    leave the other ranks waiting, so the stream is run to its end before the error is re-raised."""
    trainer = build_tiny_llama(seed=1)
    pulled = []

    class Counting(Source):
        def get_model(self):
            model = self.model

            class Wrapped(torch.nn.Module):
                def named_parameters(self, *args, **kwargs):
                    for name, param in model.named_parameters():
                        pulled.append(name)
                        yield name, param

            return Wrapped()

    failing = Sink(meta_layout(tied=False, dtype=torch.float32), raise_after=1)
    with pytest.raises(ValueError, match="refused"):
        InMemoryWeights("weights", "trainer", "generator").hand_over(Counting(trainer, 1), failing)
    # every parameter was gathered (twice listed: once by the layout check, once by the stream)
    assert pulled.count("model.norm.weight") == 2 and len(pulled) == 2 * len(list(trainer.parameters()))

