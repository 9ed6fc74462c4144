#!/usr/bin/env bash
# SAR-SFT on one machine or many, through torchrun (torch.distributed.run).
#
#   bash run_sft_multi_node.sh CONFIG [--key value ...]     # CONFIG: a YAML, e.g. under configs/train
#   bash run_sft_multi_node.sh CONFIG --smoke [--key value ...]
#
# CONFIG is found relative to the current directory, else relative to this script's folder. Training runs
# in this script's folder, where the configs' own relative paths point (data/..., configs/deepspeed/...).
# Paths given here are read from the current directory: --output_dir and --logging_dir always; --datasets
# (each file of the list), --init_adapter, --deepspeed, --resume_from_checkpoint, --data_root when they
# exist there, else from this script's folder (like CONFIG). Either spelling (--output-dir) works; an
# abbreviation (--output) is passed as it is.
# --smoke (anywhere after CONFIG): runs the config's Trainer/DeepSpeed/LoRA settings on a tiny stand-in
#   model of the same architecture for 2 optimizer steps through this launcher, on this node alone, saves,
#   reloads with load_space and checks the artifact (finite, trained) and greedy SPACE == AR; prints a line
#   per setting it changes and one summary line; exits non-zero on any failure. Run it before a long job.
#   (It runs python -m space.train.smoke CONFIG [--key value ...].)
# Environment (defaults in brackets); a value out of range stops the launcher (exit 2) before torchrun:
#   NNODES [1]; with NNODES > 1, NODE_RANK (0..NNODES-1) and MASTER_ADDR are required.
#   NODE_RANK [0 on one node]  MASTER_ADDR  MASTER_PORT [29500; on one node with neither MASTER_ADDR nor
#   MASTER_PORT set, torchrun --standalone picks a free port]
#   NPROC_PER_NODE [number of local GPUs, or 1 when there are none]; when set, it overrides the count.
#     GPUs counted: with CUDA_VISIBLE_DEVICES set, its comma-separated entries up to the first one that is
#     neither a decimal index nor a GPU-/MIG- UUID (as CUDA does: "", "-1" or "NoDevFiles" mean none;
#     each MIG- entry is one process); otherwise the "GPU n:" lines of nvidia-smi -L (MIG instances
#     under a GPU are not counted: CUDA sees them only through CUDA_VISIBLE_DEVICES); without nvidia-smi,
#     torch.cuda.device_count(). The count chosen is printed (one line, stderr).
#   PYTHON [.venv/bin/python when present, else python3]
#   SPACE_LAUNCH_DRY_RUN=1: print the command (one line) instead of running it, to see what would run (its
#     relative paths are the repository's: it reruns as printed from there).
# A failed training ends with one line (the failing rank's own error is above it) and its exit code; nodes
# that never meet (a node that did not start) end with one line and exit 1.
# Examples:
#   bash run_sft_multi_node.sh configs/train/smollm2_general_long.yaml      # the shipped adapter's recipe
#   NPROC_PER_NODE=8 bash run_sft_multi_node.sh configs/train/llama2_7b_full_zero2.yaml
#   on node i of 4: NNODES=4 NODE_RANK=i MASTER_ADDR=node0 bash run_sft_multi_node.sh configs/train/llama2_70b_full_zero3.yaml
#   SPACE_LAUNCH_DRY_RUN=1 bash run_sft_multi_node.sh configs/train/llama2_7b_lora.yaml --smoke

