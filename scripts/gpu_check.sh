#!/usr/bin/env bash
# The GPU machine's checks, after ../shared/device/run.sh has built qkv against its CUDA LibTorch
# and run the tests that CTEST_ARGS picks (the CUDA tests, and the tiled kernel's, which take AMX
# where that machine's CPU has it). Prepared for one device call:
#   scripts/gpu_prepare.sh           # here: the shared kit, nlohmann-json, Google Benchmark, the lm's text
#   device run, carry [".device"], timeout_s 500, command:
#     export QKV_GPU_DEADLINE=$(( $(date +%s) + 470 )); export CTEST_ARGS='-j8 -R CUDA|Cuda|InvalidUse\.DeviceMismatch|^Numerics\.|^Tiled|^PackedProducts|^RowOperations|^BackendsAgree'; bash .device/run.sh bash scripts/gpu_check.sh
# (a build that fails ends the call there, cheaply, leaving device time for a second call).
# What the first call that ran (2026-12-04) took: the machine's start about 30 s, configure and
# build 128 s, the tests CTEST_ARGS picks 119 s (j8), phase 2 two minutes; phase 3 and later did
# not fit. A warm machine (idle_release_s 30 s) keeps /tmp/build-cuda and /opt/deps between calls,
# so a follow-up call made at once can skip run.sh and the build:
#   export LD_LIBRARY_PATH=/opt/deps/usr/lib/x86_64-linux-gnu; env QKV_BUILD_DIR=/tmp/build-cuda \
#     QKV_SKIP_BUILD=1 QKV_TORCH_PYTHON=python3 scripts/bench.sh ...
# Phases, least measured first (qkv-train on CUDA, which ran on 2026-12-04, went last), each cut off
# so that the whole call ends by QKV_GPU_DEADLINE (epoch seconds; default 7 minutes from now) and
# its logs come back:
#   1. the machine: GPU, CPU model and flags (amx_bf16?), torch;
#   2. issue 21 on this machine's CPU (when it has AMX): the bfloat16 core and module step against
#      qkv's float32 and PyTorch's CPU attention, 2 threads, and the language model's tokens/s;
#   3. both sides' --smoke on CUDA, then scripts/bench.sh --device cuda against PyTorch on the same GPU;
#   4. the whole ctest suite (python3 with torch stands in for Debian's /usr/bin/python3);
#   5. qkv-train on CUDA: reverse and lookup in fp32, bf16-mixed and fp16-mixed (their figures to
#      set against the CPU's); the language model (short run) in the three precisions; a checkpoint
#      resumed on CUDA (losses equal to the whole run's); the seed example;
#      two Gloo ranks sharing the GPU against one process (where the build has Gloo).
# Everything goes to $OUT/gpu-check.tar.gz (logs, JSON, summaries); figures are printed as they come.
set -uo pipefail
build=${BUILD:?run through .device/run.sh, which sets BUILD}
out=${OUT:-/tmp/out}
deadline=${QKV_GPU_DEADLINE:-$(( $(date +%s) + 420 ))}
logs=/tmp/gpu-check
rm -rf "$logs"; mkdir -p "$logs" "$out"
train="$build/apps/qkv-train"
text=.device/devil.txt   # the lm's default text (Debian's dict-devil), carried as plain text
status=0
trap 'tar -C /tmp -czf "$out/gpu-check.tar.gz" gpu-check 2> /dev/null' EXIT

phase() { echo; echo "== $* ($(date -u +%T), $(( deadline - $(date +%s) )) s left)"; }
# capped SECONDS COMMAND...: at most SECONDS, and never past the deadline (minus 20 s for the tar).
capped() {
  local cap=$1 left=$(( deadline - 20 - $(date +%s) ))
  shift
  (( left < cap )) && cap=$left
  if (( cap < 5 )); then echo "(not run: out of time) $*"; return 124; fi
  timeout -k 5 "$cap" "$@"
  local rc=$?
  (( rc == 124 )) && echo "(cut off after $cap s) $*"
  return $rc
}
# summary FILE: the figures of a qkv-train --json summary in one line.
summary() {
  python3 - "$1" << 'PY'
import json, sys
try:
    s = json.loads([l for l in open(sys.argv[1]) if l.startswith("{")][-1])
except Exception as e:
    print(f"  no summary in {sys.argv[1]} ({e})"); sys.exit(0)
o = s.get("options", {})
print(f"  {o.get('task')} {s.get('device')} {s.get('precision')}: eval {json.dumps(s.get('eval'))} "
      f"final_loss {s.get('final_loss'):.5f} loss_scale {s.get('loss_scale')} "
      f"tokens/s {s.get('tokens_per_s', '-')} wall {s.get('wall_time_s', '-')} s")
PY
}

