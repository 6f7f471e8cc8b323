"""The engine contract: what every generation engine takes and returns, and how one is chosen.

An engine is a class that implements ``GenerationEngine`` plus its config: an ``EngineConfig``
dataclass (its own settings, each with a docstring, checked in ``__post_init__``) whose
``build(setup)`` makes the engine from an ``EngineSetup`` (what every engine is built from: the
live model, its path, dtype, EOS / pad ids, seed, device, TP group), registered with
``@register_engine("name")``. ``--generator.engine name`` selects it and ``--generator.<name>.*``
sets its config (the ``GeneratorConfig`` field named after it; an engine registered by a recipe
without such a field is built from its config's defaults). The generator executor holds the engine
through this contract only: no branch on which engine it is. The native engine (``torch``,
llamarl/engines/torch_engine.py) and vLLM (``vllm``, llamarl/engines/vllm_engine.py) are the two
registered here, their settings (``TorchEngineConfig``, ``VLLMEngineConfig``) in the light
llamarl/engines/engine_configs.py, so reading a run's settings imports no engine; a third (SGLang,
a remote server) is one more config with one registration and a module its ``build`` imports.

Optional capabilities, declared here and checked once when the engine is built (never found by the
engine's class or name):

- ``EngineConfig.streams_weights`` (a class flag of the config, known before the build): the engine
  loads the checkpoint itself and takes each weight sync as a stream (``StreamsWeights.load_weights``,
  required of what it builds). The generator then keeps only the model's layout (meta device, unsharded)
  and hands the weight channels a sink into the engine.
- ``EngineConfig.tensor_parallel``: the engine runs on a TP group (``EngineSetup.tp_group``); without
  it ``--generator.tp`` must be 1.
- ``Sleeps``: built with ``sleep_mode`` (its config allows it and ``EngineSetup.shares_device``), the
  engine frees its accelerator memory when the generator calls ``sleep()`` after each step.
- ``ReportsCounters``: ``counters()``, logged each step as ``gen_engine_<name>``.

Types (token ids in, token ids out: nothing is re-tokenised, so what the policy sampled is what
the trainer trains):

- ``SamplingParams``: temperature / top-p / top-k, ``max_new_tokens`` for the whole completion,
  ``stop_token_ids``: ids that end a completion besides the model's EOS ids (a tool call's
  closing token ends a turn; the stop token is kept in the output, ``finish_reason == "stop"``),
  and ``stop``: strings that end it where its text reaches one (``include_stop_text``: the
  returned text keeps the stop string or ends before it; the ids always end where the text does;
  llamarl/engines/stop_text.py).
- ``Request``: a prompt, and for a carried (partial) sample its completion so far with the
  behaviour log-prob and weight version of each of its tokens, and its ``loss_mask``: 1 for a token
  the policy sampled, 0 for one an environment inserted (an observation: log-prob 0, version -1,
  never trained). Empty means every token was sampled.
- ``Completion``: the request's carried part unchanged plus the new tokens, each tagged with the
  ``version`` of the weights that sampled it; ``finish_reason`` ``stop`` / ``length`` / ``carried``;
  after a stop string, ``stop_text`` (which one) and ``text`` (the turn's text, cut).

Stop strings (decision, llamarl/engines/stop_text.py): the engine gets the run's tokenizer in its
setup (``EngineSetup.tokenizer``) and decodes the sampled ids at its own looks only to decide where
to stop; the ids stay the sampled ones (nothing is re-tokenised), cut after the token that
completes the stop (a stop ending inside a token keeps that token; the text is cut inside it), and
the behaviour log-probs are those of exactly the kept ids. A call with ``stop`` to an engine built
without a tokenizer is a ValueError.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

import torch

from llamarl.runtime.registry import Registry

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CARRIED = "carried"


@dataclass
class SamplingParams:
    """Decoding settings; ``max_new_tokens`` bounds the whole completion, carried tokens included."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    """Ids that end a completion besides the engine's EOS ids (kept in the output, "stop")."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a completion ("stop") where the text of its last policy turn (its sampled
    tokens since the last observation, carried-in ones included) first reaches one; the engine
    needs a tokenizer (``EngineSetup.tokenizer``). llamarl/engines/stop_text.py."""
    include_stop_text: bool = True
    """With ``stop``: True, the returned text ends with the stop string and the ids with the token
    that completes it; False, the text ends before the stop string and the ids with the token where
    that text ends (a token holding text before the stop and the stop's start is kept)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(int(t) < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids}")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")


@dataclass
class Request:
    """One sample to generate; non-empty ``completion_ids`` resume a carried-over partial output."""

    sample_id: int
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # behaviour log-probs of completion_ids
    versions: list[int] = field(default_factory=list)  # weight version behind each completion token
    loss_mask: list[int] = field(default_factory=list)  # 1 sampled, 0 observation; empty: all sampled
    episode: dict = field(default_factory=dict)  # an environment episode's JSON state (engines pass it on)


@dataclass
class Completion:
    """A generated sample; ``finish_reason`` is "stop" (a stop id, kept), "length" or "carried"."""

    sample_id: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    loss_mask: list[int] = field(default_factory=list)
    """Per completion token: 1 sampled by the policy, 0 inserted by an environment (always filled)."""
    episode: dict = field(default_factory=dict)
    """The request's environment episode state, passed on unchanged by the engine."""
    stop_text: str | None = None
    """The stop string (``SamplingParams.stop``) that ended it; None when none did."""
    text: str | None = None
    """After a stop string: the text of its last policy turn (``turn_start`` on), cut at the stop
    (after it, or before it without ``include_stop_text``); None otherwise (decode the ids)."""

    def to_request(self) -> Request:
        """Return a ``Request`` that resumes this (carried) completion where it stopped."""
        return Request(sample_id=self.sample_id, prompt_ids=list(self.prompt_ids),
                       completion_ids=list(self.completion_ids), logprobs=list(self.logprobs),
                       versions=list(self.versions), loss_mask=sampled_mask(self), episode=dict(self.episode))


class NonFiniteLogits(ValueError):
    """Logits with a NaN or +inf (or only -inf) in a row: nothing to draw from. The policy's weights
    or activations are not finite; the generator reports it with its weights version."""


def check_finite_logprobs(outputs: list[Completion], *, version: int) -> None:
    """Raise ``NonFiniteLogits`` (one line: the weights version, how many samples) when a sampled
    token's behaviour log-prob is not finite: it was drawn from non-finite logits (the samplers keep
    such a row's token in range and its log-prob NaN, so this check, on the host values every engine
    returns, catches them all)."""
    bad = [o.sample_id for o in outputs
           if any(not math.isfinite(lp) for lp, m in zip(o.logprobs, sampled_mask(o)) if m)]
    if bad:
        raise NonFiniteLogits(f"weights version {version} gave non-finite logits (NaN / Inf) for {len(bad)} of "
                              f"{len(outputs)} samples (ids {bad[:4]}): the policy's weights or activations are not "
                              "finite; resume from an earlier checkpoint, or lower --trainer.lr")


def sampled_mask(sample: Request | Completion) -> list[int]:
    """``sample.loss_mask``, or all ones when it is empty (a sample without observations)."""
    return list(sample.loss_mask) if sample.loss_mask else [1] * len(sample.completion_ids)


def turn_start(sample: Request | Completion) -> int:
    """Where the sample's last policy turn begins in ``completion_ids``: after its last observation
    token (loss mask 0), 0 without one."""
    mask = sample.loss_mask
    return next((i + 1 for i in range(len(mask) - 1, -1, -1) if not mask[i]), 0)


def stop_ids(eos_token_ids: Iterable[int], sampling: SamplingParams) -> list[int]:
    """Every id that ends a completion: the engine's EOS ids, then the request's stop ids."""
    ids = [int(t) for t in eos_token_ids]
    return ids + [int(t) for t in sampling.stop_token_ids if int(t) not in ids]


def check_request(req: Request, *, sampling: SamplingParams, eos_token_ids: list[int], vocab: int) -> None:
    """Raise ValueError naming the request when it cannot be generated or resumed: empty prompt,
    carried parts of unequal lengths, more carried tokens than ``max_new_tokens``, already ended
    with a stop id, or token ids outside the vocabulary. Shared by every engine."""
    n = len(req.completion_ids)
    if not req.prompt_ids:
        raise ValueError(f"request {req.sample_id} has an empty prompt")
    if len(req.logprobs) != n or len(req.versions) != n or (req.loss_mask and len(req.loss_mask) != n):
        raise ValueError(f"request {req.sample_id}: completion_ids, logprobs, versions (and loss_mask) must have "
                         "equal lengths")
    if n > sampling.max_new_tokens:
        raise ValueError(
            f"request {req.sample_id} carries {n} tokens, more than max_new_tokens={sampling.max_new_tokens}"
        )
    # A sampled stop id ended the sample; an observation may well end with the same token.
    if n and req.completion_ids[-1] in stop_ids(eos_token_ids, sampling) and (not req.loss_mask or req.loss_mask[-1]):
        raise ValueError(f"request {req.sample_id} already ended with a stop id (EOS or stop_token_ids); "
                         "it cannot be resumed")
    ids = list(req.prompt_ids) + list(req.completion_ids)
    if min(ids) < 0 or max(ids) >= vocab:
        raise ValueError(f"request {req.sample_id} has token ids outside [0, {vocab})")
    if any(not 0 <= int(t) < vocab for t in sampling.stop_token_ids):
        raise ValueError(f"stop_token_ids {sampling.stop_token_ids} has ids outside [0, {vocab})")


def finish_completion(req: Request, ids: list[int], lps: list[float], version: int, reason: str) -> Completion:
    """The request's carried-in part unchanged, then the new tokens tagged ``version``."""
    return Completion(sample_id=req.sample_id, prompt_ids=list(req.prompt_ids),
                      completion_ids=list(req.completion_ids) + ids, logprobs=list(req.logprobs) + lps,
                      versions=list(req.versions) + [version] * len(ids), finish_reason=reason,
                      loss_mask=sampled_mask(req) + [1] * len(ids), episode=dict(req.episode))


@runtime_checkable
class GenerationEngine(Protocol):
    """What the generator executor needs of an engine.

    ``generate``: one ``Completion`` per request, in input order; a request ends on an EOS or stop
    id ("stop", the id kept), at ``sampling.max_new_tokens`` counting carried tokens ("length"), or
    after ``token_budget`` new tokens in this call ("carried", resumable with ``to_request``);
    carried-in tokens come back unchanged and new ones are tagged ``version``; sampling draws from
    ``generator`` so a seeded generator makes a call reproducible. ``weights_updated(model)``: the
    live HF model the weight channel writes into (``GeneratorExecutor.get_model``) holds new weights;
    the next ``generate`` must use only them. ``close``: release threads and memory (idempotent).
    ``pad_token_id``: what rollout batches are padded with. What an engine may do besides is declared
    by its config's class flags and the optional protocols below (module docstring)."""

    pad_token_id: int

    def generate(self, requests: list[Request], *, sampling: SamplingParams, version: int,
                 generator: torch.Generator | None = None, token_budget: int | None = None) -> list[Completion]: ...

    def weights_updated(self, model: torch.nn.Module) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class StreamsWeights(Protocol):
    """Optional capability, required of an engine whose config has ``streams_weights``: it holds its
    own weights and loads a sync as a stream of ``(HF name, full tensor)``. ``shapes`` (every name
    the iterator will yield, with its shape) lets it check the whole update before consuming the
    iterator lazily; the next ``generate`` uses only the new weights."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                     shapes: dict[str, tuple[int, ...]] | None = None) -> None: ...


@runtime_checkable
class Sleeps(Protocol):
    """Optional capability: ``sleep()`` frees the engine's accelerator memory until its next use
    (``generate`` and ``load_weights`` wake what they need). ``sleep_mode``: whether this engine
    was built to sleep; the generator then calls ``sleep()`` after each step."""

    sleep_mode: bool

    def sleep(self) -> None: ...


@runtime_checkable
class ReportsCounters(Protocol):
    """Optional capability: ``counters()``, cumulative numbers the generator logs after each step as
    ``gen_engine_<name>`` (e.g. vLLM's ``wake_ups``: parts woken from sleep so far)."""

    def counters(self) -> dict[str, float]: ...


@dataclass(frozen=True)
class EngineSetup:
    """What every registered engine is built from, whatever its config (the run's and this rank's facts)."""

    model: torch.nn.Module
    """The live HF model on ``device`` (the weight channel's receive buffer); the native engine
    samples from it directly. An engine whose config ``streams_weights`` gets it on the meta device
    (layout only) from the generator: its weights then arrive through ``load_weights(..., shapes=)``."""
    model_path: str
    """Its HF directory (or hub id), for engines that load the checkpoint themselves."""
    dtype: str
    """Compute dtype (``float32`` / ``bfloat16``)."""
    eos_token_ids: list[int]
    """Ids that end every completion (the tokenizer's and the generation config's EOS ids)."""
    pad_token_id: int
    """Rollout padding id."""
    seed: int
    """The engine's own seed (per data-parallel replica)."""
    device: torch.device
    """This rank's device (``ctx.device``)."""
    max_num_seqs: int | None = None
    """Most rows decoding at once (None: the engine's own choice; the native engine takes every
    request of a call)."""
    tp_group: object = None
    """The rank's tensor-parallel group (a ProcessGroup; None without TP): the native engine shares
    each step's sampled tokens from ``tp_src`` over it; vLLM spans the group with one engine."""
    tp_src: int = 0
    """The TP group's first rank (global rank)."""
    shares_device: bool = False
    """Another executor runs on this rank (``--run.schedule colocated``): an engine that can free its
    memory between generations (``Sleeps``) is built to, when its config allows it."""
    tokenizer: object = None
    """The run's tokenizer (HF): engines decode sampled ids with it to match stop strings
    (``SamplingParams.stop``); None, a call with stop strings is a ValueError."""


@dataclass
class EngineConfig:
    """Base of every engine's settings (``--generator.<name>.*``): subclass it as a dataclass with a
    docstring under every field, checks in ``__post_init__`` (``ValueError`` naming the flag) and
    ``build``, and register the subclass with ``@register_engine("name")``. The class flags declare
    what the engine can do (module docstring)."""

    streams_weights: ClassVar[bool] = False
    """The engine loads the checkpoint itself and each sync is streamed into ``load_weights``
    (``StreamsWeights``); the generator keeps only the model's layout, unsharded."""
    tensor_parallel: ClassVar[bool] = False
    """The engine runs on a tensor-parallel group (``--generator.tp`` > 1)."""

    def build(self, setup: EngineSetup) -> GenerationEngine:
        """The engine, built with these settings from ``setup``."""
        raise NotImplementedError(f"{type(self).__name__}.build")


def _load_builtin_engines() -> None:
    import llamarl.engines  # noqa: F401 - its modules register the built-in engines


ENGINES: Registry[type[EngineConfig]] = Registry("engine", load_builtins=_load_builtin_engines)


def register_engine(name: str) -> Callable[[type[EngineConfig]], type[EngineConfig]]:
    """Class decorator: make the ``EngineConfig`` dataclass below it the engine called ``name``
    (``--generator.engine name``). ValueError when the name is taken, TypeError for anything but an
    ``EngineConfig`` dataclass."""

    def register(config_class: type[EngineConfig]) -> type[EngineConfig]:
        if not (isinstance(config_class, type) and issubclass(config_class, EngineConfig)
                and dataclasses.is_dataclass(config_class)):
            raise TypeError(f"@register_engine({name!r}) takes an EngineConfig dataclass with build(setup), "
                            f"got {config_class!r}")
        return ENGINES.add(name, config_class)

    return register


def engine_names() -> list[str]:
    """The registered engines' names, sorted."""
    return ENGINES.names()


def engine_config_class(name: str) -> type[EngineConfig]:
    """The config class registered as ``name``; ValueError listing the known names otherwise."""
    return ENGINES.get(name)


def build_engine(name: str, setup: EngineSetup, config: EngineConfig | None = None) -> GenerationEngine:
    """The engine registered as ``name``, built from ``setup`` with ``config`` (None: its config's
    defaults). ValueError listing the known names for an unknown one; TypeError when ``config`` is
    not that engine's, or the built engine lacks the contract or a capability its config declares."""
    config_class = ENGINES.get(name)
    if config is None:
        config = config_class()
    elif not isinstance(config, config_class):
        raise TypeError(f"engine {name!r} takes a {config_class.__name__}, got a {type(config).__name__}")
    engine = config.build(setup)
    if not isinstance(engine, GenerationEngine):
        raise TypeError(f"engine {name!r} built a {type(engine).__name__}, which lacks generate / "
                        "weights_updated / close / pad_token_id (llamarl.engines.base.GenerationEngine)")
    if config.streams_weights and not isinstance(engine, StreamsWeights):
        raise TypeError(f"engine {name!r} declares streams_weights but its {type(engine).__name__} lacks "
                        "load_weights(named_tensors, *, shapes=) (llamarl.engines.base.StreamsWeights)")
    return engine
