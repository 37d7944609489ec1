"""The ``cutlass`` backend of the block-diffusion family: the Hopper kernels of
csrc/hopper/diffusion_fwd.cuh and diffusion_bwd.cuh (TMA, wgmma, a producer and two consumer
warpgroups), JIT-built on first use by ``cutlass.build``; everything else runs the Triton kernels
(this backend subclasses the Triton one).

Which kernel runs where is data (FORWARD_HEAD_DIMS, BACKWARD_HEAD_DIMS below): each CUTLASS kernel
runs for the head dims where it measured faster than Triton's on the H200: the forward and the
backward at D = 64 / 128 / 256. The
same split holds for batched calls (halves of any length, incl. block-causal with n_noisy 0: the
kernels' kBatchedStart, hopper/common.cuh) and for packed samples (``varlen_fwd`` /
``varlen_bwd``: the kStartVarlen instantiations, zero-length samples included). Both need sm90,
fp16/bf16, no softcap (declared capabilities: such calls select ``triton``) and, checked per call,
16-byte aligned rows for TMA; a call outside that runs Triton's kernel, counted in ``STATS`` per
direction and layout. (Were kBatchedStart flipped back to kStartTile, the extension says so
through ``batched_any_length`` and batched halves that are not multiples of 128 run Triton's
again.) The backward (preprocess, dK/dV per key tile, dQ per query tile: three kernels with
disjoint writes; at D = 128 and 256, batched on the 128 grid and packed at any lengths (batched
BD3 halves off the grid as packed samples), the dK/dV kernel also stores dS, which the dQ kernel
reads instead of recomputing it: DS_* below) is bitwise deterministic, batched and varlen, so
``deterministic=True`` takes it too.

The forward at D = 64 and 128 has a second kernel whose first visit of a noisy tile (its diagonal)
is half as wide where the block size divides 64 (NARROW_DIAG_* below), asked for where halves are
short; everywhere else the kernel without it runs.

Work tables (the CTA schedules, most expensive tile first) are built in C++ from dlm/geometry.h
and cached here: batched per (halves, block_size[, head dim], device), varlen per (cu_seqlens,
block_size, head dim, device), the host tuple of VarlenMask (no device sync), each entry one
host-to-device copy of the offsets and every kernel's (tile, sample) table. The forward's grid is
persistent (one CTA per SM); the backward's dK/dV kernel is the persistent one at D = 64, and at
D = 128 where halves are at most PERSISTENT_DKDV_MAX_HALF long (_GQA with grouped heads; varlen:
the longest sample's half). Batched calls with short halves (SHORT_HALF_MAX) walk the forward's
and the dS backward's dK/dV work slot-major (SHORT_HALF_ORDER), the rest in the plain order.

The build happens at the first call (one WARNING line; 27 translation units compiled in parallel
by ninja: 121 s on the H200 machine's 16 cores with 23 of them, before the D = 256 backward).
If it fails, the failure is remembered, reported by ``unavailable_reason`` (so ``python -m
dlm_ops`` shows it and dispatch picks Triton from then on) and warned once. Dispatch picks this
backend automatically wherever it can be built; ``DLM_OPS_CUTLASS=0`` opts out (no build, Triton
everywhere) and ``backend="cutlass"`` forces it. GPU tests: tests/test_gpu.py (test_cutlass_*),
torch-free harnesses in tests/cuda; results and versions in csrc/NOTES.md.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch

from ..geometry import SequenceMask
from . import base, cutlass, register
from .cutlass import sm_count as _sm_count
from .base import DETERMINISTIC, GQA, VARLEN, Capabilities, new_output
from .triton_backend import TritonBackend

SOURCES = [
    "bindings/diffusion_sm90.cpp",
    "bindings/diffusion_fwd_sm90.cu",
    "bindings/diffusion_bwd_sm90.cu",
    "bindings/diffusion_autograd_sm90.cpp",
] + [f"hopper/diffusion_{d}{layout}_{t}_d{h}.cu"
     for d, dims in (("fwd", (64, 128, 256)), ("bwd", (64, 128, 256)))
     for layout in ("", "_varlen")  # batched, packed samples: one instantiation per unit
     for t in ("bf16", "fp16") for h in dims]
# The kernels' largest tile. Batched halves must be multiples of it only where the extension says
# it was built with tiles on tile boundaries (batched_any_length false: kBatchedStart kStartTile).
TILE = 128
# CUTLASS calls run, and calls handed to Triton, per direction and layout
STATS = {"fwd": 0, "fwd_fallback": 0, "bwd": 0, "bwd_fallback": 0, "bwd_ds": 0,
         "varlen_fwd": 0, "varlen_fwd_fallback": 0, "varlen_bwd": 0, "varlen_bwd_fallback": 0,
         "varlen_bwd_ds": 0, "bwd_ds_packed": 0}

_EXT = None
_BUILD_ERROR: str | None = None


def _extension():
    """The built extension (built on the first call), or None after a failed build."""
    global _EXT, _BUILD_ERROR
    if _EXT is None and _BUILD_ERROR is None:
        _EXT, _BUILD_ERROR = cutlass.build_or_reason("dlm_diffusion_sm90", SOURCES)
    return _EXT


@lru_cache(maxsize=64)
def _tile_order(n_noisy: int, n_clean: int, block_size: int, head_dim: int,
                device: str) -> torch.Tensor:
    return _EXT.tile_order(n_noisy, n_clean, block_size, head_dim).to(device)


# Which head dims run which CUTLASS kernel; the rest run Triton's. Measured on the H200 through torch
# in one process (bf16, H=16, 16K tokens, csrc/NOTES.md): the CUTLASS backward beats Triton's (n = 1K:
# 210 vs 180 TFLOPS, n = 8K: 388 vs 283); the forward v5 does at D = 128 (287 vs 256, 542 vs 376) and
# D = 256 (n = 2K: 439 vs 243). At D = 64 v5 lost (n = 2K: 257 vs 292); since v6's TMA-store
# epilogue and the snake walk it is level and the step with it faster (session 10, n = 2K, main
# preset's D = 64 case: forward 286 vs 281, step 195 vs 177 with Triton's forward; other lengths
# not measured). The D = 256 backward (session 12: role-split dK/dV, key-split dQ): 268 TFLOPS
# against Triton's 104 through torch (main preset, n = 2K; the step 288 against 125). The kernels
# cover every head dim listed in SUPPORTED_HEAD_DIMS.
SUPPORTED_HEAD_DIMS = {"fwd": (64, 128, 256), "bwd": (64, 128, 256)}
FORWARD_HEAD_DIMS = (64, 128, 256)
BACKWARD_HEAD_DIMS = (64, 128, 256)

# The backward's dK/dV kernel: the persistent one (two K / V buffers, TMA-store epilogue, snake
# walk; DkDvPersistent in diffusion_bwd.cuh, D = 64 / 128) when every half is at most this long,
# else one CTA per key tile. Harness `persistent` (session 9, bf16 D = 128, 16K tokens), the whole
# backward against one CTA per tile: 1.07x / 1.10x at n = 1K (block 16 / 4), 1.03x at 2K, 0.91x at
# 4K, 0.93x at 8K, 0.90x for GQA 32/8 at 2K. D = 64 (session 10, `persistent64`): 1.055x / 1.058x
# at 1K, 1.01x at 2K, 0.97x at 4K, 0.91x at 8K, 0.94x GQA. Through torch (session 13, the op's
# backward, 10 interleaved rounds, B = 4, n = 2K): 1.067x / 1.054x (block 16 / 4; the step 1.020x /
# 1.025x), GQA 32/8 0.980x, D = 64 1.009x; hence 2048 for one query head per K / V head and 1024
# (_GQA) where a group of query heads shares them. Since session 19 the D = 64 kernels visit
# 128-query tiles (diffusion_bwd.cuh bwd_block_m), where the persistent one wins at every length
# (harness `bm128-64`, the whole backward against one CTA per tile: 1.09 / 1.04 / 1.04 / 1.01x at
# n = 1K-8K, GQA 32/8 1.01x): PERSISTENT_DKDV_EVERY_LENGTH, still off with
# PERSISTENT_DKDV_MAX_HALF = 0.
PERSISTENT_DKDV_MAX_HALF = 2048
PERSISTENT_DKDV_MAX_HALF_GQA = 1024
PERSISTENT_DKDV_HEAD_DIMS = (64, 128)
PERSISTENT_DKDV_EVERY_LENGTH = (64,)

# The backward with dS through HBM (csrc/hopper/bwd_dq_from_ds.cuh, diffusion_bwd.cuh
# launch_bwd_ds; csrc/NOTES.md "Session 18"): the dK/dV kernel also writes each visited tile's dS^T
# (2 bytes per pair of a visited 64-query x key tile: 128 keys at D = 128, 64 at D = 256) to a
# scratch buffer and the dQ kernel reads it back instead of recomputing S and dP: 5 matmuls per
# tile pair instead of 7 (6 instead of 8 at D = 256, whose dK/dV kernel computes S^T twice),
# deterministic (every block written by one CTA, no atomics). Batched calls at the head dims of
# DS_HEAD_DIMS whose extension has it (ext.ds_block(d) > 0: D = 128, 256) with both halves
# multiples of DS_HALF_MULTIPLE (the dQ kernel's 128-row tiles start at tile multiples), and (session 24,
# kStartVarlen instantiations) packed samples of any lengths, whose slot table lists each sample's
# rows (ext.varlen_ds_slots), while the scratch, 1 + B * H * visits blocks of ext.ds_block(d)
# elements, stays within DS_SCRATCH_MAX_BYTES (0 turns the path off). Batched BD3 calls with halves
# off the 128 grid run that packed path over their B equal samples (_bwd_packed); block-causal ones
# off the grid run the two-kernel backward.
# Harness `ds` (bf16, D = 128, 16K tokens, H = 16, session 18): the whole backward 1.12-1.17x the
# two-kernel one's (its faster dK/dV kernel per shape) at n = 1K-8K, block 4 / 16 and GQA 32/8; the
# scratch is then 0.34 GB at n = 1K and 2.2 GB at n = 8K (about a quarter of S x S x H x 2 bytes).
# The bound is 8 GiB since session 19: at 4 GiB GQA 32/8 at n = 8K (4.4 GB) ran the two-kernel
# backward, which harness `ds-rule` measured 1.05x slower (the caching allocator keeps the block
# for the next layer's backward: one scratch per step, not one per layer).
# Not at D = 64: its dS kernels (64-query dS^T blocks of 128 keys, as at D = 128; harness `ds64`)
# ran the backward 0.79-0.87x the two-kernel one, whose dK/dV kernel visits 128-query tiles, at
# n = 1K-8K (session 43, H100: the dK/dV kernel with the dS store 1.5x slower, the dQ-from-dS one
# only 1.1-1.35x faster), so the extension does not build them.
DS_HEAD_DIMS = (128, 256)
DS_HALF_MULTIPLE = 128
DS_QUERY_TILE = 64  # queries per dS^T block: the dK/dV kernel's query tile
DS_SCRATCH_MAX_BYTES = 8 << 30


# The forward's grid: one CTA per SM walking its work items in a snake (hopper/common.cuh
# snake_item; the next item's Q and K/V load while this one's last P V and stores run), at every
# length and head dim. Forward v5 (session 5) was persistent only up to halves of 2048: long halves
# balanced worse under a round-robin that gave CTA 0 the dearest item of every round than under the
# hardware's CTA scheduler (-3.7 % at n = 8K). With the snake, persistent everywhere against one
# CTA per query tile above 2048 (harness `snake` / `snake64` / `snake256`, bf16, 16K tokens, block
# size 16 and 4): D = 128 +7 % at n = 4K, +3.4 % at 8K (session 9); D = 64 +6.5 % at 4K, +3.1 % at
# 8K; D = 256 +3 % at 4K, +1 % at 8K (session 13); the same grid, 1.00x, at n <= 2K.
def _max_ctas(device: torch.device) -> int:
    """The forward's grid bound: the SM count (persistent; the launcher takes fewer CTAs when there
    are fewer work items)."""
    return _sm_count(device)


# The persistent dK/dV kernel's walk over batched work: a balanced schedule built on the host
# (dlm/geometry.h order_schedule: each item, most expensive first, to the CTA with the least
# work so far) instead of the snake. Counted in pairs plus a fixed cost per item, the snake's
# busiest CTA gets 3.1 % more than the mean work at n <= 2K (16K tokens, 132 CTAs), the
# schedule's 0.5-1.3 % (tests/test_csrc_geometry.py). Harness `sched` (session 20, bf16, 16K
# tokens, 8 rounds in alternating order, medians; the snake's A/A arm 0.99-1.01x): the whole
# backward 1.007 / 1.010 / 1.002 / 1.004x at n = 1K-8K, 1.008x block 4, 1.024x GQA 32/8 (D = 128,
# the dS backward); D = 64 1.000-1.011x. The forward's walk measured 0.98-1.02x and stays the
# snake. False: the snake everywhere.
BALANCED_SCHEDULE = True


@lru_cache(maxsize=64)
def _dkdv_schedule(n_noisy: int, n_clean: int, block_size: int, head_dim: int, slots: int, group: int,
                   ctas: int, walk: tuple[int, int], device: str) -> torch.Tensor:
    return _EXT.dkdv_schedule(n_noisy, n_clean, block_size, head_dim, slots, group, ctas, *walk).to(device)


# Packed samples' persistent dK/dV kernel walks a balanced schedule too (dlm/geometry.h
# varlen_walk / walk_schedule), handed out slot-major by (sample, head) where a batched call of
# those halves would walk slot-major (_walk), in the plain order otherwise; the kernel decodes the
# plain order either way. Until session 37 packings walked the snake over the plain order: ncu read
# the dK/dV kernel's DRAM traffic at 8 x 1K 792 MB packed against 430 MB batched. Session 37
# (benchmarks.packed_bwd_kernels, H200, bf16, D = 128, 16K tokens): the kernel 1.138 -> 1.108x the
# batched one's time at 8 x 1K, 1.145 -> 1.121x at 2 x 4K (the plain order's schedule 1.121 /
# 1.123x), a mixed packing of 9 samples 1.005x the snake (level); gradients bitwise the snake's.
@lru_cache(maxsize=64)
def _varlen_dkdv_schedule(cu_seqlens: tuple[int, ...], block_size: int, head_dim: int, slots: int, group: int,
                          ctas: int, block: int, device: str) -> torch.Tensor:
    return _EXT.varlen_dkdv_schedule(list(cu_seqlens), block_size, head_dim, slots, group, ctas,
                                     block).to(device)


# The dS backward's dQ kernel walks a balanced schedule too, of its own walk (L2 chunks of (batch,
# head) slots in 4-wave blocks of entries: hopper/diffusion_bwd.cuh ds_dq_work_order), where it
# walked the snake until session 47. That walk is not most expensive first as a whole (each chunk
# restarts at the dearest tiles), so the schedule hands its last rounds out most expensive first
# (dlm/geometry.h balanced_schedule's tail_rounds; kDsDqScheduleTailRounds). Counted as
# order_schedule counts work (tests/test_csrc_geometry.py, H200's L2): the snake's busiest CTA gets
# 2-4 % more than the mean at D = 128 and 5-20 % at D = 256, the schedule's at most 1.2 %. Harness
# `dq-sched` (session 47, H100, bf16, 16K tokens, two runs, benchmarks/results/h100_dq_sched_s47.txt;
# speed against the snake, whose A/A arm read 0.98-1.02x): the dQ kernel 1.004-1.015x at D = 128
# n = 1K-8K (the whole backward level, 0.994-1.017x), 1.04 / 1.15 / 1.14x at D = 256 n = 1K / 2K /
# 8K (the backward 1.007 / 1.018-1.040 / 1.016-1.018x); GQA 32/8 level (D = 256's dQ kernel
# 0.993-0.995x). Gradients bitwise the snake's (test_gpu). False: the snake.
DQ_SCHEDULE = True


@lru_cache(maxsize=64)
def _ds_dq_schedule(n_noisy: int, n_clean: int, block_size: int, head_dim: int, batch: int, heads: int,
                    kv_heads: int, ctas: int, device: str) -> torch.Tensor:
    return _EXT.ds_dq_schedule(n_noisy, n_clean, block_size, head_dim, batch, heads, kv_heads, ctas,
                               _index(device)).to(device)


@lru_cache(maxsize=64)
def _varlen_ds_dq_schedule(cu_seqlens: tuple[int, ...], block_size: int, head_dim: int, heads: int, kv_heads: int,
                           ctas: int, device: str) -> torch.Tensor:
    return _EXT.varlen_ds_dq_schedule(list(cu_seqlens), block_size, head_dim, heads, kv_heads, ctas,
                                      _index(device)).to(device)


def _index(device: str) -> int:
    """The device whose L2 sizes the dQ-from-dS walk: a tensor's device names its index (the CPU
    tensors of tests/test_cutlass_dispatch.py's fake extension have none)."""
    return torch.device(device).index or 0


