"""Tiny random models of the families users bring, with a real chat tokenizer (offline, seconds).

Each family keeps the architectural trait that breaks code written for a tiny untied Llama: tied
embeddings (SmolLM2, Qwen2/3, Gemma), q/k/v biases (Qwen2), q/k RMS norms and an explicit
``head_dim`` (Qwen3), a sliding-window config (Mistral), logit soft-capping, a query scale and
alternating sliding-window layers (Gemma2). The tokenizer is SmolLM2's (49,152 tokens, a ChatML
template), so prompts go through ``apply_chat_template`` exactly as the recipes do.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import (
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from llamarl.models.loading import SMOLLM2_ALIAS, resolve_model_path

# hidden 64, 4 query heads / 2 KV heads (TP 2 divides both), 2 layers, MLP 128.
_SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "max_position_embeddings": 512}

FAMILIES = {
    "llama-tied": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": True}),
    "llama-untied": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": False}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"tie_word_embeddings": True, "head_dim": 32}),
    "mistral": (MistralConfig, MistralForCausalLM, {"tie_word_embeddings": False, "sliding_window": 4096}),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {
        "tie_word_embeddings": True, "head_dim": 16, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "sliding_window": 4096}),
}


@functools.cache
def chat_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (converted once from the packaged GGUF)."""
    return AutoTokenizer.from_pretrained(str(resolve_model_path(SMOLLM2_ALIAS)))


def build_family(family: str, *, seed: int = 0, num_layers: int | None = None) -> torch.nn.Module:
    """A random fp32 model of ``family`` (see ``FAMILIES``) sized for the chat tokenizer, eval mode;
    ``num_layers`` decoder layers (None: 2).

    Same ``family`` and ``seed``: bitwise the same weights; the caller's RNG is left untouched."""
    config_cls, model_cls, extra = FAMILIES[family]
    tokenizer = chat_tokenizer()
    config = config_cls(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                        **{**_SHAPE, "num_hidden_layers": num_layers or _SHAPE["num_hidden_layers"]}, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
        # Random init leaves Qwen2's biases and the norms at 0 / 1: perturb every parameter so a
        # bias or norm weight dropped or mis-sharded on any path changes the outputs.
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.1)
    return model.to(torch.float32).eval()


def save_family(directory: Path, family: str, *, seed: int = 0) -> Path:
    """Write ``build_family(family, seed=seed)`` and the chat tokenizer as an HF directory."""
    model = build_family(family, seed=seed)
    model.save_pretrained(directory, safe_serialization=True)
    chat_tokenizer().save_pretrained(directory)
    return directory
