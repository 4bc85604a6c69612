#!/usr/bin/env bash
# The language model's speed, side by side in one run, alternating rounds, the same threads:
#  1. training tokens/s: qkv-train --task lm against scripts/lm_pytorch.py (the same model, data,
#     batches and optimizer in PyTorch), at qkv-train's default configuration, after 2 untimed steps;
#  2. generation tokens/s of qkv-train --generate with the KV cache against without it
#     (recomputing the whole prefix for every token), 256 new tokens.
#   scripts/bench_lm.sh [--threads N] [--rounds R] [--steps S] [--qkv WHERE ...] [--pytorch WHERE]
#                       [--dropout P]
# Defaults: threads = cores, 3 rounds, 30 training steps per measurement, qkv-train and PyTorch on
# this machine (WHERE: host, or a Debian release's chroot as in scripts/bench.sh; --qkv is
# repeatable: --qkv host --qkv sid times qkv built on this machine's LibTorch and on unstable's in
# the same rounds), the lm's dropout (0.1; both sides take --dropout P). Prints one table.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
threads=$(nproc) rounds=3 steps=30 pytorch=host dropout=() qkv_sides=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --threads) threads=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --qkv) qkv_sides+=("$2"); shift 2 ;;
    --pytorch) pytorch=$2; shift 2 ;;
    --dropout) dropout=(--dropout "$2"); shift 2 ;;
    -h|--help) sed -n 2,12p "$0"; exit 0 ;;
    *) echo "bench_lm.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ ${#qkv_sides[@]} -gt 0 ]] || qkv_sides=(host)
build_dir=${QKV_BUILD_DIR:-$root/build}
if [[ -z "${QKV_SKIP_BUILD:-}" ]]; then
  "$root/scripts/build.sh" qkv-train qkv-bench > /dev/null
  for side in "${qkv_sides[@]}"; do
    [[ $side == host ]] || bash "$root/scripts/test-in-debian.sh" "$side" scripts/build.sh qkv-train > /dev/null
  done
fi
train="$build_dir/apps/qkv-train"
source "$root/scripts/bench_env.sh"
use_fitting_openblas_core "$build_dir/apps/qkv-bench" bench_lm
use_same_malloc_setting  # qkv-train's own setting, given to every process (bench_env.sh)

# Under build/, where a chroot sees it too (as /qkv/build/...).
mkdir -p "$root/build"
work=$(mktemp -d "$root/build/bench-lm.XXXXXX")
trap 'rm -rf "$work"' EXIT
work_in_chroot=/qkv/build/$(basename "$work")
python=/usr/bin/python3
json_field() { "$python" -c 'import json, sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])[sys.argv[1]])' "$1"; }

# Both sides time `steps` steps after `warmup` untimed ones (lm_pytorch.py's --warmup, 2 by
# default): the first steps pay for first allocations, oneDNN's JIT and first-touch page faults
# (qkv-train on LibTorch 1.13, AMD EPYC, 2026-12-03: 0.61 s and 0.23 s, then 0.15 s a step), which
# qkv-train's own tokens/s counts in and lm_pytorch.py's leaves out. qkv-train's rate over the
# timed steps comes from its metrics.csv (elapsed_s after each step).
warmup=2
steady_tokens_per_s() {
  "$python" - "$1" "$warmup" << 'PY'
import csv, json, sys
run, warmup = sys.argv[1], int(sys.argv[2])
options = json.load(open(f"{run}/summary.json"))["options"]
elapsed = {int(r["step"]): float(r["elapsed_s"]) for r in csv.DictReader(open(f"{run}/metrics.csv"))}
last = max(elapsed)
print((last - warmup) * options["batch"] * options["seq_len"] / (elapsed[last] - elapsed[warmup]))
PY
}

# qkv-train on one side: this machine's build, or the one in a Debian release's chroot (the run's
# files under $work, which the chroot sees at $work_in_chroot). Prints its last JSON line.
run_qkv_train() {
  local side=$1
  shift
  if [[ $side == host ]]; then
    "$train" "$@" | grep '^{' | tail -1
  else
    local args=() arg
    for arg in "$@"; do args+=("${arg//$work/$work_in_chroot}"); done
    bash "$root/scripts/test-in-debian.sh" "$side" "/qkv/build-$side/apps/qkv-train" "${args[@]}" | grep '^{' | tail -1
  fi
}

# lm_pytorch.py's speed run here or in a Debian release's chroot; prints its JSON line.
run_lm_pytorch() {
  local args=(speed --threads "$threads" --warmup "$warmup" --steps "$steps")
  if [[ $pytorch == host ]]; then
    "$python" "$root/scripts/lm_pytorch.py" "${args[@]}" --like "$work/defaults/summary.json"
  else
    bash "$root/scripts/test-in-debian.sh" "$pytorch" /usr/bin/python3 /qkv/scripts/lm_pytorch.py "${args[@]}" \
      --like "$work_in_chroot/defaults/summary.json"
  fi | grep '^{' | tail -1
}

