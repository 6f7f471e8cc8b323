"""Which device each executor gets (llamarl/runtime/placement.py), decided from the specs and the node's
GPU count alone. These are the decisions every rank takes before the world exists; a world that
mixes GPU and CPU ranks (NCCL + gloo in each group, host staging between them) needs GPUs to run,
and no GPU machine was lent to the session that wrote it, so only the decisions and their
plumbing are tested here."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from llamarl.executors.config import RewardConfig
from llamarl.run.stages import Pipeline, Stage
from llamarl.runtime import world
from llamarl.runtime.placement import device_kinds, is_mixed, link_device, p2p_group
from llamarl.runtime.world import ExecutorContext, ExecutorSpec, plan_ranks


def kinds(specs, *, world_size, gpus=8, per_node=None, cuda=True):
    return placed(specs, world_size=world_size, gpus=gpus, per_node=per_node, cuda=cuda)[0]


def placed(specs, *, world_size, gpus=8, per_node=None, cuda=True):
    ranges = plan_ranks(specs, world_size)
    return device_kinds(specs, ranges, cuda=cuda, gpus_per_node=gpus, ranks_per_node=per_node or world_size)


def test_a_cpu_stage_frees_its_gpu_for_the_next_rank():
    """9 ranks on 8 GPUs, the reward (rank 2) on the host: the six trainer ranks take GPUs 2-7."""
    specs = [ExecutorSpec("generator", 2, tp=2), ExecutorSpec("reward", 1, device="cpu"), ExecutorSpec("trainer", 6)]
    got, gpu_index = placed(specs, world_size=9)
    assert got == {"generator": "cuda", "reward": "cpu", "trainer": "cuda"}
    assert gpu_index == {0: 0, 1: 1, 3: 2, 4: 3, 5: 4, 6: 5, 7: 6, 8: 7}
    # All on GPUs (8 ranks, 8 GPUs): each rank's GPU is its local rank, on every node.
    _, gpu_index = placed([ExecutorSpec("generator", 8), ExecutorSpec("trainer", 8)], world_size=16, per_node=8)
    assert gpu_index == {r: r % 8 for r in range(16)}
    # The same launch without --reward.device cpu leaves the last trainer rank without a GPU.
    specs = [ExecutorSpec("generator", 2, tp=2), ExecutorSpec("reward", 1), ExecutorSpec("trainer", 6)]
    with pytest.raises(ValueError, match=r"'trainer' has ranks \[3, 4, 5, 6, 7\] on GPUs and ranks \[8\] left"):
        placed(specs, world_size=9)


def test_one_gpu_each_and_the_ranks_beyond_the_gpus_on_the_host():
    # 9 ranks on 8 GPUs: 4 generator + 4 trainer on GPUs, the reward on local rank 8, which has none.
    specs = [ExecutorSpec("generator", 4), ExecutorSpec("trainer", 4), ExecutorSpec("reward", 1)]
    got = kinds(specs, world_size=9)
    assert got == {"generator": "cuda", "trainer": "cuda", "reward": "cpu"} and is_mixed(got)
    # Two nodes of 9 ranks (8 GPUs each): local rank = rank % 9, so ranks 8 and 17 have no GPU; a
    # trainer on ranks 8-15 would straddle them: one line naming it and both sets of ranks.
    specs = [ExecutorSpec("generator", 8), ExecutorSpec("trainer", 8), ExecutorSpec("reward", 2)]
    with pytest.raises(ValueError, match=r"'trainer' has ranks \[9, .*, 15\] on GPUs and ranks \[8\] left"):
        kinds(specs, world_size=18, per_node=9)


def test_a_stage_asked_for_cpu_runs_on_the_host_and_co_residents_follow_their_host():
    specs = [ExecutorSpec("generator", 1), ExecutorSpec("trainer", 1), ExecutorSpec("reward", 1, device="cpu"),
             ExecutorSpec("ref", 1, colocate_with="trainer")]
    assert kinds(specs, world_size=3) == {"generator": "cuda", "trainer": "cuda", "reward": "cpu", "ref": "cuda"}
    with pytest.raises(ValueError, match="shares the GPU ranks of 'trainer'"):
        kinds([ExecutorSpec("trainer", 1), ExecutorSpec("reward", 1, colocate_with="trainer", device="cpu")],
              world_size=1)
    # Without CUDA everything is on the host and nothing is mixed (today's CPU worlds, unchanged).
    assert set(kinds(specs, world_size=3, cuda=False).values()) == {"cpu"}
    assert not is_mixed(kinds(specs, world_size=3, cuda=False))
    with pytest.raises(ValueError, match="device must be one of"):
        plan_ranks([ExecutorSpec("trainer", 1, device="tpu")], 1)


def test_batches_between_a_gpu_and_a_cpu_executor_are_staged_on_the_host():
    gpu = torch.device("cuda", 3)
    assert link_device(gpu, "cuda", "cuda") == gpu
    assert link_device(gpu, "cuda", "cpu") == torch.device("cpu")
    assert link_device(torch.device("cpu"), "cpu", "cuda") == torch.device("cpu")
    ctx = ExecutorContext(rank=0, world_size=2, executor="trainer", ranks={"trainer": [0], "reward": [1]},
                          group=None, mesh=None, device=torch.device("cpu"))
    assert ctx.world_device == ctx.device and not ctx.mixed and ctx.link_device("reward") == ctx.device


def test_reward_device_flag_reaches_the_stage_and_needs_ranks_of_its_own():
    assert RewardConfig(num_ranks=1, device="cpu").device == "cpu"
    with pytest.raises(ValueError, match="--reward.device cpu needs --reward.num-ranks"):
        RewardConfig(num_ranks=0, device="cpu")
    build = lambda ctx: None
    pipeline = Pipeline(stages=[Stage("generator", build=build), Stage("reward", build=build, device="cpu"),
                                Stage("trainer", build=build, num_ranks=None)], channels=[])
    assert [s.device for s in pipeline.specs(3)] == ["auto", "cpu", "auto"]
    # Colocated, every stage shares the first one's ranks and device.
    assert [s.device for s in pipeline.colocated().specs(1)] == ["auto", "auto", "auto"]


GPU_GROUP = object()  # stands for this rank's handle of a mixed world's GPU-only NCCL group


@pytest.mark.parametrize(("src", "dst", "mixed", "want"), [
    ("cuda", "cuda", True, GPU_GROUP),  # CUDA on WORLD would wait for the CPU ranks: the GPU-only group
    ("cuda", "cpu", True, None), ("cpu", "cuda", True, None), ("cpu", "cpu", True, None),  # host buffers, gloo
    ("cuda", "cuda", False, None), ("cpu", "cpu", False, None),  # a world of one kind: WORLD, as before
])
def test_p2p_group_sends_gpu_to_gpu_links_of_a_mixed_world_on_the_gpu_only_group(src, dst, mixed, want):
    assert p2p_group(src_kind=src, dst_kind=dst, mixed=mixed, gpu_group=GPU_GROUP) is want


def test_p2p_group_refuses_unknown_kinds_and_a_mixed_gpu_link_without_its_group():
    for src, dst, end in [("tpu", "cuda", "source"), ("cuda", "meta", "destination"), ("cpu", None, "destination")]:
        with pytest.raises(ValueError, match=f"^point-to-point link: the {end} kind must be one of") as err:
            p2p_group(src_kind=src, dst_kind=dst, mixed=True, gpu_group=GPU_GROUP)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="without its GPU-only group"):
        p2p_group(src_kind="cuda", dst_kind="cuda", mixed=True, gpu_group=None)


def test_context_links_agree_on_device_and_group_at_both_ends():
    """The 9-ranks-on-8-GPUs world of the docs: generator and trainer on GPUs, the reward on the host."""
    kinds = {"generator": "cuda", "reward": "cpu", "trainer": "cuda"}
    ranks = {"generator": [0, 1], "reward": [2], "trainer": list(range(3, 9))}

    def ctx(executor, rank, *, gpu_group):
        device = torch.device("cpu") if kinds[executor] == "cpu" else torch.device("cuda", 0)
        return ExecutorContext(rank=rank, world_size=9, executor=executor, ranks=ranks, group=None, mesh=None,
                               device=device, device_kinds=kinds, world_device=torch.device("cpu"),
                               gpu_group=gpu_group)
    trainer, generator, reward = (ctx("trainer", 3, gpu_group=GPU_GROUP), ctx("generator", 0, gpu_group=GPU_GROUP),
                                  ctx("reward", 2, gpu_group=None))
    assert trainer.link_group("generator") is generator.link_group("trainer") is GPU_GROUP
    assert trainer.link_device("generator") == torch.device("cuda", 0)
    assert trainer.link_group("reward") is reward.link_group("trainer") is None
    assert reward.link_group("generator") is generator.link_group("reward") is None
    assert trainer.link_device("reward") == reward.link_device("trainer") == torch.device("cpu")


def test_a_mixed_world_makes_one_warmed_nccl_group_over_exactly_its_gpu_ranks(monkeypatch):
    """``new_group`` on every rank (collective), then one CUDA all-reduce on it by its members only,
    so its communicator exists before any point-to-point; a CPU rank keeps no handle."""
    specs = [ExecutorSpec("generator", 2, tp=2), ExecutorSpec("reward", 1, device="cpu"), ExecutorSpec("trainer", 6),
             ExecutorSpec("ref", 6, colocate_with="trainer")]
    ranges = plan_ranks(specs, 9)
    kinds = device_kinds(specs, ranges, cuda=True, gpus_per_node=8, ranks_per_node=9)[0]
    calls = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: calls.append(("new_group", ranks, kw)) or "handle")
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, **kw: calls.append(("all_reduce", tensor.device, kw)))
    meta = torch.device("meta")  # stands for the rank's GPU: no CUDA here
    timeout = timedelta(seconds=5)
    assert world._gpu_only_group(specs, ranges, kinds, on_gpu=True, device=meta, timeout=timeout) == "handle"
    assert calls == [("new_group", [0, 1, 3, 4, 5, 6, 7, 8], {"timeout": timeout, "backend": "nccl"}),
                     ("all_reduce", meta, {"group": "handle"})]
    calls.clear()
    assert world._gpu_only_group(specs, ranges, kinds, on_gpu=False, device=torch.device("cpu"), timeout=timeout) is None
    assert [c[0] for c in calls] == ["new_group"]
