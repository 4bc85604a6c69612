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


def cpu_flags():
    """The CPU's flags that decide the kernels' instruction sets, as /proc/cpuinfo lists them."""
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("flags"):
                    present = set(line.split(":", 1)[1].split())
                    return [flag for flag in wanted if flag in present]
    except OSError:
        pass
    return []


def shape_of(case):
    if case["kind"] == "sgemm":
        return f"{case['seq_len']}x{case['seq_len']} {case['dtype']}"
    if case["kind"].startswith("core_"):
        text = f"B={case['batch']} H={case['heads']} N={case['seq_len']}"
        if case.get("key_len", case["seq_len"]) != case["seq_len"]:
            text += f" S={case['key_len']}"
        text += f" D={case['head_dim']}"
        if case.get("kv_heads", case["heads"]) != case["heads"]:
            text += f" Hkv={case['kv_heads']}"
    else:
        batch = f"B={case['batch']} " if case["batch"] else ""
        length = "cache" if case["kind"] == "decode_step" else "N"
        text = f"{batch}{length}={case['seq_len']} E={case['d_model']} H={case.get('heads', 1)}"
        if case.get("kv_heads", case.get("heads", 1)) != case.get("heads", 1):
            text += f" Hkv={case['kv_heads']}"
    if case.get("causal"):
        text += " causal"
    if case.get("window"):
        text += f" window {case['window']}"
    if case.get("dropout"):
        text += f" dropout {case['dropout']:g}"
    if case.get("mask"):
        text += f" {case['mask'].replace('_', ' ').replace('+', ' and ')} mask"
    return text + " " + case["dtype"]


def human_bytes(value):
    return f"{value / 2**20:.0f} MiB" if value else "-"


def round_of(path):
    """The round of a raw result file, NAME-ROUND.json."""
    return int(path.rsplit("-", 1)[1].split(".")[0])


def read_qkv(raw, name):
    ms, flops, peak, above = [], [], [], []
    context = {}
    # In round order (as read_pytorch's), so that round i of both sides pair up past round 9 too.
    for path in sorted(glob.glob(os.path.join(raw, f"qkv-{name}-*.json")), key=round_of):
        with open(path) as file:
            report = json.load(file)
        context = report["context"]
        entry = report["benchmarks"][0]
        if entry.get("error_occurred"):
            raise SystemExit(f"qkv-bench failed on {name}: {entry.get('error_message')}")
        scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[entry["time_unit"]]
        ms.append(entry["real_time"] * scale)
        flops.append(entry["FLOPS"])
        peak.append(entry["peak_memory_bytes"])
        above.append(entry.get("peak_above_baseline_bytes", 0.0))
    return ms, flops, peak, above, context


def read_pytorch(raw, side, name):
    """{impl: {"ms": [...], "flops": [...], "peak": [...]}} and the side's versions."""
    results, context = {}, {}
    for path in sorted(glob.glob(os.path.join(raw, f"pytorch@{side}-{name}-*.json")), key=round_of):
        with open(path) as file:
            report = json.load(file)
        context = {k: report[k] for k in ("torch_version", "threads", "python")}
        for result in report["results"]:
            entry = results.setdefault(result["impl"], {"ms": [], "flops": [], "peak": []})
            entry["ms"].append(result["median_s"] * 1e3)
            entry["flops"].append(result["flops_per_s"])
            entry["peak"].append(result["peak_memory_bytes"])
    return results, context


def goals_of(case):
    """[(implementation, goal)]: cases.json's "goal" is against the fastest PyTorch implementation
    of the case ("fastest"), its "goals" against the implementation each names (a goal set against
    the documents' class means nothing against F.sdpa)."""
    named = sorted(case.get("goals", {}).items())
    return ([("fastest", case["goal"])] if case.get("goal") is not None else []) + named


def goal_torch(case, impl):
    """The PyTorch version a goal against `impl` was set against (cases.json's "goals_torch", a
    version prefix such as "1.13"), or None: a goal of 10x the documents' class on PyTorch 1.13 says
    nothing of that class on a PyTorch whose products are faster."""
    return case.get("goals_torch", {}).get(impl)


