#!/usr/bin/env bash
# The main job: SPACE vs our AR loop vs HF generate vs HF prompt lookup, same prompts, one run,
# on the embedded SmolLM2-135M-Instruct (+ the shipped SPACE adapter when present), HumanEval.
#
#   bash run_eval.sh [space-eval flags]        # later flags override the defaults below
#   bash run_eval.sh --limit 164 --max-new-tokens 256 --out results/humaneval
#   bash run_eval.sh --dataset mt-bench --limit 80
#   ADAPTER=none bash run_eval.sh              # untrained mask token: exact, but accepts little
# Flags: python -m space.eval --help. Writes samples.jsonl, summary.json, summary.md, plots.
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,9p' "$0"; exit 0; fi
cd "$(dirname "$0")"
[ -x .venv/bin/python ] || bash scripts/setup.sh
ADAPTER=${ADAPTER:-adapters/smollm2-135m-space}
args=(--dataset humaneval --limit 5 --max-new-tokens 128 --out runs/eval/main)
# mask_num 1 / num_groups 1: the fastest layout on a 2-core CPU with the default fast CPU kernels;
# k=1/g=2 and k=2/g=1 are within 1.5 % (scripts/tune_layout.py, results/tune_layout.json)
[ -d "$ADAPTER" ] && args+=(--mask-num 1 --num-groups 1)
[ -d "$ADAPTER" ] && args+=(--adapter "$ADAPTER")
exec .venv/bin/python -m space.eval "${args[@]}" "$@"
