"""Layers point down only: no module of ``llamarl`` imports a module of a higher layer.

The layers, lowest first (``LAYERS`` below is the rule as data; a module belongs to the layer of
its longest matching name, and may import its own layer and any lower one):

1. ``runtime``: the payload (``batch``), shard boxes (``boxes``), the name registry, the logger,
   the job's errors, checkpoint files and sharded state, metrics files, the progress line, the
   training-sample log, a run's identity, the world (ranks, devices, process groups, placement,
   preflight, liveness, the shared run directory) and the ``Executor`` contract. It imports nothing
   of llamarl outside its folder (``test_runtime_imports_nothing_above_it``), so anything may use it.
2. ``data``: problems, prompts, datasets, micro-batch packing, the ``\\boxed{}`` parser.
3. ``models``: loading, FSDP2 / TP sharding, per-token log-probs, micro-batched forwards,
   in-place weight copies: plain functions of modules and tensors.
4. ``algorithms``: losses, advantages, the proximal policy (math on log-probs; may use models).
5. ``engines``: the generation contract and its engines (native, vLLM).
6. ``rewards`` and ``environments``: scorers, episodes, tools (they read engines' completions).
7. ``channels``: data and weights between executors' ranks (they call models' plain functions and
   the executors' contract, never an executor).
8. ``executors``: generator, reward, trainer, and the held-out sampling-and-scoring loop
   (``executors.evaluation_loop``).
9. ``run``: the pipeline described as data (``run.stages``), the controller, the runner and its
   objects (run directory, evaluations, log, checkpoints, summary, W&B), the launcher.
10. ``rl``: the standard pipeline and the ``Task`` it runs (with the tasks and stages that several
    recipes share: arithmetic, the dataset recipes', the reference policy's), the RL configuration
    (``rl.config``: ``RLConfig`` composing the sections, each defined beside its owner in that
    folder's ``config.py``), its checks and what it implies for a run; above it only ``recipes``,
    and no recipe imports another (``test_no_recipe_imports_a_recipe``).

So algorithms, data and models never import channels, executors or the runner. Pure AST: nothing
here imports the modules it checks. Every import counts, also one inside a function or under
``TYPE_CHECKING``: a lazy upward import is still an upward arrow. A new top-level module or
subpackage must be given its layer here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("runtime", ("llamarl", "llamarl.runtime")),
    ("data", ("llamarl.data",)),
    ("models", ("llamarl.models",)),
    ("algorithms", ("llamarl.algorithms",)),
    ("engines", ("llamarl.engines",)),
    ("rewards and environments", ("llamarl.rewards", "llamarl.environments")),
    ("channels", ("llamarl.channels",)),
    ("executors", ("llamarl.executors",)),
    ("run", ("llamarl.run",)),
    ("rl", ("llamarl.rl",)),
    ("recipes", ("recipes",)),
)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int | None:
    """Index in ``LAYERS`` of ``module``'s longest matching name; ``llamarl`` matches only itself."""
    best, index = "", None
    for i, (_, names) in enumerate(LAYERS):
        for name in names:
            matches = module == name or (name != "llamarl" and module.startswith(name + "."))
            if matches and len(name) > len(best):
                best, index = name, i
    return index


