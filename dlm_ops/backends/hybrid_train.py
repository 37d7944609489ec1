"""Launchers of the fused training kernels of block-hybrid attention (templates/hybrid_train.py has
the design and the notation), called by ``HybridTritonBackend.train_fwd/train_bwd``.

Shapes the kernels decline (``reasons``) run the torch path instead: blocks longer than
MAX_TRAIN_BLOCK (a block is one tile: its (bs x bs) scores and full-D (bs x D) tiles sit next to
the (bs x F) feature tiles), F above MAX_FEATURES or F x D above MAX_STATE (the kernels hold
several (rows, F) fp32 tiles; tests/hybrid_sm90_compile.py reports what each kernel takes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..templates import hybrid_train as kernels
from .base import new_output

MAX_TRAIN_BLOCK = 64
# On sm90 the 64-row tiles' bwd_q (blocks of 33-64 tokens) takes IEEE fp32 dots for its fp32
# operands instead of tf32x3: with tf32x3 it faulted on the H200 (triton 3.6, D = 128, F = 64,
# bs = 64 and 100; session 13's GPU tests), compute-sanitizer: "out-of-range shared or local
# address" at a tf32x3 tl.dot (session 14). With IEEE dots it is correct and a training step at
# block 64 runs 3.4x faster than the torch path (B=2, n=1024, H=8/2, D=128, F=64, bf16).
# 32-row tiles (mma.sync) run tf32x3 correctly at every GPU-test shape.
EXACT_BWD_Q_SM90_ROWS = 64
MAX_FEATURES = 64  # each (rows, F) fp32 tile costs F/2 registers per thread (launch_config)
MAX_STATE = 64 * 128  # BLOCK_F * BLOCK_D: the compiled and checked sizes (F=64/D=128, 32/256)
PACK_BLOCK, PACKED_ROWS = 16, 32  # blocks of <= 16 tokens are packed 32 // bs to a 32-row tile
# DS: the head-dim columns of the state per walk/scan program, and the step of the per-tile
# kernels' loops over D. sm90 spills per thread at bs=32, F=64, D=128 for DS = 16 / 32 / 64
# (before issue 6's bwd_q): fwd 0.4 / 1.6 / 0.2 KB, bwd_q 0.9 / 2.5 / 13 KB (a 32-register
# allocation), bwd_k 0.2 / 1.3 / 0.3 KB; bwd_q now 0.1 KB at 16. 16 costs the forward 8 programs
# per head that each recompute the (bs x bs) scores.
SLICE_D = 16
ROWS = 64  # tokens per program of the logits and dW kernels


def _pow2(x: int) -> int:
    return max(16, 1 << (max(x, 1) - 1).bit_length())


# On by default since they ran on the H200 (issue 6, benchmarks/results/hybrid_train_probe_h200.txt:
# correct on all ten GPU-test shapes, see EXACT_BWD_Q_SM90_ROWS; fwd + bwd 1.12-1.22x faster
# than the torch path at bs=32 and 2.55x at bs=4). DLM_OPS_HYBRID_TRAIN_TRITON=0 sends CUDA
# training back to the torch path.
OPT_IN = "DLM_OPS_HYBRID_TRAIN_TRITON"


def exact_bwd_q(device: torch.device, block_t: int) -> bool:
    """Whether bwd_q takes IEEE fp32 dots where it would take tf32x3 (EXACT_BWD_Q_SM90_ROWS)."""
    return (device.type == "cuda" and block_t >= EXACT_BWD_Q_SM90_ROWS
            and torch.cuda.get_device_capability(device)[0] == 9)


def reasons(block: int, head_dim: int, features: int, device_type: str = "cpu") -> list[str]:
    """Why the training kernels cannot take a (block = min(block_size, n), D, F) problem."""
    out = []
    if device_type == "cuda" and os.environ.get(OPT_IN) == "0":
        out.append(f"the fused training kernels are switched off ({OPT_IN}=0)")
    if block > MAX_TRAIN_BLOCK:
        out.append(f"training block of {block} tokens > {MAX_TRAIN_BLOCK} (one tile per block)")
    if features > MAX_FEATURES or _pow2(features) * _pow2(head_dim) > MAX_STATE:
        out.append(f"training F x D = {features} x {head_dim}: the kernels hold (rows, F) fp32 "
                   f"tiles and take F <= {MAX_FEATURES} and F x D <= {MAX_STATE} (padded "
                   f"{_pow2(features)} x {_pow2(head_dim)})")
    return out


@dataclass(frozen=True)
class Geometry:
    n: int  # tokens per half
    bs: int  # block length, min(block_size, n)
    block_t: int  # rows of a tile (power of two)
    tile_len: int  # tokens of a tile: R whole blocks
    num_tiles: int

    @property
    def multi(self) -> bool:
        return self.tile_len > self.bs


def geometry(n: int, block_size: int) -> Geometry:
    """Tiles of whole blocks. Packed tiles are 32 rows (mma.sync, operands in registers): at 64
    rows (wgmma) the packed bwd_q spilled 1.5-2.8 KB per thread, and under that pressure ptxas
    12.8 (triton 3.6) built a wgmma shared-memory descriptor from the stack pointer, the illegal
    shared read of issue 6 (tests/hybrid_sm90_compile.py checks the SASS for it); at 32 rows it
    spills about 1 KB and has no descriptors. Per-thread registers hardly depend on the rows: a
    chain of dots puts every warp along the rows, 16 rows each, so a (rows, 64) fp32 tile costs
    32 registers per thread at 32 or 64 rows; what 32 rows saves is the (rows x rows) tiles.
    Blocks of 17-32 tokens take one 32-row tile, 33-64 one 64-row tile."""
    bs = min(block_size, n)
    if bs <= PACK_BLOCK:
        block_t, tile_len = PACKED_ROWS, bs * (PACKED_ROWS // bs)
    else:
        block_t, tile_len = _pow2(bs), bs
    return Geometry(n, bs, block_t, tile_len, -(-n // tile_len))


# Warps per kernel role for an A/B on a GPU, e.g. DLM_OPS_HYBRID_TRAIN_WARPS="fwd=2,bwd_q=4".
_WARPS = dict(kv.split("=") for kv in os.environ.get("DLM_OPS_HYBRID_TRAIN_WARPS", "").split(",")
              if "=" in kv)


def launch_config(role: str, block_f: int, block_d: int) -> tuple[int, int]:
    """(num_warps, num_stages) of a kernel role ("logits", "fwd", "scan", "bwd_q", "bwd_k", "dW").

    From the sm90 compile (tests/hybrid_sm90_compile.py, triton 3.6, F=64, D=128, DS=32 at the
    time): 8 warps spilled least: fwd 1.6, bwd_q 2.5, bwd_k 1.3 KB per thread at bs=32 against
    1.9, 8.5, 1.4 KB at 4 warps; the scans, logits and dW kernels do not spill. With mma.sync
    (32-row tiles) a chain of dots puts every warp along the rows, so 8 warps on 32 rows repeat
    each product four times: 2 warps may still win on time; that is for
    DLM_OPS_HYBRID_TRAIN_WARPS and the H200 to decide. No loop is pipelined (num_stages=1): the
    loops are short and every stage costs shared memory."""
    if role in _WARPS:
        return int(_WARPS[role]), 1
    return (8 if block_f * block_d >= 64 * 128 else 4), 1


def _sizes(q, feature_weight):
    d, f = q.shape[-1], feature_weight.shape[-1]
    block_d, block_f = _pow2(d), _pow2(f)
    return d, f, block_d, block_f, min(block_d, SLICE_D)


def _inputs(q, k, v, feature_weight, gate):
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return q, k, v, feature_weight.float().contiguous(), gate.contiguous()


def _strides(*ts):
    return [s for t in ts for s in (t.stride(0), t.stride(1), t.stride(2))]


def _logits(x, w32, row_off, seqlen, heads):
    """u = x W_h for the rows [row_off, row_off + seqlen) of each sample: (B, seqlen, H, F) fp32."""
    b, d, f = x.shape[0], x.shape[-1], w32.shape[-1]
    u = new_output(x, (b, seqlen, heads, f), torch.float32)
    total = b * seqlen
    block_d, block_f = _pow2(d), _pow2(f)
    warps, stages = launch_config("logits", block_f, block_d)
    kernels.hybrid_logits_kernel[(-(-total // ROWS), heads)](
        x, w32, u, x.stride(0), x.stride(1), x.stride(2), heads, heads // x.shape[2], seqlen,
        row_off, total, f, D=d, BLOCK_N=ROWS, BLOCK_D=block_d, BLOCK_F=block_f,
        IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages)
    return u


def _scan(u, y, rs, zc, u_off, first_half, halves, reverse, geo, heads, f, block_f, ds, ieee):
    """Every tile's state before it (reverse: after it): (B, H, nt, 2F, D), (B, H, nt, 2F) fp32."""
    b, d = y.shape[0], y.shape[-1]
    s = new_output(u, (b, heads, geo.num_tiles, 2 * f, d))
    z = new_output(u, (b, heads, geo.num_tiles, 2 * f))
    warps, stages = launch_config("scan", block_f, _pow2(d))
    kernels.hybrid_scan_kernel[(b * heads, -(-d // ds))](
        u, y, u if rs is None else rs, u if zc is None else zc, s, z,
        y.stride(0), y.stride(1), y.stride(2), heads, heads // y.shape[2], geo.n, u_off,
        geo.tile_len, geo.num_tiles, f, BLOCK_T=geo.block_t, D=d, DS=ds, BLOCK_F=block_f,
        FIRST_HALF=first_half, NUM_HALVES=halves, REVERSE=reverse, HAS_RS=rs is not None,
        IEEE=ieee, num_warps=warps, num_stages=stages)
    return s, z


def train_fwd(q, k, v, feature_weight, gate, block_size, scale, eps):
    out = new_output(q, q.shape)
    b, s2, h, _ = q.shape
    if not b * h * s2:
        return out
    q, k, v, w32, gate = _inputs(q, k, v, feature_weight, gate)
    n = s2 // 2
    geo = geometry(n, block_size)
    d, f, block_d, block_f, ds = _sizes(q, feature_weight)
    u_q, u_k = _logits(q, w32, 0, s2, h), _logits(k, w32, n, n, h)
    warps, stages = launch_config("fwd", block_f, block_d)
    kernels.hybrid_train_fwd_kernel[(b * h, -(-d // ds))](
        q, k, v, out, u_q, u_k, gate, *_strides(q, k, v, out), h, h // k.shape[2], n, geo.bs,
        geo.tile_len, geo.num_tiles, f, scale, eps, D=d, BLOCK_T=geo.block_t, BLOCK_D=block_d,
        DS=ds, BLOCK_F=block_f, MULTI=geo.multi, IEEE=q.dtype == torch.float32,
        num_warps=warps, num_stages=stages)
    return out


def train_bwd(dout, q, k, v, feature_weight, gate, block_size, scale, eps):
    b, s2, h, _ = q.shape
    hkv, n = k.shape[2], s2 // 2
    if not b * h * s2:
        return tuple(new_output(t, t.shape).zero_() for t in (q, k, v, feature_weight, gate))
    q, k, v, w32, gate = _inputs(q, k, v, feature_weight, gate)
    dout = dout.contiguous()
    geo = geometry(n, block_size)
    d, f, block_d, block_f, ds = _sizes(q, feature_weight)
    ieee, f32, nt = q.dtype == torch.float32, torch.float32, geo.num_tiles
    u_q, u_k = _logits(q, w32, 0, s2, h), _logits(k, w32, n, n, h)
    s_st, z_st = _scan(u_k, v, None, None, n, 1, 1, False, geo, h, f, block_f, ds, ieee)

    dq = new_output(q, q.shape)  # contiguous (B, 2n, H, D), as the kernel indexes it
    dk, dv = (new_output(q, (b, s2, h, d), f32) for _ in range(2))  # per query head
    du_q, du_k = new_output(q, (b, s2, h, f), f32), new_output(q, (b, n, h, f), f32)
    rden, dlin = (new_output(q, (b, h, s2), f32) for _ in range(2))
    dgv = new_output(q, (b, h, nt, 2), f32)
    consts = dict(D=d, BLOCK_T=geo.block_t, DS=ds, BLOCK_F=block_f, MULTI=geo.multi, IEEE=ieee)
    warps, stages = launch_config("bwd_q", block_f, block_d)
    kernels.hybrid_train_bwd_q_kernel[(nt, b * h, 2)](
        q, k, v, dout, u_q, u_k, w32, gate, s_st, z_st, dq, dk, dv, du_q, rden, dlin, dgv,
        *_strides(q, k, v, dout), h, h // hkv, n, geo.bs, geo.tile_len, nt, f, scale, eps,
        BLOCK_D=block_d, num_warps=warps, num_stages=stages,
        **{**consts, "IEEE": ieee or exact_bwd_q(q.device, geo.block_t)})
    du_st, dz_st = _scan(u_q, dout, rden, dlin, 0, 0, 2, True, geo, h, f, block_f, ds, ieee)
    warps, stages = launch_config("bwd_k", block_f, block_d)
    kernels.hybrid_train_bwd_k_kernel[(nt, b * h)](
        v, dout, u_q, u_k, w32, du_st, dz_st, rden, dlin, dk, dv, du_k, *_strides(v, dout),
        h, h // hkv, n, geo.bs, geo.tile_len, nt, f, num_warps=warps, num_stages=stages, **consts)

    dw = _feature_grad(q, du_q, 0, s2, 1) + _feature_grad(k, du_k, n, n, h // hkv)
    sig = torch.sigmoid(gate.float())
    dgate = dgv.sum((0, 2, 3)) * sig * (1 - sig)
    return (dq,
            dk.view(b, s2, hkv, h // hkv, d).sum(3).to(k.dtype),
            dv.view(b, s2, hkv, h // hkv, d).sum(3).to(v.dtype),
            dw.to(feature_weight.dtype), dgate.to(gate.dtype))


def _sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _feature_grad(x, du, row_off, seqlen, group):
    """sum over tokens of x^T du per query head: (H, D, F) fp32, the tokens split so that the
    H programs become about two per SM (hybrid_feature_grad_kernel)."""
    b, _, h, f = du.shape
    d = x.shape[-1]
    total = b * seqlen
    want = -(-2 * _sms(x.device) // h)
    split_len = -(-total // (want * ROWS)) * ROWS
    splits = -(-total // split_len)
    parts = new_output(du, (splits, h, d, f))
    block_d, block_f = _pow2(d), _pow2(f)
    warps, stages = launch_config("dW", block_f, block_d)
    kernels.hybrid_feature_grad_kernel[(h, splits)](
        x, du, parts, x.stride(0), x.stride(1), x.stride(2), h, group, seqlen, row_off, total,
        split_len, f, D=d, BLOCK_N=ROWS, BLOCK_D=block_d, BLOCK_F=block_f,
        IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages)
    return parts.sum(0)
