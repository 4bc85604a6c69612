"""qkv-train --task lm in PyTorch: the same character-level GPT, data, batches, optimizer and
schedule, written independently of the C++ code, to check qkv's training against and to time it.

    /usr/bin/python3 scripts/lm_pytorch.py parity OUT     # OUT: a qkv-train --task lm --out folder
        Trains from OUT/model_init.pt (the weights qkv started from) with OUT/summary.json's options
        and compares the loss of every step with OUT/metrics.csv (run qkv-train with --log-every 1
        and --dropout 0: dropout draws differ between the two). Tolerance: float64 1e-8, float32 1e-4.
    /usr/bin/python3 scripts/lm_pytorch.py speed [--threads N] [--steps S] [options as qkv-train's]
        Times training steps at qkv-train's default configuration; prints one JSON line.

The same model: token embedding, L pre-norm blocks (LayerNorm, attention with rotary positions and
optional grouped-query heads, residual; LayerNorm, GELU MLP, residual), final LayerNorm, LM head.
The same data: the text's characters (Unicode code points) sorted as the vocabulary, the last 10%
held out, batch windows drawn with torch.randint from a generator seeded by (seed, step) mixed as
qkv-train mixes them. The same optimizer: AdamW (betas 0.9, 0.95) with weight decay on matrices
and embeddings, linear warmup then cosine decay to lr / 10, gradient clipping.
"""
import argparse
import gzip
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULT_TEXT = "/usr/share/dictd/devil.dict.dz"
MASK64 = (1 << 64) - 1


# ---- Data ----

