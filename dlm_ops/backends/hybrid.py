"""Backends of the block-hybrid family (LLaDA-Hybrid, dlm_ops/ops/hybrid.py has the definitions).

``torch``: PyTorch ops on any device. The training form is block-batched: the sequence is cut
into nb = ceil(n / bs) blocks (the last one zero-padded, its padding masked), and

    U_c = phi(k_c)^T v_c, z_c = sum phi(k_c)          per clean block c      (B, H, nb, 2F, D)
    S_b = sum_{c<b} U_c, Z_b = sum_{c<b} z_c          an exclusive prefix sum over blocks
    out = (w a v + phi(q) S_b) / (clamp(w sum a) + clamp(phi(q) . Z_b))   per block, both halves

so everything is a batched matmul (no Python loop over blocks). Its backward is written by hand
(torch ops again): the reverse of the prefix sum is a reverse exclusive cumsum of dS_b, and the
max in a_ij = exp(s_ij - max_j s_ij) does not cancel here (the state terms are not rescaled with
it), so its gradient is kept, split among ties like ``torch.amax``.

Memory per training call (fp32 compute; float64 inputs double it), with P = 2 * nb * bs padded
tokens, in floats: q, k, v blocked and head-expanded, the in-block output, the state output and
out 6 * B * H * P * D; scores and exponentials 2 * B * H * P * bs; phi(q), phi(k) and their two
softmaxes 3 * B * H * P * 2F; the block sums U and their prefix S 2 * B * H * nb * 2F * D. At
B=1, H=16, 2n=8K, D=128, bs=32, F=64: 0.4 + 0.03 + 0.2 + 0.27 GB, about 0.9 GB. The per-block
states grow with 2F / bs (each block's (2F, D) sum is 2F/bs times the size of its tokens). The
backward recomputes the forward (only the inputs are saved) and holds about twice that.

``triton``: the decode step and the state update as fused kernels (templates/hybrid_attn.py), and
the training form's forward and backward as fused kernels (templates/hybrid_train.py has the
design, launched by hybrid_train.py): the forward walks the blocks with a D slice of the state in
registers and stores nothing per block; the backward stores one state per tile (not per block
and head-expanded copies of every input, as above) and makes five passes.
On CPU it runs only when forced under TRITON_INTERPRET=1, for tests. It declines decode shapes
whose widest fp32 dot would not fit in shared memory (MAX_DOT_BYTES) and training shapes whose
block or feature tiles the kernels cannot hold (hybrid_train.reasons); the torch path takes those.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import register
from .base import GQA, Backend, Capabilities, Problem, new_output
from .triton_backend import _IMPORT_ERROR, TRITON_DEVICES, TRITON_DTYPES, TritonEligibility

try:
    import triton

    from ..templates import hybrid_attn as kernels
    from . import hybrid_train

    _KERNEL_ERROR = None
except Exception as e:  # reported by unavailable_reason
    triton = kernels = hybrid_train = None
    _KERNEL_ERROR = _IMPORT_ERROR or f"templates.hybrid_attn unavailable ({type(e).__name__}: {e})"

EPS = 1e-6  # the clamp of each denominator term (the paper's reference implementation)


@dataclass(frozen=True)
class HybridProblem(Problem):
    block: int = 0  # block length of a decode or commit call (a fused kernel holds it); 0 otherwise
    num_features: int = 1  # F, feature_weight.shape[-1] (phi has 2F)
    train_block: int = 0  # min(block_size, n) of a training call; 0 otherwise


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# -- shared math ------------------------------------------------------------------------------


def _phi(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (B, H, ..., D), w (H, D, F) -> (phi (..., 2F), softmax(u), softmax(-u))."""
    u = torch.einsum("bh...d,hdf->bh...f", x, w)
    pos, neg = torch.softmax(u, dim=-1), torch.softmax(-u, dim=-1)
    return torch.cat([pos, neg], dim=-1), pos, neg


