"""Problem records, where a run draws them from (``Sampler``), and prompt construction (``PromptFn``:
chat template, or a plain fallback for tiny tokenizers)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any, Protocol

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
    columns: dict = dataclasses.field(default_factory=dict, hash=False)
    """The dataset row's other fields (``recipes/task.py``: every field but the prompt's), what TRL-style
    reward functions get as keyword lists, per-sample scorers as keywords they name, trajectory
    scorers and environments as ``problem.columns``; empty for the built-in tasks."""


class Sampler(Protocol):
    """Where a run's training problems come from: ``sample(index)`` is the problem of data index
    ``index``, a pure function of it (so a resumed run draws what the interrupted one would have).
    ``ArithmeticTask`` and ``ListTask`` (a dataset's rows) are samplers; the generator draws from one."""

    def sample(self, index: int) -> Problem: ...


PromptFn = Callable[[Any, str], list[int]]
"""``prompt_fn(tokenizer, question) -> token ids``: the policy's prompt for a question
(``build_chat_prompt`` with a recipe's instruction, ``arithmetic_prompt``)."""


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


ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages, where: str) -> list[dict]:
    """``messages`` as a conversation (a non-empty list of ``{"role", "content"}`` dicts, roles among
    ``ROLES``, contents strings); ValueError of one line naming ``where`` otherwise."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: a conversation is a non-empty list of {{'role', 'content'}} messages")
    for i, message in enumerate(messages):
        if not (isinstance(message, Mapping) and message.get("role") in ROLES
                and isinstance(message.get("content"), str)):
            raise ValueError(f"{where}: message {i} must be {{'role': one of {', '.join(ROLES)}, 'content': str}}, "
                             f"got {message!r}"[:300])
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def conversation_text(messages: list[dict]) -> str:
    """A conversation as the ``Problem.question`` text that carries it (its JSON), read back by
    ``conversation_of``."""
    return json.dumps(messages, ensure_ascii=False)


def conversation_of(question: str) -> list[dict] | None:
    """The conversation a ``Problem.question`` carries (``conversation_text``), None for a plain
    question."""
    if not question.startswith('[{"role"'):
        return None
    try:
        return check_messages(json.loads(question), "question")
    except ValueError:  # also json.JSONDecodeError: a plain question that happens to start so
        return None


def build_conversation_prompt(tokenizer: Any, messages: list[dict], *, system: str | None = None) -> list[int]:
    """Token ids of a conversation's prompt: ``messages`` (after a ``system`` turn, unless they open
    with their own) through the chat template with ``add_generation_prompt=True``; without a
    template, each message as ``"{role}: {content}"`` on its own line, then ``"assistant:"``."""
    if system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}, *messages]
    if getattr(tokenizer, "chat_template", None):
        return _as_token_ids(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return _as_token_ids(tokenizer(text)["input_ids"])


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


def arithmetic_prompt(tokenizer: Any, question: str) -> list[int]:
    """The arithmetic recipes' prompt (``recipes/arithmetic.py`` and the recipes built on it): the
    question as the user turn of the chat template, followed by ``ARITHMETIC_INSTRUCTION``."""
    return build_chat_prompt(tokenizer, question, instruction_suffix=ARITHMETIC_INSTRUCTION)
