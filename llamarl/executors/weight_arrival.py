"""How the trainer's weights arrive in the generator: one object, chosen once (``choose_weight_arrival``).

The generator is the inbound end of a weights channel (``WeightSink`` in llamarl/runtime/executor.py): the
channel writes the parameters of ``get_model()`` in place, or, where ``weight_sink()`` gives a
callable, streams the sync into it as ``(name, full tensor)`` pairs; then it calls
``set_weights_version``. Which of those happens, and what the generator keeps of the model, depends
on two things known before anything is loaded: whether the engine holds its own weights (its config
class declares ``streams_weights``: vLLM) and whether the trainer trains LoRA adapters
(``--trainer.lora.*``: the wire then carries the adapters alone). One class per way:

- ``InPlace``: the engine samples from the generator's HF model (the native engine); the channel
  writes its parameters (TP-sharded on the TP mesh: each rank receives its shard), then the engine
  is told (``weights_updated``).
- ``Streamed``: the engine holds the weights; the generator keeps only the model's layout (meta
  device, unsharded: the engine slices the weights itself, one TP worker per rank of the group, and
  the layout is what the channel plans against), and each sync is streamed into ``load_weights``.
- ``LoraMerge``: the channel writes the adapters into receive buffers (``AdapterMerger``,
  llamarl/models/lora_merge.py; under TP each rank receives the slices its merge needs); after the
  sync they are merged into the HF model's weights in place and the engine is told.
- ``LoraMergeThenStream``: as ``LoraMerge`` into an HF copy of the base (unsharded: the one case a
  streaming engine keeps an HF model), whose merged weights are then streamed into the engine from
  this rank's memory.

The generator calls ``load`` (the model it builds the engine from), ``bind`` (the engine built), and
for every sync ``receiver`` / ``slices`` / ``sink`` (what the channel writes) and ``landed``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from llamarl.engines.base import EngineConfig, StreamsWeights
from llamarl.models.loading import load_causal_lm, load_causal_lm_layout
from llamarl.models.lora import LoraSpec
from llamarl.models.lora_merge import AdapterMerger
from llamarl.models.tensor_parallel import apply_tensor_parallel

__all__ = ["InPlace", "LoraMerge", "LoraMergeThenStream", "Streamed", "WeightArrival", "choose_weight_arrival"]


class WeightArrival:
    """One way for the weights to arrive (module docstring). The base is ``InPlace``'s behaviour:
    the HF model, its parameters written by the channel, the engine told after each sync."""

    model: torch.nn.Module
    engine: object

    def load(self, name: str, *, dtype: torch.dtype, device: torch.device, tp_mesh=None):
        """``(model, tokenizer)`` for the generator: the HF model on ``device``, in eval mode and
        sharded over ``tp_mesh`` (None: no TP). On ``device`` before TP: sharding puts the
        projections on the mesh's device, and the embeddings / norms / lm_head must be there with them."""
        self.model, tokenizer = load_causal_lm(name, dtype=dtype, device=device)
        self.model.eval()
        if tp_mesh is not None:
            apply_tensor_parallel(self.model, tp_mesh)
        return self.model, tokenizer

    def bind(self, engine) -> None:
        """The engine built from ``model`` (the engine itself, not an episode runner around it)."""
        self.engine = engine

    def receiver(self) -> torch.nn.Module:
        """What the weights channel writes (``get_model()``): the generation model."""
        return self.model

    def slices(self) -> dict[str, tuple[int, int, int]] | None:
        """The TP slice spec of ``receiver()`` (``get_weight_slices()``); None: its parameters (TP
        DTensors or whole tensors) describe themselves."""
        return None

    def sink(self) -> Callable[[Iterator[tuple[str, torch.Tensor]]], None] | None:
        """The channel's streaming entry (``weight_sink()``): a callable taking an iterator of
        ``(name, full tensor)``, or None when the channel writes ``receiver()``'s parameters in place."""
        return None

    def landed(self) -> None:
        """After a sync is in place (written, or streamed into the engine): what the engine is told."""
        self.engine.weights_updated(self.model)

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(param.shape) for name, param in self.model.named_parameters()}


class InPlace(WeightArrival):
    """The channel writes the generation model's parameters; the engine samples from them."""


class Streamed(WeightArrival):
    """The engine holds the weights; each sync is streamed into its ``load_weights``."""

    def load(self, name: str, *, dtype: torch.dtype, device: torch.device, tp_mesh=None):
        """The model's layout only (meta device, unsharded whatever ``tp_mesh``: the engine slices the
        weights itself), and the tokenizer."""
        self.model, tokenizer = load_causal_lm_layout(name, dtype=dtype)
        self.model.eval()
        return self.model, tokenizer

    def sink(self) -> Callable[[Iterator[tuple[str, torch.Tensor]]], None]:
        """Loads the stream into the engine as it is consumed (the layout's shapes checked there)."""
        engine: StreamsWeights = self.engine  # checked when it was built
        shapes = self._shapes()
        return lambda named_tensors: engine.load_weights(named_tensors, shapes=shapes)

    def landed(self) -> None:
        """Nothing: the weights are already in the engine."""


class LoraMerge(WeightArrival):
    """Only the adapters arrive, into ``AdapterMerger``'s receive buffers; merged into the weights after each sync."""

    def __init__(self, lora: LoraSpec) -> None:
        self.lora = lora
        self.merger: AdapterMerger | None = None

    def load(self, name: str, *, dtype: torch.dtype, device: torch.device, tp_mesh=None):
        model, tokenizer = super().load(name, dtype=dtype, device=device, tp_mesh=tp_mesh)
        self.merger = AdapterMerger(model, self.lora)
        return model, tokenizer

    def receiver(self) -> torch.nn.Module:
        """The adapters' receive buffers (merged into the model by ``landed``)."""
        return self.merger.view()

    def slices(self) -> dict[str, tuple[int, int, int]] | None:
        """Under TP, which slice of each adapter this rank's merge needs (``AdapterMerger``)."""
        return self.merger.slices()

    def landed(self) -> None:
        self.merger.merge()
        self.engine.weights_updated(self.model)


class LoraMergeThenStream(LoraMerge):
    """The adapters merged into an HF copy of the base, whose weights are then streamed into the engine."""

    def load(self, name: str, *, dtype: torch.dtype, device: torch.device, tp_mesh=None):
        """The HF model on ``device``, unsharded (the engine slices what it is streamed)."""
        return super().load(name, dtype=dtype, device=device, tp_mesh=None)

    def landed(self) -> None:
        """Merge, then stream the merged policy into the engine from this rank's memory."""
        self.merger.merge()
        engine: StreamsWeights = self.engine
        engine.load_weights(((n, p.detach()) for n, p in self.model.named_parameters()), shapes=self._shapes())


def choose_weight_arrival(engine_config: EngineConfig, lora: LoraSpec | None) -> WeightArrival:
    """The way the weights arrive, from the engine config's class flag ``streams_weights`` (never the
    engine's class or name) and the trainer's adapters (None: full weights)."""
    streams = engine_config.streams_weights  # a ClassVar: the config class's declaration
    if lora is None:
        return Streamed() if streams else InPlace()
    return LoraMergeThenStream(lora) if streams else LoraMerge(lora)
