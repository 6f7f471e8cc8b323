"""A run's identity: what a checkpoint must share with the run that resumes it.

Every checkpoint's ``COMPLETE.json`` holds ``identity``, a flat ``{field: value}`` map:

- ``recipe``: the recipe's name (``arithmetic``, ``gsm8k``, ...);
- ``model.weights``: a fingerprint of the model's weights (xxh3-128 over every tensor's name, dtype
  and shape in its safetensors headers, and its ``config.json``), so another architecture, size or
  vocabulary is caught even under the same path; a Hub id not on disk is recorded as the id;
- ``dataset``: a fingerprint of the training problems the task serves (the first
  ``DATASET_SAMPLES`` of its stream, questions and answers: another file, split, seed or task);
- every configuration flag that changes what is computed, by its dotted name (``trainer.lr``,
  ``algo.loss``, ``model.name``, ``generator.temperature``, ``trainer.lora.rank``, ...).

Not recorded, so free to change on resume (``SAFE``): how long the run is and where it writes
(``run.max_steps``, ``run.output_dir``, ``checkpoint.*``, ``export.*``), what it logs and evaluates
(``run.eval_every``, ``run.log_samples``, ``run.wandb_*``, ``eval.*``), timeouts, and where and how
the same computation runs: rank counts and tensor parallelism (a trainer checkpoint reshards),
threads, the generation engine and its settings, micro-batching, activation checkpointing, log-prob
chunking, shared-prompt packing, the weight channel; the learning rate's defaults
(``trainer.full_lr``, ``trainer.lora.lr``), since ``trainer.lr`` records the rate taken (settled
before the identity is made: a resume giving that rate explicitly is the same run). A recipe's own
fields are recorded unless listed here.

``check_identity`` compares a checkpoint's identity with this run's and refuses a difference with
one line listing the differing fields, unless ``--checkpoint.allow-changes`` names each (a field,
or a section such as ``trainer`` for all its fields). A checkpoint written before identities
existed is accepted with a warning.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict
from pathlib import Path

DATASET_SAMPLES = 256

SAFE = (
    "checkpoint.", "export.", "eval.", "run.max_steps", "run.output_dir", "run.collective_timeout_s",
    "run.liveness_timeout_s", "run.eval_every", "run.num_eval_problems", "run.device_guard", "run.log_samples",
    "run.stop_on_no_signal",
    "run.wandb_", "generator.num_ranks", "generator.tp", "generator.num_threads", "generator.engine",
    "generator.torch.", "generator.vllm.", "generator.max_num_seqs", "reward.num_ranks", "reward.num_workers",
    "reward.device", "reward.timeout_s", "trainer.num_threads", "trainer.activation_checkpointing",
    "trainer.compile",
    "trainer.logprob_chunk_tokens", "trainer.max_tokens_per_microbatch", "trainer.microbatch_rows",
    "trainer.share_prompts", "trainer.max_nonfinite_steps", "trainer.lora.export_merged", "weights.",
    "trainer.full_lr", "trainer.lora.lr",  # defaults of trainer.lr, which records the rate taken
    "env.num_tool_workers", "env.tool_timeout_s", "data.test_path", "task.eval_dataset",
)


def _flatten(value: dict, prefix: str = "") -> dict:
    out = {}
    for key, item in value.items():
        if isinstance(item, dict):
            out.update(_flatten(item, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = item
    return out


def _safe(key: str) -> bool:
    return any(key == s or (s.endswith((".", "_")) and key.startswith(s)) for s in SAFE)


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def model_fingerprint(source: str) -> str:
    """The fingerprint of the model at ``source`` (what ``llamarl.models.loading.resolve_source``
    gives: a directory, or a Hub id) as the module docstring says; ``hub:<id>`` for a Hub id."""
    import xxhash

    if not Path(source).is_dir():
        return f"hub:{source}"
    source = Path(source)
    digest = xxhash.xxh3_128()
    for path in sorted(source.glob("*.safetensors")):
        header = _safetensors_header(path)
        for key in sorted(k for k in header if k != "__metadata__"):
            digest.update(f"{key}:{header[key]['dtype']}:{header[key]['shape']};".encode())
    config = source / "config.json"
    if config.is_file():
        digest.update(json.dumps(json.loads(config.read_text()), sort_keys=True).encode())
    return digest.hexdigest()


def dataset_fingerprint(task) -> str:
    """The fingerprint of the problems ``task`` (``sample(index) -> Problem``) serves first."""
    import xxhash

    digest = xxhash.xxh3_128()
    for index in range(DATASET_SAMPLES):
        problem = task.sample(index)
        digest.update(json.dumps([problem.question, problem.answer]).encode())
    return digest.hexdigest()


def run_identity(config, *, recipe: str, dataset: str | None, model_source: str) -> dict:
    """This run's identity (module docstring) from ``config`` (a dataclass), the recipe's name, the
    dataset fingerprint (None: the pipeline has no task) and where the model loads from
    (``model_source``: ``resolve_source(config.model.name)``; this module sits below the models)."""
    flat = _flatten(asdict(config))
    identity: dict = {"recipe": recipe, "model.weights": model_fingerprint(model_source)}
    if dataset is not None:
        identity["dataset"] = dataset
    identity.update({key: value for key, value in sorted(flat.items()) if not _safe(key)})
    return json.loads(json.dumps(identity))  # the JSON form, as a marker holds it (tuples as lists)


def allowed(key: str, allow: tuple[str, ...]) -> bool:
    """Whether ``--checkpoint.allow-changes`` ``allow`` names ``key`` (or a section above it)."""
    return any(key == a or key.startswith(a.rstrip(".") + ".") for a in allow)


def differences(saved: dict, current: dict) -> list[str]:
    """The fields whose value differs (or that one side lacks), sorted."""
    missing = object()
    return sorted(k for k in set(saved) | set(current) if saved.get(k, missing) != current.get(k, missing))


def identity_defaults(config) -> dict:
    """The recorded fields' default values (``type(config)()``'s), so that a field a newer llamarl
    added is no difference when this run keeps its default; ``{}`` when the class cannot be built
    with no arguments."""
    try:
        flat = _flatten(asdict(type(config)()))
    except Exception:  # noqa: BLE001 - a config class with required fields: no defaults known
        return {}
    return json.loads(json.dumps({key: value for key, value in flat.items() if not _safe(key)}))


def check_allow(allow: tuple[str, ...], known: set[str]) -> None:
    """Refuse (one line) an ``--checkpoint.allow-changes`` entry that names no identity field or section."""
    unknown = [a for a in allow if not any(k == a or k.startswith(a.rstrip(".") + ".") for k in known)]
    if unknown:
        sections = sorted({k.split(".")[0] for k in known})
        raise ValueError(f"--checkpoint.allow-changes names no field of the run's identity: {', '.join(unknown)} "
                         f"(fields are dotted flag names such as trainer.lr, or sections: {', '.join(sections)})")


def check_identity(saved: dict | None, current: dict, *, allow: tuple[str, ...], where: Path,
                   defaults: dict | None = None) -> list[str]:
    """Refuse (ValueError, one line) a checkpoint ``where`` whose identity ``saved`` differs from
    ``current`` in a field ``allow`` does not name; return the allowed differences as
    ``field: old -> new`` (for a log line). ``saved`` None (an older checkpoint) is accepted:
    returns ``["<no identity>"]``. A field the checkpoint lacks is no difference while this run
    keeps its default (``defaults``: a field added since); one this run lacks (removed since) is
    none either. An ``allow`` entry naming no field is refused (a typo)."""
    if saved is None:
        return ["<no identity>"]
    check_allow(allow, set(saved) | set(current))
    defaults = defaults or {}
    missing = object()
    diff = [k for k in differences(saved, current)
            if k in current and not (k not in saved and defaults.get(k, missing) == current[k])]
    refused = [k for k in diff if not allowed(k, allow)]
    if refused:
        shown = ", ".join(f"{k}: {_short(saved, k)} -> {_short(current, k)}" for k in refused[:6])
        more = f" (and {len(refused) - 6} more)" if len(refused) > 6 else ""
        # The flag to paste comes first: a long line is cut at its end.
        raise ValueError(f"checkpoint {where} belongs to another run (--checkpoint.allow-changes "
                         f"{','.join(refused)} accepts it; docs/troubleshooting.md says which changes are safe): "
                         f"{shown}{more}")
    return [f"{k}: {_short(saved, k)} -> {_short(current, k)}" for k in diff]


def _short(identity: dict, key: str) -> str:
    text = json.dumps(identity[key]) if key in identity else "<absent>"
    return text if len(text) <= 60 else text[:57] + "..."
