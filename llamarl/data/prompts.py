"""Problem records and prompt construction (chat template, or a plain fallback for tiny tokenizers)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# The arithmetic recipe's instruction; the arithmetic scorer reads the FIRST number of the reply.
ARITHMETIC_INSTRUCTION = "Answer with just the number."


@dataclasses.dataclass(frozen=True)
class Problem:
    """One task instance: the question shown to the model and the reference its reward scorer reads.

    ``answer`` is whatever the matching scorer expects as ``reference``: the bare integer for
    arithmetic, the full GSM8K answer field (ending in ``#### N``) for GSM8K.
    """

    question: str
    answer: str


def _user_content(question: str, instruction_suffix: str) -> str:
    """The question followed, after one space, by the instruction (if any)."""
    return f"{question} {instruction_suffix}" if instruction_suffix else question


def _as_token_ids(encoded: Any) -> list[int]:
    """Normalise apply_chat_template/encode output (list, nested list, dict, BatchEncoding) to list[int]."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):  # a tensor or array from return_tensors
        encoded = encoded.tolist()
    encoded = list(encoded)
    # A batch of one, e.g. [[1, 2, 3]].
    if len(encoded) == 1 and isinstance(encoded[0], (list, tuple)):
        encoded = list(encoded[0])
    return [int(token) for token in encoded]


def build_chat_prompt(
    tokenizer: Any, question: str, *, system: str | None = None, instruction_suffix: str = ""
) -> list[int]:
    """Token ids of the prompt for ``question``, ready for generation.

    With a chat template: ``[system?, user]`` messages with ``add_generation_prompt=True``. Without
    one (tiny test tokenizers): ``"{system}\\n\\nQuestion: {question}\\nAnswer:"`` encoded with the
    tokenizer's default special tokens. ``instruction_suffix`` is appended to the question after a space.
    """
    content = _user_content(question, instruction_suffix)
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": content})
        encoded = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return _as_token_ids(encoded)
    text = f"Question: {content}\nAnswer:"
    if system:
        text = f"{system}\n\n{text}"
    return _as_token_ids(tokenizer(text)["input_ids"])
