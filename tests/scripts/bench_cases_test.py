"""Every case of apps/qkv-bench/cases.json runs on scripts/bench_pytorch.py's side (ctest:
scripts.bench_cases): each case shrunk to a few tokens and run for one iteration on the CPU,
whatever its device, with every implementation this torch has (and the case allows). The GPU
machine's first run found long_train_step (a bfloat16 model's train step) failing in its
backward, the float32 MSE against a bfloat16 target, after the GPU time had been spent getting
there; this finds such a case here. Each run's loss or output must also be finite. Exit 77
(skipped) where this Python has no torch."""
import json
import math
import os
import sys

try:
    import torch
except ImportError:
    print("no torch under this Python: skipped")
    sys.exit(77)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import bench_pytorch  # noqa: E402


def shrunk(case):
    """The case at a size that runs in milliseconds, its structure (kind, dtype, heads, grouped
    heads, causal, window, dropout, autocast) kept."""
    small = dict(case)
    heads = case.get("heads", 1)
    small["batch"] = min(case["batch"], 2)
    small["seq_len"] = min(case["seq_len"], 16)
    if "head_dim" in case:
        small["head_dim"] = 8
    if "d_model" in case:
        small["d_model"] = 8 * heads
    if case.get("window"):
        small["window"] = 4
    return small


def main():
    with open(os.path.join(ROOT, "apps", "qkv-bench", "cases.json")) as file:
        cases = json.load(file)["cases"]
    torch.manual_seed(0)
    failures, runs = [], 0
    for case in cases:
        available = ["documents", "sdpa"] if bench_pytorch.HAS_SDPA else ["documents"]
        if case["kind"] == "sgemm":
            available = ["documents"]
        impls = [i for i in case.get("pytorch_impls", available) if i in available]
        for impl in impls:
            small = shrunk(case)
            try:
                iteration = bench_pytorch.make_iteration(small, impl, "cpu")
                iteration()
                runs += 1
            except Exception as error:  # noqa: BLE001 (every failure is reported, then the test fails)
                failures.append(f"{case['name']} ({impl}, shrunk to {small}): {type(error).__name__}: {error}")
    print(f"{runs} case and implementation pairs ran on torch {torch.__version__}")
    for failure in failures:
        print("FAIL:", failure)
    if runs == 0:
        print("FAIL: no case ran")
        return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
