#!/usr/bin/env bash
# The language model against PyTorch (ctest: lm.pytorch_parity): qkv-train --task lm trains 20
# steps on the committed excerpt from its initial weights (model_init.pt), then
# scripts/lm_pytorch.py trains the same model from the same weights on the same batches and
# compares every step's loss (float64 within 1e-8, float32 within 1e-4). Skipped (77) where
# /usr/bin/python3 has no PyTorch.
#   tests/scripts/lm_parity_test.sh QKV_TRAIN SOURCE_DIR
set -uo pipefail
train=$1
source_dir=$2
/usr/bin/python3 -c 'import torch' 2> /dev/null || { echo "no PyTorch under /usr/bin/python3: skipped"; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for dtype in float64 float32; do
  # Grouped-query heads, weight tying, warmup into the cosine decay and gradient clipping all take part.
  "$train" --task lm --device cpu --threads 1 --data "$source_dir/tests/data/devil_excerpt.txt" --dtype "$dtype" \
    --d-model 32 --heads 4 --kv-heads 2 --layers 2 --seq-len 32 --batch 8 --steps 20 --warmup-steps 5 \
    --lr 3e-3 --grad-clip 0.5 --tie-weights --dropout 0 --log-every 1 --eval-every 20 --quiet --out "$work/$dtype" ||
    { echo "FAIL: qkv-train ($dtype)"; exit 1; }
  /usr/bin/python3 "$source_dir/scripts/lm_pytorch.py" parity "$work/$dtype" || exit 1
done
echo PASS
