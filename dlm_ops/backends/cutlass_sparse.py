"""The ``cutlass`` backend of the sparse family: the Hopper block-sparse forward of
csrc/hopper/block_sparse_fwd.cuh (TMA, wgmma, a producer and two consumer warpgroups walking each
query block's list of key blocks), JIT-built on first use by ``cutlass.build`` into its own
extension, ``dlm_sparse_sm90`` (csrc/bindings/sparse_sm90.cpp): a user of the sparse ops never
builds the block-diffusion kernels, nor the reverse. Everything else runs the Triton kernels (this
backend subclasses the Triton one).

Forwards only. Block-sparse: selection blocks 128. The kernel covers what its ``supports`` says
(the extension exposes block_sparse_fwd_supports: block_size_q == block_size_k == 128, head dim 64
or 128), fp16 / bf16 (declared capabilities: fp32 selects ``triton``), GQA, any Sq / Sk (the last
blocks may be partial), empty lists (out 0, lse -inf), return_lse; checked per call, TMA-ready
q / k / v (unit stride in D, 16-byte aligned base and strides). The kernel walks its (batch, head,
query block) items in a work order, longest list first (``work_order``: one small launch of the
extension's sort, csrc/hopper/work_order.cuh, no host sync: 1.8 us of GPU time at 4096 items with
uniform counts, 12 us with random ones, where torch.argsort + the int32 cast took 22-24 us), on a
persistent grid (one CTA per SM, ``PERSISTENT``) whose CTAs take the items in the snake order;
a last round that would leave half the grid idle is split into parts over it (``SPLIT_PARTS``).

Column-sparse (``column_fwd``): dense attention over each head's listed keys, so the listed K / V
rows are gathered per query head into (B, K, H, D) buffers (K = kv_indices.shape[-1], static: no
host sync) and the same kernel runs over them with Hkv = H, every query block listing key blocks
0 .. ceil(count / 128) - 1 (one shared arange, which the kernel takes as given: with key_len it
visits blocks 0, 1, ... without reading the list, csrc/NOTES.md "Session 39") and key_len =
kv_counts (the tile of the last listed key masks the rest). Same coverage (D 64 / 128, fp16 / bf16, TMA-ready q), K >= 1. The
buffers are sized by the list width K, not the counts: cut Sk-wide tables to the longest list.
The gather and the kernel's plan (key_len, block counts, shared list, work order) are ONE launch
of the extension's ``column_gather`` (csrc/hopper/column_gather.cuh: 16-byte rows, int32 indices,
any k / v strides with a unit stride in D); the torch ops ``gather_columns`` and ``column_plan``
are its reference and run where the extension lacks it (an older build) or k / v have a non-unit
stride in D. Before that launch, the torch gather (advanced indexing with int64 index tensors)
and ~25 small plumbing ops cost 0.2-0.6 ms per call on the H200 at S = 16K-32K, up to 1.4 ms at
64K (csrc/NOTES.md "One gather launch"); the copy itself moves 4 x B K H D x 2 bytes, ~0.1 ms
at 3.5 TB/s for 32K at density 0.3.

Every backward (block- and column-sparse) and the forwards the kernel does not cover run Triton's
kernels, counted in ``STATS`` per entry point. The backwards need only the forward's out and lse,
which the CUTLASS forwards write in the public layouts.

The build happens at the first call (one WARNING line; 4 kernel units and the bindings, the
gather kernel in its own). If it fails, the failure is remembered, reported by
``unavailable_reason`` (``python -m dlm_ops`` shows it and dispatch picks Triton from then on) and
warned once. Dispatch picks this backend automatically wherever it can be built;
``DLM_OPS_CUTLASS=0`` opts out (no build, Triton everywhere) and ``backend="cutlass"`` forces it.
CPU tests: tests/test_cutlass_sparse_dispatch.py (a fake extension); GPU tests:
tests/test_sparse_attn.py (test_gpu_*) and, the gather against ``gather_columns`` bit for bit,
tests/test_cutlass_sparse_dispatch.py (test_gpu_column_*).
"""

from __future__ import annotations

import torch

from . import cutlass, register
from .base import GQA, Capabilities, new_output
from .cutlass import sm_count as _sm_count
from .sparse_triton import TritonSparseBackend

