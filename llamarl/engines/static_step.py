"""The static decode step's math (llamarl/engines/static_decode.py captures it as CUDA graphs): HF's
Llama-family decoder layer (Llama, Qwen2, Mistral, Qwen3's q / k norms, Gemma2's norms and soft caps:
``StepShape``) in few kernels.

Why few kernels: a replayed graph of a small model is bound by its number of kernels (one H200:
~3 µs each, ~1,000 a step of SmolLM2's shape at ~33 a layer; docs/gpu.md), not by their work.
The step's own kernels come from a set chosen per decoder (llamarl/engines/step_kernels.py): on CUDA
with Triton the fused set, **9 kernels a layer** for Llama, Qwen2, Mistral, Qwen3 and Gemma2 (norm,
q / k / v GEMM, RoPE + KV store, attention, o_proj, norm, gate / up GEMM, SiLU·mul, down_proj;
Gemma2's sandwich norms and residual adds fused into the norms' kernels); the aten set elsewhere,
12 a layer (14 with Qwen3's q / k norms, 32 Gemma2's), counted on the CPU proxy's fake-graph tape
(tests/fake_cuda.py):

* RMSNorm with its weight: one ``torch.nn.functional.rms_norm`` (on CUDA the fused
  ``_fused_rms_norm``, fp32 inside). The residual adds are in the GEMMs that precede them:
  ``hidden.addmm_(x, W.t())``, cuBLAS's ``C += A B``.
* q / k / v as one GEMM and gate / up as one GEMM over **fused buffers whose slices are the
  model's parameters** (``fuse_projections``): each projection's ``weight`` (and bias) is re-pointed
  (``param.data = view``) into one buffer, so a weight sync's ``copy_`` into the HF model's
  parameters, a LoRA merge's ``addmm(out=weight)`` (llamarl/models/lora_merge.py) and anything
  holding the parameter objects write the buffer the graphs read.
* RoPE and the KV store: fused, one kernel over every head of the row (Qwen3's head norms inside);
  aten, two ``bmm`` by per-row rotation matrices built once a step (queries by ``R``, keys and
  values together by ``[R | I]``) and one indexed write of the keys and values into the cache
  (a layer's cache is one tensor ``[2, slots, kv, width, d]``: keys, then values).
* Attention as one ``scaled_dot_product_attention`` over (row, KV head) pairs, the query heads of
  a KV head as its queries (GQA without repeating K / V), masked by position.
* SiLU (Gemma2: tanh GELU) and the product: one fused kernel, or two aten kernels.

Numerics: fp32 matches HF's eager step to fp32 rounding. bf16 differs from HF by at most a bf16
rounding per op where HF rounds twice and this step once (the norm's weight applied in fp32
before the cast; a rotated pair and a projection plus its residual summed before rounding).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from llamarl.engines.step_kernels import TORCH_KERNELS, StepKernels, activation_kind


class StepShape(NamedTuple):
    """How a family's layer departs from Llama's, read once from its config and modules
    (``step_shape``): Gemma2's, every field set; Llama / Qwen2 / Qwen3 / Mistral's, none."""

    norm_offset: float = 0.0
    """RMSNorms multiply by ``offset + weight``, in fp32, then round once (Gemma2: 1)."""
    sandwich_norms: bool = False
    """Each block's output is normalised before its residual add (Gemma2's post-attention and
    post-feed-forward norms; its pre-feed-forward norm is then the MLP's input norm)."""
    attn_softcap: float | None = None
    """Attention scores soft-capped, ``cap * tanh(score / cap)``, before the mask (Gemma2: 50), where
    the model's attention implementation caps them (``_SOFTCAPPING``): HF's ``sdpa`` ignores the
    cap, and the step follows the model the trainer runs, not the config."""
    final_softcap: float | None = None
    """Logits soft-capped the same way (Gemma2: 30)."""
    activation: str = "silu"
    """The MLP's activation (``step_kernels.activation_kind``: ``"silu"``; Gemma2 ``"gelu_tanh"``)."""


