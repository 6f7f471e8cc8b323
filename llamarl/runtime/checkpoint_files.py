"""What a checkpoint proves about itself: every file's size and xxh3-128 digest, taken as it is
written and checked before a run resumes from it (``--checkpoint.verify``).

Writing (``llamarl/run/controller.py``): each rank saves its executors' state inside ``recording(...)``;
every checkpoint writer (``write_json``, ``save_rng``, ``llamarl/runtime/sharded_state.py``, an executor's
pending outputs) calls ``written(path)`` right after its file is complete, which hashes it while its
pages are still in memory (xxh3-128, ~25 GB/s a core: the hash costs a fraction of the write). On
leaving ``recording`` the rank writes its manifest ``<step>.partial/.manifests/rank<r>.json``. After
the WORLD barrier, the committing rank merges the manifests (``collect_files``; a file no manifest
names, e.g. one a user's executor wrote with its own function, is hashed there), and the list goes
into ``COMPLETE.json`` under ``files`` with ``hash: "xxh3_128"``. Each rank hashes only its own
files, so the cost is spread like the writes (on several nodes, no rank reads another's files).

Verifying (``verify_checkpoint``, on one rank before anything on disk changes):

- ``full`` (default): every listed file exists, has its size and its digest, read in parallel;
- ``size``: sizes only (a truncated or missing file; not a same-size corruption);
- ``off``: nothing;

and with ``full`` or ``size`` every ``.json`` parses and every ``.safetensors`` header opens. A
checkpoint written before digests existed (no ``files`` in its marker) is accepted with a warning.
A file the runner rewrites in a committed checkpoint (``runner_state.json`` after the evaluation of
its step) goes through ``replace_committed_file``, so the marker always lists a digest it has.

Fault injection (``fault_point``): ``LLAMARL_FAULT=<phase>@<step>`` makes the process holding that
phase die there (SIGKILL; ``LLAMARL_FAULT_ACTION=raise`` raises instead, ``enospc`` raises the error
safetensors raises on a full disk). Phases: ``write`` (after an executor's files, where a full disk
is reported), ``state`` (after this rank's files, before the barrier),
``rename`` (before the partial directory is renamed), ``marker`` (after the rename, before
``COMPLETE.json``), ``prune`` (an old step renamed aside, not yet removed), ``archive`` (after the
first thing a resume moves aside). The tests of ``tests/test_checkpoint_faults.py`` use it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

HASH = "xxh3_128"
MANIFESTS = ".manifests"
_CHUNK = 16 << 20

_recording: list[tuple[Path, int, str]] | None = None  # this process's files of the checkpoint being written


class CheckpointInvalid(ValueError):
    """A checkpoint that does not verify; the message names the file and what is wrong."""


def file_digest(path: Path) -> tuple[int, str]:
    """``(size in bytes, xxh3-128 hex digest)`` of the file at ``path``, read in 16 MiB chunks."""
    import xxhash  # imported here: a process that never writes or verifies a checkpoint needs no xxhash

    digest, size = xxhash.xxh3_128(), 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


@contextmanager
def recording(root: Path, *, rank: int):
    """Record (``written``) the files this process writes under ``root`` (a ``step_<n>.partial``
    directory) and, on a normal exit, write them to ``root/.manifests/rank<rank>.json``."""
    global _recording
    _recording = []
    try:
        yield
        files = {str(path.relative_to(root)): [size, digest] for path, size, digest in _recording
                 if path.is_relative_to(root)}
        (root / MANIFESTS).mkdir(parents=True, exist_ok=True)
        tmp = root / MANIFESTS / f"rank{rank}.json.tmp"
        tmp.write_text(json.dumps(files))
        tmp.replace(root / MANIFESTS / f"rank{rank}.json")
    finally:
        _recording = None


def written(path: Path) -> None:
    """Say that the checkpoint file ``path`` is complete (a no-op outside ``recording``)."""
    if _recording is not None:
        path = Path(path).absolute()
        _recording.append((path, *file_digest(path)))


def collect_files(root: Path, *, skip: tuple[str, ...] = ()) -> dict[str, dict]:
    """Every file under ``root`` (a ``step_<n>.partial`` directory) with its size and digest: from
    the ranks' manifests where they name it, else hashed here. Removes the manifests."""
    manifests = root / MANIFESTS
    recorded: dict[str, list] = {}
    for manifest in sorted(manifests.glob("rank*.json")) if manifests.is_dir() else []:
        recorded.update(json.loads(manifest.read_text()))
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = str(path.relative_to(root))
        if rel.startswith(MANIFESTS + os.sep) or rel in skip or rel.endswith(".tmp"):
            continue
        size, digest = recorded[rel] if rel in recorded and recorded[rel][0] == path.stat().st_size \
            else file_digest(path)
        files[rel] = {"bytes": size, HASH: [digest]}
    shutil.rmtree(manifests, ignore_errors=True)
    return files