# Short halves walk their batched work slot-major: WorkOrder chunk 1, blocks of 4 entries (hopper/
# common.cuh work_order; (chunk, block), (0, 0) the plain entry-major order), so that the CTAs
# running side by side work on one (batch, head) slot's 4 dearest tiles and share its K / V (the
# forward) or Q / dO (the dS backward's dK/dV kernel, under its balanced schedule at D = 128) in
# L2, where the plain order has every slot in flight at once. At n = 1K (16K tokens: 128 slots
# re-reading 64 MB at D = 128, more than the L2) ncu read the dK/dV kernel's DRAM traffic 789 ->
# 427 MB and its time 381.7 -> 365.7 us (session 20). Through torch (benchmarks.knob_ab, H200,
# bf16, 16K tokens, medians of 10 shuffled rounds; csrc/NOTES.md session 21), against the plain
# order: D = 128 forward 1.041 / 1.054x at n = 1K (block 16 / 4) and 1.058x at n = 512, backward
# 1.010 / 1.014 / 1.012x, but the forward 0.975x at 2K and 0.961x at 4K; D = 256 forward 1.181 /
# 1.139 / 1.032x at n = 1K / 512 / 2K (backward 1.032 / 1.024 / 1.022x, step 1.082 / 1.049 /
# 1.029x), 0.967x at 4K; D = 64 level (1.00-1.02x). With GQA 32/8 (D = 128, n = 1K) the forward
# read 1.000x and the backward 0.970x: adjacent slots share K / V already. Hence the walk for one
# query head per K / V head, halves up to SHORT_HALF_MAX[head dim].
SHORT_HALF_ORDER = (1, 4)
SHORT_HALF_MAX = {128: 1024, 256: 2048}
PLAIN_ORDER = (0, 0)


