"""Model loading (HF directories, built-in aliases)."""

from llamarl.models.loading import KNOWN_ALIASES, SMOLLM2_ALIAS, load_causal_lm, resolve_model_path

__all__ = ["KNOWN_ALIASES", "SMOLLM2_ALIAS", "load_causal_lm", "resolve_model_path"]
