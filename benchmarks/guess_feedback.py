"""How a guess-the-number run's greedy games change with training (not a test).

    .venv/bin/python benchmarks/guess_feedback.py RUN_DIR

Reads every ``RUN_DIR/eval_*.jsonl`` (one greedy game per held-out problem: the transcript and its
score, the environment's reward) and prints per evaluation: the mean reward, the games won, the
guesses per game, and how often a guess moved the way the previous answer said (after "higher" a
larger number, after "lower" a smaller one): the skill the feedback is there to teach.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

_GUESS = re.compile(r"(?:^|Guess:)\s*(-?\d+)")
_ANSWER = re.compile(r"Answer: (higher|lower)")


def game_stats(transcript: str) -> tuple[int, int, int]:
    """``(guesses, moves after an answer, moves the way the answer said)`` of one transcript."""
    guesses = [int(g) for g in _GUESS.findall(transcript)]
    answers = _ANSWER.findall(transcript)
    moves = followed = 0
    for i, answer in enumerate(answers):
        if i + 1 < len(guesses):
            moves += 1
            followed += (guesses[i + 1] > guesses[i]) if answer == "higher" else (guesses[i + 1] < guesses[i])
    return len(guesses), moves, followed


def summarize(path: Path) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    stats = [game_stats(r["completion"]) for r in rows]
    moves = sum(s[1] for s in stats)
    return {"games": len(rows), "mean_reward": sum(r["score"] for r in rows) / max(len(rows), 1),
            "won": sum(r["score"] > 0 for r in rows), "guesses_per_game": sum(s[0] for s in stats) / max(len(rows), 1),
            "moves": moves, "followed": sum(s[2] for s in stats) / max(moves, 1)}


def tick_of(path: Path) -> int:
    name = path.stem
    return 0 if name == "eval_base" else int(name.rsplit("_", 1)[1]) if name.startswith("eval_step_") else 10**9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args()
    paths = sorted(args.run_dir.glob("eval_*.jsonl"), key=tick_of)
    if not paths:
        raise SystemExit(f"{args.run_dir}: no eval_*.jsonl (a run with evaluations?)")
    print("| evaluation | mean reward | games won | guesses per game | moves the way the answer said |")
    print("|---|---|---|---|---|")
    for path in paths:
        s = summarize(path)
        print(f"| {path.stem} | {s['mean_reward']:.3f} | {s['won']}/{s['games']} | {s['guesses_per_game']:.1f} | "
              f"{s['followed']:.2f} of {s['moves']} |")


if __name__ == "__main__":
    main()
