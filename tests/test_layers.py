"""Layers point down only: no module of ``llamarl`` imports a module of a higher layer.

The layers, lowest first (``LAYERS`` below is the rule as data; a module belongs to the layer of
its longest matching name, and may import its own layer and any lower one):

1. foundation: the payload (``batch``), shard boxes (``boxes``), the name registry, the logger,
   checkpoint files and sharded state, metrics files, the progress line, the training-sample log
   and the Weights & Biases logger. They import nothing of
   llamarl above them, so anything may use them.
2. ``data``: problems, prompts, datasets, micro-batch packing, the ``\\boxed{}`` parser.
3. ``models``: loading, FSDP2 / TP sharding, per-token log-probs, micro-batched forwards,
   in-place weight copies: plain functions of modules and tensors.
4. ``algorithms``: losses, advantages, the proximal policy (math on log-probs; may use models).
5. ``engines``: the generation contract and its engines (native, vLLM).
6. ``rewards`` and ``environments``: scorers, episodes, tools (they read engines' completions).
7. configuration and evaluation: the dataclass configs (which validate names against the
   registries below them), the held-out sampling-and-scoring loop.
8. the world: ranks, devices, process groups, liveness, the job's errors, the ``Executor`` contract,
   what a configuration implies for a run (``run_plan``, ``config_checks``).
9. ``channels``: data and weights between executors' ranks (they call models' plain functions and
   the executors' contract, never an executor).
10. ``executors``: generator, reward, trainer.
11. the controller and the pipeline description.
12. the runner, the standard pipeline and the ``Task`` it runs (with the tasks and stages that
    several recipes share: arithmetic, the dataset recipes', the reference policy's); above it only
    ``recipes``, and no recipe imports another (``test_no_recipe_imports_a_recipe``).

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
    ("foundation", ("llamarl", "llamarl.batch", "llamarl.boxes", "llamarl.registry", "llamarl.log",
                    "llamarl.checkpoint", "llamarl.checkpoint_files", "llamarl.run_identity",
                    "llamarl.sharded_state", "llamarl.metrics", "llamarl.progress",
                    "llamarl.sample_log", "llamarl.wandb_log")),
    ("data", ("llamarl.data",)),
    ("models", ("llamarl.models",)),
    ("algorithms", ("llamarl.algorithms",)),
    ("engines", ("llamarl.engines",)),
    ("rewards and environments", ("llamarl.rewards", "llamarl.environments")),
    ("configuration and evaluation", ("llamarl.config", "llamarl.evaluation", "llamarl.eval_history")),
    ("world", ("llamarl.world", "llamarl.placement", "llamarl.preflight", "llamarl.launch", "llamarl.liveness",
               "llamarl.shared_dir", "llamarl.errors", "llamarl.executor", "llamarl.run_plan",
               "llamarl.config_checks")),
    ("channels", ("llamarl.channels",)),
    ("executors", ("llamarl.executors",)),
    ("controller and pipeline", ("llamarl.controller", "llamarl.pipeline")),
    ("runner", ("llamarl.runner", "llamarl.run_directory", "llamarl.run_log", "llamarl.run_checkpoints",
                "llamarl.run_summary", "llamarl.rl")),
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
            for alias in node.names:  # ``from llamarl import world`` imports the module llamarl.world
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


def test_layers_point_down_only():
    unplaced, arrows = upward_arrows(ROOT)
    problems = [f"{module} has no layer in tests/test_layers.py's LAYERS" for module in unplaced] + arrows
    assert not problems, f"{len(arrows)} import(s) of a higher layer:\n" + "\n".join(problems)


# What a module outside llamarl/engines/ may import of it: the contract, the engines' settings and
# the shape helpers, never an engine's implementation (issue 47: reading a run's settings built
# nothing, yet llamarl/config.py imported the native engine and vLLM's wrapper).
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
    # The rule bites: the import llamarl/config.py had is one it reports.
    assert engine_imports_outside_engines(_tree_with(
        "llamarl/config.py", "from llamarl.engines.torch_engine import TorchEngineConfig\n")) == \
        ["llamarl.config imports llamarl.engines.torch_engine"]


def _tree_with(relative: str, text: str) -> Path:
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="layers-"))
    for name in ("llamarl/engines/__init__.py", "llamarl/engines/torch_engine.py", "recipes/__init__.py"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
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
