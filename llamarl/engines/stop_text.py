"""Stop strings (``SamplingParams.stop``): where a completion's text reaches one, and which of its
sampled tokens that keeps. Shared by every engine (the native loop's looks: scheduler.py; vLLM's
outputs: vllm_engine.py).

Decision (how an engine gets the text): the engine is built with the run's tokenizer
(``EngineSetup.tokenizer``: ``TorchEngine(tokenizer=)``, ``VLLMEngine(tokenizer=)``) and decodes
sampled ids with it (special tokens kept, no clean-up) only to decide where to stop: the ids stay
the sampled ones, nothing is re-tokenised. A call with stop strings to an engine without a
tokenizer is a ValueError (``TextStops``).

What is matched: the text of the completion's last policy turn, the decoded ids from its last
observation on (``base.turn_start``), carried-in ones included, so a stop split by a carry (two
calls) is found. The stop whose first occurrence *ends* first wins (what a streaming check sees
first; equal ends: the one starting first).

The cut ("the ids end where the text does"):

* ``include_stop_text=True``: the text ends with the stop string; the ids are the fewest whose
  decoded text starts with that text, i.e. they end with the token that completes the stop. A stop
  ending **inside** a token keeps that token (its log-prob too); the text is cut inside it.
* ``include_stop_text=False``: the text ends where the stop begins; the ids are the fewest whose
  text covers it. A token holding text before the stop and the stop's beginning is kept (the text
  cut inside it); a stop at the turn's first token keeps no token of the turn.

The behaviour log-probs returned are those of exactly the kept ids.

Cost: at a look only the tokens since the last check and a look-back of ``back`` tokens (the longest
stop's UTF-8 bytes + 3) are decoded: every token decodes to at least one byte, so a stop ending in
the new tokens begins inside the look-back, and the 3 tokens of margin absorb how decoding a slice
differs at its start (a SentencePiece leading space, a split UTF-8 character).
"""

from __future__ import annotations

MARGIN_TOKENS = 3
"""Tokens decoded before a stop's earliest possible start (module docstring)."""


class TextStops:
    """One call's stop strings over ``tokenizer`` (module docstring); ValueError, one line, for stop
    strings without a tokenizer."""

    def __init__(self, tokenizer, stops: list[str], *, include: bool) -> None:
        if tokenizer is None:
            raise ValueError(f"stop strings {stops!r} need the tokenizer to read the sampled text: build the engine "
                             "with one (EngineSetup.tokenizer / tokenizer=)")
        self.tokenizer, self.stops, self.include = tokenizer, list(stops), bool(include)
        self.back = max(len(s.encode()) for s in self.stops) + MARGIN_TOKENS
        """Tokens before the last checked one that a look decodes again."""

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def first(self, text: str) -> tuple[int, int, str] | None:
        """``(start, end, stop)`` of the stop that ends first in ``text``; None without one."""
        best = None
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0 and (best is None or (at + len(stop), at) < (best[1], best[0])):
                best = (at, at + len(stop), stop)
        return best

    def match(self, ids: list[int]) -> tuple[int, str, str] | None:
        """``(kept, stop, text)`` for a turn's ``ids``: how many of them are kept, which stop ended
        the turn and its text cut (module docstring); None when no stop is in their text."""
        text = self.decode(ids)
        found = self.first(text)
        if found is None:
            return None
        start, end, stop = found
        cut = text[: end if self.include else start]
        kept = len(ids)  # a tokenizer whose prefixes do not decode to prefixes: keep them all
        for k in range(len(ids) + 1):
            if self.decode(ids[:k]).startswith(cut):
                kept = k
                break
        return kept, stop, cut

    def search(self, turn: list[int], *, checked: int) -> tuple[int, str] | None:
        """Incremental ``match`` of ``turn`` (a turn's ids, the first ``checked`` of them already
        searched): ``(kept, stop)`` with ``kept`` counted from the turn's start, or None. Decodes
        the unchecked tokens and ``back`` before them only."""
        low = max(0, checked - self.back)
        found = self.match(turn[low:])
        return None if found is None else (low + found[0], found[1])

    def turn_text(self, turn: list[int]) -> str:
        """The text of a turn that a stop ended, cut (``match``'s); its full text without a stop."""
        found = self.match(turn)
        return self.decode(turn) if found is None else found[2]


def cut_at_stop(text: str, stop: str, *, include: bool) -> str:
    """``text`` up to the end (``include``) or the start of the first ``stop`` in it; all of it without one."""
    at = text.find(stop)
    return text if at < 0 else text[: at + len(stop) if include else at]
