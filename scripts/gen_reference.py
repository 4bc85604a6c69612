"""Writes the PyTorch reference fixtures that qkv's C++ tests compare against (tests/data/).

Each fixture is one configuration of the attention module: its weights, inputs, masks, target,
and what PyTorch computes from them: output, attention weights, MSE loss, and the gradient of
the loss with respect to every parameter and every input. The documents' configuration also
records a few Adam steps, so the C++ side is checked through training, not only one step.

The reference is written here independently of qkv's C++ code:
- the documents' configuration uses the documents' own `SelfAttention` class, verbatim;
- the others use `LoopAttention`, which computes every (batch, head, query) row with its own
  softmax over the keys it may see, in plain Python loops, so it shares no tensor trick with qkv;
  it is itself checked against the documents' class and against torch.nn.MultiheadAttention.

The decoder features (grouped-query heads, rotary positions, the Transformer block) have their
own reference, `DecoderAttention` and `Block`, written in plain tensor code: K and V repeated for
each group of query heads, RoPE as Hugging Face's LLaMA writes it (cat(θ, θ) and rotate_half). It
is checked here against the loop reference (without RoPE) and, where the installed torch has it,
against F.scaled_dot_product_attention(enable_gqa=True).

Run with the interpreter that has PyTorch:  /usr/bin/python3 scripts/gen_reference.py [--decoder-only | --interop-only | --check-only]
The files are small and committed; the C++ tests never need Python.
"""
import collections
import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from seed_example import SelfAttention as DocumentsSelfAttention  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "tests", "data")
GENERATOR = "scripts/gen_reference.py"


class LoopAttention(nn.Module):
    """The documents' module grown like qkv: heads, masks (true = attend), cross-attention, W_o."""

    def __init__(self, d_model, num_heads=1, kdim=None, vdim=None, bias=True, out_proj=False,
                 causal=False, scale=None):
        super().__init__()
        self.d_model, self.num_heads, self.causal, self.scale = d_model, num_heads, causal, scale
        self.W_q = nn.Linear(d_model, d_model, bias=bias)
        self.W_k = nn.Linear(kdim or d_model, d_model, bias=bias)
        self.W_v = nn.Linear(vdim or d_model, d_model, bias=bias)
        self.W_o = nn.Linear(d_model, d_model, bias=bias) if out_proj else None

    def forward(self, x, context=None, key_lengths=None, attn_mask=None):
        """x: (B, N, E); context: (B, S, kdim); key_lengths: (B,); attn_mask: bool (B, N, S) or
        float (N, S). Returns output (B, N, E) and weights (B, H, N, S)."""
        context = x if context is None else context
        B, N, E = x.shape
        S = context.shape[1]
        H = self.num_heads
        D = E // H
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(D)
        Q, K, V = self.W_q(x), self.W_k(context), self.W_v(context)
        rows_out = []
        weights = torch.zeros(B, H, N, S, dtype=x.dtype)
        for b in range(B):
            heads_out = []
            for h in range(H):
                cols = slice(h * D, (h + 1) * D)
                query_rows = []
                for i in range(N):
                    allowed, extra = [], []
                    for j in range(S):
                        ok = True
                        if self.causal and j > i:
                            ok = False
                        if key_lengths is not None and j >= int(key_lengths[b]):
                            ok = False
                        bias_ij = 0.0
                        if attn_mask is not None:
                            if attn_mask.dtype == torch.bool:
                                ok = ok and bool(attn_mask[b, i, j])
                            else:
                                bias_ij = attn_mask[i, j]
                                ok = ok and not math.isinf(float(bias_ij))
                        if ok:
                            allowed.append(j)
                            extra.append(bias_ij)
                    if not allowed:  # no key to attend to: zero output by qkv's definition
                        query_rows.append(torch.zeros(D, dtype=x.dtype))
                        continue
                    q = Q[b, i, cols]
                    scores = torch.stack([(q * K[b, j, cols]).sum() * scale + e for j, e in zip(allowed, extra)])
                    w = torch.softmax(scores, dim=0)
                    for w_j, j in zip(w, allowed):
                        weights[b, h, i, j] = w_j.detach()
                    query_rows.append(sum(w_j * V[b, j, cols] for w_j, j in zip(w, allowed)))
                heads_out.append(torch.stack(query_rows))  # (N, D)
            rows_out.append(torch.cat(heads_out, dim=-1))  # (N, E)
        out = torch.stack(rows_out)
        if self.W_o is not None:
            out = self.W_o(out)
        return out, weights


