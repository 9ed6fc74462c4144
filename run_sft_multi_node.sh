#!/usr/bin/env bash
# SAR-SFT on one machine or many, through torchrun (torch.distributed.run).
#
#   bash run_sft_multi_node.sh [CONFIG] [--key value ...]     # CONFIG: a YAML under configs/train
#   bash run_sft_multi_node.sh CONFIG --smoke [--key value ...]
#
# --smoke (anywhere after CONFIG): runs the config's Trainer/DeepSpeed/LoRA settings unchanged on a tiny
#   stand-in model of the same architecture for 2 optimizer steps through this launcher, saves, reloads
#   with load_space and checks greedy SPACE == AR; prints one line; exits non-zero on any failure.
#   Run it before a long job. (It runs python -m space.train.smoke CONFIG [--key value ...].)
# Environment (defaults in brackets):
#   NNODES [1]  NODE_RANK [0]  MASTER_ADDR [127.0.0.1]  MASTER_PORT [29500; on one node with neither
#   MASTER_ADDR nor MASTER_PORT set, torchrun --standalone picks a free port]
#   NPROC_PER_NODE [number of local GPUs, or 1 when there are none]; when set, it overrides the count.
#     GPUs counted: with CUDA_VISIBLE_DEVICES set, its comma-separated entries up to the first one that is
#     neither a decimal index nor a GPU-/MIG- UUID (as CUDA does: "", "-1" or "NoDevFiles" mean none;
#     each MIG- entry is one process); otherwise the "GPU n:" lines of nvidia-smi -L (MIG instances
#     under a GPU are not counted: CUDA sees them only through CUDA_VISIBLE_DEVICES).
#   PYTHON [.venv/bin/python when present, else python3]
#   SPACE_LAUNCH_DRY_RUN=1: print the command (one line) instead of running it, to see what would run.
# Examples:
#   bash run_sft_multi_node.sh configs/train/smollm2_frozen_base_cpu.yaml
#   NPROC_PER_NODE=8 bash run_sft_multi_node.sh configs/train/llama2_7b_full_zero2.yaml
#   on node i of 4: NNODES=4 NODE_RANK=i MASTER_ADDR=node0 bash run_sft_multi_node.sh configs/train/llama2_70b_full_zero3.yaml
#   SPACE_LAUNCH_DRY_RUN=1 bash run_sft_multi_node.sh configs/train/llama2_7b_lora.yaml --smoke

# count_gpus: print the number of GPUs the processes of this node can use (0 when none).
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
    echo "$n"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    # grep -c prints 0 (and exits 1) when nothing matches, e.g. nvidia-smi's "failed to communicate" message
    nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true
  else
    echo 0
  fi
}

# sourced (e.g. by the tests, to call count_gpus): define the function only
if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then return 0; fi

set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,${/^#/!q;p;}' "$0"; exit 0; fi
cd "$(dirname "$0")"
CONFIG=${1:-configs/train/smollm2_frozen_base_cpu.yaml}
[ $# -gt 0 ] && shift
[ -f "$CONFIG" ] || { echo "run_sft_multi_node.sh: config not found: $CONFIG" >&2; exit 2; }
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}

run() {  # exec the command, or print it with SPACE_LAUNCH_DRY_RUN=1
  if [[ "${SPACE_LAUNCH_DRY_RUN:-0}" == 1 ]]; then echo "$*"; exit 0; fi
  exec "$@"
}

SMOKE=0
ARGS=()
for arg in "$@"; do
  if [[ "$arg" == --smoke ]]; then SMOKE=1; else ARGS+=("$arg"); fi
done
if [[ $SMOKE == 1 ]]; then
  # space.train.smoke calls this launcher again (without --smoke) for its 2-step training
  run "$PY" -m space.train.smoke "$CONFIG" ${ARGS[@]+"${ARGS[@]}"}
fi

GPUS=$(count_gpus)
NPROC_PER_NODE=${NPROC_PER_NODE:-$([ "$GPUS" -gt 0 ] && echo "$GPUS" || echo 1)}
if [[ "${NNODES:-1}" == 1 && -z "${MASTER_ADDR:-}${MASTER_PORT:-}" ]]; then
  # one node: torchrun picks a free port, so a second run (or the tests) beside a training works
  RDZV=(--standalone)
else
  RDZV=(--nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" --master_addr "${MASTER_ADDR:-127.0.0.1}" \
        --master_port "${MASTER_PORT:-29500}")
fi
run "$PY" -m torch.distributed.run "${RDZV[@]}" --nproc_per_node "$NPROC_PER_NODE" -m space.train --config "$CONFIG" \
  ${ARGS[@]+"${ARGS[@]}"}
