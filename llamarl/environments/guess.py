"""Guess the number: an episode of several turns with feedback, rewarded by solving in few guesses.

The problem's answer is the secret (an integer in ``[1, high]``, ``high`` read from the question's
"between 1 and N"). Each policy turn is a guess ending with a newline (the stop text); the
environment answers ``Answer: higher`` / ``Answer: lower`` and asks for the next guess, or ends
the episode with its reward (``done``: nothing more is appended):

    Guess: 8                     <- sampled ("8\\n" is the turn)
    Answer: higher               <- observation (context, never trained), then "Guess:"
    Guess: 12                    <- right: the episode ends, reward 1 - (2 - 1) / MAX_GUESSES

The reward (``Turn.reward``, read by the ``env`` trajectory scorer) is ``1 - (k - 1) /
MAX_GUESSES`` when the secret is found at guess ``k`` (1.0 at the first guess), 0.0 otherwise; a
turn with no number is a wasted guess (``Answer: a number, please``). The episode ends at the
right guess, at ``--env.max-turns`` guesses, at EOS or at the token budget. The state is the secret
and the guesses so far, so an episode in progress is checkpointed and resumed exactly.
"""

from __future__ import annotations

import random
import re

from llamarl.data.prompts import Problem
from llamarl.environments.base import Turn, register_environment

MAX_GUESSES = 8
"""Guesses the reward counts down over: the k-th guess being right is worth ``1 - (k - 1) / 8``."""
_RANGE = re.compile(r"between 1 and (\d+)")
_NUMBER = re.compile(r"-?\d+")


def guess_reward(num_guesses: int) -> float:
    """The reward of finding the secret at guess ``num_guesses`` (1-based)."""
    return max(0.0, 1.0 - (num_guesses - 1) / MAX_GUESSES)


@register_environment("guess_number")
class GuessNumberEnvironment:
    """See the module docstring."""

    def stop_texts(self) -> list[str]:
        return ["\n"]  # a guess is one line

    def end_texts(self) -> list[str]:
        return []

    def reset(self, problem: Problem) -> dict:
        match = _RANGE.search(problem.question)
        if match is None or not problem.answer.strip().isdigit():
            raise ValueError(f"guess_number needs a question with 'between 1 and N' and an integer answer, got "
                             f"{problem.question!r} / {problem.answer!r}")
        return {"secret": int(problem.answer), "high": int(match.group(1)), "guesses": []}

    def step(self, state: dict, turn: str) -> Turn:
        numbers = _NUMBER.findall(turn)
        guesses = [*state["guesses"], int(numbers[-1]) if numbers else None]
        new_state = {**state, "guesses": guesses}
        if not numbers:
            return Turn(observation="Answer: a number, please\nGuess:", state=new_state)
        guess, secret = guesses[-1], state["secret"]
        if guess == secret:
            return Turn(state=new_state, done=True, reward=guess_reward(len(guesses)))
        return Turn(observation=f"Answer: {'higher' if guess < secret else 'lower'}\nGuess:", state=new_state)


class GuessNumberTask:
    """Secrets uniform in ``[1, high]``: ``sample(index)`` for training, ``heldout(n)`` seeded apart."""

    def __init__(self, *, high: int = 16, seed: int = 0) -> None:
        if high < 2:
            raise ValueError(f"high must be >= 2, got {high}")
        self.high, self.seed = high, seed

    def _problem(self, secret: int) -> Problem:
        return Problem(question=f"I am thinking of a number between 1 and {self.high}.", answer=str(secret))

    def sample(self, index: int) -> Problem:
        """Training game number ``index`` (>= 0): deterministic across processes."""
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        return self._problem(random.Random(f"llamarl-guess-train:{self.high}:{self.seed}:{index}").randint(1, self.high))

    def heldout(self, num: int) -> list[Problem]:
        """``num`` evaluation games (their own seed stream; secrets repeat, games are few)."""
        rng = random.Random(f"llamarl-guess-heldout:{self.high}")
        return [self._problem(rng.randint(1, self.high)) for _ in range(num)]
