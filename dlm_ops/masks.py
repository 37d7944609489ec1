"""mask_mods for ``torch.nn.attention.flex_attention`` that describe dlm_ops' masks.

They work with plain flex_attention (eager or compiled); under torch.compile, with dlm_ops imported,
the flex rewrite pass recognises them (like any mask_mod that computes the same mask) and runs the
fused dlm ops instead.
"""

from __future__ import annotations

import torch

__all__ = ["block_diffusion", "block_causal"]


def block_diffusion(n: int, block_size: int):
    """The BD3-LM mask over ``[noisy | clean]`` sequences of 2n tokens (DESIGN.md section 1)."""
    if n < 1 or block_size < 1:
        raise ValueError(f"n and block_size must be >= 1, got {n} and {block_size}")

    def mask_mod(b, h, q_idx, kv_idx):
        q_clean, kv_clean = q_idx >= n, kv_idx >= n
        q_block = torch.where(q_clean, q_idx - n, q_idx) // block_size
        kv_block = torch.where(kv_clean, kv_idx - n, kv_idx) // block_size
        same_half_block = (q_clean == kv_clean) & (q_block == kv_block)
        noisy_sees_clean = ~q_clean & kv_clean & (kv_block < q_block)
        clean_sees_clean = q_clean & kv_clean & (kv_block <= q_block)
        return same_half_block | noisy_sees_clean | clean_sees_clean

    mask_mod.__name__ = f"block_diffusion_n{n}_bs{block_size}"
    return mask_mod


def block_causal(block_size: int):
    """Key block <= query block (block_size 1 is causal attention)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx // block_size <= q_idx // block_size

    mask_mod.__name__ = f"block_causal_bs{block_size}"
    return mask_mod