def judged_goals(case, qkv_ms, results, best_impl, torch_version=""):
    """Each of the case's goals that this side's implementations and PyTorch version allow judging:
    the ratio (median of the rounds' PyTorch time / qkv time) against the implementation the goal
    names."""
    judged = []
    for impl, goal in goals_of(case):
        against = best_impl if impl == "fastest" else impl
        scope = goal_torch(case, impl)
        if against not in results or (scope is not None and not torch_version.startswith(scope)):
            continue
        ratio = statistics.median(p / q for q, p in zip(qkv_ms, results[against]["ms"]))
        judged.append({"against": impl, "impl": against, "goal": goal, "ratio": ratio, "met": ratio >= goal})
    return judged


def goal_cell(row):
    """The table's goal column: each of the row's goals, then each side's verdict ("met" or
    "missed", and for a goal against a named implementation which)."""
    goals = row["goals"]
    if not goals:
        return ""
    stated = ", ".join(f"≥{g['goal']:g}×" + ("" if g["against"] == "fastest" else f" {g['against']}") +
                       (f" (PyTorch {g['torch']})" if g.get("torch") else "") for g in goals)
    verdicts = []
    for side, entry in row["pytorch"].items():
        for judged in entry["goals"]:
            named = "" if judged["against"] == "fastest" or len(goals) == 1 else f" ({judged['impl']})"
            verdicts.append(f"{side} {'met' if judged['met'] else 'missed'}{named}")
    return f"{stated}: " + (", ".join(verdicts) or "no implementation it names ran")


def openblas_text(meta):
    """' (OpenBLAS core X, OPENBLAS_CORETYPE=Y)' for the table's first line, or '' without OpenBLAS."""
    if not meta["openblas_core"]:
        return ""
    forced = f", OPENBLAS_CORETYPE={meta['openblas_coretype']}" if meta["openblas_coretype"] else ""
    return f" (OpenBLAS core {meta['openblas_core']}{forced})"


