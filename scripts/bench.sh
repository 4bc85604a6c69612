#!/usr/bin/env bash
# qkv against PyTorch, side by side in one run: for each case of apps/qkv-bench/cases.json on the
# device, qkv-bench (C++, Google Benchmark) and scripts/bench_pytorch.py (Python) take turns,
# --rounds times, with the same thread count; then one table and the raw results as JSON.
#   scripts/bench.sh [--device cpu|cuda] [--threads N] [--rounds R] [--min-time S] [--cases REGEX]
#                    [--pytorch WHERE ... | none] [--malloc-defaults] [--emulate avx2|avx512] [--out FILE]
# Defaults: cpu, threads = cores, 3 rounds, 0.5 s per repetition, every non-optional case (a
# --cases REGEX includes optional ones), bench-results.json. --pytorch (repeatable): where the
# PyTorch side runs: "host" (this machine's /usr/bin/python3, the default) or a Debian release
# whose python3-torch runs in a chroot (scripts/test-in-debian.sh), e.g. --pytorch host
# --pytorch trixie --pytorch sid times PyTorch 1.13, 2.6 and the newest in the same run; --pytorch
# none times qkv alone (its bfloat16 cases against its float32 ones, the second table).
# Both sides run with qkv-train's malloc thresholds and huge pages above them (bench_env.sh);
# --malloc-defaults runs both at glibc's.
# --emulate: both sides on this CPU made to look like one without bfloat16 instructions
# (scripts/bench_env.sh), for bfloat16 cases against float32 on such CPUs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
device=cpu threads=$(nproc) rounds=3 min_time=0.5 filter="" out=bench-results.json malloc_defaults=false emulate=""
pytorch_sides=()
source "$root/scripts/bench_env.sh"
while [[ $# -gt 0 ]]; do
  case $1 in
    --device | --threads | --rounds | --min-time | --cases | --pytorch | --out | --emulate) expect_value bench.sh "$1" $# ;;
  esac
  case $1 in
    --device) device=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --min-time) min_time=$2; shift 2 ;;
    --cases) filter=$2; shift 2 ;;
    --pytorch) pytorch_sides+=("$2"); shift 2 ;;
    --out) out=$2; shift 2 ;;
    --malloc-defaults) malloc_defaults=true; shift ;;
    --emulate) emulate=$2; shift 2 ;;
    -h|--help) sed -n 2,16p "$0"; exit 0 ;;
    *) echo "bench.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ $device == cpu || $device == cuda ]] || { echo "bench.sh: --device takes cpu or cuda, got '$device'" >&2; exit 2; }
expect_whole bench.sh --threads "$threads" 1 1024
expect_whole bench.sh --rounds "$rounds" 1 1000
expect_real bench.sh --min-time "$min_time" 0 3600
expect_regex bench.sh --cases "$filter"
[[ ${#pytorch_sides[@]} -gt 0 ]] || pytorch_sides=(host)
if [[ " ${pytorch_sides[*]} " == *" none "* ]]; then
  [[ ${#pytorch_sides[@]} -eq 1 ]] || { echo "bench.sh: --pytorch none goes alone, got: ${pytorch_sides[*]}" >&2; exit 2; }
  pytorch_sides=()
fi
build_dir=${QKV_BUILD_DIR:-$root/build}
[[ -n "${QKV_SKIP_BUILD:-}" ]] || "$root/scripts/build.sh" qkv-bench > /dev/null
bench="$build_dir/apps/qkv-bench"
use_fitting_openblas_core "$bench" bench
# --malloc-defaults: both sides at glibc's own malloc settings (bench_env.sh says why not by default).
$malloc_defaults || use_same_malloc_setting
[[ -z "$emulate" ]] || emulate_cpu "$emulate" bench
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT

if [[ -n "$filter" ]]; then
  mapfile -t cases < <("$bench" --device "$device" --list --all | grep -E -- "$filter")
else
  mapfile -t cases < <("$bench" --device "$device" --list)
fi
[[ ${#cases[@]} -gt 0 ]] || { echo "bench.sh: no $device case matches '$filter'" >&2; exit 2; }
# Google Benchmark 1.8 and later want a unit on --benchmark_min_time (and warn without one);
# 1.7 (Debian 12) refuses one. Ask the binary which it is (--list runs nothing; a flag value
# Google Benchmark refuses is left to qkv-bench's parser, which exits 2).
min_time_flag=$min_time
if "$bench" --benchmark_min_time="${min_time}s" --list > /dev/null 2>&1; then
  min_time_flag=${min_time}s
fi

# The PyTorch side of one case: here, or in a Debian release's chroot (the repository is at /qkv there).
run_pytorch() {
  local side=$1 case=$2
  local args=(--device "$device" --threads "$threads" --case "$case" --min-time "$min_time" --repetitions 1)
  if [[ $side == host ]]; then
    "${QKV_TORCH_PYTHON:-/usr/bin/python3}" "$root/scripts/bench_pytorch.py" "${args[@]}"
  else
    local output status=0
    output=$(bash "$root/scripts/test-in-debian.sh" "$side" /usr/bin/python3 /qkv/scripts/bench_pytorch.py "${args[@]}") ||
      status=$?
    [[ $status -eq 0 ]] || return $status
    grep '^{' <<< "$output"
  fi
}

echo "bench: ${#cases[@]} $device cases, $rounds rounds, $threads threads, PyTorch: ${pytorch_sides[*]:-none}" >&2
for round in $(seq 1 "$rounds"); do
  for case in "${cases[@]}"; do
    echo "bench: round $round/$rounds: $case" >&2
    "$bench" --device "$device" --threads "$threads" --benchmark_filter="^${case}(/|\$)" \
      --benchmark_min_time="$min_time_flag" --benchmark_format=json > "$raw/qkv-$case-$round.json"
    for side in ${pytorch_sides[@]+"${pytorch_sides[@]}"}; do
      # Exit status 3: that torch has no implementation of the case (PyTorch 1.13: no SDPA, so no
      # causal or bfloat16 attention); the table shows none for it.
      status=0
      run_pytorch "$side" "$case" > "$raw/pytorch@$side-$case-$round.json" || status=$?
      if [[ $status -eq 3 ]]; then
        rm -f "$raw/pytorch@$side-$case-$round.json"
      elif [[ $status -ne 0 && $emulate == avx2 ]]; then
        # Under --emulate avx2 (only), LibTorch still calls oneDNN for bfloat16 and oneDNN, capped,
        # refuses ("could not create a primitive descriptor iterator"), where a real AVX2 CPU
        # would run LibTorch's own loops: no figure for that side rather than a wrong one.
        echo "bench: the PyTorch side ($side) of $case failed under --emulate $emulate (status $status): left out" >&2
        rm -f "$raw/pytorch@$side-$case-$round.json"
      elif [[ $status -ne 0 ]]; then
        echo "bench: the PyTorch side ($side) of $case failed (exit status $status)" >&2
        exit "$status"
      fi
    done
  done
done
"${QKV_TORCH_PYTHON:-/usr/bin/python3}" "$root/scripts/bench_table.py" --raw "$raw" --out "$out" --device "$device" \
  --threads "$threads"
