#!/usr/bin/env bash
# Which lines of qkv's library and apps the test suite runs: builds build-coverage/ with GCC's
# --coverage at -O1 (at -O0 the kernels make the suite too slow to wait for), runs the GoogleTest
# cases in one process per core (GoogleTest's sharding) and the other ctest tests but package.*
# (they build qkv again, without coverage), and writes gcovr's table of src/, apps/ and include/
# to build-coverage/coverage.txt with the lines no test ran, sorted so that the least covered files
# come last, just above the total.
#   scripts/coverage.sh
# Needs gcovr (Debian: apt-get install gcovr). At -O1 a line folded into another may be counted
# with it, so read a missed line in its source before writing a test for it; code for hardware
# this machine lacks (AMX, CUDA) is missed by design.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build="$root/build-coverage"
command -v gcovr > /dev/null || { echo "coverage.sh: needs gcovr (Debian: apt-get install gcovr)" >&2; exit 2; }
[[ $# -eq 0 ]] || { echo "coverage.sh: takes no arguments, got '$*'" >&2; exit 2; }

# scripts/build.sh's build (unity, Ninja where there is one) with coverage at -O1 instead of -O3:
# CMake takes its first CXXFLAGS and LDFLAGS from the environment.
CXXFLAGS="--coverage -DNDEBUG" LDFLAGS=--coverage QKV_BUILD_DIR="$build" \
  QKV_CMAKE_ARGS="-DCMAKE_CXX_FLAGS_RELEASE=-O1" "$root/scripts/build.sh"
cd "$build"
find . -name '*.gcda' -delete  # counts from this run only

shards=$(nproc)
pids=()
for ((shard = 0; shard < shards; ++shard)); do
  GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$shard tests/qkv_tests --gtest_also_run_disabled_tests \
    > "coverage-shard-$shard.log" 2>&1 &
  pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
ctest -j "$shards" -LE '^gtest$' -E '^package\.' > coverage-ctest.log 2>&1 || failed=1
# A failing test still leaves its counts; say so, and report what ran.
[[ $failed -eq 0 ]] || echo "coverage.sh: some tests failed (build-coverage/coverage-*.log); the counts below include them" >&2

gcovr --root "$root" --object-directory "$build" --filter "$root/src/" --filter "$root/apps/" \
  --filter "$root/include/" --gcov-ignore-parse-errors -j "$shards" --sort-percentage \
  --txt "$build/coverage.txt" > /dev/null 2>&1
cat "$build/coverage.txt"
exit "$failed"
