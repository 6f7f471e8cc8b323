"""Checks of a whole run's configuration that need more than one field, or the file system, run on
every rank before any process group exists, so that bad input costs a one-line error and nothing
else: a recipe's entry point turns the ValueError into ``llamarl: config error: ...`` printed once
for the whole job, exit code 2 (``llamarl.runtime.errors.config_errors``).

Per-field checks live in each config's ``__post_init__`` (each section beside its owner, composed by
``llamarl/rl/config.py``); the rank split is checked by ``Pipeline.specs`` (and ``world.plan_ranks``),
also before any group is made. What only the data can tell (a prompt too long for the budget, a
broken row) is skipped with a warning and counted where it is read.
"""

from __future__ import annotations

import inspect
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from huggingface_hub import constants, try_to_load_from_cache

from llamarl.algorithms.config import check_wait_meets_lag
from llamarl.environments.config import EnvConfig
from llamarl.executors.config import RewardConfig
from llamarl.models.loading import KNOWN_ALIASES, resolve_source
from llamarl.rl.config import RLConfig
from llamarl.rl.run_plan import expected_lag, model_context_length
from llamarl.runtime.checkpoint import resolve_resume
from llamarl.runtime.registry import import_path


def _writable(path: Path) -> bool:
    """Whether ``path`` can be created or written: a directory can be made in its nearest existing
    ancestor (which must be a directory). Leaves nothing behind."""
    for candidate in [path, *path.parents]:
        if candidate.exists():
            if not candidate.is_dir():
                return False
            # A real probe, not os.access: root passes every permission check, yet cannot make a
            # directory in /proc or on a read-only mount.
            try:
                os.rmdir(tempfile.mkdtemp(prefix=".llamarl-probe-", dir=candidate))
            except OSError:
                return False
            return True
    return False


def check_model(name: str, flag: str = "--model.name") -> None:
    """Raise ValueError unless ``name`` can name a model: an existing directory, a built-in alias, or
    a hub id (offline, ``HF_HUB_OFFLINE``: one already in the local HF cache)."""
    if name in KNOWN_ALIASES:
        return
    path = Path(name).expanduser()
    if path.is_dir():
        return
    aliases = ", ".join(KNOWN_ALIASES)
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or path.exists():
        raise ValueError(f"{flag} {name}: no such model directory (nor a built-in alias: {aliases})")
    if not constants.HF_HUB_OFFLINE:
        return  # a hub id: whether it exists is known only once it is downloaded
    try:
        cached = isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a valid repo id
        cached = False
    if not cached:
        raise ValueError(f"{flag} {name}: no such model directory, not a built-in alias ({aliases}), and not "
                         f"in the local Hugging Face cache (HF_HUB_OFFLINE is set)")


def check_call(flag: str, value: str, item: Callable, parameters: tuple[str, ...], *, partial: bool = False) -> None:
    """ValueError naming ``flag`` when ``item`` cannot be called with ``parameters`` positional
    arguments (its signature, where Python can read one); ``partial``: more parameters, given as
    keywords, may follow."""
    try:
        signature = inspect.signature(item)
    except (TypeError, ValueError):  # a builtin or C function: nothing to read
        return
    try:
        (signature.bind_partial if partial else signature.bind)(*parameters)
    except TypeError:
        raise ValueError(f"{flag} {value}: {getattr(item, '__name__', value)}{signature} cannot be called as "
                         f"f({', '.join(parameters)})") from None


def check_scorers(reward: RewardConfig) -> None:
    """``--reward.scorer``, ``--reward.trajectory-scorer`` and each of ``--reward.funcs``, a
    registered name or ``module:function`` that imports and takes the scorer's two arguments (a
    TRL-style batch function: ``completions`` and keywords); ValueError (one line naming the flag)
    otherwise."""
    from llamarl.rewards import SCORERS
    from llamarl.rewards.trajectory import TRAJECTORY_SCORERS

    for flag, value, registry, parameters in (
            ("--reward.scorer", reward.scorer, SCORERS, ("completion", "reference")),
            ("--reward.trajectory-scorer", reward.trajectory_scorer, TRAJECTORY_SCORERS, ("trajectory", "problem"))):
        if value is None or value in registry:
            continue
        if ":" not in value:
            known = ", ".join(sorted(registry) if isinstance(registry, dict) else registry.names())
            raise ValueError(f"{flag} {value}: not a registered scorer ({known}) nor module:function")
        check_call(flag, value, import_path(value, kind="function", flag=flag), parameters)
    if reward.funcs is not None:  # each function imports; a per-sample one takes (completion, reference)
        from llamarl.rewards.funcs import is_batched, resolve_func, split_funcs

        for ref in split_funcs(reward.funcs):
            fn = resolve_func(ref)
            if not is_batched(fn):  # (completion, reference), then the columns it names
                check_call("--reward.funcs", ref, fn, ("completion", "reference"), partial=True)


