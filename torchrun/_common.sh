# Shared by local.sh / multinode.sh (sourced, not run). Expects a `usage` function.
# Sets: TARGET (torchrun's program: "-m module" or a .py path), REMAINING (recipe args),
# DRY_RUN (0/1), TORCHRUN_CMD (array). Exits 2 with a message on bad arguments.

die() { echo "error: $*" >&2; echo "(see $0 --help)" >&2; exit 2; }

require_positive_int() {  # NAME VALUE
  [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1 must be a positive integer, got '$2'"
}

default_nproc() {
  local gpus=0
  if command -v nvidia-smi >/dev/null 2>&1; then gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
  if [[ "$gpus" -gt 0 ]]; then echo "$gpus"; else echo 3; fi
}

parse_common_args() {
  DRY_RUN=0
  while [[ $# -gt 0 ]]; do
    case "$1" in
      -h|--help) usage; exit 0 ;;
      --dry-run) DRY_RUN=1; shift ;;
      --) shift; break ;;
      -*) die "unknown option '$1' (script options come before RECIPE)" ;;
      *) break ;;
    esac
  done
  [[ $# -ge 1 ]] || die "missing RECIPE (a module such as recipes.gsm8k, or a .py file)"
  local recipe="$1"; shift
  if [[ "$recipe" == *.py ]]; then
    [[ -f "$recipe" ]] || die "no such file: $recipe"
    TARGET=("$recipe")
  elif [[ "$recipe" =~ ^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$ ]]; then
    TARGET=(-m "$recipe")
  else
    die "RECIPE must be a Python module name or a .py file, got '$recipe'"
  fi
  REMAINING=("$@")
  local here
  here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  if [[ -n "${TORCHRUN:-}" ]]; then
    read -r -a TORCHRUN_CMD <<< "$TORCHRUN"
  elif [[ -x "$here/.venv/bin/python" ]]; then
    # torchrun itself, ending a failed job on the failing rank's own line (llamarl/run/launch.py).
    TORCHRUN_CMD=("$here/.venv/bin/python" -m llamarl.run.launch)
  elif [[ -x "$here/.venv/bin/torchrun" ]]; then
    TORCHRUN_CMD=("$here/.venv/bin/torchrun")
  else
    TORCHRUN_CMD=(torchrun)
  fi
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  # The Python beside torchrun runs the preflight (TORCHRUN may itself be "python -m ...").
  if [[ "${TORCHRUN_CMD[0]}" == */torchrun || "${TORCHRUN_CMD[0]}" == torchrun ]]; then
    local dir; dir="$(dirname "$(command -v "${TORCHRUN_CMD[0]}" || echo "${TORCHRUN_CMD[0]}")")"
    if [[ -x "$dir/python" ]]; then PREFLIGHT_PY="$dir/python"; else PREFLIGHT_PY=python3; fi
  else
    PREFLIGHT_PY="${TORCHRUN_CMD[0]}"
  fi
}

# Check the recipe's configuration once, in one process, before torchrun starts (llamarl/runtime/preflight.py):
# a configuration error is then the job's only output (one line, exit 2). Skipped for --dry-run,
# --help and LLAMARL_PREFLIGHT=0. Args: the job's world size, then torchrun's program and its args.
preflight() {
  local world_size="$1"; shift
  [[ "$DRY_RUN" == 1 || "${LLAMARL_PREFLIGHT:-1}" == 0 ]] && return 0
  local arg
  for arg in "$@"; do [[ "$arg" == -h || "$arg" == --help ]] && return 0; done
  local rc=0
  if [[ "${PREFLIGHT_QUIET:-0}" == 1 ]]; then
    "$PREFLIGHT_PY" -m llamarl.runtime.preflight --world-size "$world_size" -- "$@" >/dev/null 2>&1 || rc=$?
  else
    "$PREFLIGHT_PY" -m llamarl.runtime.preflight --world-size "$world_size" -- "$@" || rc=$?
  fi
  if [[ "$rc" == 2 ]]; then exit 2; fi
  return 0
}

run_or_print() {
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '%q ' "$@"; echo
  else
    exec "$@"
  fi
}
