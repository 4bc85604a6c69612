#!/usr/bin/env bash
# SIGKILL qkv-train at random moments, then resume from whatever it left: the latest checkpoint
# must always load, and every resumed run must end at exactly the final loss of a run that was
# never interrupted (CPU, one thread, so the arithmetic is deterministic).
#   tests/scripts/kill_resume_test.sh QKV_TRAIN [TRIALS]      (ctest: train.sigkill_resume)
set -uo pipefail
train=$1
trials=${2:-20}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
args=(--task reverse --device cpu --threads 1 --seq-len 8 --d-model 24 --batch 16 --steps 2500
      --checkpoint-every 25 --log-every 25 --eval-every 500 --quiet --log-level error)

"$train" "${args[@]}" --out "$work/reference" --json > "$work/reference.json" || { echo "reference run failed"; exit 1; }
expected=$(grep -o '"final_loss":[^,}]*' "$work/reference.json")
RANDOM=2026  # reproducible kill moments
killed_mid_run=0
for trial in $(seq 1 "$trials"); do
  out="$work/trial$trial"
  mkdir -p "$out"
  "$train" "${args[@]}" --out "$out" > /dev/null 2>&1 &
  pid=$!
  delay=$(printf '0.%02d' $((RANDOM % 100)))
  sleep "$((RANDOM % 2)).${delay#0.}"  # 0.00 .. 1.99 s
  if kill -KILL "$pid" 2> /dev/null; then killed_mid_run=$((killed_mid_run + 1)); fi
  wait "$pid" 2> /dev/null
  if [[ -f "$out/checkpoint.pt" ]]; then
    "$train" --resume "$out" --json --quiet --log-level error > "$out/final.json" 2> "$out/error" ||
      { echo "trial $trial: the checkpoint did not resume: $(cat "$out/error")"; exit 1; }
  else  # killed before the first checkpoint: start again (a fresh folder, as a user would)
    rm -rf "$out" && mkdir -p "$out"
    "$train" "${args[@]}" --out "$out" --json > "$out/final.json" || { echo "trial $trial: rerun failed"; exit 1; }
  fi
  got=$(grep -o '"final_loss":[^,}]*' "$out/final.json")
  if [[ "$got" != "$expected" ]]; then
    echo "trial $trial: resumed run ended with $got, the uninterrupted one with $expected"
    exit 1
  fi
  rm -rf "$out"
done
echo "$trials kill trials ($killed_mid_run killed mid-run): every checkpoint loaded, every run ended with $expected"