# RMSNorms whose scale is ``1 + weight`` (a registry by class name: the offset is in their forward).
_OFFSET_NORMS = {"Gemma2RMSNorm": 1.0}
# HF attention implementations that apply ``attn_logit_softcapping`` (sdpa's and segment
# attention's SDPA calls do not).
_SOFTCAPPING = ("eager", "flash_attention_2", "flash_attention_3", "flex_attention")


def step_shape(model: torch.nn.Module) -> StepShape:
    """The model's ``StepShape``: its norms' class, its layers' extra norms, its config's caps."""
    config, layer = model.config, model.model.layers[0]
    return StepShape(norm_offset=_OFFSET_NORMS.get(type(layer.input_layernorm).__name__, 0.0),
                     sandwich_norms=getattr(layer, "pre_feedforward_layernorm", None) is not None,
                     attn_softcap=getattr(config, "attn_logit_softcapping", None)
                     if getattr(config, "_attn_implementation", None) in _SOFTCAPPING else None,
                     final_softcap=getattr(config, "final_logit_softcapping", None),
                     activation=activation_kind(config))


class FusedWeights(NamedTuple):
    """What ``static_forward`` reads besides the model's modules (``fuse_projections``)."""

    layers: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]]
    """Per decoder layer ``(qkv_weight, qkv_bias, gate_up_weight, gate_up_bias)``."""
    head_norms: torch.Tensor | None
    """Qwen3's q / k norm weights ``[layers, heads + kv, d]``, one row per head (None: no such
    norms): row 0 of a layer IS its ``q_norm.weight`` and row ``heads`` its ``k_norm.weight``, the
    other rows their copies, refreshed from them at every step (``static_forward``), so the
    weights multiply the normalised q and k heads in one kernel and a sync that writes the
    parameters is seen at the next step."""
    shape: StepShape = StepShape()
    """How the family's layer departs from Llama's (``step_shape``)."""
    kernels: StepKernels = TORCH_KERNELS
    """The step's kernels (llamarl/engines/step_kernels.py: aten, or fused on CUDA)."""


def fuse_projections(model: torch.nn.Module, kernels: StepKernels = TORCH_KERNELS) -> FusedWeights:
    """``layers``: per decoder layer the rows of q / k / v (gate / up) stacked in one buffer whose
    slices are the projections' parameters; ``head_norms``: Qwen3's q / k norms, one buffer whose
    rows are the parameters (``FusedWeights``).

    Idempotent: parameters that are already consecutive slices of one storage, in this order, are
    left as they are and the buffer is a view over them; otherwise (the first call, or a parameter
    rebound since) the buffer is made from their current values and each parameter re-pointed into
    it (``param.data = buffer[rows]``: the same ``Parameter`` object, new storage). A bias is None
    when none of the projections has one. ``kernels``: the step's kernel set (``FusedWeights``)."""
    fused = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = (attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)
        fused.append((_one_buffer([m.weight for m in qkv]), _one_bias(qkv),
                      _one_buffer([m.weight for m in gate_up]), _one_bias(gate_up)))
    return FusedWeights(fused, _head_norms(model), step_shape(model), kernels)


@torch.no_grad()
def _head_norms(model: torch.nn.Module) -> torch.Tensor | None:
    layers = model.model.layers
    if getattr(layers[0].self_attn, "q_norm", None) is None:
        return None
    heads, kv = model.config.num_attention_heads, model.config.num_key_value_heads
    first = layers[0].self_attn.q_norm.weight
    d = first.shape[0]
    per_layer, start = (heads + kv) * d, first.storage_offset()
    in_place = all(
        w.is_contiguous() and w.dtype == first.dtype and w.shape == first.shape
        and w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and w.storage_offset() == start + index * per_layer + row * d
        for index, layer in enumerate(layers)
        for w, row in ((layer.self_attn.q_norm.weight, 0), (layer.self_attn.k_norm.weight, heads)))
    if in_place and start + len(layers) * per_layer <= first.untyped_storage().nbytes() // first.element_size():
        return first.detach().as_strided((len(layers), heads + kv, d), (per_layer, d, 1), start)
    buffer = torch.stack([torch.cat((layer.self_attn.q_norm.weight.detach().expand(heads, d),
                                     layer.self_attn.k_norm.weight.detach().expand(kv, d))) for layer in layers])
    for index, layer in enumerate(layers):
        layer.self_attn.q_norm.weight.data = buffer[index, 0]
        layer.self_attn.k_norm.weight.data = buffer[index, heads]
    return buffer