def imported_modules(path: Path, module: str, known: set[str]) -> set[str]:
    """The ``llamarl`` / ``recipes`` modules ``path`` imports anywhere in its body."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # ``from llamarl.runtime import world`` imports llamarl.runtime.world
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target)
    return {name for name in found if name.split(".")[0] in ("llamarl", "recipes")}


def upward_arrows(root: Path) -> tuple[list[str], list[str]]:
    """(modules without a layer, every import of a higher layer's module) under ``root/llamarl``."""
    paths = {module_name(path, root): path for path in sorted((root / "llamarl").rglob("*.py"))}
    unplaced = sorted(module for module in paths if layer_of(module) is None)
    arrows = []
    for module, path in paths.items():
        low = layer_of(module)
        for target in sorted(imported_modules(path, module, set(paths))):
            high = layer_of(target)
            if low is not None and high is not None and high > low:
                arrows.append(f"{module} ({LAYERS[low][0]}) imports {target} ({LAYERS[high][0]})")
    return unplaced, arrows


# What no module of the runtime may import: the layers that build on it (the run, RL, the executors
# and the channels between them). LAYERS says so too; this names the folders' rule on its own.
ABOVE_THE_RUNTIME = ("llamarl.rl", "llamarl.run", "llamarl.executors", "llamarl.channels")


def runtime_imports_above(root: Path) -> list[str]:
    """Every import, by a module under ``llamarl/runtime``, of a module in ``ABOVE_THE_RUNTIME``."""
    paths = {module_name(path, root): path for path in sorted((root / "llamarl").rglob("*.py"))}
    return [f"{module} imports {target}" for module, path in paths.items()
            if module.startswith("llamarl.runtime")
            for target in sorted(imported_modules(path, module, set(paths)))
            if any(target == name or target.startswith(name + ".") for name in ABOVE_THE_RUNTIME)]


def test_runtime_imports_nothing_above_it():
    assert not (found := runtime_imports_above(ROOT)), "\n".join(found)
    # The rule bites: the channel imports the controller has (it is in run/, not runtime/) are ones
    # it would report from the runtime.
    root = _tree_with("llamarl/runtime/controller.py",
                      "from llamarl.channels.in_memory import InMemoryChannel\nimport llamarl.run.runner\n")
    for name in ("llamarl/runtime/__init__.py", "llamarl/channels/__init__.py", "llamarl/channels/in_memory.py",
                 "llamarl/run/__init__.py", "llamarl/run/runner.py"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    assert runtime_imports_above(root) == ["llamarl.runtime.controller imports llamarl.channels.in_memory",
                                           "llamarl.runtime.controller imports llamarl.run.runner"]


def test_layers_point_down_only():
    unplaced, arrows = upward_arrows(ROOT)
    problems = [f"{module} has no layer in tests/test_layers.py's LAYERS" for module in unplaced] + arrows
    assert not problems, f"{len(arrows)} import(s) of a higher layer:\n" + "\n".join(problems)


# What a module outside llamarl/engines/ may import of it: the contract, the engines' settings and
# the shape helpers, never an engine's implementation (issue 47: reading a run's settings built
# nothing, yet llamarl/rl/config.py imported the native engine and vLLM's wrapper).
ENGINE_CONTRACT = ("llamarl.engines", "llamarl.engines.base", "llamarl.engines.engine_configs",
                   "llamarl.engines.static_shapes")


def engine_imports_outside_engines(root: Path) -> list[str]:
    """Every import of an engine implementation by a module of ``llamarl`` outside ``engines`` or of
    ``recipes``."""
    paths = {module_name(path, root): path for folder in ("llamarl", "recipes")
             for path in sorted((root / folder).rglob("*.py"))}
    return [f"{module} imports {target}" for module, path in paths.items()
            if not module.startswith("llamarl.engines")
            for target in sorted(imported_modules(path, module, set(paths)))
            if target.startswith("llamarl.engines") and target not in ENGINE_CONTRACT]


def test_no_module_outside_the_engines_imports_an_engine():
    assert not (found := engine_imports_outside_engines(ROOT)), "\n".join(found)
    # The rule bites: the import the RL config had (llamarl/config.py, before the folders) is one it reports.
    assert engine_imports_outside_engines(_tree_with(
        "llamarl/rl/config.py", "from llamarl.engines.torch_engine import TorchEngineConfig\n")) == \
        ["llamarl.rl.config imports llamarl.engines.torch_engine"]


def _tree_with(relative: str, text: str) -> Path:
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="layers-"))
    for name in ("llamarl/engines/__init__.py", "llamarl/engines/torch_engine.py", "recipes/__init__.py"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    (root / relative).parent.mkdir(parents=True, exist_ok=True)
    (root / relative).write_text(text)
    return root


def recipe_imports_of_recipes(root: Path) -> list[str]:
    """Every import of a ``recipes`` module by a module of ``recipes`` (its package ``recipes``
    included): a recipe is a leaf, what two recipes share lives in ``llamarl`` (issue 47)."""
    paths = {module_name(path, root): path for path in sorted((root / "recipes").rglob("*.py"))}
    return [f"{module} imports {target}" for module, path in paths.items()
            for target in sorted(imported_modules(path, module, set(paths)))
            if target.split(".")[0] == "recipes" and target != module]


def test_no_recipe_imports_a_recipe():
    assert not (found := recipe_imports_of_recipes(ROOT)), "\n".join(found)
    # The rule bites: the imports recipes/ref_kl.py and recipes/gsm8k.py had are ones it reports.
    root = _tree_with("recipes/ref_kl.py", "from recipes.arithmetic import ArithmeticConfig, run_variant\n")
    (root / "recipes/arithmetic.py").write_text("")
    (root / "recipes/gsm8k.py").write_text("from recipes import common\nimport recipes.common as shared\n")
    (root / "recipes/common.py").write_text("")
    assert recipe_imports_of_recipes(root) == ["recipes.gsm8k imports recipes.common",
                                               "recipes.ref_kl imports recipes.arithmetic"]