def record(case, module, inputs, config, out, weights, target, extra=None):
    loss = F.mse_loss(out, target)
    loss.backward()
    fixture = {"generated_by": GENERATOR, "torch_version": str(torch.__version__), "case": case}
    fixture.update({"config." + k: v for k, v in config.items()})
    for name, p in module.named_parameters():
        fixture["param." + name] = p.detach().clone()
        fixture["grad." + name] = p.grad.detach().clone()
    for name, t in inputs.items():
        fixture["input." + name] = t.detach().clone()
        if t.is_floating_point() and t.grad is not None:
            fixture["grad." + name] = t.grad.detach().clone()
    fixture["target"] = target
    fixture["expected.output"] = out.detach().clone()
    if weights is not None:
        fixture["expected.weights"] = weights
    fixture["expected.loss"] = loss.detach().clone()
    fixture.update(extra or {})
    path = os.path.join(DATA, "parity_%s.pt" % case)
    torch.save(fixture, path)  # a plain dict of tensors and numbers (read by src/pickle_reader.cpp)
    print("wrote %s (loss %.6f)" % (os.path.relpath(path), loss.item()))


def documents_case():
    """The documents' complete example, then three Adam steps on the same batch."""
    torch.manual_seed(42)
    x = torch.randn(4, 8)
    attn = DocumentsSelfAttention(d_model=8)
    initial = {k: v.detach().clone() for k, v in attn.state_dict().items()}
    x.requires_grad_(True)
    out = attn(x)
    target = torch.randn_like(out)
    Q, K = attn.W_q(x), attn.W_k(x)
    weights = F.softmax(Q @ K.T / math.sqrt(8), dim=-1).detach().unsqueeze(0)  # (H=1, N, S)
    # Adam steps from the same initial weights, on a copy, for the training-parity test.
    trained = DocumentsSelfAttention(d_model=8)
    trained.load_state_dict(initial)
    optimizer = torch.optim.Adam(trained.parameters(), lr=0.01)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        step_loss = F.mse_loss(trained(x.detach()), target)
        step_loss.backward()
        optimizer.step()
        losses.append(step_loss.item())
    config = {"d_model": 8, "num_heads": 1, "batched": False}
    record("documents", attn, {"query": x}, config, out, weights, target,
           {"adam.lr": 0.01, "adam.losses": torch.tensor(losses, dtype=torch.float64)})
    with open(os.path.join(DATA, "seed_example.json"), "w") as f:
        loss = F.mse_loss(out, target).item()
        json.dump({"generated_by": GENERATOR, "torch_version": str(torch.__version__),
                   "script": "scripts/seed_example.py", "input_shape": list(x.shape),
                   "output_shape": list(out.shape), "loss": loss}, f, indent=2)
        f.write("\n")


def loop_case(case, seed, dtype=torch.float32, B=2, N=5, S=None, d_model=16, num_heads=4, kdim=None,
              bias=True, out_proj=False, causal=False, scale=None, key_lengths=None, mask=None):
    torch.manual_seed(seed)
    module = LoopAttention(d_model, num_heads, kdim=kdim, vdim=kdim, bias=bias, out_proj=out_proj,
                           causal=causal, scale=scale).to(dtype)
    x = torch.randn(B, N, d_model, dtype=dtype, requires_grad=True)
    inputs = {"query": x}
    context = None
    if S is not None:
        context = torch.randn(B, S, kdim or d_model, dtype=dtype, requires_grad=True)
        inputs["context"] = context
    S_eff = S if S is not None else N
    lengths = torch.tensor(key_lengths, dtype=torch.int64) if key_lengths is not None else None
    if lengths is not None:
        inputs["key_lengths"] = lengths
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.rand(B, N, S_eff) > 0.4
        attn_mask[0, 1, :] = False  # one query with no key at all
        inputs["attn_mask"] = attn_mask
    elif mask == "float":
        attn_mask = torch.randn(N, S_eff, dtype=dtype)
        attn_mask[:, 0] = float("-inf")
        inputs["attn_mask"] = attn_mask
    out, weights = module(x, context, key_lengths=lengths, attn_mask=attn_mask)
    target = torch.randn_like(out)
    config = {"d_model": d_model, "num_heads": num_heads, "bias": bias, "out_proj": out_proj,
              "causal": causal, "batched": True}
    if kdim is not None:
        config["kdim"] = kdim
        config["vdim"] = kdim
    if scale is not None:
        config["scale"] = scale
    record(case, module, inputs, config, out, weights, target)
    return module, x, out


