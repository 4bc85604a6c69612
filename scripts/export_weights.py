"""Save PyTorch attention weights in a file qkv reads (the Python side of "Weights from PyTorch").

    from export_weights import export
    export(model, "weights.pt")     # model: the documents' SelfAttention or nn.MultiheadAttention

is torch.save(dict(model.state_dict()), path). qkv reads torch.save(model.state_dict(), path) as
well (an OrderedDict); the plain dict is also what LibTorch's own torch::pickle_load reads, for
programs that load the file without qkv. From the shell, for the documents' module:

    /usr/bin/python3 scripts/export_weights.py --d-model 8 --seed 42 weights.pt
"""
import argparse
import os
import sys

import torch


def export(model, path):
    torch.save(dict(model.state_dict()), path)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("--d-model", type=int, default=8)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from seed_example import SelfAttention
    torch.manual_seed(args.seed)
    export(SelfAttention(args.d_model), args.path)
    print("wrote", args.path)


if __name__ == "__main__":
    main()
