#!/usr/bin/env bash
# The benchmark scripts' side options (ctest: scripts.bench_options): `scripts/bench.sh --pytorch
# none` times qkv alone and still prints its table; `none` beside another side is refused; a
# release name that debootstrap does not know is refused by scripts/test-in-debian.sh before it
# makes anything (it once tried to bootstrap a Debian called "none"). qkv-bench refuses an
# environment variable value that qkv refuses (QKV_TILED_ISA, QKV_LINEAR_GEMM) with exit 2 and the
# reason, before any case, where it once aborted on the uncaught error. Bad option values of
# bench.sh and bench_lm.sh are refused before anything runs or is written.
#   tests/scripts/bench_options_test.sh REPOSITORY BUILD_DIR
set -uo pipefail
repo=$1
build=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

export QKV_SKIP_BUILD=1 QKV_BUILD_DIR=$build
out=$(bash "$repo/scripts/bench.sh" --pytorch none --rounds 1 --min-time 0.01 --threads 1 --cases '^toy_forward_backward$' \
  --out "$work/results.json" 2>&1) || fail "bench.sh --pytorch none exited $?: $out"
grep -q 'PyTorch: none' <<< "$out" || fail "bench.sh did not say that no PyTorch side runs: $out"
grep -q '| toy_forward_backward' <<< "$out" || fail "no table row for the case: $out"
[[ -s "$work/results.json" ]] || fail "no raw results written"
/usr/bin/python3 - "$work/results.json" << 'PY' || fail "the raw results hold a PyTorch side"
import json, sys
results = json.load(open(sys.argv[1]))
sys.exit(1 if results["meta"]["pytorch"] or any(row.get("pytorch") for row in results["rows"]) else 0)
PY

out=$(bash "$repo/scripts/bench.sh" --pytorch none --pytorch host --cases '^toy_forward_backward$' 2>&1)
status=$?
[[ $status -eq 2 ]] || fail "--pytorch none with host: expected exit 2, got $status: $out"
grep -q 'goes alone' <<< "$out" || fail "--pytorch none with host: no reason given: $out"

# Option values are checked before anything runs, and nothing is written: --rounds 0 once wrote an
# empty table over the last results, --min-time -1 ran every case, --cases '(' reached grep.
echo previous > "$work/kept.json"
for arguments in "--rounds 0" "--threads 0" "--threads abc" "--min-time -1" "--min-time nan" "--cases (" \
  "--device tpu" "--out"; do
  read -r -a words <<< "$arguments"
  out=$(bash "$repo/scripts/bench.sh" --pytorch none --out "$work/kept.json" "${words[@]}" 2>&1)
  status=$?
  [[ $status -eq 2 ]] || fail "bench.sh $arguments: expected exit 2, got $status: $out"
  grep -Eq "^bench.sh: ${words[0]} takes " <<< "$out" || fail "bench.sh $arguments: no reason given: $out"
  ! grep -q 'round 1' <<< "$out" || fail "bench.sh $arguments ran a case: $out"
  [[ $(cat "$work/kept.json") == previous ]] || fail "bench.sh $arguments wrote over --out"
done
for arguments in "--steps 0" "--rounds x" "--dropout 1" "--threads"; do
  read -r -a words <<< "$arguments"
  out=$(bash "$repo/scripts/bench_lm.sh" --pytorch none "${words[@]}" 2>&1)
  status=$?
  [[ $status -eq 2 ]] || fail "bench_lm.sh $arguments: expected exit 2, got $status: $out"
  grep -Eq "^bench_lm.sh: ${words[0]} takes " <<< "$out" || fail "bench_lm.sh $arguments: no reason given: $out"
done

if [[ -d /usr/share/debootstrap/scripts ]]; then
  out=$(QKV_CHROOT_ROOT="$work/chroots" bash "$repo/scripts/test-in-debian.sh" no-such-release 2>&1)
  status=$?
  [[ $status -eq 2 ]] || fail "test-in-debian.sh no-such-release: expected exit 2, got $status: $out"
  grep -q "expected a Debian release debootstrap knows" <<< "$out" || fail "no reason given: $out"
  [[ ! -e "$work/chroots/no-such-release" ]] || fail "test-in-debian.sh made a folder for an unknown release"
fi
for setting in QKV_TILED_ISA=avx9000 QKV_LINEAR_GEMM=mkl; do
  out=$(env "$setting" "$build/apps/qkv-bench" --benchmark_filter='^toy_forward_backward' 2>&1)
  status=$?
  [[ $status -eq 2 ]] || fail "qkv-bench with $setting: expected exit 2, got $status: $out"
  grep -Eq "^qkv-bench: (qkv: )?${setting%%=*}: expected .*, got '${setting#*=}'" <<< "$out" ||
    fail "qkv-bench with $setting: no reason given: $out"
  ! grep -q 'toy_forward_backward' <<< "$out" || fail "qkv-bench with $setting ran a case: $out"
done
echo "bench options: ok"
