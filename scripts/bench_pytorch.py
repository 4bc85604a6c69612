"""PyTorch's side of qkv's benchmark: the cases of apps/qkv-bench/cases.json, timed in Python.

For each case every PyTorch implementation the installed torch has is timed:
  documents  the documents' SelfAttention class as written (split into heads when heads > 1:
             the same three Linear maps, the same matmul-softmax-matmul per head);
  sdpa       the same module with F.scaled_dot_product_attention (torch >= 2.0).
Core cases time the attention alone: "documents" = softmax(q kᵀ / √d) v, "sdpa" = F.sdpa.
Decoding cases (decode_step, prefill) time the same decoder block as qkv's TransformerBlock with a
KV cache of its own (preallocated tensors, written in place), as a PyTorch user would write it.
sgemm times one float32 matrix product (torch.mm), the machine's rate.

Timing follows Google Benchmark's protocol in qkv-bench: 3 warm-up iterations, then repetitions
of as many iterations as fill --min-time seconds; per repetition the mean time per iteration.
On CUDA each iteration is synchronized, so device work is counted.

  /usr/bin/python3 scripts/bench_pytorch.py --device cpu --threads 2 --case toy_train_step
  prints one JSON object: {"case": ..., "results": [{"impl", "times_s", "median_s", "flops_per_s", "peak_memory_bytes"}]}
  /usr/bin/python3 scripts/bench_pytorch.py --smoke [--device cuda]   every case, shrunk, run once
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "apps", "qkv-bench", "cases.json")
HAS_SDPA = hasattr(F, "scaled_dot_product_attention")


class SelfAttention(nn.Module):
    """The documents' module as written; `heads` > 1 splits Q, K, V into heads."""

    def __init__(self, d_model, heads=1, causal=False, use_sdpa=False):
        super().__init__()
        self.W_q = nn.Linear(d_model, d_model)
        self.W_k = nn.Linear(d_model, d_model)
        self.W_v = nn.Linear(d_model, d_model)
        self.heads, self.causal, self.use_sdpa = heads, causal, use_sdpa

    def forward(self, x, mask=None):
        """mask: None, or bool (true = attend) or float (added to the scores), broadcast to (B, H, N, N)."""
        Q, K, V = self.W_q(x), self.W_k(x), self.W_v(x)
        if self.heads == 1 and not self.causal and not self.use_sdpa and mask is None:
            scores = Q @ K.transpose(-2, -1) / (K.size(-1) ** 0.5)
            attn_weights = F.softmax(scores, dim=-1)
            return attn_weights @ V
        *lead, n, e = x.shape
        split = lambda t: t.reshape(*lead, n, self.heads, e // self.heads).transpose(-3, -2)  # (..., H, N, D)
        out = attention(split(Q), split(K), split(V), self.causal, self.use_sdpa, mask=mask)
        return out.transpose(-3, -2).reshape(*lead, n, e)


def key_len(case):
    """A core case's keys and values S: its key_len (cross-attention), else its seq_len."""
    s = case.get("key_len", case["seq_len"])
    if s != case["seq_len"] and (not case["kind"].startswith("core_") or case.get("causal") or case.get("window")):
        # attention() builds the causal and window structure for N = S only
        raise ValueError(f"case {case['name']}: key_len is for core cases without causal or window")
    return s


def padded_batch(batch, s, device):
    """As qkv-bench's padded_batch, seen as (B, 1, 1, S): true for a real key, every other batch
    row's last quarter of keys padded (the padded batches of a data loader)."""
    lengths = torch.full((batch,), s, dtype=torch.long, device=device)
    lengths[1::2] = s - s // 4
    return (torch.arange(s, device=device).unsqueeze(0) < lengths.unsqueeze(1)).view(batch, 1, 1, s)


def core_mask(case, device, dtype, backward):
    """A core case's mask, as qkv-bench's core_mask builds it (true = attend):
    "key_padding": bool (B, 1, 1, S), padded_batch's;
    "learned_bias": float (1, H, N, S) added to the scores and trained (its gradient taken);
    "fixed_bias": the same, not trained (ALiBi's)."""
    batch, n, s = max(case["batch"], 1), case["seq_len"], key_len(case)
    kind = case.get("mask")
    if kind == "key_padding":
        return padded_batch(batch, s, device)
    if kind in ("learned_bias", "fixed_bias"):
        bias = 0.1 * torch.randn(1, case["heads"], n, s, device=device, dtype=dtype)
        return bias.requires_grad_(backward and kind == "learned_bias")
    if kind:
        raise ValueError(f"case {case['name']}: unknown mask {kind!r}")
    return None


def module_mask(case, device, dtype, backward):
    """A module case's masks, as qkv-bench's module_mask builds them, joined into the one mask a
    PyTorch user gives sdpa: case["mask"] names one or both of "key_padding" (every other batch
    row's last quarter of keys padded) and "learned_bias" (a per-head bias (1, H, N, N), its gradient
    taken in backward cases), joined by "+"; with both, the bias with -inf at the padded keys
    (B, H, N, N), formed anew each step as the bias changes."""
    if not case.get("mask"):
        return None, lambda: None
    if not case["batch"]:
        raise ValueError(f"case {case['name']}: a module case's masks need a batch")
    batch, n = case["batch"], case["seq_len"]
    padding = bias = None
    for part in case["mask"].split("+"):
        if part == "key_padding":
            padding = padded_batch(batch, n, device)
        elif part == "learned_bias":
            bias = (0.1 * torch.randn(1, case["heads"], n, n, device=device, dtype=dtype)).requires_grad_(backward)
        else:
            raise ValueError(f"case {case['name']}: unknown module mask {part!r}")
    if bias is None:
        return None, lambda: padding
    if padding is None:
        return bias, lambda: bias
    return bias, lambda: bias.masked_fill(~padding, float("-inf"))


def attention(q, k, v, causal, use_sdpa, dropout=0.0, window=0, mask=None):
    groups = q.size(-3) // k.size(-3)
    if groups > 1:  # grouped-query heads: each key/value head serves `groups` query heads
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    # PyTorch has no sliding window on the CPU, and its sdpa takes is_causal or a mask, not both:
    # such cases get one mask (true = attend; a floating mask gets -inf where not).
    structure = None
    if window or (causal and mask is not None):
        positions = torch.arange(q.size(-2), device=q.device)
        offsets = positions.unsqueeze(1) - positions.unsqueeze(0)  # i - j
        structure = (offsets >= 0) & (offsets < window) if window else offsets >= 0
    if mask is None or structure is None:
        combined = structure if mask is None else mask
    else:
        combined = mask & structure if mask.dtype == torch.bool else mask.masked_fill(~structure, float("-inf"))
    if use_sdpa:
        if combined is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=combined, dropout_p=dropout)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal)
    scores = q @ k.transpose(-2, -1) / (k.size(-1) ** 0.5)
    if combined is not None:
        scores = scores.masked_fill(~combined, float("-inf")) if combined.dtype == torch.bool else scores + combined
    elif causal:
        n = q.size(-2)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return F.dropout(F.softmax(scores, dim=-1), dropout) @ v


