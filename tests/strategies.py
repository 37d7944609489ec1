"""hypothesis strategies for attention problems."""

import torch
from hypothesis import strategies as st

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEADS = [(1, 1), (2, 2), (4, 2), (3, 1), (4, 4)]  # (H, Hkv): MHA, GQA, MQA


@st.composite
def attention_problem(draw, max_n=40, head_dims=(8, 16, 32, 64)):
    """dict(batch, n, heads, kv_heads, head_dim, block_size) with n from 1, block_size up to > n."""
    n = draw(st.integers(1, max_n))
    heads, kv_heads = draw(st.sampled_from(HEADS))
    return dict(
        batch=draw(st.integers(1, 2)),
        n=n,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=draw(st.sampled_from(head_dims)),
        block_size=draw(st.one_of(st.integers(1, n + 4), st.sampled_from([1, 4, 16]))),
    )


def make_qkv(shape_q, shape_kv, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(shape_q, generator=gen).to(dtype)
    k = torch.randn(shape_kv, generator=gen).to(dtype)
    v = torch.randn(shape_kv, generator=gen).to(dtype)
    return q, k, v
