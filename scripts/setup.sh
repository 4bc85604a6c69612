#!/usr/bin/env bash
# Installs what qkv needs to build and test, skipping what is already there, on Debian 12
# (bookworm: LibTorch 1.13), Debian 13 (trixie: LibTorch 2.6) or Debian unstable (sid: the
# newest LibTorch Debian has). Elsewhere it says what to install and exits 1.
#   scripts/setup.sh    build and test dependencies, and the release's PyTorch (python3-torch) for
#                       the Python side: the interop tests and scripts/gen_reference.py
set -euo pipefail

release=unknown
if [[ -r /etc/os-release ]]; then
  # shellcheck disable=SC1091
  . /etc/os-release
  case "${ID:-}:${VERSION_ID:-}" in
    debian:12) release=bookworm ;;
    debian:13) release=trixie ;;
    debian:) release=unstable ;;  # testing and unstable carry no VERSION_ID
  esac
fi

# The same package names on every supported release; what they hold differs (see README, "Supported LibTorch").
packages=(
  cmake ninja-build g++ pkg-config
  libtorch-dev            # LibTorch, CPU: 1.13.1 on Debian 12, 2.6 on Debian 13
  libgloo-dev             # headers of c10d's Gloo process group (qkv-train data parallelism)
  libopenblas0-openmp     # without it LibTorch multiplies matrices with the reference BLAS, 50-80x slower
  libopenblas-openmp-dev  # cblas.h and libopenblas: the tiled CPU attention kernel calls sgemm/dgemm directly
  libspdlog-dev libcli11-dev nlohmann-json3-dev libstb-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-torch           # the release's PyTorch under /usr/bin/python3, the reference the tests compare with
  iproute2                # ip netns / veth: the two-host data-parallel test
  strace                  # the durable-writes test watches fsync and rename
  debootstrap             # scripts/test-in-debian.sh: the suite on other Debian releases (CI: Debian 13)
  dict-devil zlib1g-dev   # The Devil's Dictionary (gzip-compressed dictd format): qkv-train --task lm's default text
)

if [[ $release == unknown ]]; then
  cat >&2 << EOF
setup: this is ${PRETTY_NAME:-not Debian}; qkv's scripts install packages on Debian 12, 13 and unstable only.
Elsewhere install a C++17 compiler, CMake >= 3.18, LibTorch (the zip from pytorch.org or the one inside
a pip torch), spdlog, CLI11, nlohmann-json, stb, GoogleTest and Google Benchmark, then build with
  cmake -S . -B build -DCMAKE_PREFIX_PATH=/path/to/libtorch && cmake --build build
(README.md, "Building against another LibTorch").
EOF
  exit 1
fi

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2> /dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "setup: Debian $release, all ${#packages[@]} packages present"
  exit 0
fi

sudo=()
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo > /dev/null || { echo "setup: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  sudo=(sudo)
fi
echo "setup: Debian $release, installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" > /dev/null
echo "setup: done"