# Position scalings whose frequencies depend on the longest position seen: a table built once for
# the state's width would differ from HF's per-step frequencies.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def reproduces(model: torch.nn.Module) -> bool:
    """Whether ``static_forward`` reproduces ``model``'s layers (the architecture and the window are
    its callers' checks: a sliding window at least as long as every position is full attention):
    every layer full or sliding-window attention, RoPE whose frequencies do not depend on the
    sequence length (``rope_tables`` serves every step), q / k / v and gate / up ``fusable``."""
    config = model.config
    if getattr(config, "layer_types", None) and any(t not in ("full_attention", "sliding_attention")
                                                    for t in config.layer_types):
        return False
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return rope.get("rope_type", rope.get("type")) not in _LENGTH_DEPENDENT_ROPE and fusable(model)


@torch.no_grad()
def rope_tables(model: torch.nn.Module, *, width: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's ``cos`` / ``sin`` ``[width, d]`` for columns ``0 .. width - 1``, from the model's own
    rotary module, in its dtype and on its device; the sine's first half negated (``rotations``)."""
    weight = model.get_input_embeddings().weight
    column_ids = torch.arange(width, device=weight.device).unsqueeze(0)
    probe = torch.zeros((1, width, 1), dtype=weight.dtype, device=weight.device)
    cos, sin = model.model.rotary_emb(probe, column_ids)
    half = head_dim // 2
    return cos[0].contiguous(), torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1).contiguous()


def fusable(model: torch.nn.Module) -> bool:
    """Whether every layer's q / k / v, and gate / up, all have a bias or all have none."""
    return all(len({m.bias is None for m in group}) == 1 for layer in model.model.layers
               for group in ((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                             (layer.mlp.gate_proj, layer.mlp.up_proj)))


def _one_bias(linears) -> torch.Tensor | None:
    biases = [m.bias for m in linears]
    return None if biases[0] is None else _one_buffer(biases)


@torch.no_grad()
def _one_buffer(params: list[torch.Tensor]) -> torch.Tensor:
    first = params[0]
    shape = (sum(p.shape[0] for p in params), *first.shape[1:])
    strides = torch.empty(shape, device="meta").stride()
    offset, adjacent = first.storage_offset(), True
    for p in params:
        adjacent &= (p.is_contiguous() and p.dtype == first.dtype and p.storage_offset() == offset
                     and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr())
        offset += p.numel()
    if adjacent and offset <= first.untyped_storage().nbytes() // first.element_size():
        return first.detach().as_strided(shape, strides, first.storage_offset())
    buffer = torch.cat([p.detach() for p in params])
    start = 0
    for p in params:
        p.data = buffer[start:start + p.shape[0]]
        start += p.shape[0]
    return buffer


def _eps(norm: torch.nn.Module) -> float:
    return getattr(norm, "variance_epsilon", None) or norm.eps


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())


