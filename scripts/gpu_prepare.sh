#!/usr/bin/env bash
# Stages what a GPU run of qkv needs into .device/ (git-ignored): the shared kit
# (../shared/device: spdlog, fmt, GoogleTest, CLI11, stb and run.sh) plus the Debian packages
# the kit lacks and qkv uses: nlohmann-json (qkv-train, qkv-bench) and Google Benchmark (qkv-bench).
# Then one device call, carry [".device"]:   bash .device/run.sh scripts/gpu_check.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
kit=${QKV_DEVICE_KIT:-$root/../shared/device}
(cd "$root" && "$kit/prepare.sh")
(cd "$root/.device" && apt-get download nlohmann-json3-dev libbenchmark-dev libbenchmark1debian 2> /dev/null) ||
  { echo "gpu_prepare: apt-get download failed (run apt-get update?)" >&2; exit 1; }
echo "gpu_prepare: $(ls "$root/.device" | wc -l) files in .device/"
