"""Trajectory scorers, ``(trajectory, problem) -> float`` (llamarl/rewards/trajectory.py): the
trajectory's wire form (round trip, bad input), its segments taken from the loss mask, scoring in
the reward pool's workers and inline, the reward executor's use of the batch's trajectory strings,
and the guess-the-number environment played over four turns through the episode runner."""

from __future__ import annotations

import pytest

from llamarl.data.prompts import Problem
from llamarl.engines.base import Completion, Request, SamplingParams, sampled_mask
from llamarl.environments.episode_engine import EpisodeRunner
from llamarl.environments.guess import GuessNumberEnvironment, GuessNumberTask, guess_reward
from llamarl.environments.tool_workers import ToolRunner
from llamarl.executors.generator import completions_to_batch
from llamarl.executors.reward import score_rollouts
from llamarl.rewards.pool import RewardPool
from llamarl.rewards.trajectory import Segment, Trajectory, resolve_trajectory_scorer, trajectory_of


class CharTokenizer:
    """Ids are code points: decode is exact, so segments can be checked character by character."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def completion(text: str, mask: list[int], *, episode: dict | None = None) -> Completion:
    ids = [ord(c) for c in text]
    return Completion(sample_id=0, prompt_ids=[1], completion_ids=ids, logprobs=[0.0] * len(ids),
                      versions=[0] * len(ids), finish_reason="stop", loss_mask=mask, episode=episode or {})


def test_a_trajectory_is_split_where_the_loss_mask_changes_and_round_trips_as_json():
    c = completion("8\nno\n12\n", [1, 1, 0, 0, 0, 1, 1, 1],
                   episode={"turns": 2, "reward": 0.5, "state": {"guesses": [8, 12]}})
    t = trajectory_of(c, CharTokenizer())
    assert t.segments == [Segment("8\n", True), Segment("no\n", False), Segment("12\n", True)]
    assert (t.text, t.policy_text, t.observations) == ("8\nno\n12\n", "8\n12\n", ["no\n"])
    assert (t.num_turns, t.env_reward, t.env_state, t.finish_reason) == (2, 0.5, {"guesses": [8, 12]}, "stop")
    assert Trajectory.from_json(t.to_json()) == t
    single = trajectory_of(completion("42", []), CharTokenizer())  # no mask: all sampled, one segment
    assert single.segments == [Segment("42", True)] and single.env_reward is None


@pytest.mark.parametrize(("text", "message"), [
    ("[]", "needs a 'segments' list"),
    ('{"segments": [{"text": "a"}]}', "segment 0 must be"),
    ('{"segments": [], "env_reward": "high"}', "env_reward must be a finite number"),
    ('{"segments": [], "env_reward": NaN}', "env_reward must be a finite number"),
    ('{"segments": [], "num_turns": "2"}', "num_turns an integer"),
])
def test_a_malformed_trajectory_is_a_one_line_error_naming_the_field(text, message):
    with pytest.raises(ValueError, match=message):
        Trajectory.from_json(text)


def test_unknown_trajectory_scorers_list_the_registered_ones():
    with pytest.raises(ValueError, match="unknown trajectory scorer 'nope'; registered: env"):
        resolve_trajectory_scorer("nope")
    with pytest.raises(ValueError, match="cannot import trajectory scorer"):
        resolve_trajectory_scorer("scorers_for_tests:missing")


@pytest.mark.parametrize("num_workers", [0, 1])
def test_the_pool_scores_trajectories_with_the_problem_and_counts_bad_ones(num_workers):
    won = trajectory_of(completion("8\nhigher\n11\n", [1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
                                   episode={"turns": 2, "reward": 0.875}), CharTokenizer()).to_json()
    lost = trajectory_of(completion("3\n", [1, 1], episode={"turns": 1}), CharTokenizer()).to_json()
    problem = Problem(question="a number between 1 and 16", answer="11")
    with RewardPool("env", kind="trajectory", num_workers=num_workers) as pool:
        assert pool.score_trajectories([won, lost, "{not json"], [problem] * 3) == [0.875, 0.0, 0.0]
        assert pool.stats()["num_errors"] == 1  # the bad JSON: a scorer error, 0.0, the run goes on
        with pytest.raises(ValueError, match="score_batch needs a text scorer"):
            pool.score_batch(["x"], ["y"])
    with RewardPool("scorers_for_tests:solved_in_few_turns", kind="trajectory", num_workers=num_workers) as pool:
        other = Problem(question="a word", answer="11")
        assert pool.score_trajectories([won, won, lost], [problem, other, problem]) == [0.5, 0.0, 0.0]


def test_the_reward_executor_scores_the_batch_trajectories_against_its_problems():
    episodes = [completion("11\n", [1, 1, 1], episode={"turns": 1, "reward": 1.0}),
                completion("9\nhigher\n", [1, 1, 0, 0, 0, 0, 0, 0, 0], episode={"turns": 1})]
    tokenizer = CharTokenizer()
    batch = completions_to_batch(episodes, group_ids=[0, 0], references=["11", "11"], texts=["11\n", "9\nhigher\n"],
                                 pad_token_id=0, group_size=2, questions=["a number between 1 and 16"] * 2,
                                 trajectories=[trajectory_of(c, tokenizer).to_json() for c in episodes])
    with RewardPool("env", kind="trajectory", num_workers=0) as pool:
        scored, metrics = score_rollouts(pool, batch)
        assert scored["rewards"].tolist() == [1.0, 0.0] and metrics["reward_mean"] == 0.5
        bare = completions_to_batch(episodes, group_ids=[0, 0], references=["11", "11"], texts=["a", "b"],
                                    pad_token_id=0, group_size=2)
        with pytest.raises(ValueError, match="needs the batch's 'trajectory' and 'question' strings"):
            score_rollouts(pool, bare)


class ScriptedGuesser:
    """An engine (the GenerationEngine contract) whose k-th turn of every episode is ``guesses[k]``
    and a newline, sampled at log-prob -0.5."""

    pad_token_id = 0

    def __init__(self, tokenizer, guesses: list[int]) -> None:
        self.tokenizer, self.guesses = tokenizer, guesses

    def generate(self, requests, *, sampling, version, generator=None, token_budget=None):
        outs = []
        for req in requests:
            ids = self.tokenizer(f" {self.guesses[req.episode['turns']]}\n", add_special_tokens=False)["input_ids"]
            assert ids[-1] in sampling.stop_token_ids  # the environment's stop text ends the turn
            outs.append(Completion(sample_id=req.sample_id, prompt_ids=req.prompt_ids,
                                   completion_ids=req.completion_ids + ids, logprobs=req.logprobs + [-0.5] * len(ids),
                                   versions=req.versions + [version] * len(ids), finish_reason="stop",
                                   loss_mask=sampled_mask(req) + [1] * len(ids), episode=dict(req.episode)))
        return outs

    def weights_updated(self, model) -> None: ...

    def close(self) -> None: ...


def test_guess_the_number_plays_four_turns_of_feedback_and_rewards_few_guesses():
    from tiny_model import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    problem = Problem(question="I am thinking of a number between 1 and 16.", answer="11")
    runner = EpisodeRunner(ScriptedGuesser(tokenizer, [8, 12, 10, 11, 11, 11]), environment=GuessNumberEnvironment(),
                           tools=ToolRunner("guess_number", timeout_s=5.0, num_workers=0), tokenizer=tokenizer,
                           max_turns=6, problem_of=lambda sample_id: problem)
    out = runner.generate([Request(sample_id=0, prompt_ids=[5])], sampling=SamplingParams(max_new_tokens=200),
                          version=2)[0]
    trajectory = trajectory_of(out, tokenizer)
    assert [s.text for s in trajectory.segments if s.trained] == [" 8\n", " 12\n", " 10\n", " 11\n"]
    assert trajectory.observations == ["Answer: higher\nGuess:", "Answer: lower\nGuess:", "Answer: higher\nGuess:"]
    assert trajectory.num_turns == 4 and trajectory.env_state["guesses"] == [8, 12, 10, 11]
    assert trajectory.env_reward == guess_reward(4) == 1 - 3 / 8 and out.finish_reason == "stop"
    assert resolve_trajectory_scorer("env")(trajectory, problem) == 0.625
    # A game never won within max_turns ends at the length limit, unrewarded.
    lost = EpisodeRunner(ScriptedGuesser(tokenizer, [1] * 6), environment=GuessNumberEnvironment(),
                         tools=ToolRunner("guess_number", timeout_s=5.0, num_workers=0), tokenizer=tokenizer,
                         max_turns=3, problem_of=lambda sample_id: problem).generate(
        [Request(sample_id=0, prompt_ids=[5])], sampling=SamplingParams(max_new_tokens=200), version=2)[0]
    assert lost.finish_reason == "length" and lost.episode["turns"] == 3 and "reward" not in lost.episode


def test_guess_the_number_rules():
    env = GuessNumberEnvironment()
    state = env.reset(Problem(question="I am thinking of a number between 1 and 16.", answer="5"))
    assert state == {"secret": 5, "high": 16, "guesses": []}
    turn = env.step(state, "hmm\n")
    assert turn.observation == "Answer: a number, please\nGuess:" and turn.state["guesses"] == [None]
    assert env.step(turn.state, "7\n").observation.startswith("Answer: lower")
    assert [guess_reward(k) for k in (1, 2, 8, 9, 20)] == [1.0, 0.875, 0.125, 0.0, 0.0]
    with pytest.raises(ValueError, match="between 1 and N"):
        env.reset(Problem(question="guess", answer="5"))
    task = GuessNumberTask(high=16)
    secrets = [int(task.sample(i).answer) for i in range(200)]
    assert min(secrets) == 1 and max(secrets) == 16 and secrets == [int(task.sample(i).answer) for i in range(200)]