SOURCES = ["bindings/sparse_sm90.cpp", "bindings/sparse_fwd_sm90.cu",
           "bindings/column_gather_sm90.cu", "bindings/work_order_sm90.cu"] + [
    f"hopper/block_sparse_fwd_{t}_d{d}.cu" for t in ("bf16", "fp16") for d in (64, 128)]
# CUTLASS forwards run, and calls handed to Triton, per entry point; the backwards have no CUTLASS
# kernel: they are all fallbacks.
STATS = {"fwd": 0, "fwd_fallback": 0, "bwd_fallback": 0, "column_fwd": 0,
         "column_fwd_fallback": 0, "column_bwd_fallback": 0}
BLOCK = 128  # the kernel's key block (block_sparse_fwd_supports)

# The forwards' grid: persistent (one CTA per SM walking its items in the snake order; the next
# item's Q and first K / V load while this one's last P V and its O store run) or one CTA per item.
# H200, bf16, B 1, H 32/8, D 128, through the ops in one process (session 10, csrc/NOTES.md
# "Session 10"): persistent / one CTA per item = 1.029 / 1.028 / 1.022 at S = 16K
# (densities 0.1 / 0.3 / 0.5; column-sparse 1.005 / 1.025 / 1.020), 0.985 / 1.025 / 1.039 at 32K
# (column 1.007 / 1.008 / 0.994) and 0.975 / 1.002 / 1.011 at 64K (column 0.991 / 1.000 / 0.997):
# a gain at 16K, within the +-3 % run-to-run spread above it. One rule, as the diffusion forward's.
PERSISTENT = True
# The split tail (csrc/NOTES.md "Session 22"; block_sparse_fwd.cuh tail_part): where the persistent
# grid's last round would leave at least half of its CTAs idle, the kernel walks the whole rounds,
# and a second launch splits the last round's items into up to SPLIT_PARTS parts (runs of their key
# lists) over all the CTAs; the part that finishes last merges the fp32 partials (68 KB per part at
# D = 128, read from L2: why not more parts). At 16K / 10 % (4096 items of 13 tiles on 132 CTAs)
# the 32nd round holds 4 items, ~3 % of the launch.
SPLIT_PARTS = 4

_EXT = None
_BUILD_ERROR: str | None = None


def _extension():
    """The built extension (built on the first call), or None after a failed build."""
    global _EXT, _BUILD_ERROR
    if _EXT is None and _BUILD_ERROR is None:
        _EXT, _BUILD_ERROR = cutlass.build_or_reason("dlm_sparse_sm90", SOURCES)
    return _EXT


def _max_ctas(device: torch.device) -> int:
    """The kernel's grid bound (SparseFwdArgs::max_ctas): the SM count, or 0 (one CTA per item)."""
    return _sm_count(device) if PERSISTENT else 0