def _walk(longest_half: int, head_dim: int, group: int) -> tuple[int, int]:
    """The work order (chunk, block) of a batched call's forward and dS dK/dV kernel; ``group``:
    query heads per K / V head."""
    short = group == 1 and longest_half <= SHORT_HALF_MAX.get(head_dim, -1)
    return SHORT_HALF_ORDER if short else PLAIN_ORDER


# The forward's narrow visit of a noisy tile's diagonal (hopper/diffusion_fwd.cuh narrow_visit:
# each consumer's 64 keys of it where block_size divides 64), a second kernel built at D = 64 and
# 128, batched and packed (fwd_narrow_built), asked for at NARROW_DIAG_HEAD_DIMS where halves (a
# packing's longest) are at most NARROW_DIAG_MAX_HALF. Session 29, bf16, 16K tokens, D = 128, the
# kernel with it against the one without: benchmarks.build_ab, the forward 1.024 / 1.024x at n = 1K
# (block 16 / 4), 1.015x in a second call, but 0.988 / 0.996x at 2K, 0.980x at 8K and 0.994x in
# the block-128 control, which has no narrow visit (the other visits' code paid for it);
# benchmarks.knob_ab narrow-diag (one process): 1.026 / 1.043x at n = 1K, 1.041x GQA 32/8, 1.044x
# at n = 512, but its A/A row (n = 2K, no narrow visit under either setting) read 1.019x, and the
# A/A rows of the two knobs below 1.023 / 1.025x, all under shuffle seed 0 (seeds 1-3 read that
# A/A row 0.97-1.00x): a knob_ab ratio is good to about 3 %. Session 30 settled the two rules with
# an A/A arm in every row, shuffle seeds 1 and 2: packed samples (narrow-diag-varlen, 16K tokens of
# halves <= 1K) forward 1.022 / 1.037x (A/A 0.965 / 1.005) for 8 x 1K, 1.045 / 1.040x (A/A 0.989 /
# 1.006) for a mixed packing; D = 64 (narrow-diag-dims) 1.044-1.047x at n = 1K (block 16 and 4, A/A
# 0.998-1.003), 1.066 / 1.063x at n = 512 (A/A 1.001 / 1.002): +2-6 %, every A/A row but one
# (0.965) within 1.1 %, so both stay on. At D = 64 the kernel that is always narrow read 0.989x at
# n = 2K (build_ab), hence the same bound on the halves. The kernel without it is instruction for
# instruction the one before (cuobjdump). 0: never.
NARROW_DIAG_MAX_HALF = 1024
NARROW_DIAG_HEAD_DIMS = (64, 128)
NARROW_DIAG_VARLEN = True  # packed samples, by their longest half


