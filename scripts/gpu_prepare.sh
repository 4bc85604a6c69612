#!/usr/bin/env bash
# Stages what a GPU run of qkv needs into .device/ (git-ignored): the shared kit
# (../shared/device: spdlog, fmt, GoogleTest, CLI11, stb and run.sh) plus the Debian packages
# the kit lacks and qkv uses: nlohmann-json (qkv-train, qkv-bench) and Google Benchmark (qkv-bench);
# and the language model's default text (Debian's dict-devil, as qkv-train reads it) as a plain
# file, since the GPU machine has neither dictd's files nor a package registry.
# Then one device call, carry [".device"] (scripts/gpu_check.sh says how).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
kit=${QKV_DEVICE_KIT:-$root/../shared/device}
(cd "$root" && "$kit/prepare.sh")
(cd "$root/.device" && apt-get download nlohmann-json3-dev libbenchmark-dev libbenchmark1debian 2> /dev/null) ||
  { echo "gpu_prepare: apt-get download failed (run apt-get update?)" >&2; exit 1; }
/usr/bin/python3 - "$root" << 'PY'
import sys
sys.path.insert(0, f"{sys.argv[1]}/scripts")
from lm_pytorch import DEFAULT_TEXT, load_text
open(f"{sys.argv[1]}/.device/devil.txt", "w", encoding="utf-8").write(load_text(DEFAULT_TEXT))
PY
echo "gpu_prepare: $(ls "$root/.device" | wc -l) files in .device/ ($(du -sh "$root/.device" | cut -f1))"