def _launch_grid(device: torch.device, items: int) -> dict:
    """The kernel's grid arguments for `items` work items: max_ctas (_max_ctas) and split_parts,
    SPLIT_PARTS where the persistent grid's last round holds at most half of its CTAs' worth of
    items (each of them then gets at least two CTAs), 0 otherwise."""
    ctas = _max_ctas(device)
    tail = items % ctas if ctas else 0
    return {"max_ctas": ctas, "split_parts": SPLIT_PARTS if 0 < tail <= ctas // 2 else 0}


def launch_args(ext, q: torch.Tensor, items: int) -> dict:
    """ext.fwd's grid arguments (_launch_grid) with, where it splits the tail, the split's scratch:
    the partials (uninitialised) and 2 * max_ctas zeroed counters. Allocated here, not in the
    binding, so that running out of memory raises in Python (csrc/NOTES.md "Session 23": on one
    image an error raised inside an extension ended the process)."""
    grid = _launch_grid(q.device, items)
    if grid["split_parts"]:
        ctas = grid["max_ctas"]
        grid["split_partials"] = torch.empty(ext.split_scratch_floats(q.shape[-1], ctas),
                                             dtype=torch.float32, device=q.device)
        grid["split_counters"] = torch.zeros(2 * ctas, dtype=torch.int32, device=q.device)
    return grid


def work_order(counts: torch.Tensor, ext=None, max_count: int | None = None) -> torch.Tensor:
    """The kernel's work items, entries (b * H + h) * nQb + qb of the flat counts, longest list
    first (stable: ties keep their natural order, so the schedule is deterministic), int32 on the
    counts' device; no host sync. With an extension that has the sort (``ext.work_order``,
    csrc/hopper/work_order.cuh) and ``max_count`` (the list width: counts lie in [0, max_count])
    within its bounds, one launch of it; otherwise torch's stable argsort (a build from before
    it, more items or longer lists than its shared memory holds)."""
    n = counts.numel()
    rank = getattr(ext, "work_order", None)
    if (rank is not None and max_count is not None
            and 0 < n <= ext.work_order_max_items and 0 <= max_count <= ext.work_order_max_count):
        order = torch.empty(n, dtype=torch.int32, device=counts.device)
        rank(counts.contiguous(), order, max_count)
        return order
    return torch.argsort(counts.reshape(-1), descending=True, stable=True).to(torch.int32)


def gather_columns(k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, counts: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The listed keys of every query head, kg[b, j, h] = k[b, idx[b, h, j], h // G] (and vg), as
    contiguous (B, K, H, D) buffers: the kernel's (B, Sk, Hkv, D) with Hkv = H. Slots past a head's
    count are masked by the kernel, so they need only be finite (0 * inf would be NaN in P V):
    they repeat the head's first listed key, a row the result depends on anyway (key 0 for an
    empty list, whose tiles are never visited). One gather per tensor, no host sync."""
    b, h, m = idx.shape
    dev = idx.device
    listed = torch.arange(m, device=dev) < counts.unsqueeze(-1)
    first = torch.where(counts > 0, idx[..., 0], 0).unsqueeze(-1)
    # (B, K, H), contiguous: the gather's output takes the index's layout (a transposed index
    # gave a (B, H, K)-ordered result).
    rows = torch.where(listed, idx, first).transpose(1, 2).contiguous().long()
    bi = torch.arange(b, device=dev).view(b, 1, 1)
    hi = (torch.arange(h, device=dev) // (h // k.shape[2])).view(1, 1, h)
    return k[bi, rows, hi], v[bi, rows, hi]


def column_plan(counts: torch.Tensor, num_q_blocks: int, num_keys: int):
    """What the kernel needs besides the gathered keys: the shared list 0 .. ceil(K / 128) - 1,
    the per-item block counts ceil(count / 128) (B, H, nQb), and the work order (column_order).
    int32, no host sync."""
    dev = counts.device
    shared = torch.arange(-(-num_keys // BLOCK), dtype=torch.int32, device=dev)
    per_head = (counts + (BLOCK - 1)) // BLOCK  # (B, H)
    blocks = per_head.unsqueeze(-1).expand(*per_head.shape, num_q_blocks).contiguous()
    return shared, blocks, column_order(per_head, num_q_blocks)


def column_order(per_head: torch.Tensor, num_q_blocks: int) -> torch.Tensor:
    """The work order of the column-sparse items, heads with the most blocks first (stable; all
    nQb items of a head share a count, so this is work_order of the per-item counts, sorted over
    B * H heads instead of B * H * nQb items). per_head: (B, H) block counts; int32, no sync."""
    heads = work_order(per_head).long()
    return (heads.unsqueeze(-1) * num_q_blocks
            + torch.arange(num_q_blocks, device=per_head.device)).reshape(-1).to(torch.int32)


# Up to this many heads (B * H) the gather kernel also ranks the heads for the work order; its cost
# grows as (B * H)^2 (each head's CTA reads every count: 16 M L2 hits at 4096), so above it
# column_order sorts with torch (~10 small launches).
RANK_MAX_HEADS = 4096


def column_inputs(ext, k, v, idx, counts, num_q_blocks: int):
    """What the kernel reads in a column-sparse forward, (kg, vg, key_len, shared, blocks, order):
    the gathered K / V (B, K, H, D) (gather_columns), key_len = counts clamped to [0, K] (so an
    unchecked call cannot make the kernel read past the list or the keys) and column_plan's
    tables. One launch of the extension's column_gather, or the torch reference where the
    extension lacks it or k / v have a non-unit stride in D. No host sync either way."""
    b, h, m = idx.shape
    gather = getattr(ext, "column_gather", None)
    if gather is None or k.stride(-1) != 1 or v.stride(-1) != 1:
        key_len = counts.clamp(0, m).contiguous()  # int32 (B, H)
        kg, vg = gather_columns(k, v, idx, key_len)
        return (kg, vg, key_len, *column_plan(key_len, num_q_blocks, m))
    dev, i32 = idx.device, torch.int32
    kg = new_output(k, (b, m, h, k.shape[-1]))
    vg = new_output(v, kg.shape)
    key_len = torch.empty((b, h), dtype=i32, device=dev)
    blocks = torch.empty((b, h, num_q_blocks), dtype=i32, device=dev)
    shared = torch.empty((-(-m // BLOCK),), dtype=i32, device=dev)
    ranked = b * h <= RANK_MAX_HEADS
    order = torch.empty((b * h * num_q_blocks,), dtype=i32, device=dev) if ranked else None
    gather(k, v, idx.contiguous(), counts.contiguous(), kg, vg, key_len, blocks, shared, order,
           BLOCK)
    if not ranked:
        order = column_order((key_len + (BLOCK - 1)) // BLOCK, num_q_blocks)
    return kg, vg, key_len, shared, blocks, order


class CutlassSparseBackend(cutlass.Sm90Backend, TritonSparseBackend):
    name = "cutlass"
    priority = 20  # above triton: preferred where it can run
    capabilities = Capabilities(
        device_types=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        max_head_dim=128,
        head_dim_multiple=64,  # the kernel's 64 and 128; other head dims select triton
        features=frozenset({GQA}),
    )

    def _build_error(self) -> str | None:
        return _BUILD_ERROR

    @staticmethod
    def _covers(ext, q, k, v, idx, bsq, bsk) -> bool:
        """Whether the CUTLASS forward takes this call: the kernel's block sizes and head dims,
        TMA-ready q / k / v, and at least one list slot (max_blocks 0: nothing for the kernel to
        read, and Triton writes the empty result)."""
        return (ext.supports(bsq, bsk, q.shape[-1]) and idx.shape[-1] > 0
                and all(cutlass.tma_ready(t) for t in (q, k, v)))

    def block_fwd(self, q, k, v, idx, counts, bsq, bsk, scale):
        ext = _extension()
        if ext is None or not self._covers(ext, q, k, v, idx, bsq, bsk):
            STATS["fwd_fallback"] += 1
            return super().block_fwd(q, k, v, idx, counts, bsq, bsk, scale)
        idx, counts = idx.contiguous(), counts.contiguous()
        b, sq, h, _ = q.shape
        out = new_output(q, q.shape)
        lse = new_output(q, (b, h, sq), torch.float32)
        order = work_order(counts, ext, idx.shape[-1])
        ext.fwd(q, k, v, out, lse, idx, counts, order, bsq, bsk, scale,
                **launch_args(ext, q, counts.numel()))
        STATS["fwd"] += 1
        return out, lse

    def block_bwd(self, dout, q, k, v, out, lse, dlse, idx, counts, bsq, bsk, scale):
        STATS["bwd_fallback"] += 1
        return super().block_bwd(dout, q, k, v, out, lse, dlse, idx, counts, bsq, bsk, scale)

    def column_fwd(self, q, k, v, idx, counts, scale):
        ext = _extension()
        # q alone needs checking: the gathered K / V are fresh contiguous buffers (D 64 / 128:
        # 16-byte rows); K = 0 leaves no list slot (Triton writes the empty result).
        if (ext is None or not ext.supports(BLOCK, BLOCK, q.shape[-1]) or idx.shape[-1] == 0
                or not cutlass.tma_ready(q)):
            STATS["column_fwd_fallback"] += 1
            return super().column_fwd(q, k, v, idx, counts, scale)
        b, sq, h, _ = q.shape
        kg, vg, key_len, shared, blocks, order = column_inputs(ext, k, v, idx, counts,
                                                               -(-sq // BLOCK))
        out = new_output(q, q.shape)
        lse = new_output(q, (b, h, sq), torch.float32)
        ext.fwd(q, kg, vg, out, lse, shared, blocks, order, BLOCK, BLOCK, scale, key_len=key_len,
                **launch_args(ext, q, blocks.numel()))
        STATS["column_fwd"] += 1
        return out, lse

    def column_bwd(self, dout, q, k, v, out, lse, dlse, idx, counts, scale):
        STATS["column_bwd_fallback"] += 1
        return super().column_bwd(dout, q, k, v, out, lse, dlse, idx, counts, scale)


register(CutlassSparseBackend())
