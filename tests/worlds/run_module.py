"""``run_module.py --module recipes.NAME -- FLAGS``: a recipe run as ``python -m recipes.NAME FLAGS``
would run it (as a script, ``recipes/`` would come first on ``sys.path`` and ``recipes/math.py``
would shadow the standard library's ``math``)."""

import argparse
import runpy
import sys

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--module", required=True, help="the recipe module, e.g. recipes.calculator")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="the recipe's own flags, after --")
    args = parser.parse_args()
    sys.argv = [args.module, *[f for f in args.flags if f != "--"]]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)
