#!/usr/bin/env bash
# Installs what qkv needs to build and test on Debian 12, skipping what is already there.
#   scripts/setup.sh    build and test dependencies, and Debian's PyTorch (python3-torch) for the
#                       Python side: the interop round-trip test and scripts/gen_reference.py
set -euo pipefail

packages=(
  cmake ninja-build g++ pkg-config
  libtorch-dev            # LibTorch 1.13.1, CPU
  libgloo-dev             # headers of c10d's Gloo process group (qkv-train data parallelism)
  libopenblas0-openmp     # without it LibTorch multiplies matrices with the reference BLAS, 50-80x slower
  libspdlog-dev libcli11-dev nlohmann-json3-dev libstb-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-torch           # PyTorch 1.13 under /usr/bin/python3, the reference the tests compare with
)

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi

sudo=()
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "setup: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  sudo=(sudo)
fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup: done"
