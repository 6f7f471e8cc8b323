"""README.md and docs/*.md stay true: every command in a fenced shell block can run as written, and
every relative link points to a file (and heading) that exists.

Commands, line by line (continuations joined, comments and leading ``VAR=value`` dropped):

* ``make X``: X is a target of the Makefile.
* ``torchrun ... -m recipes.X ...``, ``python -m recipes.X ...``, ``torchrun/local.sh recipes.X ...``,
  ``sbatch ... torchrun/slurm.sbatch recipes.X ...``: the recipe exists, its preset (a first argument
  that is not a flag) exists, and every ``--flag`` after the module is one of its flags.
* ``python benchmarks/X.py ...`` (or any repository module / script): the file exists and knows
  every ``--flag`` used.

README.md's commands are checked against the real ``--help`` output, run once per distinct recipe
(and preset) or script. The docs pages are checked statically, to keep this test cheap: a recipe's
flags against ``docs/configuration.md`` (generated from the config dataclasses; ``tests/test_docs.py``
fails when it is stale), a script's flags against the string literals of its source (argparse).
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
PYTHON = REPO / ".venv" / "bin" / "python"
PYTHON = PYTHON if PYTHON.exists() else Path(sys.executable)

FENCE = re.compile(r"^[ \t]*```(\w*)[ \t]*\n(.*?)^[ \t]*```[ \t]*$", re.MULTILINE | re.DOTALL)
SHELL_LANGS = {"bash", "sh", "shell", "console"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.MULTILINE)
# A repository path in backticks, as the pages write them (the pattern of tests/test_docs.py).
PATH = re.compile(r"`((?:llamarl|recipes|tests|docs|benchmarks|torchrun)/[\w./-]*)")
LAUNCH_SCRIPTS = ("torchrun/local.sh", "torchrun/multinode.sh", "torchrun/slurm.sbatch")


@dataclass
class Command:
    """One command line of a page, resolved to what it runs."""

    page: str
    line: str
    make_targets: list[str] = field(default_factory=list)
    module: str | None = None  # a repository module run with -m or by a launch script
    script: str | None = None  # a repository file run by path
    preset: str | None = None
    flags: list[str] = field(default_factory=list)


def fenced_shell_lines(text: str) -> list[str]:
    lines = []
    for lang, body in FENCE.findall(text):
        if lang not in SHELL_LANGS:
            continue
        joined = re.sub(r"\\\n[ \t]*", " ", body)
        lines.extend(line.strip() for line in joined.splitlines() if line.strip())
    return lines


def without_code(text: str) -> str:
    return FENCE.sub("", text)


def parse(page: str, line: str) -> Command | None:
    tokens = shlex.split(line, comments=True)
    while tokens and ASSIGNMENT.match(tokens[0]):
        tokens.pop(0)
    if not tokens:
        return None
    cmd = Command(page, line)
    program = tokens[0]
    if program == "make":
        cmd.make_targets = [t for t in tokens[1:] if not t.startswith("-") and "=" not in t]
        return cmd
    rest: list[str] | None = None
    launcher = next((i for i, t in enumerate(tokens) if t in LAUNCH_SCRIPTS), None)
    if launcher is not None:
        cmd.script = tokens[launcher]
        args = [t for t in tokens[launcher + 1:] if t != "--dry-run"]
        if args:
            cmd.module, rest = args[0], args[1:]
    elif Path(program).name in ("torchrun", "python", "python3"):
        if "-m" in tokens:
            at = tokens.index("-m")
            cmd.module, rest = tokens[at + 1], tokens[at + 2:]
        else:
            at = next((i for i, t in enumerate(tokens[1:], 1) if t.endswith(".py")), None)
            if at is None:
                return None
            cmd.script, rest = tokens[at], tokens[at + 1:]
    else:
        return None  # pip, sbatch without a launch script, ...: nothing of this repository to check
    if cmd.module and cmd.module.endswith(".py"):
        cmd.script, cmd.module = cmd.module, None
    if rest is not None:
        if cmd.module and cmd.module.startswith("recipes.") and rest and not rest[0].startswith("-"):
            cmd.preset = rest[0]
        cmd.flags = [t.split("=", 1)[0] for t in rest if t.startswith("--")]
    return cmd


def page_commands(path: Path) -> list[Command]:
    commands = [parse(path.name, line) for line in fenced_shell_lines(path.read_text(encoding="utf-8"))]
    return [c for c in commands if c is not None]


def module_file(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__main__.py"):
        if candidate.is_file():
            return candidate
    return None


def is_repo_module(module: str) -> bool:
    return module.split(".")[0] in ("recipes", "llamarl", "benchmarks", "tests")


@functools.cache
def makefile_targets() -> frozenset[str]:
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    targets = set()
    for match in re.finditer(r"^([A-Za-z0-9_./-][^:=\n]*):(?!=)", text, re.MULTILINE):
        targets.update(match.group(1).split())
    return frozenset(targets)


@functools.cache
def reference_flags() -> dict[str, tuple[frozenset[str], frozenset[str]]]:
    """recipe module -> (its flags, its presets), read from docs/configuration.md."""
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    row = re.compile(r"^\| `(--[\w.-]+)` \| `([^`]*)`", re.MULTILINE)

    def flags(chunk: str) -> set[str]:
        found = set()
        for flag, kind in row.findall(chunk):
            found.add(flag)
            if kind == "bool":  # tyro: --section.x / --section.no-x
                section, _, name = flag.rpartition(".")
                found.add(f"{section}.no-{name}")
        return found

    parts = re.split(r"^## `(recipes\.\w+)`.*$", text, flags=re.MULTILINE)
    library = flags(parts[0])
    recipes = {}
    for name, chunk in zip(parts[1::2], parts[2::2]):
        presets = frozenset(re.findall(r"^#### `([^`]+)`", chunk, re.MULTILINE))
        recipes[name] = (frozenset(library | flags(chunk) | {"--help"}), presets)
    return recipes


@functools.cache
def help_text(target: str, preset: str | None, is_script: bool) -> str:
    """The --help output of a recipe (with its preset) or a script, run once."""
    argv = [str(PYTHON), target] if is_script else [str(PYTHON), "-m", target]
    argv += ([preset] if preset else []) + ["--help"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "COLUMNS": "400",
           "NO_COLOR": "1", "TERM": "dumb"}
    proc = subprocess.run(argv, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"`{' '.join(argv[1:])}` exited {proc.returncode}:\n{output[-2000:]}"
    return output


def check_static(cmd: Command) -> list[str]:
    """What is wrong with a command, without running anything."""
    problems = []
    where = f"{cmd.page}: `{cmd.line}`"
    for target in cmd.make_targets:
        if target not in makefile_targets():
            problems.append(f"{where}: no Makefile target {target!r}")
    if cmd.script and not (REPO / cmd.script).is_file():
        problems.append(f"{where}: {cmd.script} does not exist")
    if cmd.module and is_repo_module(cmd.module) and module_file(cmd.module) is None:
        problems.append(f"{where}: module {cmd.module} does not exist")
    return problems


def runs_repo_code(cmd: Command) -> tuple[str, bool] | None:
    """(what --help runs, whether it is a script) for a command that runs this repository's code."""
    if cmd.module and is_repo_module(cmd.module) and module_file(cmd.module):
        return cmd.module, False
    if cmd.script and cmd.script.endswith(".py") and (REPO / cmd.script).is_file():
        return cmd.script, True
    return None