# count_gpus PYTHON: print the number of GPUs the processes of this node can use (0 when none), then
# how they were counted.
count_gpus() {
  if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
    local entry n=0
    local -a entries
    IFS=, read -r -a entries <<< "$CUDA_VISIBLE_DEVICES"
    for entry in ${entries[@]+"${entries[@]}"}; do
      entry=${entry//[[:space:]]/}
      [[ -z "$entry" ]] && continue
      if [[ "$entry" =~ ^[0-9]+$ || "$entry" == GPU-?* || "$entry" == MIG-?* ]]; then
        n=$((n + 1))
      else
        break  # CUDA ignores this entry and every one after it
      fi
    done
    echo "$n in CUDA_VISIBLE_DEVICES"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    # grep -c prints 0 (and exits 1) when nothing matches, e.g. nvidia-smi's "failed to communicate" message
    echo "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true) listed by nvidia-smi -L"
  else  # a container without the NVIDIA tools: ask CUDA itself (seconds: it imports torch)
    local n
    n=$("$1" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
    echo "$n seen by torch.cuda.device_count()"
  fi
}

# sourced (e.g. by the tests, to call count_gpus): define the function only
if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then return 0; fi

set -euo pipefail
USAGE="usage: bash run_sft_multi_node.sh CONFIG [--smoke] [--key value ...]  (--help: the environment and examples)"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,${/^#/!q;p;}' "$0"; exit 0; fi
die() { echo "run_sft_multi_node.sh: $*" >&2; exit 2; }
[[ $# -gt 0 ]] || { echo "$USAGE" >&2; exit 2; }
CONFIG=$1
shift
# the caller's directory first, then the launcher's (configs/train/... from anywhere)
if [[ -f "$CONFIG" && "$CONFIG" != /* ]]; then CONFIG="$PWD/$CONFIG"; fi
CALLER=$PWD
cd "$(dirname "$0")"

# from_caller KEY VALUE: VALUE with its relative paths made absolute from the caller's directory (see above)
from_caller() {
  local item out="" sep=""
  local -a items
  case "${1//-/_}" in  # the parser takes --output-dir too
    __output_dir|__logging_dir) [[ "$2" == /* ]] && printf '%s\n' "$2" || printf '%s\n' "$CALLER/$2" ;;
    __datasets)  # a comma list of registered names and files (a folder named mbpp is not the dataset)
      IFS=, read -r -a items <<< "$2"
      for item in ${items[@]+"${items[@]}"}; do
        [[ "$item" != /* && -f "$CALLER/$item" ]] && item="$CALLER/$item"
        out+="$sep$item"; sep=,
      done
      printf '%s\n' "$out" ;;
    __init_adapter|__deepspeed|__resume_from_checkpoint|__data_root|__model_name_or_path)
      [[ "$2" != /* && -e "$CALLER/$2" ]] && printf '%s\n' "$CALLER/$2" || printf '%s\n' "$2" ;;
    *) printf '%s\n' "$2" ;;  # printf, not echo: a value such as -n or -e is kept
  esac
}
[ -f "$CONFIG" ] || die "config not found: $CONFIG"
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
command -v "$PY" >/dev/null 2>&1 || die "PYTHON=$PY: no such program"
[[ "${SPACE_LAUNCH_DRY_RUN:-0}" =~ ^[01]$ ]] || die "SPACE_LAUNCH_DRY_RUN must be 0 or 1, got '$SPACE_LAUNCH_DRY_RUN'"
if [[ -n "${NPROC_PER_NODE+set}" && ! "$NPROC_PER_NODE" =~ ^[1-9][0-9]*$ ]]; then
  die "NPROC_PER_NODE must be an integer >= 1, got '$NPROC_PER_NODE'"
fi

run() {  # exec the command, or print it with SPACE_LAUNCH_DRY_RUN=1
  if [[ "${SPACE_LAUNCH_DRY_RUN:-0}" == 1 ]]; then printf "%q " "$@"; echo; exit 0; fi  # %q: a path with spaces reruns as printed (from the repository)
  exec "$@"
}

SMOKE=0
ARGS=()
key=""
for arg in "$@"; do
  if [[ "$arg" == --smoke ]]; then SMOKE=1
  elif [[ "$arg" == --*=* ]]; then ARGS+=("${arg%%=*}=$(from_caller "${arg%%=*}" "${arg#*=}")")
  elif [[ -n "$key" ]]; then ARGS+=("$(from_caller "$key" "$arg")")
  else ARGS+=("$arg")
  fi
  if [[ "$arg" == --* && "$arg" != *=* && "$arg" != --smoke ]]; then key=$arg; else key=""; fi
done
if [[ $SMOKE == 1 ]]; then
  # space.train.smoke calls this launcher again (without --smoke, on this node alone) for its training
  run "$PY" -m space.train.smoke "$CONFIG" ${ARGS[@]+"${ARGS[@]}"}
fi

NNODES=${NNODES:-1}
[[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || die "NNODES must be an integer >= 1, got '$NNODES'"
if [[ $NNODES -gt 1 ]]; then
  [[ -n "${NODE_RANK:-}" ]] || die "NNODES=$NNODES needs NODE_RANK (this node's index, 0..$((NNODES - 1)))"
  [[ -n "${MASTER_ADDR:-}" ]] || die "NNODES=$NNODES needs MASTER_ADDR (the address of the node with NODE_RANK=0)"
fi
NODE_RANK=${NODE_RANK:-0}
# no leading zeros: bash's arithmetic reads 010 as octal 8 and 08 as an error, torchrun reads them as decimals
[[ "$NODE_RANK" =~ ^(0|[1-9][0-9]*)$ && $NODE_RANK -lt $NNODES ]] ||
  die "NODE_RANK must be an integer in 0..$((NNODES - 1)) (NNODES=$NNODES), got '$NODE_RANK'"
if [[ -n "${MASTER_PORT:-}" ]] && ! [[ "$MASTER_PORT" =~ ^[1-9][0-9]*$ && $MASTER_PORT -le 65535 ]]; then
  die "MASTER_PORT must be a port number in 1..65535, got '$MASTER_PORT'"
fi

if [[ -n "${NPROC_PER_NODE:-}" ]]; then
  echo "run_sft_multi_node.sh: processes per node: $NPROC_PER_NODE (NPROC_PER_NODE); nodes: $NNODES" >&2
else
  read -r GPUS HOW <<< "$(count_gpus "$PY")"
  NPROC_PER_NODE=$([ "$GPUS" -gt 0 ] && echo "$GPUS" || echo 1)
  echo "run_sft_multi_node.sh: processes per node: $NPROC_PER_NODE (GPUs $HOW: $GPUS); nodes: $NNODES" >&2
fi
if [[ $NNODES == 1 && -z "${MASTER_ADDR:-}${MASTER_PORT:-}" ]]; then
  # one node: torchrun picks a free port, so a second run (or the tests) beside a training works
  RDZV=(--standalone)
else
  RDZV=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "${MASTER_ADDR:-127.0.0.1}" \
        --master_port "${MASTER_PORT:-29500}")
fi
run "$PY" -m space.train.torchrun "${RDZV[@]}" --nproc_per_node "$NPROC_PER_NODE" -m space.train --config "$CONFIG" \
  ${ARGS[@]+"${ARGS[@]}"}