def dictd_entries(path):
    """A dictd database's entries in file order, without its 00-database-* header entries."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def number(digits):
        value = 0
        for c in digits:
            value = value * 64 + alphabet.index(c)
        return value

    body = gzip.open(path).read()
    entries = set()
    with open(path[: -len(".dict.dz")] + ".index", encoding="utf-8") as index:
        for line in index:
            fields = line.rstrip("\n").split("\t")
            if len(fields) < 3 or fields[0].startswith(("00database", "00-database")):
                continue
            entries.add((number(fields[1]), number(fields[2])))
    return b"".join(body[o:o + n] for o, n in sorted(entries))


def load_text(path):
    raw = dictd_entries(path) if path.endswith(".dict.dz") else open(path, "rb").read()
    return raw.decode("utf-8")


class Data:
    def __init__(self, path, context):
        text = load_text(path)
        self.vocabulary = sorted(set(text))
        index = {c: i for i, c in enumerate(self.vocabulary)}
        ids = torch.tensor([index[c] for c in text], dtype=torch.long)
        validation = len(ids) // 10
        self.train, self.validation = ids[: len(ids) - validation], ids[len(ids) - validation:]
        self.context = context

    def batch(self, seed, step, batch):
        mixed = (seed * 0x9E3779B97F4A7C15 + (step & MASK64) * 0xBF58476D1CE4E5B9 + 1) & MASK64
        generator = torch.Generator().manual_seed(mixed)
        starts = torch.randint(len(self.train) - self.context, (batch,), generator=generator, dtype=torch.long)
        windows = self.train[starts.unsqueeze(1) + torch.arange(self.context + 1).unsqueeze(0)]
        return windows[:, :-1], windows[:, 1:]


# ---- Model ----

def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x, base=10000.0):
    D = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    freqs = torch.outer(torch.arange(x.shape[-2], dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return x * emb.cos().to(x.dtype) + rotate_half(x) * emb.sin().to(x.dtype)


class Attention(nn.Module):
    def __init__(self, d_model, heads, kv_heads, dropout):
        super().__init__()
        self.H, self.Hkv, self.D, self.dropout = heads, kv_heads, d_model // heads, dropout
        self.W_q = nn.Linear(d_model, d_model)
        self.W_k = nn.Linear(d_model, kv_heads * self.D)
        self.W_v = nn.Linear(d_model, kv_heads * self.D)
        self.W_o = nn.Linear(d_model, d_model)
        self.fused = hasattr(F, "scaled_dot_product_attention")

    def forward(self, x):
        B, N, E = x.shape
        q = rope(self.W_q(x).view(B, N, self.H, self.D).transpose(1, 2))
        k = rope(self.W_k(x).view(B, N, self.Hkv, self.D).transpose(1, 2))
        v = self.W_v(x).view(B, N, self.Hkv, self.D).transpose(1, 2)
        groups = self.H // self.Hkv
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        p = self.dropout if self.training else 0.0
        if self.fused:  # PyTorch >= 2.0: its fused kernel, as a PyTorch user would write it
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:  # PyTorch 1.13: matmul, softmax, matmul
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.D)
            scores = scores.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
            out = F.dropout(torch.softmax(scores, dim=-1), p) @ v
        return self.W_o(out.transpose(1, 2).reshape(B, N, E))


class Block(nn.Module):
    def __init__(self, d_model, heads, kv_heads, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, heads, kv_heads, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp_fc = nn.Linear(d_model, 4 * d_model)
        self.mlp_proj = nn.Linear(4 * d_model, d_model)
        self.residual_dropout = nn.Dropout(dropout)

    def forward(self, x):
        h = x + self.residual_dropout(self.attn(self.ln_1(x)))
        return h + self.residual_dropout(self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(h)))))


class Gpt(nn.Module):
    def __init__(self, vocabulary, d_model, heads, kv_heads, layers, dropout, tie_weights):
        super().__init__()
        self.token_embedding = nn.Embedding(vocabulary, d_model)
        self.embedding_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, heads, kv_heads, dropout) for _ in range(layers))
        self.final_norm = nn.LayerNorm(d_model)
        self.head = None if tie_weights else nn.Linear(d_model, vocabulary, bias=False)

    def forward(self, ids):
        x = self.embedding_dropout(self.token_embedding(ids))
        for block in self.blocks:
            x = block(x)
        x = self.final_norm(x)
        return x @ self.token_embedding.weight.t() if self.head is None else self.head(x)


# ---- Training ----

def make_optimizer(model, options):
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decayed, "weight_decay": options["weight_decay"]},
                              {"params": plain, "weight_decay": 0.0}],
                             lr=options["lr"], betas=(0.9, 0.95), eps=1e-8)


def learning_rate(step, options):
    lr, warmup, steps = options["lr"], options["warmup_steps"], options["steps"]
    if step <= warmup:
        return lr * step / max(warmup, 1)
    progress = min((step - warmup) / max(steps - warmup, 1), 1.0)
    return lr / 10 + 0.5 * (lr - lr / 10) * (1.0 + math.cos(math.pi * progress))


def build(options, data):
    kv_heads = options.get("kv_heads") or options["heads"]
    dtype = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}[options["dtype"]]
    model = Gpt(len(data.vocabulary), options["d_model"], options["heads"], kv_heads, options["layers"],
                options["dropout"], options["tie_weights"]).to(dtype)
    return model


def train_steps(model, data, options, steps, on_step=None):
    optimizer = make_optimizer(model, options)
    model.train()
    losses = []
    for step in range(1, steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, options)
        inputs, targets = data.batch(options["seed"], step, options["batch"])
        optimizer.zero_grad()
        logits = model(inputs)
        flat = logits.reshape(-1, logits.shape[-1])
        loss = F.cross_entropy(flat if flat.dtype == torch.float64 else flat.float(), targets.reshape(-1))
        loss.backward()
        if options["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), options["grad_clip"])
        optimizer.step()
        losses.append(loss.item())
        if on_step:
            on_step(step, losses[-1])
    return losses


def parity(out):
    summary = json.load(open(os.path.join(out, "summary.json")))
    options = summary["options"]
    if options["dropout"] != 0:
        sys.exit("parity needs a run with --dropout 0 (the two sides draw different dropout masks)")
    data = Data(options["data"] or DEFAULT_TEXT, options["seq_len"])
    model = build(options, data)
    model.load_state_dict(torch.load(os.path.join(out, "model_init.pt")))  # strict: qkv's names are these
    expected = {}
    with open(os.path.join(out, "metrics.csv")) as metrics:
        columns = metrics.readline().strip().split(",")
        for line in metrics:
            cells = line.strip().split(",")
            if cells[columns.index("loss")]:
                expected[int(cells[0])] = float(cells[columns.index("loss")])
    steps = max(expected)
    tolerance = 1e-8 if options["dtype"] == "float64" else 1e-4
    losses = train_steps(model, data, options, steps)
    worst = 0.0
    for step, loss in enumerate(losses, start=1):
        if step in expected:
            worst = max(worst, abs(loss - expected[step]))
            print("step %3d  qkv %.12f  pytorch %.12f  |diff| %.2e" % (step, expected[step], loss, abs(loss - expected[step])))
    print("%s: %d steps, largest |loss difference| %.3g (tolerance %g), torch %s"
          % (options["dtype"], steps, worst, tolerance, torch.__version__))
    if len(expected) != steps or worst > tolerance:
        sys.exit("FAILED: the losses differ")


def speed(args):
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    options = {"d_model": args.d_model, "heads": args.heads, "kv_heads": args.kv_heads, "layers": args.layers,
               "seq_len": args.seq_len, "batch": args.batch, "lr": args.lr, "seed": args.seed,
               "dropout": args.dropout, "weight_decay": 0.1, "warmup_steps": args.warmup_steps,
               "steps": args.total_steps, "grad_clip": 1.0, "tie_weights": False, "dtype": "float32"}
    data_path = args.data
    if args.like:  # the options of a qkv-train --task lm run (its summary.json)
        like = json.load(open(args.like))["options"]
        options.update({k: like[k] for k in options if k in like})
        data_path = like.get("data") or DEFAULT_TEXT
    data = Data(data_path, options["seq_len"])
    model = build(options, data)
    train_steps(model, data, options, args.warmup)  # warm-up: allocator, first-call costs
    start = time.perf_counter()
    train_steps(model, data, options, args.steps)
    seconds = time.perf_counter() - start
    print(json.dumps({"implementation": "pytorch", "torch_version": torch.__version__, "threads": args.threads,
                      "steps": args.steps, "seconds": seconds, "options": options,
                      "tokens_per_s": args.steps * options["batch"] * options["seq_len"] / seconds,
                      "attention": "F.scaled_dot_product_attention" if hasattr(F, "scaled_dot_product_attention")
                      else "matmul-softmax-matmul"}))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("parity")
    p.add_argument("out")
    s = sub.add_parser("speed")
    s.add_argument("--threads", type=int, default=os.cpu_count())
    s.add_argument("--steps", type=int, default=10)
    s.add_argument("--warmup", type=int, default=2)
    s.add_argument("--data", default=DEFAULT_TEXT)
    s.add_argument("--d-model", type=int, default=128)
    s.add_argument("--heads", type=int, default=4)
    s.add_argument("--kv-heads", type=int, default=None)
    s.add_argument("--layers", type=int, default=4)
    s.add_argument("--seq-len", type=int, default=256)
    s.add_argument("--batch", type=int, default=16)
    s.add_argument("--lr", type=float, default=2e-3)
    s.add_argument("--dropout", type=float, default=0.1)
    s.add_argument("--warmup-steps", type=int, default=100)
    s.add_argument("--total-steps", type=int, default=1200)
    s.add_argument("--seed", type=int, default=42)
    s.add_argument("--like", help="take the model, data and optimizer options from this qkv-train summary.json")
    args = parser.parse_args()
    if args.mode == "parity":
        parity(args.out)
    else:
        speed(args)


if __name__ == "__main__":
    main()
