"""The documents' complete example (../shared/seeds/002_*.txt, "完整代码"), verbatim but for
the English comments: one self-attention layer on a (4, 8) input, MSE loss, backward.

qkv-train --task seed reproduces this run in C++; tests/data/seed_example.json holds the loss
this script prints, written by scripts/gen_reference.py.
Run with the interpreter that has PyTorch: /usr/bin/python3 scripts/seed_example.py
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class SelfAttention(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        # Three linear maps produce Q, K and V (the formula's three matrices).
        self.W_q = nn.Linear(d_model, d_model)
        self.W_k = nn.Linear(d_model, d_model)
        self.W_v = nn.Linear(d_model, d_model)

    def forward(self, x):
        # x: (sequence length, features)
        Q = self.W_q(x)
        K = self.W_k(x)
        V = self.W_v(x)
        # Scaled dot product: QK^T / sqrt(d_k)
        scores = Q @ K.transpose(-2, -1) / (K.size(-1) ** 0.5)
        # Softmax per row gives the attention weights.
        attn_weights = F.softmax(scores, dim=-1)
        # Mix V by the weights.
        return attn_weights @ V


def main():
    torch.manual_seed(42)
    x = torch.randn(4, 8)
    attn = SelfAttention(d_model=8)
    output = attn(x)
    target = torch.randn_like(output)
    loss = F.mse_loss(output, target)
    loss.backward()
    print("Input shape:", x.shape)
    print("Output shape:", output.shape)
    print("Loss:", loss.item())


if __name__ == "__main__":
    main()
