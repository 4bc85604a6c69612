#!/usr/bin/env bash
# The main job: installs what is missing, builds qkv-train, then
#   scripts/demo.sh              runs the documents' example, then trains the reverse task and
#                                draws what attention learned (out/reverse/*.png)
#   scripts/demo.sh ARGS ...     runs qkv-train ARGS (default task: the documents' example)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh" >&2
"$root/scripts/build.sh" qkv-train >&2
train="${QKV_BUILD_DIR:-$root/build}/apps/qkv-train"
if [[ $# -gt 0 ]]; then exec "$train" "$@"; fi

echo "== the documents' complete example (qkv-train --task seed)"
"$train" --task seed
echo
echo "== attention learning to reverse a sequence (qkv-train --task reverse --out out/reverse)"
"$train" --task reverse --out "$root/out/reverse"