def _narrow_diag(longest_half: int, block_size: int, head_dim: int) -> bool:
    """Whether a forward asks for the narrow diagonal's kernel (the kernel itself decides per item
    whether its visit is narrow: noisy tiles, block sizes dividing 64)."""
    return (head_dim in NARROW_DIAG_HEAD_DIMS and 0 < longest_half <= NARROW_DIAG_MAX_HALF
            and 64 % block_size == 0)


def _persistent_dkdv(longest_half: int, head_dim: int, group: int) -> bool:
    """Whether the backward runs the persistent dK/dV kernel for halves up to ``longest_half``,
    ``group`` query heads per K / V head (PERSISTENT_DKDV_MAX_HALF bounds both limits, and setting
    it to 0 turns the persistent kernel off everywhere, PERSISTENT_DKDV_EVERY_LENGTH included)."""
    if head_dim not in PERSISTENT_DKDV_HEAD_DIMS or PERSISTENT_DKDV_MAX_HALF <= 0:
        return False
    if head_dim in PERSISTENT_DKDV_EVERY_LENGTH:
        return True
    limit = PERSISTENT_DKDV_MAX_HALF if group == 1 else min(PERSISTENT_DKDV_MAX_HALF,
                                                            PERSISTENT_DKDV_MAX_HALF_GQA)
    return longest_half <= limit


@lru_cache(maxsize=64)
def _bwd_tile_orders(n_noisy: int, n_clean: int, block_size: int, head_dim: int, device: str):
    """(key tiles of the dK/dV kernel, query tiles of the dQ kernel, query tiles of the dS
    backward's dQ kernel), most expensive first."""
    return tuple(t.to(device) for t in _EXT.bwd_tile_orders(n_noisy, n_clean, block_size, head_dim))


