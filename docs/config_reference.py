"""The configuration reference (``docs/configuration.md``), generated from the config dataclasses.

    python docs/config_reference.py --write     # regenerate docs/configuration.md
    python docs/config_reference.py             # print it (same text) to stdout

Every field of a config dataclass carries its documentation as an *attribute docstring*: the
string literal right after the field (what tyro shows in ``--help``). Python keeps no trace of
those at run time, so ``field_docstrings`` reads them from the class source with ``ast``, walking
the MRO so that a subclass inherits its bases' docstrings (and a subclass that redeclares a field
only to change its default keeps the base's text).

``config_sections`` walks an *instance* of a top config: a field whose value is a dataclass is a
section (``--section.field`` on the command line; nested sections give ``--a.b.field``), every
other field is a flag. Defaults are read from the instance, so ``default_factory`` sections and a
recipe's overridden defaults (``field(default_factory=lambda: RunConfig(max_steps=40))``) show the
values a run really starts from. Flags are kebab-cased as tyro does (``num_ranks`` ->
``num-ranks``).

``render_reference`` documents ``RLConfig`` in full, then every recipe's top config
(``recipe_configs``: the ``RLConfig`` subclasses defined in ``recipes/*.py``): its own sections,
the library defaults it changes, and its presets (a module-level ``PRESETS`` dict of
``name -> (description, config)`` as ``tyro.extras.overridable_config_cli`` takes), each as the
flags whose value differs from the recipe's defaults. ``missing_docstrings`` lists the flags
without a docstring; ``tests/test_docs.py`` requires it to be empty and the committed file to be
current. A default naming a file outside the repository (a preset's CI data, ``../shared/...``) is
described, not printed (``shown_default``): a clone has nothing at that path.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import importlib
import inspect
import logging
import pkgutil
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("config_reference")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from docs/: the recipes package is at the repository root
    sys.path.insert(0, str(REPO))
OUTPUT = REPO / "docs" / "configuration.md"
COMMAND = "python docs/config_reference.py --write"
# A path that leaves the repository (`../x`, this workspace's root): the pattern of tests/test_doc_links.py.
OUTSIDE = re.compile(r"(?<![\w.~/])(?:\.\./|/work/)")
OUTSIDE_DEFAULT = "_a local copy outside the repository (CI's data): set the flag to your own path_"


@dataclass(frozen=True)
class Row:
    """One flag: ``--section.field``, its type, its default and its docstring (one line)."""

    flag: str
    type: str
    default: str
    doc: str


@dataclass(frozen=True)
class Section:
    """A ``--path.*`` group of flags: the dataclass behind it, its description and its flags.

    ``path`` is the dotted, kebab-cased section name (``""`` for the top config's own flags)."""

    path: str
    cls: type
    description: str
    rows: tuple[Row, ...]


def kebab(name: str) -> str:
    """tyro's spelling of a field name on the command line: ``num_ranks`` -> ``num-ranks``."""
    return name.replace("_", "-")


_CODE_SPAN = re.compile(r"(``.*?``|`[^`]*`)")


def _one_line(text: str) -> str:
    """A docstring as one markdown-table-safe line: whitespace collapsed, ``|`` escaped, and ``<`` /
    ``>`` outside code spans written as entities (``runs/<recipe>`` would otherwise be an HTML tag)."""
    parts = _CODE_SPAN.split(" ".join(text.split()))
    for i in range(0, len(parts), 2):  # even indices: text outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "".join(parts).replace("|", "\\|")


@functools.cache
def _class_ast(cls: type) -> ast.ClassDef | None:
    """The ``ClassDef`` of ``cls`` parsed from its source, or None when the source is unavailable."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return None
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node
    return None


def _own_field_docstrings(cls: type) -> dict[str, str]:
    """Attribute docstrings written in ``cls``'s own body: ``{field: cleaned docstring}``."""
    node = _class_ast(cls)
    if node is None:
        return {}
    docs = {}
    for statement, following in zip(node.body, node.body[1:]):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


def field_docstrings(cls: type) -> dict[str, str]:
    """``{field name: docstring}`` for every documented field of dataclass ``cls``, inherited ones
    included; the class nearest ``cls`` in the MRO that documents a field wins."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docstrings(klass))
    return docs


def class_docstring(cls: type) -> str:
    """The docstring written in ``cls``'s own body ('' when there is none: the text
    ``dataclasses`` generates from the signature does not count)."""
    node = _class_ast(cls)
    return inspect.cleandoc(ast.get_docstring(node) or "") if node is not None else ""


def format_type(annotation) -> str:
    """A resolved annotation as short text: ``int``, ``int | None``, ``{float32, bfloat16}``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return "{" + ", ".join(str(a) for a in args) + "}"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(format_type(a) for a in args)
    if annotation is type(None):
        return "None"
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(format_type(a) for a in args)}]"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def format_value(value) -> str:
    """A default as it would be typed on the command line (lists space-separated, ``[]`` empty)."""
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, (list, tuple)):
        return " ".join(format_value(v) for v in value) if value else "[]"
    return str(value)


