"""World split validation happens before any process group is created."""

import pytest
import torch.distributed as dist

from llamarl.runtime.world import ExecutorContext, ExecutorSpec, plan_ranks


def test_plan_assigns_consecutive_ranges_in_order():
    specs = [ExecutorSpec("generator", 2), ExecutorSpec("reward", 1), ExecutorSpec("trainer", 3)]
    assert plan_ranks(specs, 6) == {"generator": [0, 1], "reward": [2], "trainer": [3, 4, 5]}


@pytest.mark.parametrize(("specs", "message"), [
    ([ExecutorSpec("generator", 2), ExecutorSpec("trainer", 1)], "generator=2 \\+ trainer=1 = 3 does not match the world size 4"),
    ([ExecutorSpec("generator", 4), ExecutorSpec("trainer", 0)], "'trainer' has 0 ranks"),
    ([ExecutorSpec("a", 2), ExecutorSpec("a", 2)], "unique"),
    ([], "at least one"),
])
def test_bad_split_is_a_value_error(specs, message):
    with pytest.raises(ValueError, match=message):
        plan_ranks(specs, 4)


def test_bad_split_through_create_fails_before_any_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="does not match the world size 3"):
        ExecutorContext.create([ExecutorSpec("generator", 1), ExecutorSpec("trainer", 1)])
    assert not dist.is_initialized()