def _check_file(directory: Path, rel: str, entry: dict, mode: str) -> str | None:
    """Why ``directory/rel`` does not match its marker entry, or None."""
    path = directory / rel
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"{size} bytes, the checkpoint recorded {entry['bytes']}"
    if mode == "full":
        _, digest = file_digest(path)
        if digest not in entry[HASH]:
            return f"xxh3-128 {digest}, the checkpoint recorded {entry[HASH][-1]} (same size: corrupted)"
    try:
        if path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                f.keys()
    except Exception as exc:  # noqa: BLE001 - any unreadable header is this file's fault
        return f"does not open: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def verify_checkpoint(directory: Path, marker: dict, *, mode: str, threads: int = 4) -> bool:
    """Check ``directory``'s files against its marker ``marker`` (``COMPLETE.json``'s content) as
    ``mode`` says (module docstring). Returns False for a marker without digests (an older
    checkpoint: not verified); raises ``CheckpointInvalid`` naming the first bad file."""
    if mode == "off":
        return True
    files = marker.get("files")
    if files is None:
        return False
    if marker.get("hash") != HASH:
        raise CheckpointInvalid(f"{directory / 'COMPLETE.json'}: unknown hash {marker.get('hash')!r} (expected {HASH})")
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        problems = list(pool.map(lambda item: _check_file(directory, item[0], item[1], mode), sorted(files.items())))
    for (rel, _), problem in zip(sorted(files.items()), problems):
        if problem is not None:
            raise CheckpointInvalid(f"{directory / rel}: {problem}")
    return True


def replace_committed_file(directory: Path, name: str, value: dict, *, marker_name: str) -> None:
    """Rewrite the JSON file ``directory/name`` of a committed checkpoint and keep its marker true.

    A crash at any moment leaves a file whose digest the marker lists: the marker first accepts the
    new digest beside the old, then the file is replaced (atomically), then the old digest goes."""
    marker_path = directory / marker_name
    marker = json.loads(marker_path.read_text())
    data = json.dumps(value).encode()
    tmp = directory / (name + ".tmp")
    tmp.write_bytes(data)
    files = marker.get("files")
    if files is None:  # an older checkpoint without digests: nothing to keep true
        tmp.replace(directory / name)
        return
    size, digest = file_digest(tmp)
    old = files.get(name, {}).get(HASH, [])
    files[name] = {"bytes": size, HASH: [*old, digest]}
    _write_marker(marker_path, marker)
    tmp.replace(directory / name)
    files[name] = {"bytes": size, HASH: [digest]}
    _write_marker(marker_path, marker)


def _write_marker(path: Path, marker: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(marker))
    tmp.replace(path)


def fault_point(phase: str, step: int) -> None:
    """Die here if ``LLAMARL_FAULT`` is ``<phase>@<step>`` (module docstring): the tests' kill switch."""
    if os.environ.get("LLAMARL_FAULT") != f"{phase}@{step}":
        return
    action = os.environ.get("LLAMARL_FAULT_ACTION", "kill")
    if action == "raise":
        raise RuntimeError(f"injected fault during checkpoint {phase} of step {step}")
    if action == "enospc":
        from safetensors import SafetensorError

        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                              'message: "No space left on device" })')
    os.kill(os.getpid(), signal.SIGKILL)


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is a full disk: ``OSError(ENOSPC)``, or safetensors' error that wraps one."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(exc) or "StorageFull" in str(exc)


def disk_full_error(*, directory: Path, step: int, previous: dict | None, prefix: str) -> OSError:
    """The one-line error of a full disk while writing ``directory`` (the checkpoint of ``step``):
    the path, the step, the bytes the last complete checkpoint's files under ``prefix`` took
    (``previous``: its marker, or None) and what the filesystem has free."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    usage = shutil.disk_usage(existing)
    need = "unknown (no earlier checkpoint)"
    if previous is not None and previous.get("files"):
        total = sum(e["bytes"] for rel, e in previous["files"].items() if rel.startswith(prefix))
        need = f"about {total / 2**20:.1f} MiB (the last checkpoint's)"
    return OSError(errno.ENOSPC, f"no space left on device writing checkpoint step_{step} into {directory}: "
                                 f"needs {need}, {usage.free / 2**20:.1f} MiB free there; the earlier "
                                 "checkpoints are untouched (free space, then --checkpoint.resume latest)")