def rope(x, offset, base=10000.0):
    """Rotary positions, half-split, for x (B, H, T, D) at positions offset .. offset + T - 1."""
    d = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    freqs = torch.outer(torch.arange(offset, offset + x.shape[-2], dtype=torch.float32, device=x.device), inv_freq)
    cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class DecoderBlock(nn.Module):
    """qkv::TransformerBlock's computation (pre-norm, GQA, RoPE, causal, GELU MLP) with a KV cache."""

    def __init__(self, d_model, heads, kv_heads, capacity, use_sdpa):
        super().__init__()
        self.H, self.Hkv, self.D, self.use_sdpa = heads, kv_heads, d_model // heads, use_sdpa
        self.ln_1, self.ln_2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.W_q = nn.Linear(d_model, d_model)
        self.W_k = nn.Linear(d_model, kv_heads * self.D)
        self.W_v = nn.Linear(d_model, kv_heads * self.D)
        self.W_o = nn.Linear(d_model, d_model)
        self.mlp_fc, self.mlp_proj = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)
        self.capacity = capacity

    def new_cache(self, batch, dtype, device):
        shape = (batch, self.Hkv, self.capacity, self.D)
        return {"k": torch.zeros(shape, dtype=dtype, device=device), "v": torch.zeros(shape, dtype=dtype, device=device),
                "length": 0}

    def forward(self, x, cache):
        B, T, E = x.shape
        L = cache["length"]
        h = self.ln_1(x)
        q = rope(self.W_q(h).view(B, T, self.H, self.D).transpose(1, 2), L)
        k = rope(self.W_k(h).view(B, T, self.Hkv, self.D).transpose(1, 2), L)
        v = self.W_v(h).view(B, T, self.Hkv, self.D).transpose(1, 2)
        cache["k"][:, :, L:L + T] = k
        cache["v"][:, :, L:L + T] = v
        cache["length"] = L + T
        keys, values = cache["k"][:, :, :L + T], cache["v"][:, :, :L + T]
        groups = self.H // self.Hkv
        if groups > 1:
            keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        if T == 1:  # one new position sees every cached one
            out = F.scaled_dot_product_attention(q, keys, values) if self.use_sdpa else \
                F.softmax(q @ keys.transpose(-2, -1) / self.D ** 0.5, dim=-1) @ values
        else:
            positions = torch.arange(L + T, device=x.device)
            allowed = positions.unsqueeze(0) <= positions[L:].unsqueeze(1)  # (T, L + T)
            if self.use_sdpa:
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed)
            else:
                scores = (q @ keys.transpose(-2, -1) / self.D ** 0.5).masked_fill(~allowed, float("-inf"))
                out = F.softmax(scores, dim=-1) @ values
        x = x + self.W_o(out.transpose(1, 2).reshape(B, T, E))
        return x + self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(x))))