def check_environment(env: EnvConfig) -> None:
    """``--env.name`` (registered, or a ``module:Class`` that imports and has the contract's methods)
    and ``--env.tools`` (each ``module:function`` imported and its schema made); ValueError, one
    line naming the flag, otherwise: found before the model loads, not when the generator starts."""
    from llamarl.environments.base import environment_names, resolve_environment_class
    from llamarl.environments.function_tools import resolve_tools

    if env.name is not None and ":" not in env.name and env.name not in environment_names():
        raise ValueError(f"--env.name must be one of {environment_names()} or module:Class, got {env.name!r}")
    if env.name is not None and ":" in env.name:
        try:
            resolve_environment_class(env.name)
        except ValueError as error:
            raise ValueError(f"--env.name {env.name}: {error}") from None
    if env.tools is not None:
        resolve_tools(env.tools)
    if env.tool_format is not None:
        from llamarl.environments.tool_formats import TOOL_FORMATS

        try:
            TOOL_FORMATS.get(env.tool_format)
        except ValueError as error:
            raise ValueError(f"--env.tool-format: {error}") from None


def _local_source(name: str) -> Path | None:
    """The directory ``--model.name`` loads from when it is on this machine (an alias converted if
    need be, as the run would); None for a hub id, whose files the executors fetch and check."""
    source = Path(name).expanduser()
    if name in KNOWN_ALIASES:
        source = Path(resolve_source(name))
    return source if (source / "config.json").is_file() else None


def check_environment_tokens(config: RLConfig) -> None:
    """What the generator checks of the environment against the policy's tokenizer, with the
    tokenizer alone, before any model loads: each stop and end text a non-empty string, the tool
    schemas, a chat template that frames tool answers (in the format it speaks). ValueError, one line naming ``--env.tools`` /
    ``--env.name`` and ``--model.name``. A hub id not on disk is checked by the generator instead."""
    env = config.env
    reference, source = env.reference(), _local_source(config.model.name)
    if reference is None or source is None:
        return
    from transformers import AutoTokenizer

    from llamarl.environments.base import EnvironmentContractError, check_tool_schemas, stop_tokens
    from llamarl.environments.building import build_environment
    from llamarl.environments.function_tools import tool_observation_format, tools_reference
    from llamarl.environments.tool_formats import choose_tool_format

    flag = f"--env.tools {env.tools}" if env.tools is not None else f"--env.name {env.name}"
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    if env.tools is not None and env.tool_format is None:  # the format the chat template speaks
        reference = tools_reference(env.tools, tool_format=choose_tool_format(tokenizer).name)
    try:
        environment = build_environment(reference)
        stop_tokens(environment, tokenizer)
        stop_tokens(environment, tokenizer, ending=True)
        schemas = check_tool_schemas(reference, environment)
        if schemas is not None:
            tool_observation_format(tokenizer, schemas)
    except (ValueError, EnvironmentContractError) as error:
        raise ValueError(f"{flag} with --model.name {config.model.name}: {error}") from None


def check_lora(config: RLConfig) -> None:
    """``--trainer.lora.*`` against the model and the rest of the run: the targets must match linears
    of the model's decoder layers (checked on its architecture built on the meta device, no weights
    read)."""
    spec = config.trainer.lora.spec()
    if spec is None:
        return
    source = Path(config.model.name).expanduser()
    if config.model.name in KNOWN_ALIASES:
        source = Path(resolve_source(config.model.name))
    if not (source / "config.json").is_file():
        return  # a hub id: its architecture is known once downloaded, where the trainer checks again
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(source)))
    spec.target_modules(model)


def validate_config(config: RLConfig) -> None:
    """Raise ValueError (one line, naming the flag and the value) for a configuration that cannot run.

    The rank split is not checked here: ``Pipeline.specs`` checks it for every pipeline, naming each
    stage's ``--*.num-ranks`` flag, before any process group exists."""
    check_scorers(config.reward)
    check_environment(config.env)
    name = config.model.name
    check_model(name)
    check_lora(config)
    check_environment_tokens(config)
    output = Path(config.run.output_dir or "runs")
    if not _writable(output):
        raise ValueError(f"--run.output-dir {output}: not writable")
    resume = config.checkpoint.resume
    if resume is not None and resume != "latest":
        # A checkpoint path is checked here, before any process group: the one-line error of
        # resolve_resume, not a traceback from every rank once the world exists.
        resolve_resume(resume, Path(resume).parent)
    generator, trainer = config.generator, config.trainer
    if generator.max_new_tokens >= trainer.max_tokens_per_microbatch:
        raise ValueError(f"--generator.max-new-tokens {generator.max_new_tokens} leaves no room for a prompt in "
                         f"--trainer.max-tokens-per-microbatch {trainer.max_tokens_per_microbatch}")
    context = model_context_length(name)
    if context is not None and generator.max_new_tokens >= context:
        raise ValueError(f"--generator.max-new-tokens {generator.max_new_tokens} does not fit the model's "
                         f"context of {context} tokens ({name})")
    if config.algo.advantage == "rloo" and generator.samples_per_prompt < 2:
        raise ValueError("--algo.advantage rloo needs --generator.samples-per-prompt >= 2, "
                         f"got {generator.samples_per_prompt}")
    algo = config.algo
    check_wait_meets_lag(algo, expected_lag(config), why=f"--run.schedule {config.run.schedule}, --run.async-lag "
                         f"{config.run.async_lag}, --trainer.num-minibatches {config.trainer.num_minibatches}")