def config_sections(config, *, path: str = "") -> list[Section]:
    """The sections of dataclass instance ``config``, depth first: its own flags (if any) first,
    then each nested dataclass field as ``path.field`` in declaration order.

    Raises TypeError when ``config`` is not a dataclass instance."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"expected a dataclass instance, got {config!r}")
    cls = type(config)
    hints = typing.get_type_hints(cls)
    docs = field_docstrings(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        value = getattr(config, f.name)
        name = f"{path}.{kebab(f.name)}" if path else kebab(f.name)
        if dataclasses.is_dataclass(value):
            nested.append((name, value, docs.get(f.name, "")))
        else:
            rows.append(Row(flag=f"--{name}", type=format_type(hints.get(f.name, f.type)),
                            default=format_value(value), doc=docs.get(f.name, "")))
    sections = [Section(path, cls, class_docstring(cls), tuple(rows))] if rows else []
    for name, value, doc in nested:
        for section in config_sections(value, path=name):
            if section.path == name and doc:  # the parent's docstring of this field describes it best
                section = dataclasses.replace(section, description=doc)
            sections.append(section)
    return sections


def missing_docstrings(config) -> list[str]:
    """The flags of ``config`` (an instance) whose field has no docstring."""
    return [row.flag for section in config_sections(config) for row in section.rows if not row.doc]


def recipe_configs() -> list[tuple[str, type, dict]]:
    """``(module, top config class, presets)`` for every ``recipes/*.py`` recipe (a module with a
    ``main``: a shared base in ``llamarl``, e.g. ``llamarl/rl/dataset_recipes.py``'s, is documented
    through the recipes that use it)
    that defines an ``RLConfig`` subclass, sorted by module name; ``presets`` is the module's ``PRESETS`` dict
    (``name -> (description, config instance)``) or ``{}``. Imports every recipe module."""
    import recipes
    from llamarl.rl.config import RLConfig

    found = []
    for info in sorted(pkgutil.iter_modules(recipes.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"recipes.{info.name}")
        if not callable(getattr(module, "main", None)):
            continue
        classes = [obj for obj in vars(module).values()
                   if isinstance(obj, type) and issubclass(obj, RLConfig) and obj is not RLConfig
                   and obj.__module__ == module.__name__ and dataclasses.is_dataclass(obj)]
        presets = getattr(module, "PRESETS", {})
        found.extend((module.__name__, cls, presets if isinstance(presets, dict) else {}) for cls in classes)
    return found


def _flag_values(config) -> dict[str, tuple[str, Section]]:
    """``{flag: (default text, its section)}`` of a config instance."""
    return {row.flag: (row.default, section) for section in config_sections(config) for row in section.rows}


def _code(text: str) -> str:
    """``text`` as an inline code span (empty stays empty); pipes escaped for tables."""
    return f"`{text}`".replace("|", "\\|") if text != "" else "`''`"


def shown_default(text: str) -> str:
    """A default as the reference shows it: in code, or described where it names a file outside the
    repository (the code keeps its path; the docs do not point users at it)."""
    return OUTSIDE_DEFAULT if OUTSIDE.search(text) else _code(text)


def _section_table(section: Section) -> list[str]:
    title = f"`--{section.path}.*`" if section.path else "top-level flags"
    source = section.cls.__module__.replace(".", "/") + ".py"  # where the section is defined: beside its owner
    lines = [f"### {title} ({section.cls.__name__}, `{source}`)", ""]
    if section.description:
        lines += [_one_line(section.description), ""]
    lines += ["| flag | type | default | description |", "|---|---|---|---|"]
    lines += [f"| `{row.flag}` | {_code(row.type)} | {shown_default(row.default)} | {_one_line(row.doc)} |"
              for row in section.rows]
    return [*lines, ""]


def _differences(config, baseline: dict[str, tuple[str, Section]]) -> list[tuple[str, str, str]]:
    """``(flag, value, baseline value)`` for every flag of ``config`` also in ``baseline`` with
    another value, in ``config``'s order."""
    return [(flag, value, baseline[flag][0]) for flag, (value, _) in _flag_values(config).items()
            if flag in baseline and baseline[flag][0] != value]


def render_reference() -> str:
    """The whole of ``docs/configuration.md`` (module docstring)."""
    from llamarl.rl.config import RLConfig

    base = RLConfig()
    base_values = _flag_values(base)
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from the config dataclasses' field docstrings by `{COMMAND}`; do not edit by hand. -->",
        "",
        (f"**Generated** by `{COMMAND}` (or `python docs/config_reference.py > docs/configuration.md`) "
         "from the docstrings of the config dataclasses (each section's beside what it configures, as its heading "
         "says, composed by `llamarl/rl/config.py`; each recipe's top config in `recipes/`). Edit a field's "
         "docstring there and regenerate; `tests/test_docs.py` fails when this "
         "file is stale or a field has no docstring."),
        "",
        ("Every flag is `--section.field` with the field name in kebab-case (tyro); "
         "`torchrun ... -m recipes.<name> --help` prints the same text for one recipe. Types: `{a, b}` is one "
         "of the listed values, `X | None` also takes `None`; a list takes its values space-separated."),
        "",
        "## Library sections (`RLConfig`, `llamarl/rl/config.py`)",
        "",
        _one_line(class_docstring(RLConfig)),
        "",
    ]
    for section in config_sections(base):
        lines += _section_table(section)
    for module, cls, presets in recipe_configs():
        instance = cls()
        lines += [f"## `{module}` (`{cls.__name__}`)", ""]
        if class_docstring(cls):
            lines += [_one_line(class_docstring(cls)), ""]
        lines += [(f"`torchrun ... -m {module}{' <preset>' if presets else ''} [flags]`: every library section "
                   "above, plus:"), ""]
        for section in config_sections(instance):
            if not any(row.flag in base_values for row in section.rows):
                lines += _section_table(section)
        changed = _differences(instance, base_values)
        if changed:
            lines += [f"### Library defaults {cls.__name__} changes", "",
                      "| flag | here | library |", "|---|---|---|"]
            lines += [f"| `{flag}` | {shown_default(value)} | {shown_default(old)} |" for flag, value, old in changed]
            lines.append("")
        if presets:
            own = _flag_values(instance)
            lines += ["### Presets", "",
                      (f"The first argument names a preset; flags after it override the preset's values. "
                       f"Each preset's values that differ from {cls.__name__}'s defaults:"), ""]
            for name, (description, preset) in presets.items():
                lines += [f"#### `{name}`", "", _one_line(description), "",
                          "| flag | value | default |", "|---|---|---|"]
                lines += [f"| `{flag}` | {shown_default(value)} | {shown_default(old)} |"
                          for flag, value, old in _differences(preset, own)]
                lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def all_missing_docstrings() -> list[str]:
    """``"<config class>: <flag>"`` for every undocumented flag of RLConfig and every recipe config."""
    from llamarl.rl.config import RLConfig

    configs = [RLConfig, *(cls for _, cls, _ in recipe_configs())]
    return [f"{cls.__module__}.{cls.__name__}: {flag}" for cls in configs for flag in missing_docstrings(cls())]


def main(argv: list[str] | None = None) -> int:
    """CLI: print the reference to stdout, or ``--write`` it to ``docs/configuration.md``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--write", action="store_true", help=f"write {OUTPUT.relative_to(REPO)} instead of printing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    text = render_reference()
    missing = all_missing_docstrings()
    if missing:
        logger.warning("fields without a docstring: %s", ", ".join(missing))
    if args.write:
        OUTPUT.write_text(text, encoding="utf-8")
        logger.info("wrote %s (%d lines)", OUTPUT, text.count("\n"))
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
