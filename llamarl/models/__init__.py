"""Model construction and loading (tiny test Llamas, HF directories, built-in aliases)."""

from llamarl.models.loading import (
    KNOWN_ALIASES,
    SMOLLM2_ALIAS,
    build_tiny_llama,
    load_causal_lm,
    resolve_model_path,
    tiny_llama_config,
)

__all__ = [
    "KNOWN_ALIASES",
    "SMOLLM2_ALIAS",
    "build_tiny_llama",
    "load_causal_lm",
    "resolve_model_path",
    "tiny_llama_config",
]