@lru_cache(maxsize=64)
def _ds_slots(n_noisy: int, n_clean: int, block_size: int, key_tile: int,
              device: str) -> tuple[torch.Tensor, int]:
    """The dS backward's slot table and its visits: one scratch block per visit of the dK/dV kernel
    (a 64-query tile seeing a ``key_tile``-key tile), numbered key tile by key tile in the kernel's
    visit order (each key tile's run of query tiles, in position order, as geometry.py lists them;
    the kernel finds a visit's block from its key tile's first), and -1 where it does not visit, as
    an int32 (S / 64) x (S / key_tile) table on ``device``. Halves must be multiples of
    DS_HALF_MULTIPLE."""
    mask = SequenceMask(n_noisy, n_clean, block_size)
    plans = mask.bwd_tiles(DS_QUERY_TILE, key_tile)
    slots = torch.full((mask.seqlen // DS_QUERY_TILE, len(plans)), -1, dtype=torch.int32)
    visits = 0
    for kt, plan in enumerate(plans):
        for visit in plan.visits:
            slots[visit.start // DS_QUERY_TILE, kt] = visits
            visits += 1
    return slots.flatten().to(device), visits


def _ds_block(ext, head_dim: int) -> int:
    """Elements per dS^T block where the extension has the dS backward for this head dim, else 0."""
    return _ds_block_of(ext, head_dim) if head_dim in DS_HEAD_DIMS and hasattr(ext, "ds_block") else 0


@lru_cache(maxsize=16)
def _ds_block_of(ext, head_dim: int) -> int:
    """ext.ds_block, a constant of the build, asked once per head dim (a call into the extension
    took 3 us of the H200 host's step, session 28)."""
    return ext.ds_block(head_dim)


def _ds_scratch_elems(q: torch.Tensor, block: int, slots: int, visits: int) -> int:
    """Elements of the dS^T scratch, ``1 + slots * visits`` blocks, or 0 past DS_SCRATCH_MAX_BYTES or
    where the kernels' 32-bit row numbers (key_tile rows per block) would overflow."""
    blocks = 1 + slots * visits
    if blocks * block * q.element_size() > DS_SCRATCH_MAX_BYTES or blocks * (block // DS_QUERY_TILE) >= 2**31:
        return 0
    return blocks * block


def _ds_plan(ext, q: torch.Tensor, mask) -> dict:
    """The dS backward's arguments of ext.bwd (slot table, visits) and its scratch's size
    (``ds_elems``) for this batched call, or none where it does not apply (head dim, halves off the
    tile grid, the scratch's bound)."""
    block = _ds_block(ext, q.shape[-1])
    if not block or mask.n_noisy % DS_HALF_MULTIPLE or mask.n_clean % DS_HALF_MULTIPLE:
        return {}
    b, _, h, _ = q.shape
    slots, visits = _ds_slots(mask.n_noisy, mask.n_clean, mask.block_size, block // DS_QUERY_TILE,
                              str(q.device))
    elems = _ds_scratch_elems(q, block, b * h, visits)
    return {"ds_elems": elems, "ds_slots": slots, "ds_visits": visits} if elems else {}


class VarlenTables(NamedTuple):
    """Device tables of one packed batch: the offsets and, per kernel, (tile order, tile sample)."""

    cu_seqlens: torch.Tensor
    longest_half: int  # of any sample: the persistent-grid rules (PERSISTENT_*MAX_HALF)
    fwd: tuple[torch.Tensor, torch.Tensor]
    dkdv: tuple[torch.Tensor, torch.Tensor]
    dq: tuple[torch.Tensor, torch.Tensor]
    ds_dq: tuple[torch.Tensor, torch.Tensor]  # the dQ-from-dS kernel's entries


@lru_cache(maxsize=64)
def _varlen_tables(cu_seqlens: tuple[int, ...], block_size: int, head_dim: int,
                   device: str) -> VarlenTables:
    """Every kernel's work entries over all samples, most expensive first (built in C++ from
    dlm/geometry.h), moved to the device in one copy. Keyed by VarlenMask's host tuple, so a
    training loop that repeats a packing (or a forward followed by its backward) builds once; the
    bound keeps ever-new packings from growing the cache (each entry is a few KB)."""
    cu = list(cu_seqlens)
    parts = [torch.tensor(cu, dtype=torch.int32),
             *_EXT.varlen_tile_order(cu, block_size, head_dim),
             *_EXT.varlen_bwd_tile_orders(cu, block_size, head_dim)]
    flat = torch.cat(parts).to(device)
    cu_d, *tables = flat.split([p.numel() for p in parts])
    longest_half = max((b - a for a, b in zip(cu, cu[1:])), default=0) // 2
    return VarlenTables(cu_d, longest_half, tuple(tables[0:2]), tuple(tables[2:4]), tuple(tables[4:6]),
                        tuple(tables[6:8]))


@lru_cache(maxsize=64)
def _varlen_ds_slots(cu_seqlens: tuple[int, ...], block_size: int, head_dim: int,
                     device: str) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The dS backward's slot table of a packing (ext.varlen_ds_slots: the table, each sample's first
    row, the visits, the table's width), on the device: built by the backward only (a forward-only
    call never needs it), cached as _varlen_tables ((tokens / 64) x the widest sample's key tiles
    entries)."""
    slots, rows, visits, width = _EXT.varlen_ds_slots(list(cu_seqlens), block_size, head_dim)
    flat = torch.cat([slots, rows]).to(device)
    return (*flat.split([slots.numel(), rows.numel()]), visits, width)


def _ds_plan_varlen(ext, q: torch.Tensor, cu_seqlens: tuple[int, ...], block_size: int) -> dict:
    """The dS backward's arguments of ext.bwd for packed samples (q: (1, S, H, D); the packing's host
    cu_seqlens) and its scratch's size, or none where it does not apply (head dim, the scratch's
    bound)."""
    block = _ds_block(ext, q.shape[-1])
    if not block or not hasattr(ext, "varlen_ds_slots"):
        return {}
    slots, rows, visits, width = _varlen_ds_slots(cu_seqlens, block_size, q.shape[-1], str(q.device))
    elems = _ds_scratch_elems(q, block, q.shape[2], visits)
    return {} if not elems else {"ds_elems": elems, "ds_slots": slots, "ds_visits": visits,
                                 "ds_rows": rows, "ds_k_tiles": width}


def _scratch(ext, rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """lse2 and delta for the backward, one allocation: ``rows`` floats each plus the
    ``ext.scratch_pad`` floats the odd-length / varlen dK/dV kernel reads past the end (its lse2 /
    delta bulk copies start at the aligned float at or before a tile's first row), which the
    preprocess kernel zeroes so that masked queries keep dS = 0 (a fill here was one more launch
    per backward: session 20, the step at n = 1K is near host-bound); each starts 16-byte aligned
    (width a multiple of 4)."""
    width = -(-rows // 4) * 4 + ext.scratch_pad
    buf = torch.empty((2, width), dtype=torch.float32, device=device)
    return buf[0], buf[1]


# The backward's launch is planned from the shapes and the mask alone (BwdCall) and launched by
# one of two executors that allocate the same tensors and make the same ext.bwd call: _launch_bwd
# here (the backward op's body, the Python autograd node) and the extension's run_bwd (C++, the
# autograd node attach_bwd makes; csrc/bindings/diffusion_autograd_sm90.cpp).
# tests/test_native_backward.py holds them to bitwise equal gradients on every layout, and
# test_cutlass_dispatch.py the node's plan to the Python launch's arguments.
AS_GIVEN, AS_PACKED, AS_ONE_BATCH = 0, 1, 2  # BwdCall.layout: ext.bwd sees the tensors as given,
# as one packed batch (1, B S, H, D), or packed samples' (total, H, D) as (1, total, H, D)

# The eager step's backward as a C++ autograd node where the CUTLASS kernels take it (batched and
# packed calls that want a gradient, outside torch.compile and dispatch modes: ops/eager.py). On
# CUDA the autograd engine runs a backward on its device thread, and our Python backward there
# cost the H200's host far more than on the calling thread (benchmarks.host_time --nodes,
# session 36, n = 1K, D = 128, B = 8, best burst: the step 0.437 ms, the same step with autograd's
# multithreading off 0.238, the backend's bwd alone on the main thread 0.075; a trivial Python
# node's step cost only 0.016 more than a C++ node's), so the step at n <= 2K waited on the host.
# False: the Python node everywhere.
NATIVE_BACKWARD = True


class BwdCall(NamedTuple):
    """One backward's launch: how its tensors are viewed, the kernels' arguments after the
    tensors (ext.bwd's keywords, the dS scratch aside) and its size, and the STATS it counts."""

    layout: int  # AS_GIVEN, AS_PACKED or AS_ONE_BATCH
    args: dict
    ds_elems: int  # elements of the dS^T scratch (q's dtype); 0: the two-kernel dQ
    stats: tuple[str, ...]


def _bwd_call(layout, q_shape, k_shape, device, n_noisy, block_size, scale, dkdv, dq_tables,
              longest_half, stats, cu_seqlens=None, ds=None, mask=None, packing=None) -> BwdCall:
    """The launch of the three backward kernels on (B, S, H, D) views of shapes q_shape / k_shape;
    dkdv / dq_tables: (order, sample or None); longest_half: of any sample (the persistent dK/dV
    rule); ds: _ds_plan's arguments; mask: the batched call's, or packing: the packed call's host
    cu_seqlens (the persistent dK/dV kernel and the dS backward's dQ kernel then walk their balanced
    schedules)."""
    ds = dict(ds or {})
    ds_elems = ds.pop("ds_elems", 0)
    b, _, _, d = q_shape
    group = q_shape[2] // k_shape[2]
    persistent = _persistent_dkdv(longest_half, d, group)
    schedule, ctas = None, _max_ctas(device)
    # The dS backward's dK/dV kernel walks slot-major where _walk says so: batched calls decode that
    # walk in the kernel, packed ones decode the plain order and get it from their schedule.
    walk = _walk(longest_half, d, group) if ds else PLAIN_ORDER
    decoded = walk if mask is not None else PLAIN_ORDER
    # The dS backward runs the persistent dK/dV kernel wherever the head dim has one.
    if (BALANCED_SCHEDULE and d in PERSISTENT_DKDV_HEAD_DIMS and (persistent or ds)
            and b * k_shape[2] * dkdv[0].numel() > ctas):
        if mask is not None:
            schedule = _dkdv_schedule(mask.n_noisy, mask.n_clean, mask.block_size, d, b * k_shape[2],
                                      group, ctas, walk, str(device))
        elif packing is not None:
            schedule = _varlen_dkdv_schedule(packing, block_size, d, k_shape[2], group, ctas, walk[1],
                                             str(device))
    dq_schedule = None
    if DQ_SCHEDULE and ds and b * q_shape[2] * dq_tables[0].numel() > ctas:
        if mask is not None:
            dq_schedule = _ds_dq_schedule(mask.n_noisy, mask.n_clean, mask.block_size, d, b, q_shape[2],
                                          k_shape[2], ctas, str(device))
        elif packing is not None:
            dq_schedule = _varlen_ds_dq_schedule(packing, block_size, d, q_shape[2], k_shape[2], ctas, str(device))
    args = dict(dkdv_order=dkdv[0], dq_order=dq_tables[0], n_noisy=n_noisy, block_size=block_size,
                scale=scale, dkdv_sample=dkdv[1], dq_sample=dq_tables[1], cu_seqlens=cu_seqlens,
                persistent_dkdv=persistent, dkdv_schedule=schedule, dkdv_order_chunk=decoded[0],
                dkdv_order_block=decoded[1], dq_schedule=dq_schedule, **ds)
    return BwdCall(layout, args, ds_elems, stats)


def _rows(x, h: int):
    """A batched (B, H, S) lse or dlse as the packed call's (1, H, B S)."""
    return None if x is None else x.float().transpose(0, 1).reshape(1, h, -1)


def _launch_bwd(ext, call: BwdCall, dout, q, k, v, out, lse, dlse):
    """Run ``call`` (the Python executor; the extension's run_bwd is the C++ one): dq, dk, dv."""
    if not cutlass.tma_ready(dout if dout.dim() == 4 else dout[None]):
        # dout comes from autograd in any layout (an expand, a transpose): one copy makes it
        # TMA-ready rather than handing the whole backward to Triton. An empty dout (no token) can
        # keep an expand's zero strides through contiguous().
        dout = dout.contiguous() if dout.numel() else dout.new_empty(dout.shape)
    given = (q, k, v)
    if call.layout == AS_ONE_BATCH:
        dout, q, k, v, out = (t[None] for t in (dout, q, k, v, out))
        lse, dlse = lse[None], None if dlse is None else dlse[None]
    elif call.layout == AS_PACKED:
        b, s, h, d = q.shape
        dout, out = (t if t.stride(0) == s * t.stride(1) else t.contiguous() for t in (dout, out))
        dout, q, k, v, out = (t.view(1, b * s, *t.shape[2:]) for t in (dout, q, k, v, out))
        lse, dlse = _rows(lse, h), _rows(dlse, h)
    for key in call.stats:
        STATS[key] += 1
    b, s, h, _ = q.shape
    if b * s * h == 0:
        # No token (an empty varlen packing; autograd still calls the backward): nothing to
        # launch, and the zero-size dlse autograd passes is an expand whose strides the
        # binding's layout checks reject (contiguous() keeps them on an empty tensor).
        return tuple(torch.empty_like(t) for t in given)
    lse = lse.float().contiguous()
    dlse = None if dlse is None else dlse.float().contiguous()
    dq, dk, dv = new_output(q, q.shape), new_output(k, k.shape), new_output(v, v.shape)
    lse2, delta = _scratch(ext, b * h * s, q.device)
    ds_scratch = (torch.empty(call.ds_elems, dtype=q.dtype, device=q.device) if call.ds_elems
                  else None)
    ext.bwd(dout, q, k, v, out, lse, dlse, dq, dk, dv, lse2, delta, ds_scratch=ds_scratch,
            **call.args)
    return tuple(g.view(t.shape) for g, t in zip((dq, dk, dv), given))


def _attach(ext, call: BwdCall, q, k, v, out, lse):
    """(out, lse) of a forward, with ``call`` attached as their C++ autograd node (the backward's
    STATS are counted here: the node does not come back to Python)."""
    for key in call.stats:
        STATS[key] += 1
    plan = ext.BwdPlan(layout=call.layout, ds_elems=call.ds_elems, poison=base.POISON_OUTPUTS,
                       **call.args)
    return ext.attach_bwd(q, k, v, out, lse, plan)


class CutlassDiffusionBackend(cutlass.Sm90Backend, TritonBackend):
    name = "cutlass"
    priority = 20  # above triton: preferred where it can run
    capabilities = Capabilities(
        device_types=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        max_head_dim=256,
        head_dim_multiple=64,  # 64, 128, 256 (forward and backward); 192 runs Triton
        features=frozenset({GQA, DETERMINISTIC, VARLEN}),
    )

    def _build_error(self) -> str | None:
        return _BUILD_ERROR

    @staticmethod
    def _covers(ext, mask, head_dims, *tensors) -> bool:
        """Whether the CUTLASS kernels take this call: head dim, TMA-ready (B, S, H, D) tensors
        and, batched (``mask`` a SequenceMask; None for packed samples), halves on tile boundaries
        where the extension needs them."""
        aligned = (mask is None or getattr(ext, "batched_any_length", False)
                   or not (mask.n_noisy % TILE or mask.n_clean % TILE))
        return (aligned and tensors[0].shape[-1] in head_dims
                and all(cutlass.tma_ready(t) for t in tensors))

    @staticmethod
    def _backward_extension(softcap):
        """The extension for a backward, or None (a softcap: Triton's)."""
        return _extension() if softcap == 0 else None

    def fwd(self, q, k, v, mask, scale, softcap, deterministic):
        ext = _extension() if softcap == 0 else None
        if ext is None or not self._covers(ext, mask, FORWARD_HEAD_DIMS, q, k, v):
            STATS["fwd_fallback"] += 1
            return super().fwd(q, k, v, mask, scale, softcap, deterministic)
        b, s, h, _ = q.shape
        out = new_output(q, q.shape)
        lse = new_output(q, (b, h, s), torch.float32)
        order = _tile_order(mask.n_noisy, mask.n_clean, mask.block_size, q.shape[-1], str(q.device))
        chunk, block = _walk(max(mask.n_noisy, mask.n_clean), q.shape[-1], q.shape[2] // k.shape[2])
        ext.fwd(q, k, v, out, lse, order, mask.n_noisy, mask.block_size, scale,
                _max_ctas(q.device), order_chunk=chunk, order_block=block,
                narrow_diag=mask.n_noisy > 0 and _narrow_diag(max(mask.n_noisy, mask.n_clean),
                                                              mask.block_size, q.shape[-1]))
        STATS["fwd"] += 1
        return out, lse

    def varlen_fwd(self, q, k, v, mask, scale, softcap, deterministic):
        ext = _extension() if softcap == 0 else None
        if ext is None or not self._covers(ext, None, FORWARD_HEAD_DIMS, q[None], k[None], v[None]):
            STATS["varlen_fwd_fallback"] += 1
            return super().varlen_fwd(q, k, v, mask, scale, softcap, deterministic)
        total, h, d = q.shape
        out = new_output(q, q.shape)
        lse = new_output(q, (h, total), torch.float32)
        t = _varlen_tables(mask.cu_seqlens, mask.block_size, d, str(q.device))
        ext.fwd(q[None], k[None], v[None], out[None], lse[None], t.fwd[0], 0, mask.block_size, scale,
                _max_ctas(q.device), tile_sample=t.fwd[1], cu_seqlens=t.cu_seqlens,
                narrow_diag=NARROW_DIAG_VARLEN and _narrow_diag(t.longest_half, mask.block_size, d))
        STATS["varlen_fwd"] += 1
        return out, lse

    # -- the backward: planned from the shapes and the mask, then launched ---------------------

    def _plan_bwd(self, ext, q, k, v, mask, scale) -> BwdCall | None:
        """The batched backward's launch for these inputs (any dout: one copy makes it TMA-ready),
        or None where it is not the CUTLASS kernels' (Triton's then)."""
        if not self._covers(ext, mask, BACKWARD_HEAD_DIMS, q, k, v):
            return None
        ds = _ds_plan(ext, q, mask)
        if not ds:
            packed = self._plan_packed(ext, q, k, v, mask, scale)
            if packed is not None:
                return packed
        dkdv_order, dq_order, ds_dq_order = _bwd_tile_orders(mask.n_noisy, mask.n_clean,
                                                             mask.block_size, q.shape[-1],
                                                             str(q.device))
        stats = ("bwd", "bwd_ds") if ds else ("bwd",)
        return _bwd_call(AS_GIVEN, q.shape, k.shape, q.device, mask.n_noisy, mask.block_size, scale,
                         (dkdv_order, None), (ds_dq_order if ds else dq_order, None),
                         max(mask.n_noisy, mask.n_clean), stats, ds=ds, mask=mask)

    def _plan_packed(self, ext, q, k, v, mask, scale) -> BwdCall | None:
        """The dS backward of a batched BD3 call whose halves are off the 128 grid, run as the
        packed one over its B samples (equal lengths: the batch viewed as (1, B S, H, D), lse and
        dlse copied to (H, B S), 4 bytes per row and head), or None where that does not apply
        (block-causal masks, tensors whose batch cannot be merged into the rows, the head dim or
        the scratch's bound: the batched two-kernel backward then runs). Session 24: the packed dS
        backward over 8 halves of 1000 ran 1.13x the batched two-kernel one (H200, bf16, D 128).
        A dout or out whose batch cannot be merged is copied by the executor."""
        b, s, h, d = q.shape
        # On the 128 grid the batched dS path declined for a reason the packed one shares (its bound).
        if (mask.n_noisy != mask.n_clean or not mask.n_noisy % DS_HALF_MULTIPLE or not b * s
                or not _ds_block(ext, d) or any(t.stride(0) != s * t.stride(1) for t in (q, k, v))):
            return None
        cu = tuple(range(0, b * s + 1, s))
        ds = _ds_plan_varlen(ext, q.view(1, b * s, h, d), cu, mask.block_size)
        if not ds:
            return None
        t = _varlen_tables(cu, mask.block_size, d, str(q.device))
        return _bwd_call(AS_PACKED, (1, b * s, h, d), (1, b * s, *k.shape[2:]), q.device, 0,
                         mask.block_size, scale, t.dkdv, t.ds_dq, t.longest_half,
                         ("bwd", "bwd_ds", "bwd_ds_packed"), t.cu_seqlens, ds=ds, packing=cu)

    def _plan_varlen_bwd(self, ext, q, k, v, mask, scale) -> BwdCall | None:
        if not self._covers(ext, None, BACKWARD_HEAD_DIMS, q[None], k[None], v[None]):
            return None
        t = _varlen_tables(mask.cu_seqlens, mask.block_size, q.shape[-1], str(q.device))
        ds = _ds_plan_varlen(ext, q[None], mask.cu_seqlens, mask.block_size)
        stats = ("varlen_bwd", "varlen_bwd_ds") if ds else ("varlen_bwd",)
        return _bwd_call(AS_ONE_BATCH, (1, *q.shape), (1, *k.shape), q.device, 0, mask.block_size, scale,
                         t.dkdv, t.ds_dq if ds else t.dq, t.longest_half, stats, t.cu_seqlens, ds=ds,
                         packing=mask.cu_seqlens)

    def bwd(self, dout, q, k, v, out, lse, dlse, mask, scale, softcap, deterministic):
        ext = self._backward_extension(softcap)
        call = None if ext is None else self._plan_bwd(ext, q, k, v, mask, scale)
        if call is None or not cutlass.tma_ready(out):
            STATS["bwd_fallback"] += 1
            return super().bwd(dout, q, k, v, out, lse, dlse, mask, scale, softcap, deterministic)
        return _launch_bwd(ext, call, dout, q, k, v, out, lse, dlse)

    def varlen_bwd(self, dout, q, k, v, out, lse, dlse, mask, scale, softcap, deterministic):
        ext = self._backward_extension(softcap)
        call = None if ext is None else self._plan_varlen_bwd(ext, q, k, v, mask, scale)
        if call is None or not cutlass.tma_ready(out[None]):
            STATS["varlen_bwd_fallback"] += 1
            return super().varlen_bwd(dout, q, k, v, out, lse, dlse, mask, scale, softcap,
                                      deterministic)
        return _launch_bwd(ext, call, dout, q, k, v, out, lse, dlse)

    # -- the eager training step: the backward as a C++ autograd node --------------------------

    def fwd_with_grad(self, q, k, v, mask, scale, softcap, deterministic):
        """The forward of a call that wants a gradient, its backward attached as a C++ autograd
        node (the extension's attach_bwd: the planned launch, no Python on the autograd engine's
        thread; NATIVE_BACKWARD), or None where that does not apply (the caller's Python node)."""
        return self._with_node(self._plan_bwd, self.fwd, q, k, v, mask, scale, softcap,
                               deterministic)

    def varlen_fwd_with_grad(self, q, k, v, mask, scale, softcap, deterministic):
        return self._with_node(self._plan_varlen_bwd, self.varlen_fwd, q, k, v, mask, scale,
                               softcap, deterministic)

    def _with_node(self, plan, forward, q, k, v, mask, scale, softcap, deterministic):
        ext = self._backward_extension(softcap) if NATIVE_BACKWARD else None
        call = None if ext is None or not hasattr(ext, "attach_bwd") else plan(ext, q, k, v, mask,
                                                                                scale)
        if call is None:
            return None
        out, lse = forward(q, k, v, mask, scale, softcap, deterministic)
        return _attach(ext, call, q, k, v, out, lse)


register(CutlassDiffusionBackend())