phase "1. the machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
grep -m1 'model name' /proc/cpuinfo
echo "cores: $(nproc); bf16 flags: $(grep -m1 -o -w -E 'amx_bf16|amx_tile|avx512_bf16|avx512f' /proc/cpuinfo | sort -u | tr '\n' ' ')"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), "threads", torch.get_num_threads())'
if ! /usr/bin/python3 -c 'import torch' 2> /dev/null; then
  # The suite's Python references run /usr/bin/python3 (Debian's, with python3-torch); here the
  # PyTorch is another interpreter's. A disposable machine: point /usr/bin/python3 at it.
  [[ -e /usr/bin/python3 ]] && mv /usr/bin/python3 /usr/bin/python3.image
  printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > /usr/bin/python3 && chmod +x /usr/bin/python3
  /usr/bin/python3 -c 'import torch; print("/usr/bin/python3 now runs torch", torch.__version__)'
fi

phase "2. issue 21 on this CPU"
if grep -q -w amx_bf16 /proc/cpuinfo; then
  capped 150 env QKV_BUILD_DIR="$build" QKV_SKIP_BUILD=1 QKV_TORCH_PYTHON=python3 scripts/bench.sh --threads 2 --rounds 1 \
    --pytorch host --out "$logs/bench-cpu-amx.json" \
    --cases '^(flash|bf16)_n(512_bh64|2048_bh2)_forward_backward$|^medium_train_step|^bf16_n4096_forward$|^bf16_gemm_4096$' \
    2>&1 | tee "$logs/bench-cpu-amx.txt" | tail -40 || status=1
  capped 80 env QKV_BUILD_DIR="$build" QKV_SKIP_BUILD=1 scripts/bench_lm.sh --rounds 2 --threads 2 --precision fp32 \
    --precision bf16-mixed --pytorch none --no-generation --data "$text" 2>&1 | tee "$logs/bench-lm-amx.txt" | tail -12
else
  echo "no amx_bf16 on this CPU: issue 21's AMX goals not measured here"
fi

phase "3. scripts/bench.sh --device cuda"
capped 60 "$build/apps/qkv-bench" --device cuda --smoke > "$logs/bench-smoke-cuda.txt" 2>&1 || { status=1; grep -E 'FAILED|failed' "$logs/bench-smoke-cuda.txt"; }
capped 60 python3 scripts/bench_pytorch.py --device cuda --smoke > "$logs/bench-pytorch-smoke-cuda.txt" 2>&1 ||
  { status=1; grep -E 'FAILED|failed|Error' "$logs/bench-pytorch-smoke-cuda.txt"; }
capped 90 env QKV_BUILD_DIR="$build" QKV_SKIP_BUILD=1 QKV_TORCH_PYTHON=python3 scripts/bench.sh --device cuda --rounds 1 \
  --pytorch host --out "$logs/bench-cuda.json" 2>&1 | tee "$logs/bench-cuda.txt" | tail -30 || status=1
phase "4. the whole ctest suite"
capped 170 ctest --test-dir "$build" -j 12 --timeout 160 --output-on-failure > "$logs/ctest-all.log" 2>&1
echo "passed $(grep -c ' Passed ' "$logs/ctest-all.log"), skipped $(grep -c 'Skipped ' "$logs/ctest-all.log")"
grep -E "tests passed|tests failed|\*\*\*Failed|\*\*\*Timeout|Not Run|Exception|Failed " "$logs/ctest-all.log" | head -40

phase "5. qkv-train on CUDA"
# (the CPU's figures for the same runs: tests/test_qkv_train.cpp's runs, or qkv-train --device cpu here)
for task in reverse lookup; do
  for precision in fp32 bf16-mixed fp16-mixed; do
    capped 60 "$train" --task "$task" --device cuda --precision "$precision" --json --quiet --out "$logs/$task-cuda-$precision" \
      > "$logs/$task-cuda-$precision.json" 2> "$logs/$task-cuda-$precision.err" || { status=1; tail -5 "$logs/$task-cuda-$precision.err"; }
    summary "$logs/$task-cuda-$precision.json"
  done
