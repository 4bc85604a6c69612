#!/usr/bin/env bash
# Builds qkv's libFuzzer targets with clang (in build-fuzz/, ASan + coverage on qkv's own code)
# and runs each for a bounded time from the seeds in fuzz/corpus/, as many at once as there are
# cores (QKV_FUZZ_JOBS=N to choose).
#   scripts/fuzz.sh [SECONDS_PER_TARGET]     (default 60)
#   QKV_FUZZ_TARGETS="fuzz_backends" scripts/fuzz.sh 120    only the targets named
# A crash stops the script and leaves the input as build-fuzz/crash-*: make it a regression test
# (in fuzz/corpus/<target's folder> or tests/data/fuzz_regressions*/, the suites' ctest
# fuzz_replay.* run it through the target again, built with GCC: fuzz/replay_main.cpp).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-60}
jobs=${QKV_FUZZ_JOBS:-$(nproc)}
# Each target and the folder of fuzz/corpus/ it starts from.
declare -A seeds=([fuzz_weights_loader]=weights [fuzz_checkpoint_loader]=checkpoints [fuzz_train_options]=options
                 [fuzz_backends]=backends)
read -r -a targets <<< "${QKV_FUZZ_TARGETS:-fuzz_weights_loader fuzz_checkpoint_loader fuzz_train_options fuzz_backends}"
# Checked before anything is built: libFuzzer takes -max_total_time=abc for 0, no limit at all, and
# a QKV_FUZZ_JOBS of 0 would never finish a batch.
if [[ ! $seconds =~ ^[0-9]{1,7}$ ]] || ((10#$seconds < 1)); then
  echo "fuzz.sh: expected SECONDS_PER_TARGET, a whole number of seconds >= 1, got '$seconds'" >&2
  exit 2
fi
if [[ ! $jobs =~ ^[0-9]{1,4}$ ]] || ((10#$jobs < 1)); then
  echo "fuzz.sh: expected QKV_FUZZ_JOBS, a whole number >= 1, got '$jobs'" >&2
  exit 2
fi
[[ ${#targets[@]} -gt 0 ]] || { echo "fuzz.sh: QKV_FUZZ_TARGETS names no target (known: ${!seeds[*]})" >&2; exit 2; }
for target in "${targets[@]}"; do
  [[ -n "${seeds[$target]+known}" ]] ||
    { echo "fuzz.sh: expected targets among ${!seeds[*]}, got '$target' in QKV_FUZZ_TARGETS" >&2; exit 2; }
done
"$root/scripts/setup.sh"
if ! command -v clang++ > /dev/null || ! ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a > /dev/null 2>&1; then
  sudo=(); [[ $(id -u) -ne 0 ]] && sudo=(sudo)
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends clang libclang-rt-14-dev > /dev/null
fi
build=$root/build-fuzz
if [[ ! -f "$build/CMakeCache.txt" ]]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_UNITY_BUILD="${QKV_UNITY_BUILD:-ON}" \
    -DQKV_FUZZ=ON -DQKV_BUILD_TESTS=OFF -DQKV_INSTALL=OFF -DQKV_SANITIZE=address,fuzzer-no-link > /dev/null
fi
cmake --build "$build" --target "${targets[@]}"
export LSAN_OPTIONS="suppressions=$root/tests/sanitizers/lsan.supp:print_suppressions=0"
cd "$build"
# One target a core at a time (each runs on one thread): the same runs per target as one after
# another, in less time (CI: three targets on 2 cores, 240 s instead of 360).
run_target() {
  local target=$1 corpus="$build/corpus-$1"
  mkdir -p "$corpus"
  "$build/fuzz/$target" -max_total_time="$seconds" -rss_limit_mb=4096 -timeout=20 -print_final_stats=1 \
    "$corpus" "$root/fuzz/corpus/${seeds[$target]}" > "$build/$target.log" 2>&1
}
failed=()
for ((first = 0; first < ${#targets[@]}; first += jobs)); do
  batch=("${targets[@]:first:jobs}")
  echo "== ${batch[*]} for $seconds s"
  pids=()
  for target in "${batch[@]}"; do
    run_target "$target" &
    pids+=($!)
  done
  for i in "${!batch[@]}"; do
    target=${batch[$i]}
    if wait "${pids[$i]}"; then
      grep -E "stat::number_of_executed_units|Done [0-9]+ runs" "$build/$target.log" | tail -2 | sed "s/^/$target: /" || true
    else
      tail -40 "$build/$target.log"
      failed+=("$target")
    fi
  done
  if ((${#failed[@]})); then
    echo "fuzz: ${failed[*]} found a problem (input saved in $build; log: $build/<target>.log)"
    exit 1
  fi
done
echo "fuzz: no crash"
