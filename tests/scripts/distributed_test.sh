#!/usr/bin/env bash
# Data-parallel failures and launchers, on loopback (ctest: train.distributed_failures):
#  1. a rank SIGKILLed mid-run: the other exits non-zero within --dist-timeout, naming the collective;
#  2. a rank that never arrives: the one that did exits non-zero within a bound (3 × --dist-timeout + 10 s,
#     start-up included; measured 7.9 s with a 3 s timeout);
#  3. SIGTERM to `qkv-train --nproc 2`: every rank stops at the same step, rank 0 writes a checkpoint, exit 143;
#  4. torchrun --no_python (when /usr/bin/torchrun exists): a 2-process job succeeds.
#   tests/scripts/distributed_test.sh QKV_TRAIN
set -uo pipefail
train=$1
work=$(mktemp -d)
trap 'kill -KILL $(jobs -p) 2> /dev/null; rm -rf "$work"' EXIT
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT
fail() { echo "FAIL: $*"; exit 1; }
free_port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2> /dev/null ||
              echo $((20000 + RANDOM % 20000)); }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
job=(--task reverse --device cpu --threads 1 --steps 1000000 --quiet)
args=("${job[@]}" --log-every 1000000)
timeout_s=10

# 1. A rank dies mid-run.
export MASTER_ADDR=127.0.0.1 MASTER_PORT=$(free_port) WORLD_SIZE=2
RANK=0 "$train" "${args[@]}" --dist-timeout $timeout_s --out "$work/killed" 2> "$work/rank0.err" &
rank0=$!
RANK=1 "$train" "${args[@]}" --dist-timeout $timeout_s 2> "$work/rank1.err" &
rank1=$!
for _ in $(seq 600); do [[ -f "$work/killed/metrics.csv" ]] && break; sleep 0.1; done  # training has begun
sleep 1
kill -KILL $rank1
start=$(now)
wait $rank0
status=$?
took=$(elapsed "$start")
echo "killed rank 1: rank 0 exited with $status after $took s: $(cat "$work/rank0.err")"
[[ $status -ne 0 ]] || fail "rank 0 exited 0 after its peer died"
awk -v t="$took" -v limit=$timeout_s 'BEGIN { exit !(t <= limit + 5) }' || fail "rank 0 took $took s (timeout $timeout_s s)"
grep -q "rank 0 of 2: the all-reduce of the gradients (collective #[0-9]*) failed" "$work/rank0.err" ||
  fail "rank 0's message does not name the failed collective"

# 2. A rank never arrives.
export MASTER_PORT=$(free_port)
start=$(now)
RANK=0 "$train" "${args[@]}" --dist-timeout 3 2> "$work/alone.err"
status=$?
took=$(elapsed "$start")
echo "rank 1 missing: rank 0 exited with $status after $took s: $(cat "$work/alone.err")"
[[ $status -ne 0 ]] || fail "rank 0 exited 0 without its peer"
awk -v t="$took" 'BEGIN { exit !(t <= 3 * 3 + 10) }' || fail "rank 0 waited $took s with --dist-timeout 3"
grep -q "were all 2 ranks started" "$work/alone.err" || fail "the message does not say what to check"
unset MASTER_ADDR MASTER_PORT WORLD_SIZE

# 3. SIGTERM to the launcher: both ranks stop together, rank 0 checkpoints. The signal is sent once
#    rank 0 has recorded a trained step: the ranks then have finished an all-reduce, so both are past
#    their start-up and catch the signal (before it, the default action would end a rank, as it
#    should: there is nothing to save yet). Slow machines (sanitizers, a loaded CI) get a minute.
"$train" "${job[@]}" --log-every 1 --nproc 2 --out "$work/stopped" --checkpoint-every 1000000 > /dev/null 2> "$work/stopped.err" &
job=$!
rows() { cat "$1" 2> /dev/null | wc -l; }
for _ in $(seq 600); do [[ $(rows "$work/stopped/metrics.csv") -ge 3 ]] && break; sleep 0.1; done
[[ $(rows "$work/stopped/metrics.csv") -ge 3 ]] ||
  fail "no trained step recorded within 60 s: $(cat "$work/stopped.err")"
kill -TERM $job
wait $job
status=$?
echo "SIGTERM: the job exited with $status"
[[ $status -eq 143 ]] || fail "expected exit 143, got $status: $(cat "$work/stopped.err")"
[[ -f "$work/stopped/checkpoint.pt" ]] || fail "no checkpoint after SIGTERM"
"$train" --resume "$work/stopped" --nproc 2 --steps "$(( $(grep -o '"steps": [0-9]*' "$work/stopped/summary.json" | tail -1 | grep -o '[0-9]*$') + 5 ))" \
  --quiet > /dev/null 2> "$work/resume.err" || fail "the checkpoint did not resume on 2 ranks: $(cat "$work/resume.err")"

# 4. torchrun, as PyTorch users launch jobs. Debian's torchrun 1.13 fails under Python 3.11 with its
#    default --redirects/--tee (a Flag enum change); giving both explicitly avoids it.
if [[ -x /usr/bin/torchrun ]]; then
  # USE_LIBUV=0: PyTorch >= 2.4 makes its TCPStore ask for libuv, which Debian's builds lack.
  if USE_LIBUV=0 /usr/bin/torchrun --redirects 1 --tee 1 --master_port "$(free_port)" --no_python --nproc_per_node 2 \
    "$train" --task reverse --device cpu --steps 20 --quiet --out "$work/torchrun" > "$work/torchrun.log" 2>&1; then
    grep -q '"world_size": 2' "$work/torchrun/summary.json" || fail "torchrun job did not run on 2 ranks"
    echo "torchrun --nproc_per_node 2: ok"
  elif grep -Eq "buil[td] without libuv support" "$work/torchrun.log"; then
    # torchrun's own rendezvous (Python) fails before any rank starts: not qkv-train's to fix. (PyTorch 2.6
    # words it "was build without", 2.14 "was built without".)
    echo "torchrun cannot start here: its own TCPStore asks for libuv, which this PyTorch lacks; skipped its case"
  else
    fail "torchrun job failed: $(tail -20 "$work/torchrun.log")"
  fi
else
  echo "torchrun not installed: skipped its case"
fi
echo "PASS"
