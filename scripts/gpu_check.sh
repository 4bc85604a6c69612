#!/usr/bin/env bash
# The GPU machine's checks, after ../shared/device/run.sh has built qkv against its CUDA LibTorch
# and run ctest (CUDA tests included). Prepared for one device call:
#   scripts/gpu_prepare.sh           # here: the shared kit plus nlohmann-json and Google Benchmark
#   device run, carry [".device"]:   bash .device/run.sh scripts/gpu_check.sh
# Runs the training tasks on CUDA in float32 and bfloat16, data parallelism with CUDA tensors,
# and last the benchmark against PyTorch (its table is the end of the output).
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
# Data parallelism with CUDA tensors: 2 processes sharing the one GPU through Gloo, compared with
# one process on the whole batch; then NCCL, which needs a GPU per process (expected: a clear refusal).
echo "== qkv-train --nproc 2 --device cuda --dist-backend gloo"
"$train" --task reverse --device cuda --nproc 2 --dist-backend gloo --steps 200 --save-replicas \
  --out "$out/ddp-gloo-cuda" --quiet || status=1
"$train" --task reverse --device cuda --steps 200 --out "$out/single-cuda" --quiet || status=1
python3 - "$out" <<'PY' || status=1
import sys, torch
out = sys.argv[1]
a, b = (torch.load(f"{out}/ddp-gloo-cuda/replica-{r}.pt") for r in (0, 1))
c = torch.load(f"{out}/single-cuda/model.pt")
print("replicas max |diff|:", max((a[k] - b[k]).abs().max().item() for k in a))
print("2 ranks vs 1 process max |diff|:", max((a[k] - c[k]).abs().max().item() for k in a))
sys.exit(0 if all(torch.equal(a[k], b[k]) for k in a) else 1)
PY
echo "== qkv-train --nproc 2 --device cuda --dist-backend nccl (one GPU: expect a refusal naming the GPU count)"
"$train" --task reverse --device cuda --nproc 2 --dist-backend nccl --steps 20 --quiet
echo "exit status $?"
echo "== scripts/bench.sh --device cuda"
QKV_BUILD_DIR=$build QKV_SKIP_BUILD=1 QKV_TORCH_PYTHON=python3 \
  scripts/bench.sh --device cuda --rounds 2 --out "$out/bench-cuda.json" || status=1
exit $status