def _phi_bwd(x, w, pos, neg, dphi):
    """Gradients of phi(x) = [softmax(xW), softmax(-xW)] given dphi: (dx, dW)."""
    f = pos.shape[-1]
    dp, dn = dphi[..., :f], dphi[..., f:]
    du = pos * (dp - (dp * pos).sum(-1, keepdim=True)) - neg * (dn - (dn * neg).sum(-1, keepdim=True))
    dx = torch.einsum("bh...f,hdf->bh...d", du, w)
    dw = torch.einsum("bh...d,bh...f->hdf", x, du)
    return dx, dw


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, Hkv, ...) -> (B, H, ...): query head h reads kv head h // (H / Hkv)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_groups(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, ...) -> (B, Hkv, ...): the gradient of ``_expand_heads``."""
    b, h = x.shape[:2]
    return x.reshape(b, kv_heads, h // kv_heads, *x.shape[2:]).sum(2)


def _blocks(x: torch.Tensor, nb: int, bs: int, dtype) -> torch.Tensor:
    """(B, 2n, h, D) -> (B, h, 2, nb, bs, D) in ``dtype``, each half zero-padded to nb * bs."""
    b, s, h, d = x.shape
    n = s // 2
    x = x.to(dtype).reshape(b, 2, n, h, d)
    if nb * bs > n:
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, nb * bs - n))
    return x.reshape(b, 2, nb, bs, h, d).permute(0, 4, 1, 2, 3, 5)