# The default configuration, as qkv-train resolves it (lm_pytorch.py takes the same options from
# its summary); and for each qkv side a model to generate from, with a context of 320 for 256 new
# tokens after the prompt (its weights do not change the speed).
"$train" --task lm --device cpu --threads "$threads" --steps 1 --eval-every 1000 --quiet "${dropout[@]}" \
  --out "$work/defaults" > /dev/null
for side in "${qkv_sides[@]}"; do  # each side's own checkpoint, in its LibTorch's format
  run_qkv_train "$side" --task lm --device cpu --threads "$threads" --seq-len 320 --steps 2 --eval-every 1000 --quiet \
    --json --out "$work/model-$side" > /dev/null
done

declare -A qkv_train=() cached=() uncached=()
pytorch_train=()
for round in $(seq 1 "$rounds"); do
  echo "bench_lm: round $round/$rounds" >&2
  for side in "${qkv_sides[@]}"; do
    rm -rf "$work/train-$side"
    run_qkv_train "$side" --task lm --device cpu --threads "$threads" --steps $((warmup + steps)) --log-every 1 \
      --eval-every 100000 --quiet "${dropout[@]}" --json --out "$work/train-$side" > /dev/null
    qkv_train[$side]+=" $(steady_tokens_per_s "$work/train-$side")"
  done
  run_lm_pytorch > "$work/pytorch.json"
  pytorch_train+=("$(json_field tokens_per_s < "$work/pytorch.json")")
  for side in "${qkv_sides[@]}"; do
    for cache in yes no; do
      flag=()
      [[ $cache == yes ]] || flag=(--no-kv-cache)
      result=$(run_qkv_train "$side" --task lm --device cpu --threads "$threads" --generate --resume "$work/model-$side" \
        --max-new-tokens 256 --temperature 0 --json "${flag[@]}" 2> /dev/null | json_field tokens_per_s)
      if [[ $cache == yes ]]; then cached[$side]+=" $result"; else uncached[$side]+=" $result"; fi
    done
  done
done
sides=()
for side in "${qkv_sides[@]}"; do sides+=("$side|${qkv_train[$side]}|${cached[$side]}|${uncached[$side]}"); done
"$python" - "$threads" "$work" "${pytorch_train[*]}" "${dropout[1]:-}" "${GLIBC_TUNABLES:-none}" "${sides[@]}" << 'PY'
import json, statistics, sys
threads, work, pytorch, dropout, tunables = sys.argv[1:6]
pytorch = [float(x) for x in pytorch.split()]
torch_version = json.loads(open(f"{work}/pytorch.json").read())["torch_version"]
dropout_note = f" with dropout {dropout}" if dropout else ""
ratio = lambda a, b: statistics.median(x / y for x, y in zip(a, b))
judged = lambda value, goal: f"≥ {goal}: {'met' if value >= goal else 'missed'}"  # on the unrounded median
print(f"language model, default configuration{dropout_note}, {threads} threads, PyTorch {torch_version}; "
      f"medians of {len(pytorch)} rounds; both sides' GLIBC_TUNABLES: {tunables}")
print("| measurement | qkv | other | ratio | goal |")
print("| --- | --- | --- | --- | --- |")
rounds = []
for entry in sys.argv[6:]:
    side, trained, cached, uncached = entry.split("|")
    trained, cached, uncached = ([float(x) for x in a.split()] for a in (trained, cached, uncached))
    summary = json.load(open(f"{work}/train-{side}/summary.json"))
    version = summary["torch_version"]  # the LibTorch it was built on
    built = f"qkv-train on LibTorch {version} ({side}; linear layers on {summary.get('linear_products', 'unknown')})"
    print(f"| training tokens/s: {built} vs lm_pytorch.py | {statistics.median(trained):.0f} "
          f"| {statistics.median(pytorch):.0f} | {ratio(trained, pytorch):.3f} | {judged(ratio(trained, pytorch), 1.3)} |")
    print(f"| generation tokens/s, 256 new, {built}: KV cache vs recomputing the prefix "
          f"| {statistics.median(cached):.0f} | {statistics.median(uncached):.0f} | {ratio(cached, uncached):.2f} "
          f"| {judged(ratio(cached, uncached), 5)} |")
    rounds.append(f"qkv ({side}) {trained} cached {cached} uncached {uncached}")
print("rounds:", "; ".join(rounds), "; pytorch", pytorch)
PY
