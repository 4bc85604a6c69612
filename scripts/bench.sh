#!/usr/bin/env bash
# qkv against PyTorch, side by side in one run: for each case of apps/qkv-bench/cases.json on the
# device, qkv-bench (C++, Google Benchmark) and scripts/bench_pytorch.py (Python) take turns,
# --rounds times, with the same thread count; then one table and the raw results as JSON.
#   scripts/bench.sh [--device cpu|cuda] [--threads N] [--rounds R] [--min-time S] [--cases REGEX] [--out FILE]
# Defaults: cpu, threads = cores, 3 rounds, 0.5 s per repetition, all cases, bench-results.json.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
device=cpu threads=$(nproc) rounds=3 min_time=0.5 filter=. out=bench-results.json
while [[ $# -gt 0 ]]; do
  case $1 in
    --device) device=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --min-time) min_time=$2; shift 2 ;;
    --cases) filter=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h|--help) sed -n 2,6p "$0"; exit 0 ;;
    *) echo "bench.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
python=${QKV_TORCH_PYTHON:-/usr/bin/python3}  # the interpreter with PyTorch
build_dir=${QKV_BUILD_DIR:-$root/build}
[[ -n "${QKV_SKIP_BUILD:-}" ]] || "$root/scripts/build.sh" qkv-bench > /dev/null
bench="$build_dir/apps/qkv-bench"
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT

mapfile -t cases < <("$bench" --device "$device" --list | grep -E -- "$filter")
[[ ${#cases[@]} -gt 0 ]] || { echo "bench.sh: no $device case matches '$filter'" >&2; exit 2; }
echo "bench: ${#cases[@]} $device cases, $rounds rounds, $threads threads" >&2
for round in $(seq 1 "$rounds"); do
  for case in "${cases[@]}"; do
    echo "bench: round $round/$rounds: $case" >&2
    "$bench" --device "$device" --threads "$threads" --benchmark_filter="^${case}(/|\$)" \
      --benchmark_min_time="$min_time" --benchmark_format=json > "$raw/qkv-$case-$round.json"
    "$python" "$root/scripts/bench_pytorch.py" --device "$device" --threads "$threads" --case "$case" \
      --min-time "$min_time" --repetitions 1 > "$raw/pytorch-$case-$round.json"
  done
done
"$python" "$root/scripts/bench_table.py" --raw "$raw" --out "$out" --device "$device" --threads "$threads"
