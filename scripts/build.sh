#!/usr/bin/env bash
# Configures (once) and builds qkv incrementally in $QKV_BUILD_DIR (default: build/).
#   scripts/build.sh [TARGET ...]     extra CMake arguments go in $QKV_CMAKE_ARGS
# A unity build (CMAKE_UNITY_BUILD, batches of 8 sources; QKV_UNITY_BUILD=OFF for one file at a
# time): each translation unit pays about 15-30 s here for LibTorch's headers even with the
# precompiled header (the templates they instantiate), so fewer, larger units build faster: the
# library in 93 s against 250 s one source at a time (2 jobs, AMD EPYC Zen 5 VM, 2026-12-02).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build_dir=${QKV_BUILD_DIR:-$root/build}
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [[ ! -f "$build_dir/CMakeCache.txt" ]]; then
  # shellcheck disable=SC2086
  cmake -S "$root" -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_UNITY_BUILD="${QKV_UNITY_BUILD:-ON}" ${QKV_CMAKE_ARGS:-}
fi
targets=()
for target in "$@"; do targets+=(--target "$target"); done
cmake --build "$build_dir" "${targets[@]}" -j "$(nproc)"
