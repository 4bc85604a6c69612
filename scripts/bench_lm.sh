#!/usr/bin/env bash
# The language model's speed, side by side in one run, alternating rounds, the same threads:
#  1. training tokens/s: qkv-train --task lm against scripts/lm_pytorch.py (the same model, data,
#     batches and optimizer in PyTorch), at qkv-train's default configuration;
#  2. generation tokens/s of qkv-train --generate with the KV cache against without it
#     (recomputing the whole prefix for every token), 256 new tokens.
#   scripts/bench_lm.sh [--threads N] [--rounds R] [--steps S] [--pytorch WHERE] [--dropout P]
# Defaults: threads = cores, 3 rounds, 30 training steps per measurement, PyTorch on this machine
# (WHERE: host, or a Debian release's chroot as in scripts/bench.sh), the lm's dropout (0.1; both
# sides take --dropout P). Prints one table.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
threads=$(nproc) rounds=3 steps=30 pytorch=host dropout=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --threads) threads=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --pytorch) pytorch=$2; shift 2 ;;
    --dropout) dropout=(--dropout "$2"); shift 2 ;;
    -h|--help) sed -n 2,10p "$0"; exit 0 ;;
    *) echo "bench_lm.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
build_dir=${QKV_BUILD_DIR:-$root/build}
[[ -n "${QKV_SKIP_BUILD:-}" ]] || "$root/scripts/build.sh" qkv-train qkv-bench > /dev/null
train="$build_dir/apps/qkv-train"
# OpenBLAS may run kernels below the CPU's: Debian 12's takes an Intel Xeon of the Emerald Rapids
# generation for an old CPU and runs its generic kernels, and an OPENBLAS_CORETYPE in the
# environment may name an older core than the CPU's (Haswell, AVX2, on an AMD Zen 5 with AVX-512:
# 1.8x slower). That sets the speed of LibTorch's float32 products on both sides of the comparison;
# qkv-bench says which OPENBLAS_CORETYPE fits, and it is set for every side, the chroots included,
# in place of the environment's.
coretype=$("$build_dir/apps/qkv-bench" --blas-advice | grep -o 'run with OPENBLAS_CORETYPE=[A-Z0-9]*' | cut -d= -f2 || true)
if [[ -n "$coretype" ]]; then
  echo "bench_lm: OpenBLAS would run kernels below this CPU's${OPENBLAS_CORETYPE:+ (OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE in the environment)}: OPENBLAS_CORETYPE=$coretype for every side" >&2
  export OPENBLAS_CORETYPE=$coretype
fi

# qkv-train keeps freed memory in the heap for the next step (glibc's mmap threshold at 32 MiB,
# apps/common/cli_support.h: without it, page faults took a fifth of the float32 step on an AMD
# EPYC VM); the PyTorch side gets the same setting through glibc's tunables, so that both sides
# train on the same allocator (where the environment sets malloc's thresholds, qkv-train leaves
# them alone and both sides run on the environment's).
pytorch_tunables=${GLIBC_TUNABLES:-}
if [[ "$pytorch_tunables" != *glibc.malloc.* && -z "${MALLOC_MMAP_THRESHOLD_:-}" && -z "${MALLOC_TRIM_THRESHOLD_:-}" ]]; then
  pytorch_tunables=${pytorch_tunables:+$pytorch_tunables:}glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=268435456
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python=/usr/bin/python3
json_field() { "$python" -c 'import json, sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])[sys.argv[1]])' "$1"; }

# The default configuration, as qkv-train resolves it (lm_pytorch.py takes the same options from
# its summary); and a model to generate from, with a context of 320 for 256 new tokens after the
# prompt (its weights do not change the speed).
"$train" --task lm --device cpu --threads "$threads" --steps 1 --eval-every 1000 --quiet "${dropout[@]}" \
  --out "$work/defaults" > /dev/null
"$train" --task lm --device cpu --threads "$threads" --seq-len 320 --steps 2 --eval-every 1000 --quiet \
  --out "$work/model" > /dev/null

qkv_train=() pytorch_train=() cached=() uncached=()
for round in $(seq 1 "$rounds"); do
  echo "bench_lm: round $round/$rounds" >&2
  qkv_train+=("$("$train" --task lm --device cpu --threads "$threads" --steps "$steps" --eval-every 100000 --quiet \
    "${dropout[@]}" --json | json_field tokens_per_s)")
  if [[ $pytorch == host ]]; then
    pytorch_train+=("$(GLIBC_TUNABLES=$pytorch_tunables "$python" "$root/scripts/lm_pytorch.py" speed --threads "$threads" --steps "$steps" \
      --like "$work/defaults/summary.json" | json_field tokens_per_s)")
  else
    cp "$work/defaults/summary.json" "$root/build/bench-lm-defaults.json"  # where the chroot sees it (/qkv)
    pytorch_train+=("$(GLIBC_TUNABLES=$pytorch_tunables bash "$root/scripts/test-in-debian.sh" "$pytorch" /usr/bin/python3 /qkv/scripts/lm_pytorch.py \
      speed --threads "$threads" --steps "$steps" --like /qkv/build/bench-lm-defaults.json | grep '^{' |
      json_field tokens_per_s)")
  fi
  for cache in yes no; do
    flag=$([[ $cache == yes ]] && echo "" || echo "--no-kv-cache")
    result=$("$train" --task lm --device cpu --threads "$threads" --generate --resume "$work/model" --max-new-tokens 256 \
      --temperature 0 --json $flag 2> /dev/null | json_field tokens_per_s)
    if [[ $cache == yes ]]; then cached+=("$result"); else uncached+=("$result"); fi
  done
done
torch_version=$([[ $pytorch == host ]] && "$python" -c 'import torch; print(torch.__version__)' ||
  bash "$root/scripts/test-in-debian.sh" "$pytorch" /usr/bin/python3 -c 'import torch; print(torch.__version__)' | tail -1)
"$python" - "$threads" "$torch_version" "${qkv_train[*]}" "${pytorch_train[*]}" "${cached[*]}" "${uncached[*]}" \
  "${dropout[1]:-}" "${pytorch_tunables:-none}" << 'PY'
import statistics, sys
threads, torch_version = sys.argv[1], sys.argv[2]
qkv, pytorch, cached, uncached = ([float(x) for x in a.split()] for a in sys.argv[3:7])
dropout_note = f" with dropout {sys.argv[7]}" if sys.argv[7] else ""
ratio = lambda a, b: statistics.median(x / y for x, y in zip(a, b))
print(f"language model, default configuration{dropout_note}, {threads} threads, PyTorch {torch_version}; "
      f"medians of {len(qkv)} rounds; PyTorch's GLIBC_TUNABLES: {sys.argv[8]}")
print("| measurement | qkv | other | ratio | goal |")
print("| --- | --- | --- | --- | --- |")
print(f"| training tokens/s: qkv-train vs lm_pytorch.py | {statistics.median(qkv):.0f} | {statistics.median(pytorch):.0f} "
      f"| {ratio(qkv, pytorch):.2f} | ≥ 1.3 |")
print(f"| generation tokens/s, 256 new: KV cache vs recomputing the prefix | {statistics.median(cached):.0f} "
      f"| {statistics.median(uncached):.0f} | {ratio(cached, uncached):.2f} | ≥ 5 |")
print("rounds:", "qkv", qkv, "pytorch", pytorch, "cached", cached, "uncached", uncached)
PY
