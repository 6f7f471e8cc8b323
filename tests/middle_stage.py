"""Shape checks shared by the recipes that put one stage between the reward and the trainer
(generator -> reward -> MIDDLE -> trainer: ``recipes/llm_judge.py``'s judge, ``recipes/ref_kl.py``'s
reference policy)."""

from __future__ import annotations

import pytest

from llamarl.rl.task import Task

TASK = Task(None, scorer="arithmetic")  # the shape only: nothing samples

# (schedule, async lag) -> which of the three data channels deliver within the tick: the middle
# stage adds no lag (its input arrives the tick the reward scored it).
SAME_TICK = [("async", 2, (False, True, False)), ("async", 1, (True, True, False)), ("sync", 2, (True, True, True))]


def check_middle_stage_pipeline(config_class, build, *, middle: str, channels: tuple[str, str, str]) -> None:
    """``build(config, task)`` (the recipe's pipeline builder) for ``config_class()``: colocated, every
    stage on the one rank with in-memory channels; a world too small for the split is refused naming
    ``--<middle>.num-ranks``; under async lag 2 / 1 and sync, the stages in data order, ``channels``
    linking them, and the same-tick pattern of ``SAME_TICK``."""
    stages = ["generator", "reward", middle, "trainer"]
    config = config_class()
    config.run.schedule = "colocated"  # every stage, the middle one included, on every rank
    pipeline = build(config, TASK)
    assert [s.num_ranks for s in pipeline.specs(1)] == [1, 1, 1, 1]
    assert all(pipeline.in_memory(c) for c in pipeline.channels)
    with pytest.raises(ValueError, match=rf"^--generator.num-ranks 1 \+ --{middle}.num-ranks 1 \+ at least 1 trainer "
                                         r"rank = 3 > the world size 2"):
        build(config_class(), TASK).specs(2)
    for schedule, lag, same in SAME_TICK:
        config = config_class()
        config.run.schedule, config.run.async_lag = schedule, lag
        pipeline = build(config, TASK)
        assert pipeline.order == stages
        data = [c for c in pipeline.channels if c.kind != "weights"]
        assert [(c.name, c.outbound, c.inbound) for c in data] == list(zip(channels, stages, stages[1:]))
        assert tuple(c.same_tick for c in data) == same
