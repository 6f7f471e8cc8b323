#!/usr/bin/env bash
# Several nodes, one c10d rendezvous: run this same command on every node.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: torchrun/multinode.sh [--dry-run] RECIPE [RECIPE ARGS...]

Run the SAME command on every node. The torchrun agents meet at MASTER_ADDR:MASTER_PORT (c10d
rendezvous, hosted by whichever agent runs on MASTER_ADDR), agree on the ranks and start
NNODES x NPROC_PER_NODE processes; ranks are global, so `--generator.num-ranks` etc. count over all
nodes (the generator gets the first ranks: node 0's first processes).

Variables (required):
  NNODES           number of nodes (or MIN:MAX for an elastic range)
  MASTER_ADDR      host name / IP of the rendezvous node, reachable from every node
Variables (optional):
  MASTER_PORT      rendezvous port on MASTER_ADDR (default 29500)
  NPROC_PER_NODE   processes per node (default: the number of GPUs, else 3)
  RDZV_ID          job id shared by all nodes (default llamarl-$MASTER_PORT); a new id per job
  NODE_RANK        not needed with c10d (ranks are assigned at rendezvous); if set, passed as --node-rank
  RDZV_TIMEOUT     seconds to wait for all nodes (default 900)
  TORCHRUN, OMP_NUM_THREADS, EXTRA_TORCHRUN_ARGS   as in torchrun/local.sh

--dry-run prints the torchrun command instead of running it. Before torchrun starts, every node
checks the recipe's configuration once (llamarl/runtime/preflight.py; the first node prints an error, as one
line, and every node exits 2); LLAMARL_PREFLIGHT=0 skips the check.

Example (two 8-GPU nodes, run on both):
  NNODES=2 MASTER_ADDR=node001 NPROC_PER_NODE=8 torchrun/multinode.sh recipes.gsm8k qwen2.5-1.5b-8gpu \
      --generator.num-ranks 8 --reward.num-ranks 1
USAGE
}

source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
parse_common_args "$@"
set -- "${REMAINING[@]}"

[[ -n "${NNODES:-}" ]] || die "NNODES is not set (number of nodes)"
[[ "$NNODES" =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] || die "NNODES must be N or MIN:MAX, got '$NNODES'"
[[ -n "${MASTER_ADDR:-}" ]] || die "MASTER_ADDR is not set (the rendezvous host)"
MASTER_PORT="${MASTER_PORT:-29500}"
require_positive_int MASTER_PORT "$MASTER_PORT"
NPROC_PER_NODE="${NPROC_PER_NODE:-$(default_nproc)}"
require_positive_int NPROC_PER_NODE "$NPROC_PER_NODE"
RDZV_ID="${RDZV_ID:-llamarl-$MASTER_PORT}"
RDZV_TIMEOUT="${RDZV_TIMEOUT:-900}"
require_positive_int RDZV_TIMEOUT "$RDZV_TIMEOUT"

node_rank=()
if [[ -n "${NODE_RANK:-}" ]]; then
  [[ "$NODE_RANK" =~ ^[0-9]+$ ]] || die "NODE_RANK must be a non-negative integer, got '$NODE_RANK'"
  node_rank=(--node-rank "$NODE_RANK")
fi

# shellcheck disable=SC2206
# Every node checks the configuration (same flags, same error); only the first node prints it, so a
# SLURM job's merged output holds it once. Ranks are global: the world is NNODES (its maximum) x NPROC.
[[ "${SLURM_NODEID:-${NODE_RANK:-0}}" == 0 ]] || PREFLIGHT_QUIET=1
preflight "$(( ${NNODES##*:} * NPROC_PER_NODE ))" "${TARGET[@]}" "$@"

cmd=("${TORCHRUN_CMD[@]}" --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" "${node_rank[@]}"
     --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID"
     --rdzv-conf "join_timeout=$RDZV_TIMEOUT" --max-restarts 0 ${EXTRA_TORCHRUN_ARGS:-} "${TARGET[@]}" "$@")
run_or_print "${cmd[@]}"
