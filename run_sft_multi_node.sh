#!/usr/bin/env bash
# SAR-SFT on one machine or many, through torchrun (torch.distributed.run).
#
#   bash run_sft_multi_node.sh [CONFIG] [--key value ...]     # CONFIG: a YAML under configs/train
#
# Environment (defaults in brackets):
#   NNODES [1]  NODE_RANK [0]  MASTER_ADDR [127.0.0.1]  MASTER_PORT [29500; on one node with neither
#   MASTER_ADDR nor MASTER_PORT set, torchrun --standalone picks a free port]
#   NPROC_PER_NODE [number of local GPUs, or 1 on a CPU machine]
#   PYTHON [.venv/bin/python when present, else python3]
# Examples:
#   bash run_sft_multi_node.sh configs/train/smollm2_frozen_base_cpu.yaml
#   NPROC_PER_NODE=8 bash run_sft_multi_node.sh configs/train/llama2_7b_full_zero2.yaml
#   on node i of 4: NNODES=4 NODE_RANK=i MASTER_ADDR=node0 bash run_sft_multi_node.sh configs/train/llama2_70b_full_zero3.yaml
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,14p' "$0"; exit 0; fi
cd "$(dirname "$0")"
CONFIG=${1:-configs/train/smollm2_frozen_base_cpu.yaml}
[ $# -gt 0 ] && shift
[ -f "$CONFIG" ] || { echo "run_sft_multi_node.sh: config not found: $CONFIG" >&2; exit 2; }
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
GPUS=$(command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | wc -l || echo 0)
NPROC_PER_NODE=${NPROC_PER_NODE:-$([ "$GPUS" -gt 0 ] && echo "$GPUS" || echo 1)}
if [[ "${NNODES:-1}" == 1 && -z "${MASTER_ADDR:-}${MASTER_PORT:-}" ]]; then
  # one node: torchrun picks a free port, so a second run (or the tests) beside a training works
  RDZV=(--standalone)
else
  RDZV=(--nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" --master_addr "${MASTER_ADDR:-127.0.0.1}" \
        --master_port "${MASTER_PORT:-29500}")
fi
exec "$PY" -m torch.distributed.run "${RDZV[@]}" --nproc_per_node "$NPROC_PER_NODE" -m space.train --config "$CONFIG" "$@"