def check_loop_reference():
    """LoopAttention must agree with the documents' class and with nn.MultiheadAttention."""
    torch.manual_seed(0)
    docs = DocumentsSelfAttention(8)
    loop = LoopAttention(8)
    loop.load_state_dict(docs.state_dict())
    x = torch.randn(5, 8)
    assert torch.allclose(docs(x), loop(x.unsqueeze(0))[0][0], atol=1e-6), "LoopAttention != documents"

    loop = LoopAttention(16, 4, out_proj=True, causal=True)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([loop.W_q.weight, loop.W_k.weight, loop.W_v.weight]))
        mha.in_proj_bias.copy_(torch.cat([loop.W_q.bias, loop.W_k.bias, loop.W_v.bias]))
        mha.out_proj.weight.copy_(loop.W_o.weight)
        mha.out_proj.bias.copy_(loop.W_o.bias)
    x = torch.randn(2, 6, 16)
    causal = torch.triu(torch.full((6, 6), float("-inf")), diagonal=1)
    expected, expected_w = mha(x, x, x, attn_mask=causal, average_attn_weights=False)
    got, got_w = loop(x)
    assert torch.allclose(expected, got, atol=1e-5), "LoopAttention != nn.MultiheadAttention"
    assert torch.allclose(expected_w, got_w, atol=1e-6), "LoopAttention weights != nn.MultiheadAttention"
    print("LoopAttention agrees with the documents' class and nn.MultiheadAttention")


def interop_cases():
    """Weight files as PyTorch users write them, for tests/test_state_dict.cpp."""
    torch.manual_seed(21)
    docs = DocumentsSelfAttention(8)
    x = torch.randn(5, 8)
    torch.save(dict(docs.state_dict()), os.path.join(DATA, "interop_documents_weights.pt"))
    torch.save(docs.state_dict(), os.path.join(DATA, "interop_documents_ordereddict.pt"))
    torch.save({"generated_by": GENERATOR, "query": x, "output": docs(x).detach()},
               os.path.join(DATA, "interop_documents_io.pt"))

    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    with torch.no_grad():  # PyTorch initialises the biases to zero; make them count
        mha.in_proj_bias.uniform_(-0.5, 0.5)
        mha.out_proj.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, 5, 16)
    seq_first = nn.MultiheadAttention(16, 4)  # the default layout: (N, B, E)
    seq_first.load_state_dict(mha.state_dict())
    torch.save(dict(mha.state_dict()), os.path.join(DATA, "interop_mha_weights.pt"))
    torch.save({"generated_by": GENERATOR, "query": x,
                "output_batch_first": mha(x, x, x, need_weights=False)[0].detach(),
                "query_seq_first": x.transpose(0, 1).contiguous(),
                "output_seq_first": seq_first(x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1),
                                              need_weights=False)[0].detach()},
               os.path.join(DATA, "interop_mha_io.pt"))
    mha_with_other_widths()
    print("wrote tests/data/interop_*.pt")


