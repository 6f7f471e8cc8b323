"""Environments for tests, importable by "envs_for_tests:NAME" in tool workers and torchrun worlds."""

from __future__ import annotations

from llamarl.data.prompts import Problem
from llamarl.environments.base import Turn


class DigitsEnv:
    """A turn ends at any digit (a tiny random model samples one every few tokens); the tool answers
    " ok" and the episode is done after its third call."""

    def stop_texts(self) -> list[str]:
        return list("0123456789")

    def end_texts(self) -> list[str]:
        return []

    def reset(self, problem: Problem) -> dict:
        return {"calls": 0}

    def step(self, state: dict, turn: str) -> Turn:
        calls = state["calls"] + 1
        return Turn(observation=" ok", state={"calls": calls}, done=calls >= 3)


class StopAtText:
    """A turn ends at ``text`` (set by the test; inline tools only); the tool answers " ok"."""

    text = "a"

    def stop_texts(self) -> list[str]:
        return [self.text]

    def end_texts(self) -> list[str]:
        return []

    def reset(self, problem) -> dict:
        return {"calls": 0}

    def step(self, state: dict, turn: str) -> Turn:
        return Turn(observation=" ok", state={"calls": state["calls"] + 1})


class RankDigitsEnv(DigitsEnv):
    """``DigitsEnv`` whose answer names the process's global rank (" r0", " r1", ...): TP peers
    running it each would append different observations; with the TP group's shared answers
    (``TurnShare``) every peer appends the first rank's."""

    def step(self, state: dict, turn: str) -> Turn:
        import os

        answered = super().step(state, turn)
        return Turn(observation=f" r{os.environ['RANK']}", state=answered.state, done=answered.done)


class BrokenToolEnv(DigitsEnv):
    """``DigitsEnv`` whose tool always raises: every call is a counted tool error (the progress line
    shows ``tool_err=<calls>/<calls>``)."""

    def step(self, state: dict, turn: str) -> Turn:
        raise RuntimeError("the tool is broken")
