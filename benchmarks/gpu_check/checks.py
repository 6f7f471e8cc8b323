"""Each section's targets (issues 45's and 46's Targets; ``common.TARGETS``) against its numbers: a pure
function of the section's result, so the met / MISSED logic is tested on CPU with made-up results.

A check is ``{"what", "value", "target", "met"}``: ``met`` True (met), False (MISSED) or None (not
measured: the number is missing, e.g. a section cut short). A missed target is a finding of the
report, not a failure of the command."""

from __future__ import annotations

from gpu_check.common import TARGETS


def _check(what: str, value, target: str, met: bool | None) -> dict:
    return {"what": what, "value": value, "target": target, "met": met}


def _at_most(what: str, value: float | None, limit: float) -> dict:
    return _check(what, value, f"<= {limit:g}", None if value is None else value <= limit)


def _at_least(what: str, value: float | None, limit: float, spec: str = "g") -> dict:
    return _check(what, value, f">= {limit:{spec}}", None if value is None else value >= limit)


def step_limit(shape: str, rows_index: int) -> float:
    """The most a decode step may take over its bound: the first row count (64) has a target per
    shape (a shape without one, the smoke's tiny, takes 135M's), the others (256) one for all."""
    if rows_index == 0:
        per_shape = TARGETS["step_vs_bound_64"]
        return per_shape.get(shape, per_shape["smollm2-135m"])
    return TARGETS["step_vs_bound_256"]


def shape_checks(result: dict) -> list[dict]:
    """``shape:<name>``: at each row count the worst step over its live-KV bound (every width and
    sampling mode must meet it), and the longest capture of the shape's ladder."""
    found = []
    shape = result.get("shape", "?")
    for index, rows in enumerate(result.get("rows", [])):
        steps = [s for s in result.get("steps", []) if s["rows"] == rows and s.get("vs_bound") is not None]
        worst = max(steps, key=lambda s: s["vs_bound"], default=None)
        what = f"{shape}: decode step / bound with live KV, {rows} rows" + (
            f" (worst: width {worst['width']}, {worst['mode']})" if worst else "")
        found.append(_at_most(what, None if worst is None else worst["vs_bound"], step_limit(shape, index)))
    found.append(_at_most(f"{shape}: seconds capturing the graphs of a width's calls (the longest width)", result.get("capture_s_max"),
                          TARGETS["capture_seconds_per_shape"]))
    return found


def tick_checks(result: dict) -> list[dict]:
    """``tick:<name>``: generated tokens/s at 135M (and the smoke's tiny), its fraction of the
    tick's bound at 1.5B; other shapes report their numbers without a target."""
    shape = result.get("shape", "?")
    if shape in ("smollm2-135m", "tiny"):
        return [_at_least(f"{shape}: tick generated tokens/s", result.get("gen_tokens_per_s"),
                          TARGETS["tick_gen_tokens_per_s_135m"], ",.0f")]
    if shape == "qwen2.5-1.5b":
        return [_at_least(f"{shape}: tick generated tokens/s over its bound", result.get("gen_vs_bound"),
                          TARGETS["tick_fraction_of_bound_1.5b"]), tick_memory_check(result)]
    return []


def tick_memory_check(result: dict) -> dict:
    """Issue 46: the colocated tick (generator resident beside the trainer) fits the device: its
    peak allocated memory over the device's, MISSED on an out-of-memory error."""
    limit = TARGETS["tick_memory_fraction_1.5b"]
    what = f"{result.get('shape', '?')}: colocated tick's peak memory / the device's (generator's weights resident)"
    if result.get("out_of_memory"):
        return _check(what, "out of memory", f"<= {limit:g}", False)
    peak, total = result.get("peak_gpu_memory_gib"), result.get("device_memory_gib")
    return _at_most(what, peak / total if peak and total else None, limit)


def train_checks(result: dict) -> list[dict]:
    """``train:<name>``: each case's MFU (forward + backward + AdamW step over the data sheet's peak)
    against the shape's target (the smoke's tiny takes 135M's); one not measured where no case ran."""
    shape = result.get("shape", "?")
    per_shape = TARGETS["train_mfu"]
    limit = per_shape.get(shape, per_shape["smollm2-135m"])
    found = []
    for entry in result.get("methods", {}).values():
        for case in entry.get("cases", []):
            what = (f"{shape}: trainer MFU, {method_name(entry)}, shared prompts "
                    f"{'on' if case['share_prompts'] else 'off'}" + (", layers compiled" if case.get("compiled") else ""))
            found.append(_at_least(what, case.get("mfu"), limit))
    return found or [_at_least(f"{shape}: trainer MFU", None, limit)]


def method_name(entry: dict) -> str:
    return f"LoRA rank {entry['lora_rank']}" if entry.get("method") == "lora" else "full fine-tuning"


def tests_checks(result: dict) -> list[dict]:
    counts = result.get("counts")
    failed = None if counts is None else counts.get("failed", 0) + counts.get("error", 0)
    return [_check("tests/gpu failures", failed, "0", None if failed is None else failed == TARGETS["tests_failed"])]


def recipe_checks(result: dict) -> list[dict]:
    limit, value = TARGETS["recipe_seconds_to_0.70"], result.get("seconds_to_0.70")
    what = "training seconds to 0.70 held-out accuracy"
    if result.get("accuracy_meaningful") is False:
        return [_check(what, None, f"<= {limit:g}", None)]
    if value is None and result.get("evals"):  # the run evaluated and never reached it
        return [_check(what, f"not reached in {result['ticks']} ticks", f"<= {limit:g}", False)]
    return [_at_most(what, value, limit)]


def checks(name: str, result: dict) -> list[dict]:
    """The checks of section ``name`` (``shape:<x>``, ``tick:<x>``, ``train:<x>``, ``tests``, ``recipe``)."""
    kind = name.split(":", 1)[0]
    return {"shape": shape_checks, "tick": tick_checks, "train": train_checks, "tests": tests_checks,
            "recipe": recipe_checks}[kind](result)


def tally(report_checks: list[dict]) -> dict[str, int]:
    """How many checks were met, MISSED and not measured."""
    counts = {"met": 0, "missed": 0, "not measured": 0}
    for check in report_checks:
        counts[{True: "met", False: "missed", None: "not measured"}[check["met"]]] += 1
    return counts
