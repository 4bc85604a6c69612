#!/usr/bin/env bash
# The main job: installs what is missing, builds qkv-train and runs the documents' example.
#   scripts/demo.sh [qkv-train options ...]     e.g. scripts/demo.sh --steps 100
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh" >&2
"$root/scripts/build.sh" qkv-train >&2
exec "${QKV_BUILD_DIR:-$root/build}/apps/qkv-train" --task seed "$@"
