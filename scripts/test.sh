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
  ctest_args+=(-E "^package\\.|^train\\.sigkill_resume$|LearnTheirAttentionPattern|AOneMinuteRun|^ScalingExperiment\\.")
fi
start=$(date +%s)
"$root/scripts/build.sh"
echo "test: built in $(( $(date +%s) - start )) s"
cd "${QKV_BUILD_DIR:-$root/build}"
ctest --output-on-failure -j "$(nproc)" "${ctest_args[@]}" "$@"
