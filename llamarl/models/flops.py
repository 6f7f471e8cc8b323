"""The trainer's FLOPs counted from the work it does, for TFLOP/s and MFU.

A decoder-only transformer's matmul FLOPs, from its HF config (``hidden_size`` H, layers, query
heads ``n_q`` and KV heads ``n_kv`` of ``head_dim`` d, ``intermediate_size`` I, vocabulary V)::

    per token and layer   2 H (n_q d) + 2 * 2 H (n_kv d) + 2 (n_q d) H     q, k, v, o projections
                        + 3 * 2 H I                                        gate, up, down (SwiGLU / GeGLU)
    per attended pair     2 * 2 n_q d                                      Q K^T and P V, every query head
    per predicted token   2 H V                                            the LM head

so a forward costs ``layers * (tokens * per_token + pairs * per_pair) + predicted * 2 H V``, and a
training step (forward and backward: each matmul's backward is two matmuls of its size) three times
that. Norms, RoPE, activations, softmax and the log-softmax are not counted (nor by
``torch.utils.flop_counter.FlopCounterMode``, which ``tests/test_flops.py`` checks this against).

What counts as the work (``batch_work``): each packed token once (a shared prompt once per
micro-batch, not once per sample), the (query, key) pairs each token actually attends to (a causal
row of n tokens: n (n + 1) / 2; a shared prompt's completion of m tokens after a context of c:
m c + m (m + 1) / 2), and the completion tokens whose log-probs are computed. Padding, dummy
micro-batches, activation-checkpointing and log-prob recomputation are overhead, not counted, which
is the usual MFU convention (PaLM's appendix B).

``PEAK_TFLOPS`` holds the dense bf16 peaks of the GPUs this project has run on, by device name.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PEAK_TFLOPS", "ModelFlops", "pairs_causal", "pairs_shared", "peak_tflops", "work_of"]

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}
"""Dense bf16 tensor-core peaks (TFLOP/s, without sparsity) by a substring of the CUDA device name;
H100 is the SXM part (the PCIe one is 756)."""


def peak_tflops(device_name: str | None) -> float | None:
    """The dense bf16 peak of the device called ``device_name`` (``torch.cuda.get_device_name``), or
    None where it is not known (every CPU; an unknown GPU). "H100 PCIe" is told from the SXM part."""
    if not device_name:
        return None
    if "H100" in device_name and "PCIe" in device_name:
        return 756.0
    return next((peak for name, peak in PEAK_TFLOPS.items() if name in device_name), None)


def pairs_causal(length: int) -> int:
    """(query, key) pairs of a causal row of ``length`` tokens: ``length (length + 1) / 2``."""
    return length * (length + 1) // 2


def pairs_shared(context: int, completions: list[int]) -> int:
    """Pairs of a context of ``context`` tokens forwarded once, then completions of these lengths,
    each seeing the context and its own earlier tokens."""
    return pairs_causal(context) + sum(m * context + pairs_causal(m) for m in completions)


@dataclass(frozen=True)
class ModelFlops:
    """A model's FLOP coefficients (module docstring): ``per_token`` (the projections and MLP of
    every layer), ``per_pair`` (attention, every layer) and ``per_predicted`` (the LM head)."""

    per_token: float
    per_pair: float
    per_predicted: float

    @classmethod
    def from_config(cls, config) -> ModelFlops:
        """From an HF decoder config (Llama, Qwen2, Qwen3, Mistral, Gemma 2 ...)."""
        hidden, layers = config.hidden_size, config.num_hidden_layers
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        q, kv = heads * head_dim, kv_heads * head_dim
        projections = 2 * hidden * q + 2 * 2 * hidden * kv + 2 * q * hidden
        mlp = 3 * 2 * hidden * config.intermediate_size
        return cls(per_token=layers * (projections + mlp), per_pair=layers * 4 * q,
                   per_predicted=2 * hidden * config.vocab_size)

    def forward(self, *, tokens: float, pairs: float, predicted: float) -> float:
        """FLOPs of one forward over ``tokens`` tokens attending over ``pairs`` (query, key) pairs,
        with the LM head on ``predicted`` of them."""
        return tokens * self.per_token + pairs * self.per_pair + predicted * self.per_predicted

    def training(self, *, tokens: float, pairs: float, predicted: float, frozen_weights: bool = False) -> float:
        """FLOPs of a forward and its backward: three forwards (``forward``). ``frozen_weights`` (LoRA):
        the weights' own gradients are not computed, so the projections, MLP and head cost two
        forwards and attention three (the adapters' small matmuls are not counted)."""
        weights = 2 if frozen_weights else 3
        return weights * (tokens * self.per_token + predicted * self.per_predicted) + 3 * pairs * self.per_pair


def work_of(num_tokens: list[int], start: int, segments=None) -> tuple[float, float, float]:
    """``(tokens, pairs, predicted)`` of one micro-batch (module docstring): rows of ``num_tokens``
    tokens each predicting its tokens from column ``start`` on, or, with ``segments`` (a
    ``PackedLayout``'s ``[G, W]`` host tensor: 0 context, k the k-th completion, -1 padding), the
    packed rows, each context once."""
    if segments is None:
        return (float(sum(num_tokens)), float(sum(pairs_causal(n) for n in num_tokens)),
                float(sum(max(n - max(start, 1), 0) for n in num_tokens)))
    tokens = pairs = predicted = 0
    for row in segments.tolist():
        context = row.count(0)
        completions = [row.count(k) for k in range(1, max(row) + 1)]
        tokens += context + sum(completions)
        pairs += pairs_shared(context, completions)
        predicted += sum(completions)
    return float(tokens), float(pairs), float(predicted)