def mha_with_other_widths():
    """nn.MultiheadAttention whose keys and values have other widths (kdim, vdim): its weights are
    q_proj_weight, k_proj_weight and v_proj_weight instead of one in_proj_weight. One module with
    kdim == vdim and biases, one with kdim != vdim, no biases and a key_padding_mask (PyTorch's
    polarity: True = padding), and one with add_bias_kv, whose bias_k and bias_v qkv refuses."""
    torch.manual_seed(22)
    cross = nn.MultiheadAttention(16, 4, kdim=8, vdim=8, batch_first=True)
    with torch.no_grad():
        cross.in_proj_bias.uniform_(-0.5, 0.5)
        cross.out_proj.bias.uniform_(-0.5, 0.5)
    assert not cross._qkv_same_embed_dim and "q_proj_weight" in cross.state_dict()
    x, context = torch.randn(2, 5, 16), torch.randn(2, 7, 8)
    torch.save(dict(cross.state_dict()), os.path.join(DATA, "interop_mha_cross_weights.pt"))
    torch.save({"generated_by": GENERATOR, "query": x, "context": context,
                "output": cross(x, context, context, need_weights=False)[0].detach()},
               os.path.join(DATA, "interop_mha_cross_io.pt"))

    widths = nn.MultiheadAttention(16, 4, kdim=8, vdim=12, bias=False, batch_first=True)
    key, value = torch.randn(2, 7, 8), torch.randn(2, 7, 12)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, 4:] = True  # the second batch element's last three keys are padding
    output, weights = widths(x, key, value, key_padding_mask=padding, average_attn_weights=False)
    torch.save(dict(widths.state_dict()), os.path.join(DATA, "interop_mha_widths_weights.pt"))
    torch.save({"generated_by": GENERATOR, "query": x, "key": key, "value": value,
                "key_padding_mask": padding, "output": output.detach(), "weights": weights.detach()},
               os.path.join(DATA, "interop_mha_widths_io.pt"))

    bias_kv = nn.MultiheadAttention(16, 4, add_bias_kv=True, batch_first=True)
    torch.save(dict(bias_kv.state_dict()), os.path.join(DATA, "interop_mha_bias_kv_weights.pt"))


def pickle_variants_case():
    """What torch.save writes beyond a plain dict of contiguous float32 tensors, for qkv's own
    reader of the pickle (src/pickle_reader.cpp; tests/test_state_dict.cpp, WeightsFromPython).
    Every tensor is made from torch.arange, so the test computes what it must read by itself."""
    def arange(n, dtype=torch.float32):
        return torch.arange(n).to(dtype)

    base = arange(10)
    variants = collections.OrderedDict()  # an OrderedDict with attributes, as Module.state_dict() returns
    variants._metadata = collections.OrderedDict([("", {"version": 1})])
    variants["transposed"] = arange(24).reshape(4, 6).t()        # strides (1, 6)
    variants["sliced"] = arange(24)[5:17:3]                      # offset 5, stride 3, in the whole storage
    variants["shared_head"] = base[:5]                           # one storage, two tensors
    variants["shared_tail"] = base[5:]
    variants["expanded"] = arange(3).expand(2, 3)                # stride 0
    variants["scalar"] = torch.tensor(3.5)                       # no dimensions
    variants["empty"] = torch.zeros(0, 3)
    variants["bfloat16"] = arange(8, torch.bfloat16)
    variants["float16"] = arange(8, torch.float16)
    variants["float64"] = arange(8, torch.float64)
    variants["int64"] = arange(8, torch.int64)
    variants["bool"] = arange(8) % 3 == 0
    variants["parameter"] = nn.Parameter(arange(4))               # torch._utils._rebuild_parameter
    variants["one_entry"] = {"only": arange(2)}                   # SETITEM, not SETITEMS
    variants["one_item"] = [arange(2)]                            # APPEND, not APPENDS
    variants["plain"] = [1, -2, 70000, -(2 ** 40), 2.5, "text", True, False, None, (1, 2)]
    if torch.__version__.startswith("1."):
        torch.save(variants, os.path.join(DATA, "interop_pickle_variants.pt"))
        # pickle_protocol=4: FRAME, MEMOIZE, SHORT_BINUNICODE, STACK_GLOBAL instead of protocol 2's opcodes
        torch.save(variants, os.path.join(DATA, "interop_pickle_variants_protocol4.pt"), pickle_protocol=4)
        torch.save({"W": arange(4)}, os.path.join(DATA, "interop_one_entry.pt"))
        print("wrote tests/data/interop_pickle_variants.pt, interop_pickle_variants_protocol4.pt, interop_one_entry.pt")
    else:  # PyTorch 2.x writes more entries (byteorder, .data/serialization_id): run in the sid chroot
        torch.save(variants, os.path.join(DATA, "interop_pickle_variants_torch2.pt"))
        print("wrote tests/data/interop_pickle_variants_torch2.pt")


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, offset, base):
    """x (B, H, N, D) at positions offset .. offset + N - 1, as Hugging Face's LLaMA (angles in float64)."""
    D = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    positions = torch.arange(offset, offset + x.shape[-2], dtype=torch.float64)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return x * emb.cos().to(x.dtype) + rotate_half(x) * emb.sin().to(x.dtype)


