"""``python3 benchmarks/gpu_check [flags]``: see the package docstring (benchmarks/gpu_check/__init__.py)."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Run as a directory, this package's own folder is sys.path[0]: its modules (cli, common, report)
# must not shadow others of those names; benchmarks/ holds the package and generation.py.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

from gpu_check.cli import main

if __name__ == "__main__":
    sys.exit(main())