def _add_linear_(hidden: torch.Tensor, x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """``hidden += linear(x)``, the residual add inside the GEMM (``C += A B``)."""
    hidden.addmm_(x, linear.weight.t())
    return hidden if linear.bias is None else hidden.add_(linear.bias)


def static_forward(model: torch.nn.Module, fused: FusedWeights, tokens: torch.Tensor, positions: torch.Tensor,
                   caches: list[torch.Tensor], cos_table: torch.Tensor, sin_table: torch.Tensor,
                   logits: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                   scaling: float) -> torch.Tensor:
    """Write into ``logits`` ``[rows, vocab]`` (and return it) the logits of the token after
    ``tokens`` ``[rows]``, each fed at its row's position ``positions`` ``[rows]``; write its keys
    and values into row r of ``caches[l]`` (``[2, rows, kv, width, d]``: keys then values, views of
    the state's first ``rows`` slots) at that position and attend over the row's columns
    ``0 .. position``. ``fused``: ``fuse_projections(model)``. ``sin_table`` is RoPE's sine with
    its first half negated. Shapes depend only on ``rows`` and the width: one graph per pair.
    ``logits`` is written by the last GEMM (``out=``): a buffer of the caller's, not the graph's."""
    rows = tokens.shape[0]
    inner = model.model
    kernels, shape = fused.kernels, fused.shape
    hidden = inner.embed_tokens(tokens)  # [rows, hidden]
    # What the kernels need once a step (aten: RoPE's rotation matrices and the attention's mask).
    aux = kernels.prepare(cos_table, sin_table, positions, width=caches[0].shape[3], num_kv_heads=num_kv_heads,
                          dtype=hidden.dtype)
    heads = num_heads + 2 * num_kv_heads
    offset, layers = shape.norm_offset, inner.layers
    eps = _eps(layers[0].input_layernorm)

    head_norms, head_eps = fused.head_norms, 0.0
    if head_norms is not None:  # each head's norm weight from its parameter row (FusedWeights): 2 kernels a step
        head_norms[:, 1:num_heads].copy_(head_norms[:, :1].expand(-1, num_heads - 1, -1))
        head_norms[:, num_heads + 1:].copy_(head_norms[:, num_heads:num_heads + 1].expand(-1, num_kv_heads - 1, -1))
        head_eps = layers[0].self_attn.q_norm.variance_epsilon
    x = kernels.norm(hidden, layers[0].input_layernorm.weight, eps, offset)  # each layer's input norm: the layer before's end
    for index, (layer, (qkv_weight, qkv_bias, gate_up_weight, gate_up_bias), cache) in enumerate(
            zip(layers, fused.layers, caches)):
        attn, mlp = layer.self_attn, layer.mlp
        following = layers[index + 1].input_layernorm if index + 1 < len(layers) else inner.norm
        qkv = _linear(x, qkv_weight, qkv_bias).view(rows, heads, head_dim)
        q = kernels.rope_store(qkv, aux, positions, cos_table, sin_table, cache,
                               None if head_norms is None else head_norms[index], num_heads, num_kv_heads,
                               head_eps)  # [rows, heads, d]
        attended = kernels.attend(q, cache, aux, positions, scaling, shape.attn_softcap).view(rows, num_heads * head_dim)
        if shape.sandwich_norms:  # Gemma2: the block's output normalised, then added; its own MLP norm
            x = kernels.sandwich(hidden, _linear(attended, attn.o_proj.weight, attn.o_proj.bias),
                                 layer.post_attention_layernorm.weight, layer.pre_feedforward_layernorm.weight,
                                 eps, offset)
        else:
            _add_linear_(hidden, attended, attn.o_proj)
            x = kernels.norm(hidden, layer.post_attention_layernorm.weight, eps, offset)
        gate_up = _linear(x, gate_up_weight, gate_up_bias)
        activated = kernels.act_mul(gate_up, mlp.act_fn, shape.activation)
        if shape.sandwich_norms:
            x = kernels.sandwich(hidden, _linear(activated, mlp.down_proj.weight, mlp.down_proj.bias),
                                 layer.post_feedforward_layernorm.weight, following.weight, eps, offset)
        else:
            _add_linear_(hidden, activated, mlp.down_proj)
            x = kernels.norm(hidden, following.weight, eps, offset)
    lm_head = model.lm_head
    if lm_head.bias is None:
        torch.mm(x, lm_head.weight.t(), out=logits)
    else:
        torch.addmm(lm_head.bias, x, lm_head.weight.t(), out=logits)
    if shape.final_softcap is not None:  # Gemma2: cap * tanh(logits / cap), in place
        logits.div_(shape.final_softcap).tanh_().mul_(shape.final_softcap)
    return logits
