#!/usr/bin/env bash
# One node: torchrun --standalone with NPROC_PER_NODE processes running a recipe.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: torchrun/local.sh [--dry-run] RECIPE [RECIPE ARGS...]

Runs RECIPE on this node under `torchrun --standalone` (a private c10d rendezvous on a free port).
RECIPE is a module (recipes.gsm8k) or a Python file (path/to/script.py); the rest is passed to it.

Variables:
  NPROC_PER_NODE   processes on this node (default: the number of GPUs, else 3)
  TORCHRUN         the torchrun to use (default: `.venv/bin/python -m llamarl.run.launch`, torchrun with a
                   failed job's output ending on the failing rank's own line; else torchrun on PATH)
  OMP_NUM_THREADS  threads per process (default 1; the recipes set their own per executor)
  EXTRA_TORCHRUN_ARGS  more torchrun flags, e.g. "--max-restarts 1"

--dry-run prints the torchrun command instead of running it.

Before torchrun starts, the recipe's configuration is checked once in one process
(llamarl/runtime/preflight.py): a configuration error is printed as one line and the script exits 2
without starting torchrun. LLAMARL_PREFLIGHT=0 skips the check.

Examples:
  torchrun/local.sh recipes.gsm8k cpu-smoke
  NPROC_PER_NODE=1 torchrun/local.sh recipes.gsm8k qwen2.5-0.5b-1gpu
  NPROC_PER_NODE=8 torchrun/local.sh recipes.gsm8k qwen2.5-1.5b-8gpu --run.max-steps 100
USAGE
}

source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
parse_common_args "$@"
set -- "${REMAINING[@]}"

NPROC_PER_NODE="${NPROC_PER_NODE:-$(default_nproc)}"
require_positive_int NPROC_PER_NODE "$NPROC_PER_NODE"

preflight "$NPROC_PER_NODE" "${TARGET[@]}" "$@"
# shellcheck disable=SC2206
cmd=("${TORCHRUN_CMD[@]}" --standalone --nproc-per-node "$NPROC_PER_NODE" ${EXTRA_TORCHRUN_ARGS:-} "${TARGET[@]}" "$@")
run_or_print "${cmd[@]}"
