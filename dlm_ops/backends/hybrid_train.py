"""Launchers of the fused training kernels of block-hybrid attention (templates/hybrid_train.py has
the design and the notation), called by ``HybridTritonBackend.train_fwd/train_bwd``.

Shapes the kernels decline (``reasons``) run the torch path instead:
  * blocks longer than MAX_TRAIN_BLOCK: a block is one tile, its (bs x bs) scores and four
    (bs x D) tiles live next to the state;
  * a state of more than MAX_STATE fp32 per sign: the walks keep S (or dU) as two (F x D) fp32
    register tiles, 64 KB at F=64, D=128, i.e. 64 of the 255 registers per thread at 8 warps;
    F=64 with D=256 would double it and spill (the sm90 compile check in the tests says how many
    registers each kernel takes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..templates import hybrid_train as kernels
from .base import new_output

MAX_TRAIN_BLOCK = 64
MAX_STATE = 64 * 128  # BLOCK_F * BLOCK_D
SMALL_BLOCK_TILE = 32  # blocks of <= 8 tokens are packed R = 32 // bs to a tile
INTERPRET_SMS = 4  # "SMs" under the interpreter: small test problems then take several chunks
CHUNK_TILES = None  # tests force tiles per chunk here; None picks (see ``geometry``)
CHUNK_ROWS = 32  # tokens per step of the chunk-sum kernel


def _pow2(x: int) -> int:
    return max(16, 1 << (max(x, 1) - 1).bit_length())


def reasons(block: int, head_dim: int, features: int) -> list[str]:
    """Why the training kernels cannot take a (block = min(block_size, n), D, F) problem."""
    out = []
    if block > MAX_TRAIN_BLOCK:
        out.append(f"training block of {block} tokens > {MAX_TRAIN_BLOCK} (one tile per block)")
    if _pow2(features) * _pow2(head_dim) > MAX_STATE:
        out.append(f"training state F x D = {features} x {head_dim} (padded {_pow2(features)} x "
                   f"{_pow2(head_dim)}) > {MAX_STATE} fp32 per sign held in registers")
    return out


@dataclass(frozen=True)
class Geometry:
    n: int  # tokens per half
    bs: int  # block length, min(block_size, n)
    block_t: int  # rows of a tile (power of two)
    tile_len: int  # tokens of a tile: R whole blocks
    num_tiles: int
    chunk_tiles: int  # tiles walked by one program
    chunks: int

    @property
    def multi(self) -> bool:
        return self.tile_len > self.bs


def geometry(n: int, block_size: int, programs: int, sms: int) -> Geometry:
    """Tiles and chunks of a call. Chunks: a program per (b, h, chunk) keeps ~255 registers per
    thread at 8 warps, so one fits an SM; B*H >= SMs is one wave already (one chunk, no prefix
    pass), fewer heads split the sequence into sms // (B*H) chunks to fill that wave."""
    bs = min(block_size, n)
    if bs <= 8:
        block_t = SMALL_BLOCK_TILE
        tile_len = bs * (block_t // bs)
    else:
        block_t, tile_len = _pow2(bs), bs
    num_tiles = -(-n // tile_len)
    want = CHUNK_TILES or -(-num_tiles // max(1, min(num_tiles, sms // max(programs, 1))))
    chunk_tiles = max(1, min(want, num_tiles))
    return Geometry(n, bs, block_t, tile_len, num_tiles, chunk_tiles, -(-num_tiles // chunk_tiles))


def _sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRET_SMS


def _warps(block_f: int, block_d: int) -> int:
    return 8 if block_f * block_d >= 64 * 128 else 4


def _exclusive(x: torch.Tensor, reverse: bool) -> torch.Tensor:
    """Sum over the chunks before (reverse: after) each chunk, along dim 2; a shifted cumsum."""
    if reverse:
        return _exclusive(x.flip(2), False).flip(2)
    out = torch.zeros_like(x)
    torch.cumsum(x[:, :, :-1], dim=2, out=out[:, :, 1:])
    return out


def _chunk_states(x, y, w32, rs, zc, first_half, halves, geo, heads, reverse):
    """Exclusive (reverse: suffix) prefix over chunks of the chunk sums of phi(x)^T (y * rs):
    ((B, H, nC, 2F, D), (B, H, nC, 2F)) fp32 (see hybrid_chunk_state_kernel)."""
    b, _, _, d = x.shape
    f = w32.shape[-1]
    s = new_output(x, (b, heads, geo.chunks, 2 * f, d), torch.float32)
    z = new_output(x, (b, heads, geo.chunks, 2 * f), torch.float32)
    block_d, block_f = _pow2(d), _pow2(f)
    kernels.hybrid_chunk_state_kernel[(b * heads, geo.chunks)](
        x, y, w32, w32 if rs is None else rs, w32 if zc is None else zc, s, z,
        x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2),
        heads, heads // x.shape[2], heads // y.shape[2], geo.n, geo.chunk_tiles * geo.tile_len, f,
        D=d, BLOCK_N=CHUNK_ROWS, BLOCK_D=block_d, BLOCK_F=block_f, FIRST_HALF=first_half,
        NUM_HALVES=halves, HAS_RS=rs is not None, IEEE=x.dtype == torch.float32,
        num_warps=_warps(block_f, block_d))
    return _exclusive(s, reverse), _exclusive(z, reverse)


def _common(q, k, feature_weight, geo):
    b, _, h, d = q.shape
    f = feature_weight.shape[-1]
    return dict(H=h, G=h // k.shape[2], n=geo.n, bs=geo.bs, tile_len=geo.tile_len,
                chunk_tiles=geo.chunk_tiles, num_tiles=geo.num_tiles, F=f, D=d,
                BLOCK_T=geo.block_t, BLOCK_D=_pow2(d), BLOCK_F=_pow2(f), MULTI=geo.multi,
                HAS_S0=geo.chunks > 1, IEEE=q.dtype == torch.float32,
                num_warps=_warps(_pow2(f), _pow2(d)))


def _strides(*ts):
    return [s for t in ts for s in (t.stride(0), t.stride(1), t.stride(2))]


def _inputs(q, k, v, feature_weight, gate):
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return q, k, v, feature_weight.float().contiguous(), gate.contiguous()


def train_fwd(q, k, v, feature_weight, gate, block_size, scale, eps):
    out = new_output(q, q.shape)
    b, s2, h, _ = q.shape
    if not b * h * s2:
        return out
    q, k, v, w32, gate = _inputs(q, k, v, feature_weight, gate)
    geo = geometry(s2 // 2, block_size, b * h, _sms(q.device))
    s0 = z0 = w32  # unread placeholders when there is a single chunk
    if geo.chunks > 1:
        s0, z0 = _chunk_states(k, v, w32, None, None, 1, 1, geo, h, reverse=False)
    kernels.hybrid_train_fwd_kernel[(b * h, geo.chunks)](
        q, k, v, out, w32, gate, s0, z0, *_strides(q, k, v, out), scale=scale, eps=eps,
        **_common(q, k, feature_weight, geo))
    return out


def train_bwd(dout, q, k, v, feature_weight, gate, block_size, scale, eps):
    b, s2, h, d = q.shape
    hkv, n, f = k.shape[2], s2 // 2, feature_weight.shape[-1]
    if not b * h * s2:
        return tuple(new_output(t, t.shape).zero_() for t in (q, k, v, feature_weight, gate))
    q, k, v, w32, gate = _inputs(q, k, v, feature_weight, gate)
    dout = dout.contiguous()
    geo = geometry(n, block_size, b * h, _sms(q.device))
    common = _common(q, k, feature_weight, geo)
    f32 = torch.float32
    dq = new_output(q, q.shape)  # contiguous (B, 2n, H, D), as the kernel indexes it
    dk, dv = (new_output(q, (b, s2, h, d), f32) for _ in range(2))  # per query head
    du_q, du_k = new_output(q, (b, s2, h, f), f32), new_output(q, (b, n, h, f), f32)
    rden, dlin = (new_output(q, (b, h, s2), f32) for _ in range(2))
    dgv = new_output(q, (b, h, geo.chunks), f32)

    s0 = z0 = du0 = dz0 = w32
    if geo.chunks > 1:
        s0, z0 = _chunk_states(k, v, w32, None, None, 1, 1, geo, h, reverse=False)
    kernels.hybrid_train_bwd_q_kernel[(b * h, geo.chunks)](
        q, k, v, dout, w32, gate, s0, z0, dq, dk, dv, du_q, rden, dlin, dgv,
        *_strides(q, k, v, dout), scale=scale, eps=eps, **common)
    if geo.chunks > 1:
        du0, dz0 = _chunk_states(q, dout, w32, rden, dlin, 0, 2, geo, h, reverse=True)
    kernels.hybrid_train_bwd_k_kernel[(b * h, geo.chunks)](
        q, k, v, dout, w32, du0, dz0, rden, dlin, dk, dv, du_k, *_strides(q, k, v, dout), **common)

    dw = _feature_grad(q, du_q, 0, s2, 1) + _feature_grad(k, du_k, n, n, h // hkv)
    sig = torch.sigmoid(gate.float())
    dgate = dgv.sum((0, 2)) * sig * (1 - sig)
    grads = (dq,
             dk.view(b, s2, hkv, h // hkv, d).sum(3).to(k.dtype),
             dv.view(b, s2, hkv, h // hkv, d).sum(3).to(v.dtype),
             dw.to(feature_weight.dtype), dgate.to(gate.dtype))
    return grads


def _feature_grad(x, du, row_off, seqlen, group):
    """sum over tokens of x^T du per query head: (H, D, F) fp32, split over tokens so that the
    H programs become a wave (hybrid_feature_grad_kernel)."""
    b, _, h, f = du.shape
    d = x.shape[-1]
    total, rows = b * seqlen, 64
    want = -(-2 * _sms(x.device) // h)  # two programs per SM: this kernel is light
    split_len = -(-total // (want * rows)) * rows
    splits = -(-total // split_len)
    parts = new_output(du, (splits, h, d, f))
    block_d, block_f = _pow2(d), _pow2(f)
    kernels.hybrid_feature_grad_kernel[(h, splits)](
        x, du, parts, x.stride(0), x.stride(1), x.stride(2), h, group, seqlen, row_off, total,
        split_len, f, D=d, BLOCK_N=rows, BLOCK_D=block_d, BLOCK_F=block_f,
        IEEE=x.dtype == torch.float32, num_warps=4)
    return parts.sum(0)