def malloc_setting():
    """glibc malloc's thresholds as the environment gives them to both sides (scripts/bench.sh)."""
    tunables = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t.startswith("glibc.malloc.")]
    legacy = [f"{k}={os.environ[k]}" for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_") if k in os.environ]
    return " ".join(tunables + legacy) or "glibc's defaults"


def bfloat16_against_float32(rows, cases, isa):
    """Issue 21's comparisons of qkv with itself: a bfloat16 case's time against its float32 case's
    (against_float32 in cases.json), or its FLOP rate against a product's (rate_against), round by
    round, each with the goal for the instruction set the products ran on."""
    by_name = {r["case"]: r for r in rows}
    compared = []
    for r in rows:
        case = cases[r["case"]]
        for key, kind in (("against_float32", "time"), ("rate_against", "rate")):
            spec = case.get(key)
            if spec is None or spec["case"] not in by_name:
                continue
            other = by_name[spec["case"]]
            if kind == "time":  # float32 time / bfloat16 time: above 1, bfloat16 is faster
                pairs = [f / b for f, b in zip(other["qkv_ms_rounds"], r["qkv_ms_rounds"])]
            else:  # this case's FLOP rate / the product's
                pairs = [b / o for b, o in zip(r["qkv_flops_rounds"], other["qkv_flops_rounds"])]
            goal = spec["goals"].get(isa, spec["goals"].get("other"))
            ratio = statistics.median(pairs)
            entry = {"case": r["case"], "against": spec["case"], "kind": kind, "ratio": ratio, "ratio_rounds": pairs,
                     "goal": goal, "goal_met": None if goal is None else ratio >= goal}
            # Both cases do the same FLOPs, so float32 time / bfloat16 time = the bfloat16 rate / the
            # float32 rate: with the bfloat16 product's rate in place of the bfloat16 case's, the
            # ratio this machine's products allow a case that only multiplied (not a hard ceiling:
            # qkv's own tiles can outrun LibTorch's product), round by round.
            product = by_name.get(spec.get("product"))
            if kind == "time" and product is not None:
                at_product = [p / f for p, f in zip(product["qkv_flops_rounds"], other["qkv_flops_rounds"])]
                entry.update(product=spec["product"], at_product_rate=statistics.median(at_product),
                             at_product_rate_rounds=at_product)
            compared.append(entry)
    return compared


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--raw", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args()
    with open(os.path.join(ROOT, "apps", "qkv-bench", "cases.json")) as file:
        cases = {c["name"]: c for c in json.load(file)["cases"]}
    sides = sorted({os.path.basename(p)[len("pytorch@"):].split("-", 1)[0]
                    for p in glob.glob(os.path.join(args.raw, "pytorch@*.json"))},
                   key=lambda side: (side != "host", side))

    rows, context, side_versions = [], {}, {}
    names = sorted({os.path.basename(p)[4:].rsplit("-", 1)[0] for p in glob.glob(os.path.join(args.raw, "qkv-*.json"))},
                   key=list(cases).index)
    for name in names:
        case = cases[name]
        qkv_ms, qkv_flops, qkv_peak, qkv_above, context = read_qkv(args.raw, name)
        row = {"case": name, "shape": shape_of(case), "kind": case["kind"], "qkv_ms": statistics.median(qkv_ms),
               "qkv_ms_rounds": qkv_ms, "qkv_flops_per_s": statistics.median(qkv_flops), "qkv_flops_rounds": qkv_flops,
               "qkv_peak_memory_bytes": max(qkv_peak), "qkv_peak_above_baseline_bytes": max(qkv_above),
               "goals": [{"against": impl, "goal": goal, "torch": goal_torch(case, impl)}
                         for impl, goal in goals_of(case)],
               "memory_goal": case.get("memory_goal"), "pytorch": {}}
        for side in sides:
            results, versions = read_pytorch(args.raw, side, name)
            if not results:
                continue
            side_versions[side] = versions
            best_impl = min(results, key=lambda impl: statistics.median(results[impl]["ms"]))
            best = results[best_impl]
            # Round i of each side ran back to back: the ratio of each round pair cancels the drift
            # of a shared machine's speed better than the ratio of the two medians.
            pairs = [p / q for q, p in zip(qkv_ms, best["ms"])]
            entry = {"torch_version": versions["torch_version"], "impl": best_impl, "ms": statistics.median(best["ms"]),
                     "ms_rounds": best["ms"], "flops_per_s": statistics.median(best["flops"]),
                     "peak_memory_bytes": max(best["peak"]), "ratio_rounds": pairs, "ratio": statistics.median(pairs),
                     "all": {impl: {"ms_rounds": v["ms"], "peak_memory_bytes": max(v["peak"])}
                             for impl, v in results.items()}}
            entry["goals"] = judged_goals(case, qkv_ms, results, best_impl, versions["torch_version"])
            if entry["goals"]:
                entry["goal_met"] = all(judged["met"] for judged in entry["goals"])
            if row["memory_goal"] is not None:
                entry["memory_ratio"] = row["qkv_peak_memory_bytes"] / entry["peak_memory_bytes"]
                entry["memory_goal_met"] = entry["memory_ratio"] <= row["memory_goal"]
            row["pytorch"][side] = entry
        rows.append(row)

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": args.device, "threads": args.threads, "cpu": cpu_model(), "cores": os.cpu_count(),
        "blas": blas_library(), "libtorch_cpp": context.get("torch_version"), "pytorch": side_versions,
        "cpu_flags": cpu_flags(), "qkv_tiled_isa": context.get("tiled_isa"),
        "qkv_linear_products": context.get("linear_products"),
        "openblas_core": context.get("blas_core"), "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
        "malloc": malloc_setting(),
        "google_benchmark": {k: context.get(k) for k in ("library_version", "library_build_type", "num_cpus", "mhz_per_cpu")},
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" and torch.cuda.is_available() else None,
    }
    against_float32 = bfloat16_against_float32(rows, cases, meta["qkv_tiled_isa"])
    with open(args.out, "w") as file:
        json.dump({"meta": meta, "rows": rows, "bfloat16_against_float32": against_float32}, file, indent=2)

    described = ", ".join(f"{side}: PyTorch {v['torch_version']} (Python {v['python']})" for side, v in side_versions.items())
    print(f"qkv vs PyTorch on {args.device}: {meta['date']}, {meta['cpu']} ({meta['cores']} cores), "
          f"{args.threads} threads, BLAS {meta['blas']}{openblas_text(meta)}, LibTorch {meta['libtorch_cpp']} (C++); {described}; "
          f"CPU flags: {' '.join(meta['cpu_flags']) or 'none of avx2, avx512f, avx512_bf16, amx_bf16'}; "
          f"qkv's tiled kernel ran on {meta['qkv_tiled_isa'] or 'unknown'}, its linear layers on "
          f"{meta['qkv_linear_products'] or 'unknown'}; malloc (both sides): {meta['malloc']}"
          + (f", GPU {meta['gpu']}" if meta["gpu"] else ""))
    print("times: median over rounds; ratio: median over rounds of PyTorch time / qkv time (above 1: qkv faster), "
          "against the fastest PyTorch implementation; memory: peak "
          + ("allocated on the GPU" if args.device == "cuda" else "resident set of the process (qkv: also above its "
             "baseline before the case's tensors)"))
    header = ["case", "shape", "qkv ms", "qkv GFLOP/s"]
    for side in side_versions:
        header += [f"PyTorch {side_versions[side]['torch_version']} ms (impl)", "ratio"]
    header += ["goal", "qkv peak (above baseline)"]
    lines = [header]
    for r in rows:
        # Cases whose arithmetic is not counted (decoding: FLOPs 0 in the raw results) print "—", not 0.
        flops_cell = f"{r['qkv_flops_per_s'] / 1e9:.3g}" if r["qkv_flops_per_s"] > 0 else "—"
        line = [r["case"], r["shape"], f"{r['qkv_ms']:.4g}", flops_cell]
        for side in side_versions:
            entry = r["pytorch"].get(side)
            if entry is None:
                line += ["-", "-"]
                continue
            line += [f"{entry['ms']:.4g} ({entry['impl']})", f"{entry['ratio']:.2f}"]
        line.append(goal_cell(r))
        line.append(f"{human_bytes(r['qkv_peak_memory_bytes'])} ({human_bytes(r['qkv_peak_above_baseline_bytes'])})")
        lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("| " + " | ".join("-" * w for w in widths) + " |")
    for line in lines[1:]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |")
    if against_float32:
        print(f"qkv's bfloat16 against its own float32 (issue 21), the products on {meta['qkv_tiled_isa']}: "
              "ratio = median over rounds of the float32 case's time / the bfloat16 case's (against a product: the "
              "bfloat16 case's FLOP rate / the product's)")
        print("| bfloat16 case | against | ratio | rounds | goal | at the bfloat16 product's rate |")
        print("| --- | --- | --- | --- | --- | --- |")
        for c in against_float32:
            goal = "" if c["goal"] is None else f"≥ {c['goal']:g}{'' if c['kind'] == 'time' else ' of the rate'}: " + (
                "met" if c["goal_met"] else "missed")
            at_product = "" if "at_product_rate" not in c else f"{c['at_product_rate']:.3f} ({c['product']})"
            print(f"| {c['case']} | {c['against']} | {c['ratio']:.3f} | {', '.join(f'{x:.3f}' for x in c['ratio_rounds'])} "
                  f"| {goal} | {at_product} |")
        if any("at_product_rate" in c for c in against_float32):
            print("at the bfloat16 product's rate: the float32 case's time over the time its FLOPs take at the "
                  "product's bfloat16 rate in the same round (the bfloat16 product's FLOP rate / the float32 case's): "
                  "the ratio a bfloat16 case that only multiplied would reach on this machine")
    print(f"raw results: {args.out}")


if __name__ == "__main__":
    main()
