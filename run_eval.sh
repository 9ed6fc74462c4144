#!/usr/bin/env bash
# The main job: SPACE vs our AR loop vs HF generate vs HF prompt lookup, same prompts, one run,
# on the embedded SmolLM2-135M-Instruct (+ the shipped SPACE adapter when present), HumanEval.
#
#   bash run_eval.sh [space-eval flags]        # later flags override the defaults below
#   bash run_eval.sh --limit 164 --max-new-tokens 256 --out runs/eval/humaneval164
#   bash run_eval.sh --dataset mt-bench --limit 80
#   ADAPTER=none bash run_eval.sh              # untrained mask token: exact, but accepts little
# Flags: python -m space.eval --help. The adapter is added only for its own base model (not for
# --model tiny-random-llama) and not when you pass --adapter. Writes samples.jsonl, summary.*, plots
# to runs/eval/main_<dataset>[_<model>][_<adapter>|_no_adapter] unless you pass --out.
# Relative paths (--out, --dataset, ADAPTER) are read from where you run it.
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,12p' "$0"; exit 0; fi
here=$(cd "$(dirname "$0")" && pwd)
venv=${VENV:-.venv}  # scripts/setup.sh's VENV (relative to the repository), which it is handed on to
[[ "$venv" == /* ]] || venv=$here/$venv
py=$venv/bin/python
[ -x "$py" ] || bash "$here/scripts/setup.sh"
if [ -n "${ADAPTER:-}" ] && [ "$ADAPTER" != none ] && [ ! -f "$ADAPTER/space_config.json" ]; then
  echo "run_eval.sh: ADAPTER=$ADAPTER is not a SPACE adapter (no space_config.json there); ADAPTER=none runs without one" >&2
  exit 2
fi
ADAPTER=${ADAPTER:-$here/adapters/smollm2-135m-space}
model=""; dataset=humaneval; chosen=""; prev=""
for a in "$@"; do  # the user's --model, --dataset and --adapter (then the default adapter is not added)
  case "$prev" in --model) model=$a;; --dataset) dataset=$a;; --adapter) chosen=$a;; esac
  case "$a" in --model=*) model=${a#--model=};; --dataset=*) dataset=${a#--dataset=};; --adapter=*) chosen=${a#--adapter=};; esac
  case "$a" in --adapter|--adapter=*) ADAPTER=none;; esac
  prev=$a
done
# another model: the adapter does not fit it. Its own base spelt another way (a path for the alias, ./m/ for m)
# keeps it; so does any failure to tell (a config that cannot be read: space-eval says what is wrong with it)
if [ -n "$model" ] && [ -f "$ADAPTER/space_config.json" ] && [ "$("$py" -c '
import json, sys
from space.models import model_identity
base = json.load(open(sys.argv[1]))["base_model"]
print("other" if model_identity(sys.argv[2]) != model_identity(str(base)) else "same")' \
    "$ADAPTER/space_config.json" "$model" 2>/dev/null)" = other ]; then
  ADAPTER=none
fi
# --device auto: the GPU when there is one (space-eval records the device it chose)
# a folder per dataset (a .jsonl's by its name), model and adapter: a folder's samples resume only a run with the
# same settings, and a second dataset there stopped at the first's
name=$(basename "$dataset"); name=${name%.gz}; name=${name%.jsonl}; name=${name//:/_}
[ -n "$model" ] && name+=_$(basename "$model")
if [ -n "$chosen" ] && [ "$chosen" != none ]; then name+=_$(basename "$chosen")
elif [ ! -f "$ADAPTER/space_config.json" ]; then name+=_no_adapter
elif [ "$ADAPTER" != "$here/adapters/smollm2-135m-space" ]; then name+=_$(basename "$ADAPTER")  # ADAPTER=...
fi
args=(--dataset humaneval --limit 5 --max-new-tokens 128 --device auto --out "runs/eval/main_$name")
# the adapter decodes with its own tuned layout (space_config.json "decode"); --mask-num etc. override it
[ -f "$ADAPTER/space_config.json" ] && args+=(--adapter "$ADAPTER")
exec "$py" -m space.eval "${args[@]}" "$@"
