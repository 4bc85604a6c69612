"""Round trip of weights between Python PyTorch and qkv (run by ctest as interop.python_roundtrip).

Python -> C++ -> Python: the documents' module and nn.MultiheadAttention (batch-first and
sequence-first) are saved here, loaded by qkv (qkv-weights), run, written back by qkv, and loaded
again in Python: outputs and weights must agree to 1e-6. Then a model trained by qkv-train from
Python weights is loaded into the documents' class; the same for a grouped-query module and a
TransformerBlock (scripts/gen_reference.py's references). Every file qkv writes must load with
torch.load's defaults and with weights_only=True (the default since PyTorch 2.6, which refuses
TorchScript's type tags).

    /usr/bin/python3 scripts/interop_roundtrip.py BUILD/apps/qkv-weights BUILD/apps/qkv-train
Exits 77 (ctest: skipped) when this interpreter has no PyTorch.
"""
import os
import subprocess
import sys
import tempfile

try:
    import torch
    import torch.nn as nn
except ImportError:
    print("SKIP: this python has no PyTorch (Debian: apt-get install python3-torch)")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from export_weights import export  # noqa: E402
from seed_example import SelfAttention  # noqa: E402


def inputs(query):
    # One entry: Python pickles it with SETITEM, which LibTorch 1.13's unpickler lacked (qkv reads it).
    return {"query": query}


def run(*command):
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit("FAILED: %s\n%s%s" % (" ".join(map(str, command)), result.stdout, result.stderr))
    return result


def close(a, b, what, tol=1e-6):
    diff = (a - b).abs().max().item()
    if diff > tol:
        sys.exit("FAILED: %s differs by %g" % (what, diff))
    print("ok: %s (max |diff| %.2g)" % (what, diff))


def load(path):
    """What a Python user does with a file qkv wrote: torch.load with its defaults, and the
    weights_only loader (the default from PyTorch 2.6 on; an explicit argument since 1.13)."""
    plain = torch.load(path)
    if "weights_only" in torch.load.__code__.co_varnames:
        safe = torch.load(path, weights_only=True)
        if set(safe) != set(plain):
            sys.exit("FAILED: %s loads differently with weights_only=True" % path)
    return plain


def main():
    weights_tool, train_tool = sys.argv[1], sys.argv[2]
    tmp = tempfile.mkdtemp(prefix="qkv_interop_")
    path = lambda name: os.path.join(tmp, name)  # noqa: E731
    torch.manual_seed(0)

    # The documents' module: Python -> C++ -> Python.
    docs = SelfAttention(8)
    x = torch.randn(5, 8)
    export(docs, path("docs.pt"))
    torch.save(inputs(x), path("x.pt"))
    run(weights_tool, "forward", path("docs.pt"), path("x.pt"), path("out.pt"), "--save-weights", path("back.pt"))
    close(load(path("out.pt"))["output"], docs(x), "documents' module: qkv output vs Python")
    again = SelfAttention(8)
    again.load_state_dict(load(path("back.pt")))  # strict: same keys
    for key, value in docs.state_dict().items():
        close(again.state_dict()[key], value, "weights back in Python: " + key, tol=0.0)
    close(again(x), docs(x), "documents' module reloaded in Python: output", tol=0.0)

    # nn.MultiheadAttention, batch-first and sequence-first.
    for batch_first in (True, False):
        mha = nn.MultiheadAttention(16, 4, batch_first=batch_first)
        with torch.no_grad():
            mha.in_proj_bias.uniform_(-0.5, 0.5)
            mha.out_proj.bias.uniform_(-0.5, 0.5)
        q = torch.randn(2, 6, 16)  # qkv is batch-first
        python_input = q if batch_first else q.transpose(0, 1)
        expected = mha(python_input, python_input, python_input, need_weights=False)[0]
        if not batch_first:
            expected = expected.transpose(0, 1)
        export(mha, path("mha.pt"))
        torch.save(inputs(q), path("q.pt"))
        run(weights_tool, "forward", path("mha.pt"), path("q.pt"), path("mha_out.pt"), "--heads", "4")
        close(load(path("mha_out.pt"))["output"], expected,
              "nn.MultiheadAttention(batch_first=%s): qkv output vs Python" % batch_first)

    # qkv-train from Python weights; its model.pt loads into the documents' class.
    torch.manual_seed(1)
    start = SelfAttention(24)
    export(start, path("start.pt"))
    run(train_tool, "--task", "reverse", "--device", "cpu", "--d-model", "24", "--seq-len", "8", "--steps", "20",
        "--init-weights", path("start.pt"), "--out", path("run"), "--quiet")
    trained = SelfAttention(24)
    trained.load_state_dict(load(path("run/model.pt")))
    moved = (trained.W_q.weight - start.W_q.weight).abs().max().item()
    if moved == 0.0:
        sys.exit("FAILED: the trained weights equal the initial ones")
    print("ok: qkv-train --init-weights from Python, model.pt back into the documents' class (W_q moved %.3g)" % moved)

    # Grouped-query heads and a TransformerBlock: Python -> C++ -> Python.
    from gen_reference import Block, DecoderAttention
    torch.manual_seed(2)
    for name, module in (("gqa", DecoderAttention(16, 4, num_kv_heads=2, rope=True, causal=True)),
                         ("block", Block(16, 4, num_kv_heads=1, rope=True, causal=True))):
        q = torch.randn(2, 6, 16)
        expected = module(q)[0] if name == "gqa" else module(q)
        export(module, path(name + ".pt"))
        torch.save(inputs(q), path(name + "_q.pt"))
        run(weights_tool, "forward", path(name + ".pt"), path(name + "_q.pt"), path(name + "_out.pt"), "--heads", "4",
            "--causal", "--rope", "--save-weights", path(name + "_back.pt"))
        close(load(path(name + "_out.pt"))["output"], expected, "%s: qkv output vs Python" % name, tol=1e-5)
        module.load_state_dict(load(path(name + "_back.pt")))  # strict: the reference's keys
        print("ok: %s weights back into the Python reference" % name)

    # torch.save(model.state_dict()): an OrderedDict with _metadata, which qkv reads itself.
    torch.save(docs.state_dict(), path("ordered.pt"))
    run(weights_tool, "forward", path("ordered.pt"), path("x.pt"), path("ordered_out.pt"))
    close(load(path("ordered_out.pt"))["output"], docs(x), "state_dict() OrderedDict: qkv output vs Python")
    print("ok: OrderedDict file of state_dict() read")
    print("interop round trip passed")


if __name__ == "__main__":
    main()
