"""docs/: the generated configuration reference is current, every config field is documented, and
the hand-written pages name only files that exist."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "docs"))  # the generator is a docs script, not library code
import config_reference

DOCS = REPO / "docs"
# Every hand-written page, README.md included (configuration.md is generated: checked above).
PAGES = ("README.md", *sorted(f"docs/{p.name}" for p in DOCS.glob("*.md") if p.name != "configuration.md"))


# A path in backticks, as the pages write them: `llamarl/runtime/world.py`, `tests/worlds/`, `docs/x.png`.
PATH = re.compile(r"`((?:llamarl|recipes|tests|docs|benchmarks|torchrun)/[\w./-]*)")
# A relative markdown link or image target: ](architecture.png).
LINK = re.compile(r"\]\((?!https?://|#)([^)\s#]+)")


def test_configuration_reference_is_current():
    current = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert current == config_reference.render_reference(), (
        f"docs/configuration.md is stale: run `.venv/bin/{config_reference.COMMAND}` and commit it")


def test_every_config_field_has_a_docstring():
    missing = config_reference.all_missing_docstrings()
    assert not missing, ("config fields without a docstring (add one right after the field, tyro shows it in "
                         f"--help and docs/configuration.md is generated from it): {missing}")


def test_attribute_docstrings_are_inherited_and_sections_nest():
    from llamarl.rl.config import RLConfig
    from recipes.arithmetic import ArithmeticConfig

    base = {row.flag: row for s in config_reference.config_sections(RLConfig()) for row in s.rows}
    recipe = {row.flag: row for s in config_reference.config_sections(ArithmeticConfig()) for row in s.rows}
    # ArithmeticConfig redeclares `run` with another default_factory: the docs stay, the default changes.
    assert recipe["--run.max-steps"].doc == base["--run.max-steps"].doc != ""
    assert (base["--run.max-steps"].default, recipe["--run.max-steps"].default) == ("20", "40")
    assert recipe["--task.num-digits"].type == "int" and "--task.num-digits" not in base
    assert base["--run.async-lag"].type == "{1, 2}" and base["--generator.token-budget"].type == "int | None"


@pytest.mark.parametrize("page", PAGES)
def test_pages_name_only_existing_files(page):
    path = REPO / page
    text = path.read_text(encoding="utf-8")
    named = {m.rstrip(".") for m in PATH.findall(text)}
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"{page} names files that do not exist: {missing}"
    links = [t for t in LINK.findall(text) if not (path.parent / t).exists()]
    assert not links, f"{page} links to missing files: {links}"


@pytest.mark.parametrize("picture", ["architecture.png", "schedules.png"])
def test_diagrams_are_committed_and_small(picture):
    path = DOCS / picture
    assert path.is_file(), f"docs/{picture} is missing: run `.venv/bin/python docs/draw_architecture.py`"
    assert path.stat().st_size < 300_000
