"""A faster decode step for Llama-family models: fused projections over a preallocated KV cache.

``TorchEngine`` prefills with the HF model as before; the decode steps then run here when the
model qualifies (``FusedDecoder.supports``: HF ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
``MistralForCausalLM`` whose sliding window, if any, is longer than the sequences; plain CPU
tensors, no tensor parallelism; ``--generator.no-fused-decode`` / ``TorchEngine(fused_decode=False)``
turns it off):

* **fused projections**: q, k and v as one matmul, gate and up as one, so a layer runs four
  matmuls instead of seven; on CPU the fused weights are also pre-packed for oneDNN
  (``torch.ops.mkldnn._reorder_linear_weight``), which reads them far faster at a few rows
  (measured with SmolLM2-135M, one thread: all the linears of a step at 1 / 16 / 64 rows 36.9 /
  53.1 / 110 ms plain, 23.8 / 32.2 / 91.5 ms pre-packed). The fused copies are derived from the
  live weights: every call compares the weights' version counters (bumped by any in-place write,
  the weight channels' included) with those they were built from and rebuilds them when a weight
  changed (one copy of the weights), so an in-place update takes effect at the next call as it
  does with the HF modules;
* **a preallocated KV cache** ``[batch, kv_heads, width + steps, head_dim]`` per layer, written in
  place at the step's column, and an attention mask preallocated to the same width (no per-step
  concatenation); the attention of the single query row is two small matmuls and a softmax, as
  HF's eager attention computes it (SDPA's CPU kernel spends ~1 ms per layer on a single row).

Norms, rotary embeddings, the activation and the LM head are the model's own modules, so the
numerics are HF's eager path: greedy tokens equal the HF loop's (tests) and log-probs agree to
rounding. A finished row is dropped from the batch exactly as in the HF loop (same live rows at
every step, so a seeded sampler draws the same numbers).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

_SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


def _mkldnn_ready(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and weight.dtype in (torch.float32, torch.bfloat16))


class _Linear:
    """One fused projection: its weight (and bias), pre-packed for oneDNN on CPU."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None], *, rows_hint: int) -> None:
        self.weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        self.bias = None if biases[0] is None else (torch.cat(biases) if len(biases) > 1 else biases[0])
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(self.weight, rows_hint)
                       if _mkldnn_ready(self.weight) else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return torch.nn.functional.linear(x, self.weight, self.bias)