class DecoderAttention(nn.Module):
    """Attention with num_kv_heads key/value heads (each shared by a group of query heads), RoPE,
    causal mask, optional W_o: the decoder reference, in plain tensor code."""

    def __init__(self, d_model, num_heads, num_kv_heads=None, rope=False, rope_base=10000.0, causal=False,
                 out_proj=False, bias=True):
        super().__init__()
        self.H, self.Hkv = num_heads, num_kv_heads or num_heads
        self.D = d_model // num_heads
        self.rope, self.rope_base, self.causal = rope, rope_base, causal
        self.W_q = nn.Linear(d_model, d_model, bias=bias)
        self.W_k = nn.Linear(d_model, self.Hkv * self.D, bias=bias)
        self.W_v = nn.Linear(d_model, self.Hkv * self.D, bias=bias)
        self.W_o = nn.Linear(d_model, d_model, bias=bias) if out_proj else None

    def project(self, x, offset=0):
        B, N, _ = x.shape
        q = self.W_q(x).view(B, N, self.H, self.D).transpose(1, 2)
        k = self.W_k(x).view(B, N, self.Hkv, self.D).transpose(1, 2)
        v = self.W_v(x).view(B, N, self.Hkv, self.D).transpose(1, 2)
        if self.rope:
            q, k = apply_rope(q, offset, self.rope_base), apply_rope(k, offset, self.rope_base)
        return q, k, v

    def forward(self, x):
        B, N, E = x.shape
        q, k, v = self.project(x)
        groups = self.H // self.Hkv
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # one per query head
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.D)
        if self.causal:
            scores = scores.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(B, N, E)
        if self.W_o is not None:
            out = self.W_o(out)
        return out, weights.detach()


class Block(nn.Module):
    """qkv::TransformerBlock's reference: pre-norm attention and GELU MLP on residual branches."""

    def __init__(self, d_model, num_heads, num_kv_heads=None, rope=False, causal=False, mlp_ratio=4, bias=True):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = DecoderAttention(d_model, num_heads, num_kv_heads, rope=rope, causal=causal, out_proj=True,
                                     bias=bias)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp_fc = nn.Linear(d_model, mlp_ratio * d_model, bias=bias)
        self.mlp_proj = nn.Linear(mlp_ratio * d_model, d_model, bias=bias)

    def forward(self, x):
        h = x + self.attn(self.ln_1(x))[0]
        return h + self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(h))))


def check_decoder_reference():
    """DecoderAttention without RoPE equals the loop reference (with one key/value head per query
    head) and the repeated-heads form equals F.scaled_dot_product_attention(enable_gqa=True)."""
    torch.manual_seed(10)
    decoder = DecoderAttention(16, 4, causal=True, out_proj=True)
    loop = LoopAttention(16, 4, out_proj=True, causal=True)
    loop.load_state_dict(decoder.state_dict())
    x = torch.randn(2, 6, 16)
    assert torch.allclose(decoder(x)[0], loop(x)[0], atol=1e-5), "DecoderAttention != LoopAttention"
    checked = "the loop reference"
    sdpa = getattr(F, "scaled_dot_product_attention", None)
    if sdpa is not None and "enable_gqa" in (sdpa.__doc__ or ""):
        gqa = DecoderAttention(32, 8, 2, rope=True, causal=True)
        q, k, v = gqa.project(torch.randn(2, 7, 32))
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        groups = 8 // 2
        scores = q @ k.repeat_interleave(groups, 1).transpose(-2, -1) / math.sqrt(4)
        scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
        got = torch.softmax(scores, -1) @ v.repeat_interleave(groups, 1)
        assert torch.allclose(expected, got, atol=1e-6), "repeated K/V != F.scaled_dot_product_attention(enable_gqa)"
        checked += " and F.scaled_dot_product_attention(enable_gqa=True)"
    print("DecoderAttention agrees with " + checked)