README_COMMANDS = page_commands(README)
DOC_COMMANDS = [c for page in sorted(DOCS.glob("*.md")) for c in page_commands(page)]


def test_pages_have_commands():
    assert any(c.make_targets == ["run"] for c in README_COMMANDS), "README.md lost `make run`"
    assert any(c.make_targets == ["test"] for c in README_COMMANDS), "README.md lost `make test`"
    assert any(c.module and c.module.startswith("recipes.") for c in DOC_COMMANDS)


def test_commands_name_existing_targets_and_files():
    problems = [p for c in README_COMMANDS + DOC_COMMANDS for p in check_static(c)]
    assert not problems, "\n".join(problems)


def test_readme_flags_are_in_help():
    problems = []
    for cmd in README_COMMANDS:
        runs = runs_repo_code(cmd)
        if runs is None or not cmd.flags:
            continue
        text = help_text(runs[0], cmd.preset, runs[1])
        problems += [f"README.md: `{cmd.line}`: {flag} is not in its --help" for flag in cmd.flags
                     if flag != "--help" and not re.search(re.escape(flag) + r"(?![\w.-])", text)]
    assert not problems, "\n".join(problems)


def test_doc_flags_are_known():
    problems = []
    recipes = reference_flags()
    for cmd in DOC_COMMANDS:
        runs = runs_repo_code(cmd)
        if runs is None:
            continue
        target, is_script = runs
        where = f"{cmd.page}: `{cmd.line}`"
        if not is_script and target in recipes:
            known, presets = recipes[target]
            if cmd.preset is not None and cmd.preset not in presets:
                problems.append(f"{where}: {target} has no preset {cmd.preset!r} (has {sorted(presets)})")
            problems += [f"{where}: {flag} is not a flag of {target} (docs/configuration.md)"
                         for flag in cmd.flags if flag not in known]
        else:
            source = (module_file(target) if not is_script else REPO / target).read_text(encoding="utf-8")
            problems += [f"{where}: {flag} does not appear in {target}'s source" for flag in cmd.flags
                         if flag != "--help" and f'"{flag}"' not in source and f"'{flag}'" not in source]
    assert not problems, "\n".join(problems)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    found, seen = set(), {}
    for _, text in HEADING.findall(without_code(path.read_text(encoding="utf-8"))):
        base = slug(text)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return frozenset(found)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_links_point_to_existing_files(page):
    text = without_code(page.read_text(encoding="utf-8"))
    problems = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if not path.exists():
            problems.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            problems.append(f"{target}: {path.name} has no heading with anchor #{anchor}")
    named = {m.rstrip(".") for m in PATH.findall(text)}
    problems += [f"`{p}`: no such file" for p in sorted(named) if not (REPO / p).exists()]
    assert not problems, f"{page.relative_to(REPO)}:\n" + "\n".join(problems)


def test_readme_is_a_short_page():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= 200, f"README.md has {lines} lines; move details to docs/"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
