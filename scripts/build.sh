#!/usr/bin/env bash
# Configures (once) and builds qkv incrementally in $QKV_BUILD_DIR (default: build/).
#   scripts/build.sh [TARGET ...]     extra CMake arguments go in $QKV_CMAKE_ARGS
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build_dir=${QKV_BUILD_DIR:-$root/build}
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [[ ! -f "$build_dir/CMakeCache.txt" ]]; then
  # shellcheck disable=SC2086
  cmake -S "$root" -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release ${QKV_CMAKE_ARGS:-}
fi
targets=()
for target in "$@"; do targets+=(--target "$target"); done
cmake --build "$build_dir" "${targets[@]}" -j "$(nproc)"
