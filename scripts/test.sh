#!/usr/bin/env bash
# The test command: installs what is missing, builds incrementally, runs the whole suite (ctest).
#   scripts/test.sh [CTEST_ARGS ...]     e.g. scripts/test.sh -R Parity
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
start=$(date +%s)
"$root/scripts/build.sh"
echo "test: built in $(( $(date +%s) - start )) s"
cd "${QKV_BUILD_DIR:-$root/build}"
ctest --output-on-failure -j "$(nproc)" "$@"