def decoder_case(case, seed, dtype=torch.float32, B=2, N=5, d_model=32, num_heads=8, num_kv_heads=None,
                 rope=False, causal=False, block=False):
    torch.manual_seed(seed)
    if block:
        module = Block(d_model, num_heads, num_kv_heads, rope=rope, causal=causal).to(dtype)
    else:
        module = DecoderAttention(d_model, num_heads, num_kv_heads, rope=rope, causal=causal).to(dtype)
    with torch.no_grad():  # non-trivial LayerNorm parameters and biases
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(B, N, d_model, dtype=dtype, requires_grad=True)
    if block:
        out, weights = module(x), None
    else:
        out, weights = module(x)
    target = torch.randn_like(out)
    config = {"d_model": d_model, "num_heads": num_heads, "num_kv_heads": num_kv_heads or num_heads, "rope": rope,
              "rope_base": 10000.0, "causal": causal, "batched": True, "kind": "block" if block else "attention"}
    if block:
        config["mlp_ratio"] = 4
    record(case, module, {"query": x}, config, out, weights, target)


def decoder_cases():
    check_decoder_reference()
    for kv_heads in (8, 4, 2, 1):
        decoder_case("gqa_h8_kv%d" % kv_heads, seed=20 + kv_heads, num_kv_heads=kv_heads)
    decoder_case("gqa_h8_kv2_f64", seed=22, dtype=torch.float64, num_kv_heads=2)
    decoder_case("rope", seed=30, d_model=16, num_heads=4, rope=True, N=6)
    decoder_case("rope_f64", seed=30, dtype=torch.float64, d_model=16, num_heads=4, rope=True, N=6)
    decoder_case("rope_gqa_causal", seed=31, d_model=16, num_heads=4, num_kv_heads=2, rope=True, causal=True, N=7)
    decoder_case("rope_gqa_causal_f64", seed=31, dtype=torch.float64, d_model=16, num_heads=4, num_kv_heads=2,
                 rope=True, causal=True, N=7)
    decoder_case("block", seed=40, d_model=16, num_heads=4, block=True)
    decoder_case("block_f64", seed=40, dtype=torch.float64, d_model=16, num_heads=4, block=True)
    decoder_case("block_gqa_rope_causal", seed=41, d_model=16, num_heads=4, num_kv_heads=2, rope=True, causal=True,
                 block=True, N=6)
    decoder_case("block_gqa_rope_causal_f64", seed=41, dtype=torch.float64, d_model=16, num_heads=4, num_kv_heads=2,
                 rope=True, causal=True, block=True, N=6)


def main():
    os.makedirs(DATA, exist_ok=True)
    if "--check-only" in sys.argv[1:]:  # the references' own checks, e.g. under another torch version
        check_loop_reference()
        check_decoder_reference()
        return
    if "--decoder-only" in sys.argv[1:]:
        decoder_cases()
        return
    if "--interop-only" in sys.argv[1:]:
        interop_cases()
        return
    if "--pickle-variants-only" in sys.argv[1:]:
        pickle_variants_case()
        return
    interop_cases()
    pickle_variants_case()
    check_loop_reference()
    documents_case()
    loop_case("multihead", seed=1)
    loop_case("multihead_f64", seed=1, dtype=torch.float64)
    loop_case("causal", seed=2, B=2, N=6, d_model=12, num_heads=3, causal=True)
    loop_case("padded", seed=3, B=3, N=5, d_model=12, num_heads=2, key_lengths=[5, 2, 0])
    loop_case("cross", seed=4, B=2, N=3, S=7, d_model=16, num_heads=4, kdim=10)
    loop_case("out_proj", seed=5, out_proj=True)
    loop_case("bool_mask", seed=6, B=2, N=4, d_model=8, num_heads=2, mask="bool")
    loop_case("float_mask", seed=7, B=2, N=4, d_model=8, num_heads=2, mask="float")
    loop_case("unscaled", seed=8, d_model=16, num_heads=2, scale=1.0)
    loop_case("no_bias_causal_f64", seed=9, dtype=torch.float64, B=2, N=4, S=6, d_model=8, num_heads=2,
              bias=False, causal=True)
    decoder_cases()


if __name__ == "__main__":
    main()
