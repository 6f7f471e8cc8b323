"""A tiny random Llama + character-level tokenizer saved as an HF directory (offline, seconds)."""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from llamarl.models.loading import build_tiny_llama

SPECIALS = ["[PAD]", "[EOS]", "[UNK]"]


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
