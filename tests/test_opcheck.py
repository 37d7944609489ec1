"""torch.library.opcheck: schema, fake functions, autograd registration, AOT dispatch."""

import pytest
import torch

import dlm_ops  # noqa: F401  (registers the ops)
from dlm_ops.ops import diffusion as ops

from .strategies import make_qkv


def _inputs(seqlen, heads=4, kv_heads=2, d=16, grad=False, batch=2):
    q, k, v = make_qkv((batch, seqlen, heads, d), (batch, seqlen, kv_heads, d), torch.float32, 0)
    return [t.requires_grad_(grad) for t in (q, k, v)]


@pytest.mark.parametrize("op,seqlen", [(ops.diffusion_attn_fwd, 20), (ops.block_causal_attn_fwd, 13)])
@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_opcheck_batched(op, seqlen, softcap):
    q, k, v = _inputs(seqlen, grad=True)
    torch.library.opcheck(op, (q, k, v, 3, None, softcap, False, None))
    out, lse = op(q, k, v, 3, 0.2, softcap, True, "torch")
    bwd = {ops.diffusion_attn_fwd: ops.diffusion_attn_bwd,
           ops.block_causal_attn_fwd: ops.block_causal_attn_bwd}[op]
    q, k, v = _inputs(seqlen)
    for dlse in (None, torch.randn_like(lse)):
        args = (torch.randn_like(out), q, k, v, out.detach(), lse.detach(), dlse, 3, 0.2, softcap,
                True, "torch")
        torch.library.opcheck(bwd, args)


def test_opcheck_varlen():
    cu = torch.tensor([0, 6, 6, 20], dtype=torch.int32)
    q, k, v = (t[0].requires_grad_() for t in _inputs(20, batch=1))
    torch.library.opcheck(ops.diffusion_attn_varlen_fwd, (q, k, v, cu, 14, 4, None, 0.0, False, None))
    out, lse = ops.diffusion_attn_varlen_fwd(q, k, v, cu, 14, 4, None, 0.0, False, None)
    q, k, v = (t.detach() for t in (q, k, v))
    args = (torch.randn_like(out), q, k, v, out.detach(), lse.detach(), torch.randn_like(lse), cu, 14,
            4, None, 0.0, False, None)
    torch.library.opcheck(ops.diffusion_attn_varlen_bwd, args)