def _unblock(x: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of ``_blocks``: (B, h, 2, nb, bs, D) -> (B, 2n, h, D)."""
    b, h, _, nb, bs, d = x.shape
    x = x.permute(0, 2, 3, 4, 1, 5).reshape(b, 2, nb * bs, h, d)[:, :, :n]
    return x.reshape(b, 2 * n, h, d)


def _exclusive_cumsum(x: torch.Tensor, dim: int, reverse: bool = False) -> torch.Tensor:
    """sum over c < b (reverse: c > b) along ``dim``; a shifted cumsum, no subtraction (exact)."""
    if reverse:
        return _exclusive_cumsum(x.flip(dim), dim).flip(dim)
    c = torch.cumsum(x.narrow(dim, 0, x.shape[dim] - 1), dim=dim)
    return torch.cat([torch.zeros_like(x.narrow(dim, 0, 1)), c], dim=dim)


class _Fwd:
    """Forward intermediates of blocked queries qb (B, H, ..., bs, D) against keys kb, vb of the same
    blocks (key_ok masks padded keys) and states s (B, H, ..., 2F, D), z (B, H, ..., 2F)."""

    def __init__(self, qb, kb, vb, key_ok, s, z, w, gate, scale):
        self.qb, self.kb, self.vb, self.s, self.z, self.w = qb, kb, vb, s, z, w
        gv = torch.sigmoid(gate.to(qb.dtype)).reshape((1, -1) + (1,) * (qb.dim() - 3))
        self.gv = gv  # (1, H, 1...): broadcasts over (B, H, ..., bs)
        scores = (qb @ kb.transpose(-1, -2)) * scale
        if key_ok is not None:
            scores = scores.masked_fill(~key_ok, float("-inf"))
        self.scores = scores
        self.m = scores.amax(dim=-1, keepdim=True)
        self.a = torch.exp(scores - self.m)
        self.l = self.a.sum(-1)
        self.o_loc = self.a @ vb
        self.phi_q, self.pos_q, self.neg_q = _phi(qb, w)
        self.lin = (self.phi_q * z.unsqueeze(-2)).sum(-1)
        self.wl = gv * self.l
        self.den = torch.clamp(self.wl, min=EPS) + torch.clamp(self.lin, min=EPS)
        self.out = (gv[..., None] * self.o_loc + self.phi_q @ s) / self.den[..., None]

    def backward(self, dout, scale):
        """Gradients w.r.t. qb, kb, vb, s, z, w (H, D, F) and the gate's pre-activation (H,)."""
        gv = self.gv
        dnum = dout / self.den[..., None]
        dden = -(dout * self.out).sum(-1) / self.den
        dwl = dden * (self.wl >= EPS)  # torch.clamp passes the gradient at the bound too
        dlin = dden * (self.lin >= EPS)
        reduce = [d for d in range(dout.dim() - 1) if d != 1]
        dgv = (dnum * self.o_loc).sum(-1) + dwl * self.l
        dgate = dgv.sum(dim=reduce) * gv.flatten() * (1 - gv.flatten())
        do_loc = gv[..., None] * dnum
        da = do_loc @ self.vb.transpose(-1, -2) + (gv * dwl)[..., None]
        dvb = self.a.transpose(-1, -2) @ do_loc
        t = self.a * da
        ties = (self.scores == self.m).to(t.dtype)
        ds = t - ties / ties.sum(-1, keepdim=True) * t.sum(-1, keepdim=True)
        dqb = (ds @ self.kb) * scale
        dkb = (ds.transpose(-1, -2) @ self.qb) * scale
        dphi_q = dnum @ self.s.transpose(-1, -2) + dlin[..., None] * self.z.unsqueeze(-2)
        ds_state = self.phi_q.transpose(-1, -2) @ dnum
        dz_state = (self.phi_q * dlin[..., None]).sum(-2)
        dq_phi, dw = _phi_bwd(self.qb, self.w, self.pos_q, self.neg_q, dphi_q)
        return dqb + dq_phi, dkb, dvb, ds_state, dz_state, dw, dgate


# -- torch ------------------------------------------------------------------------------------


class HybridTorchBackend(Backend):
    name = "torch"
    family = "hybrid"
    priority = 0
    capabilities = Capabilities(
        device_types=None,
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        max_head_dim=256,
        head_dim_multiple=8,
        features=frozenset({GQA}),
    )

    def decode(self, q, k, v, state_s, state_z, feature_weight, gate, scale):
        cd = compute_dtype(q.dtype)
        heads = q.shape[2]
        qb = q.to(cd).transpose(1, 2)  # (B, H, bs, D)
        kb = _expand_heads(k.to(cd).transpose(1, 2), heads)
        vb = _expand_heads(v.to(cd).transpose(1, 2), heads)
        fwd = _Fwd(qb, kb, vb, None, state_s.to(cd), state_z.to(cd), feature_weight.to(cd), gate,
                   scale)
        out = new_output(q, q.shape)
        out.copy_(fwd.out.transpose(1, 2))
        return out

    def state_update(self, state_s, state_z, k, v, feature_weight):
        heads = state_s.shape[1]
        cd = state_s.dtype
        kb = _expand_heads(k.to(cd).transpose(1, 2), heads)
        vb = _expand_heads(v.to(cd).transpose(1, 2), heads)
        phi_k = _phi(kb, feature_weight.to(cd))[0]
        new_s, new_z = new_output(state_s, state_s.shape), new_output(state_z, state_z.shape)
        torch.add(state_s, phi_k.transpose(-1, -2) @ vb, out=new_s)
        torch.add(state_z, phi_k.sum(-2), out=new_z)
        return new_s, new_z

    @staticmethod
    def _train(q, k, v, feature_weight, gate, block_size, scale):
        """The blocked forward: (_Fwd, phi(k) pieces, blocked clean keys/values, key mask)."""
        cd = compute_dtype(q.dtype)
        b, s2, heads, _ = q.shape
        n = s2 // 2
        bs = min(block_size, n)  # block_size > n: one block per half
        nb = -(-n // bs)
        w = feature_weight.to(cd)
        qb = _blocks(q, nb, bs, cd)
        kb = _expand_heads(_blocks(k, nb, bs, cd), heads)
        vb = _expand_heads(_blocks(v, nb, bs, cd), heads)
        key_ok = (torch.arange(nb * bs, device=q.device) < n).reshape(nb, bs)  # padding of the last block
        kc, vc = kb[:, :, 1], vb[:, :, 1]  # clean blocks (B, H, nb, bs, D) build the state
        phi_k, pos_k, neg_k = _phi(kc, w)
        phi_k = phi_k * key_ok[..., None]
        s_blk = _exclusive_cumsum(phi_k.transpose(-1, -2) @ vc, dim=2)  # (B, H, nb, 2F, D)
        z_blk = _exclusive_cumsum(phi_k.sum(-2), dim=2)  # (B, H, nb, 2F)
        fwd = _Fwd(qb, kb, vb, key_ok[:, None, :], s_blk[:, :, None], z_blk[:, :, None], w, gate,
                   scale)  # the state broadcasts over the two halves (dim 2)
        return fwd, (phi_k, pos_k, neg_k, kc, vc, key_ok), n

    def train_fwd(self, q, k, v, feature_weight, gate, block_size, scale):
        out = new_output(q, q.shape)
        if q.shape[1]:
            fwd, _, n = self._train(q, k, v, feature_weight, gate, block_size, scale)
            out.copy_(_unblock(fwd.out, n))
        return out

    def train_bwd(self, dout, q, k, v, feature_weight, gate, block_size, scale):
        grads = [new_output(t, t.shape) for t in (q, k, v, feature_weight, gate)]
        if not q.shape[1]:
            return tuple(g.zero_() for g in grads)
        cd = compute_dtype(q.dtype)
        fwd, (phi_k, pos_k, neg_k, kc, vc, key_ok), n = self._train(
            q, k, v, feature_weight, gate, block_size, scale)
        nb, bs = key_ok.shape
        dqb, dkb, dvb, ds_blk, dz_blk, dw, dgate = fwd.backward(_blocks(dout, nb, bs, cd), scale)
        # S_b and Z_b feed both halves of block b; U_c reaches every later block b > c.
        du = _exclusive_cumsum(ds_blk.sum(2), dim=2, reverse=True)  # (B, H, nb, 2F, D)
        dz = _exclusive_cumsum(dz_blk.sum(2), dim=2, reverse=True)  # (B, H, nb, 2F)
        dphi_k = (vc @ du.transpose(-1, -2) + dz.unsqueeze(-2)) * key_ok[..., None]
        dvb[:, :, 1] += phi_k @ du
        dk_phi, dw_k = _phi_bwd(kc, fwd.w, pos_k, neg_k, dphi_k)
        dkb[:, :, 1] += dk_phi
        kv_heads = k.shape[2]
        for g, x in zip(grads, (_unblock(dqb, n), _unblock(_sum_groups(dkb, kv_heads), n),
                                _unblock(_sum_groups(dvb, kv_heads), n), dw + dw_k, dgate)):
            g.copy_(x)
        return tuple(grads)


# -- triton -----------------------------------------------------------------------------------

MAX_TRITON_BLOCK = 128  # queries = keys of one active block, held whole by one program
# The widest dot's two fp32 operands (q @ W: (bs + F) x D, or phi @ S: F x (bs + D), padded to
# powers of two) must sit in shared memory at once; 96 KB leaves room on every sm80+ GPU (sm80
# 164 KB, sm86/89 100 KB, sm90 228 KB). bs=32, F=64, D=128 needs 48 KB.
MAX_DOT_BYTES = 96 * 1024


def _pow2(x: int) -> int:
    return max(16, 1 << (max(x, 1) - 1).bit_length())


def decode_dot_bytes(block: int, head_dim: int, features: int) -> int:
    """Shared memory of the decode kernel's widest fp32 dot (see MAX_DOT_BYTES)."""
    s, d, f = _pow2(block), _pow2(head_dim), _pow2(features)
    return 4 * max((s + f) * d, f * (s + d), s * (s + d), s * (f + d))


class HybridTritonBackend(TritonEligibility, HybridTorchBackend):
    name = "triton"
    capabilities = Capabilities(
        device_types=TRITON_DEVICES,
        dtypes=TRITON_DTYPES,
        max_head_dim=256,
        head_dim_multiple=8,
        features=frozenset({GQA}),
    )

    def unavailable_reason(self) -> str | None:
        return _KERNEL_ERROR

    def not_supported_reasons(self, problem):
        reasons = super().not_supported_reasons(problem)  # TritonEligibility's, then the family's
        if isinstance(problem, HybridProblem) and problem.block:  # a decode call
            if problem.block > MAX_TRITON_BLOCK:
                reasons.append(f"active block of {problem.block} tokens > {MAX_TRITON_BLOCK}")
            need = decode_dot_bytes(problem.block, problem.head_dim, problem.num_features)
            if need > MAX_DOT_BYTES:
                reasons.append(f"block {problem.block}, F {problem.num_features}, head_dim "
                               f"{problem.head_dim} need {need // 1024} KB of shared memory for one "
                               f"fp32 dot, > {MAX_DOT_BYTES // 1024} KB")
        if isinstance(problem, HybridProblem) and problem.train_block and hybrid_train is not None:
            reasons += hybrid_train.reasons(problem.train_block, problem.head_dim,
                                            problem.num_features, problem.device_type)
        if problem.device_type == "cuda" and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            if (major, minor) < (8, 0):
                reasons.append(f"needs compute capability >= 8.0, this GPU has {major}.{minor}")
        return reasons

    def decode(self, q, k, v, state_s, state_z, feature_weight, gate, scale):
        b, bs, h, d = q.shape
        f = feature_weight.shape[-1]
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        state_s, state_z = state_s.contiguous(), state_z.contiguous()
        feature_weight, gate = feature_weight.contiguous(), gate.contiguous()
        out = new_output(q, q.shape)
        if b * h * bs:
            block_s = max(16, triton.next_power_of_2(bs))
            block_d = max(16, triton.next_power_of_2(d))
            block_f = max(16, triton.next_power_of_2(f))
            # 8 warps once the two (F, D) state halves pass 64 KB of registers (F=64, D=128).
            warps = 8 if block_f * block_d >= 64 * 128 else 4
            kernels.hybrid_decode_kernel[(b * h,)](
                q, k, v, out, state_s, state_z, feature_weight, gate,
                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
                h, h // k.shape[2], bs, f, scale, EPS,
                D=d, BLOCK_S=block_s, BLOCK_D=block_d, BLOCK_F=block_f,
                IEEE=q.dtype == torch.float32, num_warps=warps)
        return out

    def train_fwd(self, q, k, v, feature_weight, gate, block_size, scale):
        return hybrid_train.train_fwd(q, k, v, feature_weight, gate, block_size, scale, EPS)

    def train_bwd(self, dout, q, k, v, feature_weight, gate, block_size, scale):
        return hybrid_train.train_bwd(dout, q, k, v, feature_weight, gate, block_size, scale, EPS)

    def state_update(self, state_s, state_z, k, v, feature_weight):
        b, bs, hkv, d = k.shape
        h, f = state_s.shape[1], feature_weight.shape[-1]
        k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
        state_s, state_z, feature_weight = (t.contiguous() for t in (state_s, state_z,
                                                                      feature_weight))
        new_s, new_z = new_output(state_s, state_s.shape), new_output(state_z, state_z.shape)
        if not bs:  # an empty block commits nothing
            return new_s.copy_(state_s), new_z.copy_(state_z)
        if b * h:
            block_d, block_f = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(f))
            kernels.hybrid_state_update_kernel[(b * h,)](
                state_s, state_z, k, v, feature_weight, new_s, new_z,
                k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                h, h // hkv, bs, f,
                D=d, BLOCK_S=max(16, triton.next_power_of_2(bs)), BLOCK_D=block_d,
                BLOCK_F=block_f, IEEE=k.dtype == torch.float32,
                num_warps=8 if block_f * block_d >= 64 * 128 else 4)
        return new_s, new_z


register(HybridTritonBackend())
register(HybridTorchBackend())
