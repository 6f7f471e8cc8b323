"""Tiny random Llamas (``tiny_llama_config``, ``build_tiny_llama``) and a character-level tokenizer,
saved together as an HF directory (offline, seconds)."""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["[PAD]", "[EOS]", "[UNK]"]


def tiny_llama_config(
    *,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 256,
) -> LlamaConfig:
    """Return a small ``LlamaConfig`` for tests and toy runs.

    Contract: the config has GQA (``num_kv_heads`` < ``num_heads`` by default), no dropout, and
    ``head_dim = hidden_size // num_heads``; ``hidden_size`` must be divisible by ``num_heads`` and
    ``num_heads`` by ``num_kv_heads`` (ValueError otherwise).
    """
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        # Ids inside any vocab >= 3, so tokenizer-less tests have valid special tokens.
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def build_tiny_llama(seed: int = 0, **kw) -> LlamaForCausalLM:
    """Build a randomly initialised fp32 ``LlamaForCausalLM`` from ``tiny_llama_config(**kw)``.

    Contract: the same ``seed`` and ``kw`` give bitwise-identical weights; the global RNG state of the
    caller is left untouched (a forked generator is used); the model is returned in eval mode.
    """
    config = tiny_llama_config(**kw)
    # fork_rng keeps the caller's RNG stream independent of how many tiny models a test builds.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(torch.float32).eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token="[EOS]",
                                   unk_token="[UNK]")


def save_tiny_model(directory: Path, *, seed: int = 0, tie_word_embeddings: bool = False) -> Path:
    """Write a tiny random Llama (vocab = the tokenizer's) and its tokenizer into ``directory``."""
    tokenizer = tiny_tokenizer()
    model = build_tiny_llama(seed=seed, vocab_size=128, tie_word_embeddings=tie_word_embeddings)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory
