"""Load weights that qkv wrote (qkv-train's model.pt, qkv::save_state_dict) into the documents'
Python module:

    /usr/bin/python3 scripts/import_weights.py out/reverse/model.pt

prints the keys and runs the module once on a random input of the right width.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from seed_example import SelfAttention  # noqa: E402


def load(path):
    state = torch.load(path)
    model = SelfAttention(state["W_q.weight"].shape[0])
    model.load_state_dict(state)  # strict: the keys are the documents' own
    return model


if __name__ == "__main__":
    model = load(sys.argv[1])
    print({k: tuple(v.shape) for k, v in model.state_dict().items()})
    print("output shape:", model(torch.randn(4, model.W_q.in_features)).shape)
