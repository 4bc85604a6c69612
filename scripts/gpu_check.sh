#!/usr/bin/env bash
# The GPU machine's checks, after ../shared/device/run.sh has built qkv against its CUDA LibTorch
# and run ctest (CUDA tests included). Prepared for one device call:
#   ../shared/device/prepare.sh      # here, from the project root
#   device run, carry [".device"]:   bash .device/run.sh scripts/gpu_check.sh
# Runs the training tasks on CUDA in float32 and bfloat16 and prints their summaries.
set -uo pipefail
build=${BUILD:?run through .device/run.sh, which sets BUILD}
out=${OUT:-/tmp/out}
train="$build/apps/qkv-train"
status=0
for dtype in float32 bfloat16; do
  for task in reverse lookup; do
    echo "== qkv-train --task $task --device cuda --dtype $dtype"
    "$train" --task "$task" --device cuda --dtype "$dtype" --out "$out/$task-$dtype" --quiet || status=1
  done
done
echo "== seed example on CUDA"
"$train" --task seed --device cuda || status=1
exit $status
