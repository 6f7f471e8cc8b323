"""GroupBuffer (llamarl/executors/group_buffer.py) on its own: the generator's groups in flight between
steps (carried samples, finished groups, stale restarts, the data position), no engine, no processes."""

from __future__ import annotations

import json

import pytest

from llamarl.data.prompts import Problem
from llamarl.engines.base import Completion, Request
from llamarl.executors.group_buffer import GroupBuffer

N = 3  # samples per prompt


def problem(index: int) -> Problem:
    return Problem(question=f"q{index}", answer=str(index))


def out(sample_id: int, reason: str = "stop", versions: tuple[int, ...] = (0, 0), mask: tuple[int, ...] = ()) -> Completion:
    """A completion of ``sample_id`` with one token per entry of ``versions``."""
    return Completion(sample_id=sample_id, prompt_ids=[sample_id // N, 7], completion_ids=[5] * len(versions),
                      logprobs=[-0.5] * len(versions), versions=list(versions), finish_reason=reason,
                      loss_mask=list(mask) or [1] * len(versions))


def opened(buffer: GroupBuffer, *indices: int) -> list[Request]:
    return [r for i in indices for r in buffer.open(i, problem(i), [i, 7])]


def test_claim_gives_each_replica_a_disjoint_run_and_moves_the_position_past_the_round():
    replicas = [GroupBuffer(N) for _ in range(2)]
    seen = [[list(b.claim([3, 3], replica=d)) for _ in range(2)] for d, b in enumerate(replicas)]
    assert seen == [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 10, 11]]]
    assert all(b.data_position == 12 for b in replicas)
    # a refill round of unequal counts: replica 1 starts after replica 0's run
    assert list(replicas[1].claim([2, 1, 4], replica=1)) == [14] and replicas[1].data_position == 19
    assert list(replicas[0].claim([0, 2], replica=0)) == [] and replicas[0].data_position == 14


def test_open_records_the_problem_and_gives_one_fresh_request_per_sample():
    buffer = GroupBuffer(N)
    requests = opened(buffer, 4)
    assert [r.sample_id for r in requests] == [12, 13, 14]
    assert all(r.prompt_ids == [4, 7] and not r.completion_ids for r in requests)
    assert requests[0].prompt_ids is not requests[1].prompt_ids
    assert buffer.problem(13) == problem(4)
    buffer.skip()
    assert buffer.skipped_prompts == 1


def test_unfinished_samples_are_carried_and_a_group_is_done_only_when_all_its_samples_finished():
    buffer = GroupBuffer(N)
    opened(buffer, 0, 1)
    buffer.add([out(2), out(0), out(1, "carried"), out(3, "length"), out(4), out(5)])
    assert buffer.num_carried == 1 and buffer.carried[0].sample_id == 1
    assert buffer.carried[0].completion_ids == [5, 5]  # resumed where it stopped
    done = buffer.take_done()
    assert [(g, [c.sample_id for c in outs], p) for g, outs, p in done] == [(1, [3, 4, 5], problem(1))]
    assert buffer.take_done() == [] and 1 not in buffer.problems
    carried = buffer.take_carried()
    assert [r.sample_id for r in carried] == [1] and buffer.num_carried == 0
    buffer.add([out(1)])
    assert [g for g, _, _ in buffer.take_done()] == [0] and not buffer.finished and not buffer.problems


def test_stale_groups_restart_from_their_prompt_all_samples_at_once():
    buffer = GroupBuffer(N)
    opened(buffer, 0, 1, 2)
    buffer.add([
        out(0, versions=(1, 1)), out(1, "carried", versions=(3, 3)), out(2, versions=(3,)),  # group 0: old finished
        out(3, "carried", versions=(1, 2)), out(4, versions=(3,)), out(5, versions=(3,)),  # group 1: old carried
        out(6, versions=(1,)), out(7, versions=(1,)), out(8, versions=(1,)),  # group 2: old, but all finished
    ])
    assert buffer.restart_stale(2) == [0, 1]
    assert buffer.restarted_stale == 2 * N
    assert sorted(r.sample_id for r in buffer.carried) == [0, 1, 2, 3, 4, 5]
    assert all(not r.completion_ids and r.prompt_ids == [r.sample_id // N, 7] for r in buffer.carried)
    assert sorted(buffer.finished) == [2]  # a finished group is emitted, never restarted
    assert sorted(buffer.problems) == [0, 1, 2]  # restarted groups keep their problem
    assert buffer.restart_stale(2) == [] and buffer.restarted_stale == 2 * N


def test_observation_tokens_never_make_a_group_stale():
    buffer = GroupBuffer(N)
    opened(buffer, 0)
    buffer.add([out(0, "carried", versions=(5, -1, -1, 5), mask=(1, 0, 0, 1)), out(1, "carried", versions=(-1,), mask=(0,))])
    assert buffer.restart_stale(5) == [] and buffer.num_carried == 2
    assert buffer.restart_stale(6) == [0] and buffer.num_carried == N


def test_state_dict_round_trips_through_json_and_a_resumed_buffer_continues_where_it_stopped():
    buffer = GroupBuffer(N)
    opened(buffer, *buffer.claim([2, 2], replica=1))
    buffer.skip()
    buffer.add([out(6, "carried", versions=(0, 1)), out(7), out(9)])
    buffer.restart_stale(2)
    state = json.loads(json.dumps(buffer.state_dict()))
    resumed = GroupBuffer(N)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == buffer.state_dict()
    assert resumed.carried == buffer.carried and resumed.finished == buffer.finished
    assert resumed.problems == buffer.problems and resumed.problem(10) == problem(3)
    assert list(resumed.claim([2, 2], replica=1)) == list(buffer.claim([2, 2], replica=1)) == [6, 7]
    resumed.add([out(10), out(11)])
    assert [g for g, _, _ in resumed.take_done()] == [3]


def test_a_checkpoint_without_the_counters_starts_them_at_zero():
    buffer = GroupBuffer(N)
    buffer.load_state_dict({"data_position": 8, "carried": [], "finished": {}, "problems": {}})
    assert (buffer.data_position, buffer.skipped_prompts, buffer.restarted_stale) == (8, 0, 0)


def test_group_size_must_be_positive():
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        GroupBuffer(0)
