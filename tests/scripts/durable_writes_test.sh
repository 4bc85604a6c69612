#!/usr/bin/env bash
# Durable replacement of files (ctest: files.durable_writes). For every file that qkv-train and
# qkv-weights replace (checkpoint.pt, model.pt, summary.json, vocab-free weights), the system calls
# must come in this order: fsync of the temporary file, its rename over the final name, then an
# fsync of the folder. Otherwise a power loss right after the rename can leave an empty or partial
# file under the final name. Skipped (77) without strace.
#   tests/scripts/durable_writes_test.sh QKV_TRAIN QKV_WEIGHTS
set -uo pipefail
train=$1
weights=$2
command -v strace > /dev/null || { echo "strace is not installed: skipped"; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

trace() {  # trace FILE COMMAND...: the command's fsync and rename calls, with paths for descriptors
  local out=$1
  shift
  # LeakSanitizer cannot run under ptrace (it stops the process with a fatal error): in the
  # sanitizer build the traced program keeps AddressSanitizer but leaves the leak check out.
  ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" strace -f -y -qq -e trace=fsync,fdatasync,rename,renameat,renameat2 -o "$out" "$@" > /dev/null ||
    fail "$* failed: $(tail -5 "$out")"
}
trace "$work/train.trace" "$train" --task reverse --device cpu --seq-len 6 --d-model 16 --batch 8 --steps 4 \
  --checkpoint-every 2 --quiet --out "$work/out"
trace "$work/weights.trace" "$weights" convert "$work/out/model.pt" "$work/converted.pt"
# A resumed run keeps the rows of metrics.csv so far: it must replace the file, not rewrite it in place.
trace "$work/resume.trace" "$train" --resume "$work/out" --steps 6 --quiet

# check TRACE FILE: every rename onto FILE, from its temporary FILE.tmp-*, is preceded by an fsync
# of that temporary and followed by an fsync of FILE's folder. Prints how many such replacements were seen.
check() {
  awk -v target="$2" '
    function path_of(call,    p) { p = call; sub(/^[^<]*</, "", p); sub(/>.*$/, "", p); return p }
    { sub(/^[0-9]+ +/, "") }                                      # strace -f: the pid
    /^(fsync|fdatasync)\(/ {
      p = path_of($0)
      if (pending != "") { if (p != pending) { bad = bad "folder fsync of " p " instead of " pending "; " } else { good++ }; pending = "" }
      last = p
      next
    }
    /^rename/ && index($0, "\"" target "\"") && index($0, "\"" target ".tmp-") {
      match($0, /"[^"]*"/); source = substr($0, RSTART + 1, RLENGTH - 2)   # the temporary renamed
      if (last != source) bad = bad "rename without an fsync of " source " before it (last fsync: " last "); "
      folder = target; sub(/\/[^\/]*$/, "", folder); pending = folder
    }
    END {
      if (pending != "") bad = bad "no folder fsync after the last rename; "
      if (bad != "") { print "BAD " bad; exit 1 }
      print good
    }' "$1"
}
for file in checkpoint.pt model.pt summary.json; do
  seen=$(check "$work/train.trace" "$work/out/$file") || fail "$file: $seen"
  [[ $seen -ge 1 ]] || fail "$file was never replaced through a temporary file: $(cat "$work/train.trace")"
  echo "$file: $seen durable replacements"
done
seen=$(check "$work/resume.trace" "$work/out/metrics.csv") || fail "metrics.csv on resume: $seen"
[[ $seen -ge 1 ]] || fail "a resumed run rewrote metrics.csv in place: $(cat "$work/resume.trace")"
echo "metrics.csv on resume: $seen durable replacement"
seen=$(check "$work/weights.trace" "$work/converted.pt") || fail "converted.pt: $seen"
[[ $seen -ge 1 ]] || fail "qkv-weights convert did not write durably: $(cat "$work/weights.trace")"
echo "qkv-weights convert: $seen durable replacement"
echo PASS
