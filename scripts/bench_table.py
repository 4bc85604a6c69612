"""Joins the raw results of scripts/bench.sh (qkv-bench's and bench_pytorch.py's JSON, several
rounds) into one table on stdout and one JSON file. Figures are medians over the rounds; the
ratio is PyTorch's time over qkv's (above 1: qkv is faster), taken per round (the two sides ran
back to back) and then the median, against the fastest PyTorch implementation of the case."""
import argparse
import datetime
import glob
import json
import os
import platform
import statistics

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def blas_library():
    """The BLAS Debian's alternatives point LibTorch at (OpenBLAS openmp / pthread, or the reference)."""
    for path in ("/usr/lib/x86_64-linux-gnu/libblas.so.3", "/usr/lib/aarch64-linux-gnu/libblas.so.3"):
        if os.path.exists(path):
            return os.path.realpath(path).replace("/usr/lib/x86_64-linux-gnu/", "").replace("/usr/lib/aarch64-linux-gnu/", "")
    config = torch.__config__.show()
    for line in config.splitlines():
        if "BLAS_INFO" in line:
            return line.strip()
    return "unknown"


def cpu_model():
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def shape_of(case):
    if case["kind"].startswith("core_"):
        text = f"B={case['batch']} H={case['heads']} N={case['seq_len']} D={case['head_dim']}"
    else:
        batch = f"B={case['batch']} " if case["batch"] else ""
        text = f"{batch}N={case['seq_len']} E={case['d_model']} H={case.get('heads', 1)}"
    if case.get("causal"):
        text += " causal"
    return text + " " + case["dtype"]


def human_bytes(value):
    return f"{value / 2**20:.0f} MiB" if value else "-"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--raw", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args()
    with open(os.path.join(ROOT, "apps", "qkv-bench", "cases.json")) as file:
        cases = {c["name"]: c for c in json.load(file)["cases"]}

    rows, context = [], {}
    names = sorted({os.path.basename(p)[4:].rsplit("-", 1)[0] for p in glob.glob(os.path.join(args.raw, "qkv-*.json"))},
                   key=list(cases).index)
    for name in names:
        case = cases[name]
        qkv_ms, qkv_flops, qkv_peak = [], [], []
        for path in sorted(glob.glob(os.path.join(args.raw, f"qkv-{name}-*.json"))):
            with open(path) as file:
                report = json.load(file)
            context = report["context"]
            entry = report["benchmarks"][0]
            if entry.get("error_occurred"):
                raise SystemExit(f"qkv-bench failed on {name}: {entry.get('error_message')}")
            scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[entry["time_unit"]]
            qkv_ms.append(entry["real_time"] * scale)
            qkv_flops.append(entry["FLOPS"])
            qkv_peak.append(entry["peak_memory_bytes"])
        pytorch = {}
        for path in sorted(glob.glob(os.path.join(args.raw, f"pytorch-{name}-*.json"))):
            with open(path) as file:
                report = json.load(file)
            torch_context = {k: report[k] for k in ("torch_version", "threads", "python")}
            for result in report["results"]:
                entry = pytorch.setdefault(result["impl"], {"ms": [], "flops": [], "peak": []})
                entry["ms"].append(result["median_s"] * 1e3)
                entry["flops"].append(result["flops_per_s"])
                entry["peak"].append(result["peak_memory_bytes"])
        best_impl = min(pytorch, key=lambda impl: statistics.median(pytorch[impl]["ms"]))
        best = pytorch[best_impl]
        row = {
            "case": name, "shape": shape_of(case), "kind": case["kind"],
            "qkv_ms": statistics.median(qkv_ms), "qkv_ms_rounds": qkv_ms,
            "qkv_flops_per_s": statistics.median(qkv_flops), "qkv_peak_memory_bytes": max(qkv_peak),
            "pytorch_impl": best_impl, "pytorch_ms": statistics.median(best["ms"]),
            "pytorch_ms_rounds": best["ms"], "pytorch_flops_per_s": statistics.median(best["flops"]),
            "pytorch_peak_memory_bytes": max(best["peak"]),
            "pytorch_all": {impl: {"ms_rounds": v["ms"], "peak_memory_bytes": max(v["peak"])} for impl, v in pytorch.items()},
            "goal": case.get("goal"), "memory_goal": case.get("memory_goal"),
        }
        # Round i of each side ran back to back: the ratio of each round pair cancels the drift of a
        # shared machine's speed better than the ratio of the two medians.
        pairs = [p / q for q, p in zip(qkv_ms, best["ms"])]
        row["ratio_rounds"] = pairs
        row["ratio"] = statistics.median(pairs)
        row["memory_ratio"] = (row["qkv_peak_memory_bytes"] / row["pytorch_peak_memory_bytes"]
                               if row["pytorch_peak_memory_bytes"] else None)
        if row["goal"] is not None:
            row["goal_met"] = row["ratio"] >= row["goal"]
        if row["memory_goal"] is not None:
            row["memory_goal_met"] = row["memory_ratio"] is not None and row["memory_ratio"] <= row["memory_goal"]
        rows.append(row)

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": args.device, "threads": args.threads, "cpu": cpu_model(), "cores": os.cpu_count(),
        "blas": blas_library(), "libtorch_cpp": context.get("torch_version"), "pytorch": torch_context,
        "google_benchmark": {k: context.get(k) for k in ("library_version", "library_build_type", "num_cpus", "mhz_per_cpu")},
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" and torch.cuda.is_available() else None,
    }
    with open(args.out, "w") as file:
        json.dump({"meta": meta, "rows": rows}, file, indent=2)

    print(f"qkv vs PyTorch on {args.device}: {meta['date']}, {meta['cpu']} ({meta['cores']} cores), "
          f"{args.threads} threads, BLAS {meta['blas']}, LibTorch {meta['libtorch_cpp']} (C++), "
          f"PyTorch {torch_context['torch_version']} (Python {torch_context['python']})"
          + (f", GPU {meta['gpu']}" if meta["gpu"] else ""))
    print("times: median over rounds; ratio: median over rounds of PyTorch time / qkv time (above 1: qkv faster); "
          "memory: peak "
          + ("allocated on the GPU" if args.device == "cuda" else "resident set of the process"))
    header = ["case", "shape", "qkv ms", "PyTorch ms", "PyTorch impl", "ratio", "goal", "qkv GFLOP/s",
              "PyTorch GFLOP/s", "qkv peak", "PyTorch peak"]
    lines = [header]
    for r in rows:
        goal = "" if r["goal"] is None else f"≥{r['goal']:g}× {'met' if r['goal_met'] else 'MISSED'}"
        if r["memory_goal"] is not None:
            goal += f" mem ≤{r['memory_goal']:g}× {'met' if r['memory_goal_met'] else 'MISSED'}"
        lines.append([r["case"], r["shape"], f"{r['qkv_ms']:.4g}", f"{r['pytorch_ms']:.4g}", r["pytorch_impl"],
                      f"{r['ratio']:.2f}", goal.strip(), f"{r['qkv_flops_per_s'] / 1e9:.3g}",
                      f"{r['pytorch_flops_per_s'] / 1e9:.3g}", human_bytes(r["qkv_peak_memory_bytes"]),
                      human_bytes(r["pytorch_peak_memory_bytes"])])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("| " + " | ".join("-" * w for w in widths) + " |")
    for line in lines[1:]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |")
    print(f"raw results: {args.out}")


if __name__ == "__main__":
    main()