class FusedDecoder:
    """Decode steps of one HF Llama-family model (module docstring)."""

    @staticmethod
    def supports(model: torch.nn.Module, *, length: int) -> bool:
        """True for the architectures and layouts this step reproduces exactly (module docstring),
        for a decode whose sequences reach ``length`` positions (a sliding window shorter than that
        would change the attention: the HF modules handle it)."""
        config = model.config
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        if type(model).__name__ not in _SUPPORTED or (window is not None and window < length):
            return False
        if any(isinstance(p, DTensor) or p.device.type != "cpu" for p in model.parameters()):
            # Tensor parallel (or otherwise sharded): the HF modules handle it. Not on accelerators
            # yet: the fused copies would double the weights' memory there, and a GPU decode step
            # is host-bound (it needs a captured graph, not fewer matmuls).
            return False
        layers = model.model.layers
        return all(not hasattr(layer.self_attn, "q_norm") for layer in layers)

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        config = model.config
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self._fused: list[tuple[_Linear, _Linear, _Linear, _Linear]] | None = None
        self._built_from: tuple[int, ...] = ()

    def _sources(self) -> list[torch.Tensor]:
        return [p for layer in self.model.model.layers for p in (*layer.self_attn.parameters(), *layer.mlp.parameters())]

    def _layers(self, rows_hint: int) -> list[tuple[_Linear, _Linear, _Linear, _Linear]]:
        versions = tuple(p._version for p in self._sources())
        if self._fused is None or versions != self._built_from:
            self._built_from = versions
            fused = []
            for layer in self.model.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                fused.append((
                    _Linear([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight],
                            [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias], rows_hint=rows_hint),
                    _Linear([attn.o_proj.weight], [attn.o_proj.bias], rows_hint=rows_hint),
                    _Linear([mlp.gate_proj.weight, mlp.up_proj.weight], [mlp.gate_proj.bias, mlp.up_proj.bias],
                            rows_hint=rows_hint),
                    _Linear([mlp.down_proj.weight], [mlp.down_proj.bias], rows_hint=rows_hint)))
            self._fused = fused
        return self._fused

    def start(self, cache, mask: torch.Tensor, *, num_steps: int) -> DecodeState:
        """The decode state after a prefill: ``cache`` is the prefill's HF ``DynamicCache`` (rows as
        the batch), ``mask`` its ``[batch, width]`` attention mask; room for ``num_steps`` tokens."""
        batch, width = mask.shape
        keys, values = [], []
        for layer in cache.layers:
            k = layer.keys.new_zeros(batch, self.num_kv_heads, width + num_steps, self.head_dim)
            v = torch.zeros_like(k)
            k[:, :, :width], v[:, :, :width] = layer.keys, layer.values
            keys.append(k)
            values.append(v)
        full_mask = mask.new_zeros(batch, width + num_steps, dtype=torch.bool)
        full_mask[:, :width] = mask.bool()
        return DecodeState(keys=keys, values=values, mask=full_mask, column=width)

    @torch.no_grad()
    def step(self, state: DecodeState, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of the next token after ``tokens`` ``[rows]`` at ``positions``
        ``[rows]``; the tokens' keys and values go into the state's next column."""
        model = self.model
        rows, column = tokens.shape[0], state.column
        hidden = model.model.embed_tokens(tokens.unsqueeze(1))  # [rows, 1, hidden]
        cos, sin = model.model.rotary_emb(hidden, positions.unsqueeze(1))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [rows, 1, 1, head_dim]
        state.mask[:, column] = True
        visible = state.mask[:, None, None, : column + 1]  # [rows, 1, 1, column + 1]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        groups = self.num_heads // self.num_kv_heads
        for index, (layer, (qkv, out, gate_up, down)) in enumerate(zip(model.model.layers, self._layers(rows))):
            x = layer.input_layernorm(hidden)
            q, k, v = qkv(x.view(rows, -1)).split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(rows, 1, self.num_heads, self.head_dim).transpose(1, 2)  # [rows, heads, 1, d]
            k = k.view(rows, 1, self.num_kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            state.keys[index][:, :, column] = k[:, :, 0]
            state.values[index][:, :, column] = v.view(rows, self.num_kv_heads, self.head_dim)
            keys = state.keys[index][:, :, : column + 1]  # [rows, kv, T, d]
            values = state.values[index][:, :, : column + 1]
            # Grouped query heads against their KV head: [rows, kv, groups, d] x [rows, kv, d, T].
            scores = torch.matmul(q.view(rows, self.num_kv_heads, groups, self.head_dim),
                                  keys.transpose(-1, -2)) * self.scaling
            scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            attended = torch.matmul(weights, values).reshape(rows, 1, q_size)
            hidden = hidden + out(attended.view(rows, -1)).view(rows, 1, -1)
            x = layer.post_attention_layernorm(hidden)
            gate, up = gate_up(x.view(rows, -1)).chunk(2, dim=-1)
            hidden = hidden + down(layer.mlp.act_fn(gate) * up).view(rows, 1, -1)
        hidden = model.model.norm(hidden)
        state.column += 1
        return model.lm_head(hidden)[:, -1]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecodeState:
    """The preallocated KV cache and mask of one decode (``FusedDecoder.start``)."""

    def __init__(self, *, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor,
                 column: int) -> None:
        self.keys, self.values, self.mask, self.column = keys, values, mask, column

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (finished rows leave the batch, as in the HF loop)."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.mask = self.mask.index_select(0, rows)
