"""README.md and docs/*.md point only inside the repository.

Every link (inline ``[text](target)``, image, reference definition ``[id]: target``, HTML ``href=`` /
``src=``) is an http(s) URL or a path that resolves inside the repository and exists; a
``page.md#anchor`` target names a heading of that page (GitHub's slug: lowercase, punctuation other
than ``-`` and ``_`` dropped, spaces to ``-``, ``-1``, ``-2``, ... for repeats; ``slug`` / ``anchors``
of ``tests/test_readme.py``). And no page names a file outside the repository in its text: a clone
has no ``../shared/...`` beside it.

``tests/test_readme.py`` checks inline links for existence too; this file adds the rest: the
repository boundary, the URL schemes, reference-style and HTML links, and paths named in prose.
Pure file parsing, no subprocess.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_readme import anchors, slug, without_code

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^[ ]{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
HTML = re.compile(r"\b(?:href|src)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
# A path that leaves the repository, wherever a page writes it (prose, backticks, commands):
# `../x` (pages write repository paths from the root, `llamarl/runtime/world.py`) or this workspace's root.
OUTSIDE = re.compile(r"(?<![\w.~/])(?:\.\./|/work/)[\w./-]*")
# Generated from the recipes' configs (tests/test_docs.py keeps it current): its values are the code's.
GENERATED = {"configuration.md"}
# Pages with a known mention of a file outside the repository, to be fixed (strict: passes once fixed).
KNOWN_OUTSIDE: dict[str, str] = {}


def page_id(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


def link_targets(text: str) -> list[str]:
    """Every link target of a markdown page, outside code blocks and code spans."""
    prose = INLINE_CODE.sub("", without_code(text))
    return INLINE.findall(prose) + REFERENCE.findall(prose) + HTML.findall(prose)


def link_problem(page: Path, target: str) -> str | None:
    """What is wrong with one link target of `page`, or None."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", target):
        return None if re.match(r"^https?://\S+$", target) else "only http(s) URLs may leave the repository"
    if target.startswith("//"):
        return "a protocol-relative URL: write https://"
    path_part, _, anchor = target.partition("#")
    path = (page.parent / path_part).resolve() if path_part else page
    if not path.is_relative_to(REPO):
        return "outside the repository (a clone has nothing there)"
    if not path.exists():
        return "no such file in the repository"
    if anchor and path.suffix == ".md" and anchor not in anchors(path):
        return f"{page_id(path)} has no heading with anchor #{anchor}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_links_stay_inside_the_repository(page):
    targets = link_targets(page.read_text(encoding="utf-8"))
    problems = [f"({t}): {p}" for t in targets if (p := link_problem(page, t))]
    assert not problems, f"{page_id(page)}:\n" + "\n".join(problems)


def outside_params() -> list:
    params = []
    for page in PAGES:
        if page.name in GENERATED:
            continue
        known = KNOWN_OUTSIDE.get(page.name) if page.parent.name == "docs" else None
        marks = [pytest.mark.xfail(reason=f"known: {known}", strict=True)] if known else []
        params.append(pytest.param(page, id=page_id(page), marks=marks))
    return params


@pytest.mark.parametrize("page", outside_params())
def test_pages_name_no_file_outside_the_repository(page):
    lines = page.read_text(encoding="utf-8").splitlines()
    found = [f"line {n}: {m}" for n, line in enumerate(lines, 1) for m in OUTSIDE.findall(line)]
    assert not found, (f"{page_id(page)} names paths outside the repository (a clone has none of them; "
                       "put what they say in the repository or link an https URL):\n" + "\n".join(found))


def test_rules_catch_what_they_should(tmp_path):
    """The parser and the rules on a page written to break them (so a green run means something)."""
    page = REPO / "docs" / "architecture.md"
    text = ("[a](../../outside.md) ![b](architecture.png) [c](architecture.md#no-such-heading) "
            "[d](https://example.com/x) [e](mailto:x@y.z) [f](#channels) `[g](../code-span.md)`\n"
            "[h]: ../../ref.md\n<img src=\"../../pic.png\">\n```\n[i](../../fenced.md)\n```\n")
    targets = link_targets(text)
    assert targets == ["../../outside.md", "architecture.png", "architecture.md#no-such-heading",
                       "https://example.com/x", "mailto:x@y.z", "#channels", "../../ref.md", "../../pic.png"]
    verdicts = {t: link_problem(page, t) for t in targets}
    assert {t for t, p in verdicts.items() if p is None} == {"architecture.png", "https://example.com/x",
                                                            "#channels"}
    assert "outside the repository" in verdicts["../../outside.md"]
    assert "no heading" in verdicts["architecture.md#no-such-heading"]
    assert "http(s)" in verdicts["mailto:x@y.z"]
    assert OUTSIDE.findall("see `../shared/DESIGN.md`, `.../step_3`, docs/../x and /work/venv") == [
        "../shared/DESIGN.md", "/work/venv"]


@pytest.mark.parametrize("heading, anchor", [
    ("Weight sync: DDMA vs gather-broadcast", "weight-sync-ddma-vs-gather-broadcast"),
    ("Async + AIPO vs sync vs async without correction (2026-11-23)",
     "async--aipo-vs-sync-vs-async-without-correction-2026-11-23"),
    ("`make run` (2026-11-25, AMD EPYC)", "make-run-2026-11-25-amd-epyc"),
    ("Loading the trainer's model shard by shard", "loading-the-trainers-model-shard-by-shard"),
    ("snake_case and [a link](x.md)", "snake_case-and-a-link"),
])
def test_slug_is_githubs(heading, anchor):
    assert slug(heading) == anchor