def make_decoding(case, impl, device, dtype):
    batch = max(case["batch"], 1)
    block = DecoderBlock(case["d_model"], case["heads"], case.get("kv_heads", case["heads"]), case["seq_len"] + 1,
                         impl == "sdpa").to(device=device, dtype=dtype).eval()
    cache = block.new_cache(batch, dtype, device)
    prompt = torch.randn(batch, case["seq_len"], case["d_model"], device=device, dtype=dtype)
    token = torch.randn(batch, 1, case["d_model"], device=device, dtype=dtype)
    if case["kind"] == "prefill":
        def prefill():
            with torch.no_grad():
                cache["length"] = 0
                block(prompt, cache)
        return prefill
    with torch.no_grad():
        block(prompt, cache)

    def decode_step():
        with torch.no_grad():
            block(token, cache)
            cache["length"] = case["seq_len"]  # forget the new position again
    return decode_step


def flop_count(case):
    """As qkv-bench's flop_count (FlashAttention's papers' convention)."""
    if case["kind"] == "sgemm":
        return 2.0 * case["seq_len"] ** 3
    if case["kind"] in ("decode_step", "prefill"):
        return 0.0
    batch = max(case["batch"], 1)
    n, s, h = case["seq_len"], key_len(case), case.get("heads", 1)
    d = case.get("head_dim", case.get("d_model", 0) // h)
    window = case.get("window", 0)
    attention_flops = (4.0 * batch * h * n * min(s, window) * d if window
                       else 4.0 * batch * h * n * s * d * (0.5 if case.get("causal") else 1.0))
    core = case["kind"].startswith("core_")
    projections = 0.0 if core else 3 * 2.0 * batch * n * case["d_model"] ** 2
    if case["kind"] not in ("module_forward", "core_forward"):
        attention_flops *= 3.5
        projections *= 3.0
    return attention_flops + projections


def make_iteration(case, impl, device):
    torch.manual_seed(0)
    dtype = getattr(torch, case["dtype"])
    use_sdpa = impl == "sdpa"
    if case["kind"] == "sgemm":
        a = torch.randn(case["seq_len"], case["seq_len"], device=device, dtype=dtype)
        b = torch.randn(case["seq_len"], case["seq_len"], device=device, dtype=dtype)
        return lambda: torch.mm(a, b)
    if case["kind"] in ("decode_step", "prefill"):
        return make_decoding(case, impl, device, dtype)
    backward = case["kind"] not in ("module_forward", "core_forward")
    if case["kind"].startswith("core_"):
        batch = max(case["batch"], 1)
        shape = (batch, case["heads"], case["seq_len"], case["head_dim"])
        kv_shape = (batch, case.get("kv_heads", case["heads"]), key_len(case), case["head_dim"])
        q = torch.randn(shape, device=device, dtype=dtype, requires_grad=backward)
        k, v = (torch.randn(kv_shape, device=device, dtype=dtype, requires_grad=backward) for _ in range(2))
        grad_output = torch.randn(shape, device=device, dtype=dtype)
        causal, dropout, window = case.get("causal", False), case.get("dropout", 0.0), case.get("window", 0)
        mask = core_mask(case, device, dtype, backward)

        def core():
            if not backward:
                with torch.no_grad():
                    attention(q, k, v, causal, use_sdpa, window=window, mask=mask)
                return
            q.grad = k.grad = v.grad = None
            if mask is not None:
                mask.grad = None
            attention(q, k, v, causal, use_sdpa, dropout, window, mask).backward(grad_output)

        return core

    model = SelfAttention(case["d_model"], case.get("heads", 1), case.get("causal", False), use_sdpa)
    model.to(device=device, dtype=dtype)
    shape = (case["batch"], case["seq_len"], case["d_model"]) if case["batch"] else (case["seq_len"], case["d_model"])
    x = torch.randn(shape, device=device, dtype=dtype)
    target = torch.randn(shape, device=device, dtype=dtype)
    bias, mask = module_mask(case, device, dtype, backward)
    if case["kind"] == "module_forward":
        def forward():
            with torch.no_grad():
                model(x, mask())
        return forward
    if case["kind"] == "module_forward_backward":
        def forward_backward():
            model.zero_grad()
            if bias is not None:
                bias.grad = None
            F.mse_loss(model(x, mask()), target).backward()
        return forward_backward
    if bias is not None or mask() is not None:
        raise ValueError(f"case {case['name']}: masks are for core and module_forward(_backward) cases")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    autocast_dtype = getattr(torch, case["autocast"]) if case.get("autocast") else None

    def train_step():  # the documents' step plus the optimizer
        optimizer.zero_grad()
        # Mixed precision (case "autocast"): float32 weights, the forward under torch.autocast.
        with torch.autocast(device_type=device, dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None):
            output = model(x)
        loss = F.mse_loss(output.float(), target.float())  # a bfloat16 model's loss in float32 too
        loss.backward()
        optimizer.step()

    return train_step


def time_case(case, impl, device, min_time, repetitions):
    iteration = make_iteration(case, impl, device)
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(case.get("warmup", 3)):
        iteration()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    # As Google Benchmark: grow the iteration count until one repetition fills min_time.
    iterations, elapsed = 1, 0.0
    while True:
        start = time.perf_counter()
        for _ in range(iterations):
            iteration()
            sync()
        elapsed = time.perf_counter() - start
        if elapsed >= min_time or iterations >= 10**9:
            break
        iterations = max(iterations + 1, min(iterations * 10, int(iterations * min_time * 1.4 / max(elapsed, 1e-9))))
    times = [elapsed / iterations]
    for _ in range(repetitions - 1):
        start = time.perf_counter()
        for _ in range(iterations):
            iteration()
            sync()
        times.append((time.perf_counter() - start) / iterations)
    median = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"impl": impl, "iterations": iterations, "times_s": times, "median_s": median,
            "flops_per_s": flop_count(case) / median, "peak_memory_bytes": peak}


