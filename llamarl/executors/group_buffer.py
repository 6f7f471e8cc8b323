"""GroupBuffer: the generator's bookkeeping between steps of which groups are in flight and which are done.

A group is one prompt's ``group_size`` samples, its id the prompt's data index; sample ``j`` of
group ``g`` has ``sample_id = g * group_size + j``. A group is handed out (``take_done``) only when
all its samples finished, because the advantage baseline needs the whole group. Between steps the
buffer holds:

- the data position: prompts claimed so far by every data-parallel replica. A round of ``counts``
  (prompts per replica) gives replica ``d`` the indices ``position + sum(counts[:d]) ..`` and moves
  the position past all of them, so replicas take disjoint prompts and a resumed run neither skips
  nor repeats one (``claim``);
- the problem of every open group (``open`` records it; ``skip`` counts a prompt left out);
- the carried samples: unfinished ones (partial rollouts, ``--generator.token-budget``), resumed
  at the next step (``take_carried``);
- the finished samples of groups not yet complete (``add`` sorts an engine's outputs into both);
- the counters of skipped prompts and of samples restarted as stale (``restart_stale``).

Plain Python (``Request`` / ``Completion`` / ``Problem`` dataclasses): no process group, engine or
model, so it is tested on its own (tests/test_group_buffer.py). ``state_dict`` is JSON-ready: what
the generator's checkpoint keeps of it.
"""

from __future__ import annotations

from dataclasses import asdict

from llamarl.data.prompts import Problem
from llamarl.engines.base import Completion, Request

__all__ = ["GroupBuffer"]

Group = tuple[int, list[Completion], Problem]
"""A finished group: ``(id, its completions by sample id, its problem)`` (``dynamic_sampling.Group``)."""


class GroupBuffer:
    """The groups in flight between the generator's steps (module docstring)."""

    def __init__(self, group_size: int) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.group_size = group_size
        self.data_position = 0
        self.carried: list[Request] = []
        self.finished: dict[int, list[Completion]] = {}
        self.problems: dict[int, Problem] = {}
        self.skipped_prompts = 0
        self.restarted_stale = 0

    def claim(self, counts: list[int], *, replica: int) -> range:
        """The data indices of replica ``replica``'s ``counts[replica]`` prompts in a round where replica
        ``d`` takes ``counts[d]``: after the lower replicas' runs; the position moves past the round."""
        first = self.data_position + sum(counts[:replica])
        self.data_position += sum(counts)
        return range(first, first + counts[replica])

    def open(self, index: int, problem: Problem, prompt_ids: list[int]) -> list[Request]:
        """Record group ``index``'s ``problem``; its ``group_size`` fresh requests of ``prompt_ids``."""
        self.problems[index] = problem
        n = self.group_size
        return [Request(sample_id=index * n + j, prompt_ids=list(prompt_ids)) for j in range(n)]

    def skip(self) -> None:
        """Count a claimed prompt left out (too long for the trainer's budget)."""
        self.skipped_prompts += 1

    def problem(self, sample_id: int) -> Problem:
        """The problem of the group sample ``sample_id`` belongs to."""
        return self.problems[sample_id // self.group_size]

    def take_carried(self) -> list[Request]:
        """The carried samples, to resume now; the buffer keeps none."""
        carried, self.carried = self.carried, []
        return carried

    def add(self, outputs: list[Completion]) -> None:
        """Sort an engine's outputs: ``carried`` ones are resumed next step, the others join their group."""
        for out in outputs:
            if out.finish_reason == "carried":
                self.carried.append(out.to_request())
            else:
                self.finished.setdefault(out.sample_id // self.group_size, []).append(out)

    def take_done(self) -> list[Group]:
        """Every group whose samples have all finished, by group id: ``(id, completions, problem)``,
        removed from the buffer."""
        n = self.group_size
        done = sorted(g for g, outs in self.finished.items() if len(outs) == n)
        return [(g, sorted(self.finished.pop(g), key=lambda o: o.sample_id), self.problems.pop(g)) for g in done]

    def restart_stale(self, oldest_allowed: int) -> list[int]:
        """Restart from its prompt every group with a carried sample and a sampled token of a version
        below ``oldest_allowed`` (in any of its samples, finished ones included): all its samples at once,
        so they stay in step. Observation tokens (version -1) never count. Returns the restarted
        group ids (counted in ``restarted_stale``, by sample)."""
        n = self.group_size
        prompts: dict[int, list[int]] = {}
        for sample in self.carried + [c for outs in self.finished.values() for c in outs]:
            sampled = [v for v in sample.versions if v >= 0]  # observation tokens have no version
            if sampled and min(sampled) < oldest_allowed:
                prompts[sample.sample_id // n] = list(sample.prompt_ids)
        stale = {g for g in prompts if any(r.sample_id // n == g for r in self.carried)}
        if not stale:
            return []
        self.carried = [r for r in self.carried if r.sample_id // n not in stale]
        for g in sorted(stale):
            self.finished.pop(g, None)
            self.carried += [Request(sample_id=g * n + j, prompt_ids=list(prompts[g])) for j in range(n)]
        self.restarted_stale += n * len(stale)
        return sorted(stale)

    @property
    def num_carried(self) -> int:
        return len(self.carried)

    def state_dict(self) -> dict:
        """The buffer as JSON-ready values (``load_state_dict`` takes it back)."""
        return {
            "data_position": self.data_position, "skipped_prompts": self.skipped_prompts,
            "restarted_stale": self.restarted_stale,
            "carried": [asdict(r) for r in self.carried],
            "finished": {str(g): [asdict(c) for c in outs] for g, outs in self.finished.items()},
            "problems": {str(g): asdict(p) for g, p in self.problems.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict``'s values (counters a checkpoint lacks start at 0)."""
        self.data_position = int(state["data_position"])
        self.skipped_prompts = int(state.get("skipped_prompts", 0))
        self.restarted_stale = int(state.get("restarted_stale", 0))
        self.carried = [Request(**r) for r in state["carried"]]
        self.finished = {int(g): [Completion(**c) for c in outs] for g, outs in state["finished"].items()}
        self.problems = {int(g): Problem(**p) for g, p in state["problems"].items()}