done
for precision in fp32 bf16-mixed fp16-mixed; do
  capped 90 "$train" --task lm --device cuda --data "$text" --steps 600 --eval-every 600 --precision "$precision" \
    --json --quiet --out "$logs/lm-cuda-$precision" > "$logs/lm-cuda-$precision.json" 2> "$logs/lm-cuda-$precision.err" ||
    { status=1; tail -5 "$logs/lm-cuda-$precision.err"; }
  summary "$logs/lm-cuda-$precision.json"
done
echo "-- a checkpoint resumed on CUDA (fp32, bf16-mixed and --dtype bfloat16 with its float32 masters): 10 + 10 steps against 20"
# Until 2026-12-05 this had never run: LibTorch's Module::load moves a tensor read from the file to
# the file's device (the CPU), and qkv-train refuses a model whose tensors moved.
for variant in "--precision fp32" "--precision bf16-mixed" "--dtype bfloat16"; do
  name=$(echo "$variant" | tr -d ' -')
  capped 40 "$train" --task reverse --device cuda $variant --steps 20 --log-every 1 --quiet --out "$logs/whole-$name" \
    > /dev/null 2> "$logs/whole-$name.err" || { status=1; tail -3 "$logs/whole-$name.err"; }
  capped 40 "$train" --task reverse --device cuda $variant --steps 10 --log-every 1 --quiet --out "$logs/split-$name" \
    > /dev/null 2> "$logs/split-$name.err" || { status=1; tail -3 "$logs/split-$name.err"; }
  capped 40 "$train" --resume "$logs/split-$name" --device cuda --steps 20 --log-every 1 --quiet > /dev/null 2>> "$logs/split-$name.err" ||
    { status=1; tail -3 "$logs/split-$name.err"; }
  if cmp -s <(cut -d, -f1,2 "$logs/whole-$name/metrics.csv") <(cut -d, -f1,2 "$logs/split-$name/metrics.csv"); then
    echo "  $variant: resumed losses equal the whole run's"
  else
    echo "  $variant: resumed losses DIFFER from the whole run's"; status=1
    diff <(cut -d, -f1,2 "$logs/whole-$name/metrics.csv") <(cut -d, -f1,2 "$logs/split-$name/metrics.csv") | head -6
  fi
done
echo "-- seed example on CUDA"
capped 30 "$train" --task seed --device cuda 2>&1 | tail -4
echo "-- 2 Gloo ranks sharing the GPU against one process on the whole batch"
if grep -q '^QKV_GLOO_INCLUDE_DIR:PATH=.*NOTFOUND' "$build/CMakeCache.txt"; then
  # pip's torch wheels ship no gloo headers, so qkv-train was built without its Gloo group
  # (2026-12-04) and refuses --dist-backend gloo.
  echo "  skipped: this build has no Gloo group (no gloo headers in this LibTorch)"
else
  capped 60 "$train" --task reverse --device cuda --nproc 2 --dist-backend gloo --steps 200 --save-replicas --quiet \
    --out "$logs/ddp-gloo-cuda" > "$logs/ddp-gloo-cuda.log" 2>&1 || { status=1; tail -5 "$logs/ddp-gloo-cuda.log"; }
  capped 60 "$train" --task reverse --device cuda --steps 200 --quiet --out "$logs/single-cuda" > "$logs/single-cuda.log" 2>&1 ||
    status=1
  python3 - "$logs" << 'PY' || status=1
import sys, torch
d = sys.argv[1]
try:
    a, b = (torch.load(f"{d}/ddp-gloo-cuda/replica-{r}.pt") for r in (0, 1))
    c = torch.load(f"{d}/single-cuda/model.pt")
except Exception as e:
    print("  replicas not readable:", e); sys.exit(1)
print("  replicas max |diff|:", max((a[k].float() - b[k].float()).abs().max().item() for k in a))
print("  2 ranks vs 1 process max |diff|:", max((a[k].float() - c[k].float()).abs().max().item() for k in a))
sys.exit(0 if all(torch.equal(a[k], b[k]) for k in a) else 1)
PY
fi
echo "-- NCCL with one GPU (a clear refusal expected)"
capped 30 "$train" --task reverse --device cuda --nproc 2 --dist-backend nccl --steps 20 --quiet 2>&1 | tail -3

phase "done, status $status"
exit $status