def implementations(case, requested=None):
    """The PyTorch implementations of `case` this torch has: those requested, else the case's
    pytorch_impls, else every one."""
    available = ["documents", "sdpa"] if HAS_SDPA else ["documents"]
    if case["kind"] == "sgemm":
        available = ["documents"]  # one product: the implementation is torch.mm either way
    return [i for i in (requested or case.get("pytorch_impls", available)) if i in available]


def shrunk(case):
    """The case at a size that runs in milliseconds, its structure kept (kind, dtype, heads and
    grouped heads, causal, window, mask, dropout, autocast): what --smoke runs. The same shrinking as
    qkv-bench --smoke's."""
    small = dict(case, batch=min(case["batch"], 2), seq_len=min(case["seq_len"], 16))
    if "key_len" in case:
        small["key_len"] = min(case["key_len"], 24)  # still unlike seq_len where the case's is
    if "head_dim" in case:
        small["head_dim"] = 8
    if "d_model" in case:
        small["d_model"] = 8 * case.get("heads", 1)
    if case.get("window"):
        small["window"] = 4
    return small


def smoke(cases, device):
    """--smoke: every case of every device, shrunk, one iteration of each implementation on
    `device`; prints what ran and what failed; returns the exit status (1 if any failed)."""
    ran, failed = 0, []
    for case in cases:
        for impl in implementations(case):
            try:
                make_iteration(shrunk(case), impl, device)()
                if device == "cuda":
                    torch.cuda.synchronize()
                print(f"ran {case['name']} ({impl})")
                ran += 1
            except Exception as error:  # noqa: BLE001 (every failure is named, then the exit status says so)
                print(f"FAILED {case['name']} ({impl}): {type(error).__name__}: {error}")
                failed.append(case["name"])
    print(f"bench_pytorch.py --smoke on {device}, torch {torch.__version__}: {ran} ran, {len(failed)} failed")
    return 1 if failed or ran == 0 else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument("--case", help="a case name from apps/qkv-bench/cases.json")
    parser.add_argument("--smoke", action="store_true",
                        help="run every case of every device once, shrunk to a few tokens, on --device, and exit "
                             "(0: all ran; 1: names those that failed)")
    parser.add_argument("--min-time", type=float, default=0.5, help="seconds per repetition")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--impl", choices=["documents", "sdpa"], action="append",
                        help="only these implementations (default: every one this torch has)")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    with open(CASES) as file:
        cases = {c["name"]: c for c in json.load(file)["cases"]}
    if args.smoke:
        sys.exit(smoke(cases.values(), args.device))
    if args.case is None:
        parser.error("--case or --smoke is required")
    if args.case not in cases:
        sys.exit(f"bench_pytorch.py: no case {args.case!r}; cases: {', '.join(cases)}")
    case = cases[args.case]
    if case["device"] != args.device:
        sys.exit(f"bench_pytorch.py: case {args.case} is a {case['device']} case, not {args.device}")
    device = "cuda" if args.device == "cuda" else "cpu"
    impls = implementations(case, args.impl)
    if not impls:  # exit status 3: this torch cannot run the case (scripts/bench.sh leaves the side out)
        print(f"bench_pytorch.py: torch {torch.__version__} has none of {case.get('pytorch_impls')} for {args.case}",
              file=sys.stderr)
        sys.exit(3)
    results = [time_case(case, impl, device, args.min_time, args.repetitions) for impl in impls]
    print(json.dumps({"case": args.case, "torch_version": torch.__version__, "threads": torch.get_num_threads(),
                      "python": sys.version.split()[0], "results": results}))


if __name__ == "__main__":
    main()
