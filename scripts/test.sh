#!/usr/bin/env bash
# The test command: installs what is missing, builds incrementally, runs the whole suite (ctest).
#   scripts/test.sh [CTEST_ARGS ...]              e.g. scripts/test.sh -R Parity
#   scripts/test.sh --sanitize [CTEST_ARGS ...]   the same under AddressSanitizer + UBSan, in build-sanitize/
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
ctest_args=()
if [[ "${1:-}" == "--sanitize" ]]; then
  shift
  export QKV_BUILD_DIR=${QKV_BUILD_DIR:-$root/build-sanitize}
  # CMakeLists.txt adds -O1 -g1 with the sanitizers (line tables for the reports).
  export QKV_CMAKE_ARGS="${QKV_CMAKE_ARGS:-} -DQKV_SANITIZE=address,undefined -DCMAKE_BUILD_TYPE=RelWithDebInfo"
  # UBSan stops at the first report; LibTorch's own leaks are suppressed (see the file for why).
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
  export ASAN_OPTIONS="detect_odr_violation=0:abort_on_error=0"
  export LSAN_OPTIONS="suppressions=$root/tests/sanitizers/lsan.supp:print_suppressions=0"
  # Left to the plain run: the consumer projects (they rebuild qkv without sanitizers) and the long
  # training runs, which repeat code paths the shorter tests already take under the sanitizers
  # (SIGKILL at 20 moments; default-size runs that must learn; the sqrt(d_k) experiment).
  # The long GoogleTest cases, listed in tests/sanitizers/long_cases.txt as GoogleTest's patterns
  # (which tests/CMakeLists.txt leaves out of kernel.* and routes.* too): the sharded run's filter
  # below, and, each pattern made an anchored regex, ctest's.
  mapfile -t long_cases < <(grep -v -e '^#' -e '^[[:space:]]*$' "$root/tests/sanitizers/long_cases.txt")
  gtest_filter="-$(IFS=:; echo "${long_cases[*]}")"
  long_regex=$(printf '|^%s$' "${long_cases[@]}" | sed 's/\./\\./g; s/\*/.*/g')
  ctest_args+=(-E "^package\\.|^train\\.sigkill_resume\$${long_regex}")
  sanitize=1
fi
start=$(date +%s)
"$root/scripts/build.sh"
echo "test: built in $(( $(date +%s) - start )) s"
cd "${QKV_BUILD_DIR:-$root/build}"
if [[ -n "${sanitize:-}" && $# -eq 0 ]]; then
  # ctest starts every GoogleTest case in a process of its own; under the sanitizers each start
  # (LibTorch loaded by an instrumented binary, LeakSanitizer's scan at exit) costs about 3 s, most
  # of the 244 cases' time. So here qkv_tests runs them itself, one shard per core (GoogleTest's
  # sharding: every case in exactly one shard), and ctest runs the other tests (label gtest
  # excluded): 390 s + 280 s, where ctest took 1653 s, sharing the 2 cores with another run for
  # 921 s of it (AMD EPYC Zen 5 VM, 2026-12-02).
  shards=$(nproc)
  pids=()
  for ((shard = 0; shard < shards; ++shard)); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$shard tests/qkv_tests --gtest_filter="$gtest_filter" \
      > "gtest-shard-$shard.log" 2>&1 &
    pids+=($!)
  done
  failed=0
  for ((shard = 0; shard < shards; ++shard)); do
    if wait "${pids[$shard]}"; then
      grep -E "^\[  (PASSED  |SKIPPED )\] [0-9]+ tests?[,.]" "gtest-shard-$shard.log" | sed "s/^/test: shard $shard: /" || true
    else
      failed=1
      grep -E "^\[  FAILED  \]|ERROR: (Address|Leak|UndefinedBehavior)Sanitizer|runtime error" "gtest-shard-$shard.log" | head -40 || true
      echo "test: GoogleTest shard $shard of $shards failed under the sanitizers: $PWD/gtest-shard-$shard.log"
    fi
  done
  ctest --output-on-failure -j "$(nproc)" -LE '^gtest$' "${ctest_args[@]}" || failed=1
  exit "$failed"
fi
ctest --output-on-failure -j "$(nproc)" "${ctest_args[@]}" "$@"
