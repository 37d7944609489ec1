"""A small block-diffusion transformer, shared by the flex-rewrite tests and benchmark."""

from __future__ import annotations

import torch


class TinyBD3(torch.nn.Module):
    """Pre-norm layers with RoPE over a [noisy | clean] input; attention through ``attend(q, k, v)``
    on (B, H, S, D). Noisy and clean copies of a token share its position."""

    def __init__(self, vocab=32, dim=32, heads=4, layers=2):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict(dict(norm=torch.nn.LayerNorm(dim), qkv=torch.nn.Linear(dim, 3 * dim),
                                     proj=torch.nn.Linear(dim, dim), mlp=torch.nn.Linear(dim, dim)))
            for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)

    @staticmethod
    def rope(x):
        s, d = x.shape[-2], x.shape[-1]
        pos = torch.arange(s, device=x.device) % (s // 2)
        freq = pos[:, None] / (10000 ** (torch.arange(0, d, 2, device=x.device) / d))
        cos, sin = freq.cos().to(x.dtype), freq.sin().to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)

    def forward(self, tokens, attend):
        x = self.embed(tokens)
        b, s, dim = x.shape
        for layer in self.layers:
            h = layer["norm"](x)
            q, k, v = layer["qkv"](h).view(b, s, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
            attn = attend(self.rope(q), self.rope(k), v)
            x = x + layer["proj"](attn.transpose(1, 2).reshape(b, s, dim))
            x = x + torch.relu(layer["mlp"](x))
        return self.head(x)


def noisy_half_loss(model, tokens, attend, vocab):
    """Cross-entropy of the noisy half's predictions against the clean tokens (BD3-LM style)."""
    n = tokens.shape[1] // 2
    logits = model(tokens, attend)[:, :n]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).float(),
                                             tokens[:, n:].reshape(-1))
