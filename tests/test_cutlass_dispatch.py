"""The cutlass backend's Python side without a GPU (dlm_ops/backends/cutlass_diffusion.py): which
calls it runs and which it hands to Triton (batched halves of any length, varlen, softcap, head
dims, TMA alignment, a failed build), what it passes the extension (views, tables, scratch) and
the varlen table cache. A fake extension stands in for the sm90 build and records its calls; its
tables are written here from dlm_ops.geometry, the definition the C++ tables mirror (the GPU test
test_cutlass_varlen_tables_match_geometry compares the real ones)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dlm_ops.backends import cutlass_diffusion as cd
from dlm_ops.backends.triton_backend import TritonBackend
from dlm_ops.geometry import (SCHEDULE_ITEM_HALF_TILES, SequenceMask, VarlenMask, most_expensive_first,
                              order_schedule, varlen_walk, walk_schedule)


def _order(plans):
    return [i for i in most_expensive_first([p.area for p in plans])]


def entries(cu, block_size, plans_of):
    """(tile, sample) of every packed sample, most expensive first over all samples."""
    rows = [(t, i, p.area) for i, (_, m) in enumerate(VarlenMask(tuple(cu), block_size).samples)
            for t, p in enumerate(plans_of(m))]
    order = most_expensive_first([a for _, _, a in rows])
    return ([rows[o][0] for o in order], [rows[o][1] for o in order])


def _i32(x):
    return torch.tensor(x, dtype=torch.int32)


def varlen_ds_slots(cu, block_size, key_tile):
    """The dS backward's slot table of packed samples, written from dlm_ops.geometry (the mirror of
    the extension's varlen_ds_slots): (table, each sample's first row, visits, width). Sample i owns
    a row per 64-query tile of its own (cut from each half's start), `width` (the widest sample's
    key tiles) entries per row; its visits are numbered after the earlier samples', key tile by key
    tile in visit order; -1 where no visit is."""
    samples = [m for _, m in VarlenMask(tuple(cu), block_size).samples]
    width = max([1] + [len(m.bwd_tiles(64, key_tile)) for m in samples])
    rows, tables, visits = [], [], 0
    for m in samples:
        starts = {lo: i for i, (lo, _) in enumerate(m._tiles(64))}
        table = [[-1] * width for _ in starts]
        for kt, plan in enumerate(m.bwd_tiles(64, key_tile)):
            for visit in plan.visits:
                table[starts[visit.start]][kt] = visits
                visits += 1
        rows.append(sum(len(t) for t in tables))
        tables.append(table)
    flat = [x for t in tables for row in t for x in row]
    return _i32(flat), _i32(rows), visits, width


class _Asked(tuple):
    """What a fake schedule builder was asked for, standing in for its tensor (.to keeps it)."""

    def to(self, device):
        return self


class FakeExtension:
    """The extension's interface: tables from geometry.py, kernels that record and write zeros."""

    scratch_pad = 128

    def __init__(self, batched_any_length=True):
        self.batched_any_length = batched_any_length
        self.calls = []
        self.table_builds = 0

    def tile_order(self, nn, nc, bs, d):
        return _i32(_order(SequenceMask(nn, nc, bs).fwd_tiles(128, 64 if d > 128 else 128)))

    def bwd_tile_orders(self, nn, nc, bs, d):
        m, t = SequenceMask(nn, nc, bs), 64 if d > 128 else 128  # bwd_parts.cuh bwd_block_n / dq_block_*
        return (_i32(_order(m.bwd_tiles(128 if d == 64 else 64, t))), _i32(_order(m.fwd_tiles(t, t))),
                _i32(_order(m.fwd_tiles(128, t))))  # the dQ-from-dS kernel's: 128 rows x key tile

    def varlen_tile_order(self, cu, bs, d):
        self.table_builds += 1
        return [_i32(x) for x in entries(cu, bs, lambda m: m.fwd_tiles(128, 64 if d > 128 else 128))]

    def varlen_bwd_tile_orders(self, cu, bs, d):
        t = 64 if d > 128 else 128
        dkdv = entries(cu, bs, lambda m: m.bwd_tiles(128 if d == 64 else 64, t))  # bwd_block_m
        dq = entries(cu, bs, lambda m: m.fwd_tiles(t, t))
        ds_dq = entries(cu, bs, lambda m: m.fwd_tiles(128, t))  # the dQ-from-dS kernel's
        return [_i32(x) for x in (*dkdv, *dq, *ds_dq)]

    def dkdv_schedule(self, nn, nc, bs, d, slots, group, ctas, order_chunk=0, order_block=0):
        bm, bn = 128 if d == 64 else 64, 64 if d > 128 else 128
        plans = SequenceMask(nn, nc, bs).bwd_tiles(bm, bn)
        chunk, block = (None, 1) if order_chunk == 0 else (order_chunk, order_block)
        return _i32(order_schedule(plans, _order(plans), slots, group, ctas, bm, bn, chunk, block))

    def varlen_dkdv_schedule(self, cu, bs, d, slots, group, ctas, order_block=0):
        bm, bn = 128 if d == 64 else 64, 64 if d > 128 else 128
        samples = [m.bwd_tiles(bm, bn) for _, m in VarlenMask(tuple(cu), bs).samples]
        tile, sample = entries(cu, bs, lambda m: m.bwd_tiles(bm, bn))
        walk = varlen_walk(sample, slots, order_block)
        fixed = SCHEDULE_ITEM_HALF_TILES * bm * bn // 2
        costs = [group * samples[sample[w // slots]][tile[w // slots]].area + fixed for w in walk]
        return _i32(walk_schedule(walk, costs, ctas))

    # The dQ-from-dS kernel's schedules: the walk's L2 chunks depend on the device, which this fake
    # does not have, so they record what they were asked for (the backend must hand over the result).
    def ds_dq_schedule(self, nn, nc, bs, d, batch, heads, kv_heads, ctas, device):
        return _Asked(("ds_dq_schedule", nn, nc, bs, d, batch, heads, kv_heads, ctas, device))

    def varlen_ds_dq_schedule(self, cu, bs, d, heads, kv_heads, ctas, device):
        return _Asked(("varlen_ds_dq_schedule", tuple(cu), bs, d, heads, kv_heads, ctas, device))

    def fwd(self, q, k, v, out, lse, order, n_noisy, block_size, scale, max_ctas, tile_sample=None,
            cu_seqlens=None, order_chunk=0, order_block=0, narrow_diag=False):
        self.calls.append(("fwd", dict(q=q, out=out, lse=lse, order=order, n_noisy=n_noisy,
                                       max_ctas=max_ctas, tile_sample=tile_sample,
                                       cu_seqlens=cu_seqlens, walk=(order_chunk, order_block),
                                       narrow_diag=narrow_diag)))
        out.zero_(), lse.zero_()

    def bwd(self, dout, q, k, v, out, lse, dlse, dq, dk, dv, lse2, delta, dkdv_order, dq_order,
            n_noisy, block_size, scale, dkdv_sample=None, dq_sample=None, cu_seqlens=None,
            persistent_dkdv=False, ds_scratch=None, ds_slots=None, ds_visits=0, dkdv_schedule=None,
            dkdv_order_chunk=0, dkdv_order_block=0, ds_rows=None, ds_k_tiles=0, dq_schedule=None):
        assert ds_scratch is not None or dkdv_order_chunk == 0  # the binding's checks
        assert ds_scratch is not None or dq_schedule is None
        assert (ds_rows is not None) == (cu_seqlens is not None and ds_scratch is not None)
        self.calls.append(("bwd", dict(q=q, lse=lse, dlse=dlse, lse2=lse2, delta=delta,
                                       dkdv_order=dkdv_order, dq_order=dq_order,
                                       dkdv_sample=dkdv_sample, dq_sample=dq_sample,
                                       cu_seqlens=cu_seqlens, persistent_dkdv=persistent_dkdv,
                                       ds_scratch=ds_scratch, ds_slots=ds_slots, ds_visits=ds_visits,
                                       dkdv_schedule=dkdv_schedule, ds_rows=ds_rows,
                                       ds_k_tiles=ds_k_tiles, dq_schedule=dq_schedule,
                                       dkdv_walk=(dkdv_order_chunk, dkdv_order_block))))
        for g in (dq, dk, dv):
            g.zero_()


def _install(monkeypatch, ext):
    """The backend's extension replaced by `ext` for this test."""
    monkeypatch.setattr(cd, "_EXT", ext)
    monkeypatch.setattr(cd, "_extension", lambda: ext)


@pytest.fixture
def fake(monkeypatch):
    """The backend wired to a FakeExtension; Triton's entry points replaced by markers."""
    ext = FakeExtension()
    _install(monkeypatch, ext)
    monkeypatch.setattr(cd, "FORWARD_HEAD_DIMS", (64, 128, 256))  # every head dim the kernels have
    monkeypatch.setattr(cd, "_sm_count", lambda device: 132)  # no GPU to ask
    for name in ("fwd", "bwd", "varlen_fwd", "varlen_bwd"):
        monkeypatch.setattr(TritonBackend, name, lambda self, *a, _n=name: ("triton", _n))
    caches = (cd._tile_order, cd._bwd_tile_orders, cd._varlen_tables, cd._varlen_ds_slots,
              cd._dkdv_schedule, cd._varlen_dkdv_schedule, cd._ds_dq_schedule, cd._varlen_ds_dq_schedule)
    for cached in caches:
        cached.cache_clear()
    monkeypatch.setattr(cd, "STATS", dict.fromkeys(cd.STATS, 0))
    yield ext
    for cached in caches:
        cached.cache_clear()


def _batched(b, nn, nc, h, hkv, d, dtype=torch.bfloat16):
    s = nn + nc
    q = torch.randn(b, s, h, d).to(dtype)
    k, v = (torch.randn(b, s, hkv, d).to(dtype) for _ in range(2))
    return q, k, v


def _packed(halves, h, hkv, d, dtype=torch.bfloat16):
    cu = [0]
    for n in halves:
        cu.append(cu[-1] + 2 * n)
    q = torch.randn(cu[-1], h, d).to(dtype)
    k, v = (torch.randn(cu[-1], hkv, d).to(dtype) for _ in range(2))
    return q, k, v, VarlenMask(tuple(cu), 16)


def _run_batched(backend, q, k, v, mask, softcap=0.0):
    """The forward, then the backward on its outputs; each either CUTLASS's (a tuple of tensors)
    or Triton's marker."""
    fwd = backend.fwd(q, k, v, mask, 0.125, softcap, False)
    out, lse = fwd if fwd[0] != "triton" else (torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1]))
    bwd = backend.bwd(torch.randn_like(q), q, k, v, out, lse, None, mask, 0.125, softcap, False)
    return fwd, bwd


@given(st.integers(0, 300), st.integers(0, 300), st.integers(1, 400), st.sampled_from([64, 128, 256]),
       st.booleans())
def test_batched_halves_of_any_length_run_cutlass(nn, nc, bs, d, any_length):
    """With batched_any_length (kBatchedStart = kStartAny) every halves pair runs the kernels
    (block-causal n_noisy 0 and empty ones too); without it, only multiples of 128."""
    ext = FakeExtension(any_length)
    with pytest.MonkeyPatch.context() as mp:
        _install(mp, ext)
        mp.setattr(cd, "FORWARD_HEAD_DIMS", (64, 128, 256))
        mp.setattr(cd, "STATS", dict.fromkeys(cd.STATS, 0))
        mp.setattr(cd, "_sm_count", lambda device: 132)
        for name in ("fwd", "bwd"):
            mp.setattr(TritonBackend, name, lambda self, *a, _n=name: ("triton", _n))
        q, k, v = _batched(1, nn, nc, 2, 1, d)
        fwd, bwd = _run_batched(cd.CutlassDiffusionBackend(), q, k, v, SequenceMask(nn, nc, bs))
    runs = any_length or (nn % 128 == 0 and nc % 128 == 0)
    assert (fwd[0] != "triton") == runs
    assert (bwd[0] != "triton") == (runs and d in cd.BACKWARD_HEAD_DIMS)
    if runs:
        call = dict(ext.calls)["fwd"]
        assert call["n_noisy"] == nn and call["tile_sample"] is None and call["cu_seqlens"] is None
        assert call["order"].tolist() == _order(SequenceMask(nn, nc, bs).fwd_tiles(128, 64 if d > 128 else 128))
        assert not fwd[0].isnan().any() and not fwd[1].isnan().any()
        # the persistent rules: the forward always, the dK/dV kernel at D = 64 always, at D = 128
        # up to PERSISTENT_DKDV_MAX_HALF_GQA (two query heads share the K / V head here)
        assert call["max_ctas"] == 132
    if bwd[0] != "triton" and nn + nc:
        call = dict(ext.calls)["bwd"]
        assert call["persistent_dkdv"] == (d == 64 or (
            d == 128 and max(nn, nc) <= cd.PERSISTENT_DKDV_MAX_HALF_GQA))


def test_softcap_head_dims_alignment_and_failed_builds_fall_back(fake, monkeypatch):
    backend = cd.CutlassDiffusionBackend()
    mask = SequenceMask(100, 100, 5)
    q, k, v = _batched(2, 100, 100, 4, 2, 128)
    assert [r[0] for r in _run_batched(backend, q, k, v, mask, softcap=30.0)] == ["triton"] * 2
    assert cd.STATS["fwd_fallback"] == cd.STATS["bwd_fallback"] == 1
    # head dims outside FORWARD / BACKWARD_HEAD_DIMS: the forward alone, then neither
    monkeypatch.setattr(cd, "FORWARD_HEAD_DIMS", (256,))
    fwd, bwd = _run_batched(backend, q, k, v, mask)
    assert fwd[0] == "triton" and bwd[0] != "triton"
    q2, k2, v2 = _batched(2, 100, 100, 4, 2, 256)
    monkeypatch.setattr(cd, "BACKWARD_HEAD_DIMS", (64, 128))
    fwd, bwd = _run_batched(backend, q2, k2, v2, mask)
    assert fwd[0] != "triton" and bwd[0] == "triton"
    # rows not 16-byte aligned for TMA: a view one element into its storage
    monkeypatch.setattr(cd, "FORWARD_HEAD_DIMS", (64, 128, 256))
    shifted = torch.randn(q.numel() + 1).to(q.dtype)[1:].view(q.shape)
    assert _run_batched(backend, shifted, k, v, mask)[0][0] == "triton"
    # a failed build: the extension is None
    monkeypatch.setattr(cd, "_extension", lambda: None)
    assert [r[0] for r in _run_batched(backend, q, k, v, mask)] == ["triton"] * 2
    assert cd.STATS["fwd"] == cd.STATS["bwd"] == 1
    assert cd.STATS["fwd_fallback"] == 4 and cd.STATS["bwd_fallback"] == 4


@given(st.lists(st.integers(1, 5), min_size=4, max_size=4), st.permutations(range(4)),
       st.integers(0, 9), st.sampled_from([torch.bfloat16, torch.float32]))
def test_tma_ready_is_its_definition(shape, order, offset, dtype):
    """tma_ready: unit stride in D, a 16-byte aligned start and every other stride a multiple of 16
    bytes, on permuted and offset views of one storage."""
    from dlm_ops.backends import cutlass

    base = torch.empty(offset + 2 * 8 * 125 * 16, dtype=dtype)  # room for any shape below
    dims = [shape[i] * (8 if i == order[-1] else 1) for i in range(4)]
    t = base[offset:offset + torch.Size(dims).numel()].view(dims).permute(*order)
    size = t.element_size()
    expected = (t.stride(3) == 1 and t.data_ptr() % 16 == 0
                and all(t.stride(i) * size % 16 == 0 for i in range(3)))
    assert cutlass.tma_ready(t) == expected


def test_backward_scratch_is_padded_and_aligned(fake):
    """lse2 / delta: B * H * S floats plus the pad the odd-length dK/dV kernel reads (the
    preprocess kernel zeroes it: no fill launch here), each 16-byte aligned; dout in a layout TMA
    cannot read is copied, not handed to Triton."""
    backend = cd.CutlassDiffusionBackend()
    q, k, v = _batched(3, 37, 37, 5, 1, 64)  # B * H * S = 1110: not a multiple of 4
    mask = SequenceMask(37, 37, 3)
    out, lse = backend.fwd(q, k, v, mask, 0.125, 0.0, False)
    dout = torch.randn(3, 74, 5, 65).to(q.dtype)[..., 1:]  # misaligned rows
    grads = backend.bwd(dout, q, k, v, out, lse, None, mask, 0.125, 0.0, False)
    assert grads[0] != "triton" and all(not g.isnan().any() for g in grads)
    call = dict(fake.calls)["bwd"]
    rows = 3 * 5 * 74
    for t in (call["lse2"], call["delta"]):
        assert t.dim() == 1 and t.numel() >= rows + fake.scratch_pad and t.data_ptr() % 16 == 0
    assert call["dkdv_sample"] is None and call["cu_seqlens"] is None


@pytest.mark.parametrize("halves", [[0, 100, 37, 0, 256, 1, 300], [500], [0, 0, 3], [0, 0], [],
                                    [3, 2049, 0]])
@pytest.mark.parametrize("hkv", [4, 2])
def test_varlen_runs_cutlass_with_its_tables(fake, halves, hkv):
    backend = cd.CutlassDiffusionBackend()
    q, k, v, mask = _packed(halves, 4, hkv, 128)
    out, lse = backend.varlen_fwd(q, k, v, mask, 0.125, 0.0, False)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0]) and not out.isnan().any()
    dlse = torch.randn(4, q.shape[0])
    dq, dk, dv = backend.varlen_bwd(torch.randn_like(q), q, k, v, out, lse, dlse, mask, 0.125, 0.0,
                                    False)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert cd.STATS["varlen_fwd"] == cd.STATS["varlen_bwd"] == 1
    assert cd.STATS["varlen_fwd_fallback"] == cd.STATS["varlen_bwd_fallback"] == 0
    if not q.shape[0]:  # no token: the backward has nothing to launch
        (_, f), = fake.calls
        assert f["q"].shape == (1, *q.shape) and f["cu_seqlens"].tolist() == list(mask.cu_seqlens)
        return
    (_, f), (_, b) = fake.calls
    cu = list(mask.cu_seqlens)
    assert f["q"].shape == (1, *q.shape) and f["lse"].shape == (1, 4, q.shape[0])
    assert f["cu_seqlens"].tolist() == cu and b["cu_seqlens"].tolist() == cu
    # the persistent rules as batched, by the longest sample's half: the forward always, the dK/dV
    # kernel up to PERSISTENT_DKDV_MAX_HALF (one query head per K / V head) or _GQA
    assert f["max_ctas"] == 132
    limit = cd.PERSISTENT_DKDV_MAX_HALF if hkv == 4 else cd.PERSISTENT_DKDV_MAX_HALF_GQA
    assert b["persistent_dkdv"] == (max(halves, default=0) <= limit)
    assert (f["order"].tolist(), f["tile_sample"].tolist()) == entries(cu, 16, lambda m: m.fwd_tiles(128, 128))
    assert (b["dkdv_order"].tolist(), b["dkdv_sample"].tolist()) == entries(cu, 16, lambda m: m.bwd_tiles(64, 128))
    assert (b["dq_order"].tolist(), b["dq_sample"].tolist()) == entries(cu, 16, lambda m: m.fwd_tiles(128, 128))
    assert b["lse"].shape == (1, 4, q.shape[0]) and b["dlse"].shape == (1, 4, q.shape[0])
    rows = 4 * q.shape[0]  # the pad the varlen dK/dV kernel reads (the preprocess zeroes it)
    assert b["lse2"].numel() >= rows + fake.scratch_pad and b["delta"].numel() >= rows + fake.scratch_pad
    # the forward's tables served the backward: one build for both directions
    assert fake.table_builds == 1


def test_varlen_falls_back_where_batched_does(fake, monkeypatch):
    backend = cd.CutlassDiffusionBackend()
    q, k, v, mask = _packed([10, 0, 33], 4, 2, 128)

    def both(q, k, v, softcap=0.0):
        return (backend.varlen_fwd(q, k, v, mask, 0.125, softcap, False)[0],
                backend.varlen_bwd(torch.randn_like(q), q, k, v, torch.zeros_like(q),
                                   torch.zeros(4, q.shape[0]), None, mask, 0.125, softcap, False)[0])

    assert both(q, k, v, softcap=5.0) == ("triton", "triton")
    q96, k96, v96, _ = _packed([10, 0, 33], 4, 2, 96)
    assert both(q96, k96, v96) == ("triton", "triton")
    shifted = torch.randn(q.numel() + 4).to(q.dtype)[4:].view(q.shape)  # 8 bytes off: not TMA-ready
    assert both(shifted, k, v) == ("triton", "triton")
    monkeypatch.setattr(cd, "FORWARD_HEAD_DIMS", (256,))  # a D = 128 forward left to Triton
    fwd, bwd = both(q, k, v)
    assert fwd == "triton" and bwd != "triton"
    monkeypatch.setattr(cd, "_extension", lambda: None)
    assert both(q, k, v) == ("triton", "triton")
    assert cd.STATS["varlen_fwd_fallback"] == 5 and cd.STATS["varlen_bwd_fallback"] == 4
    assert cd.STATS["varlen_bwd"] == 1 and cd.STATS["varlen_fwd"] == 0


def test_varlen_tables_are_cached_per_packing_block_size_head_dim_and_device(fake):
    a = cd._varlen_tables((0, 4, 4, 10), 16, 128, "cpu")
    assert cd._varlen_tables((0, 4, 4, 10), 16, 128, "cpu") is a and fake.table_builds == 1
    for key in (((0, 4, 4, 12), 16, 128, "cpu"), ((0, 4, 4, 10), 2, 128, "cpu"),
                ((0, 4, 4, 10), 16, 256, "cpu")):
        assert cd._varlen_tables(*key) is not a
    assert fake.table_builds == 4
    assert a.cu_seqlens.dtype == torch.int32 and a.cu_seqlens.tolist() == [0, 4, 4, 10]
    assert all(t.is_contiguous() and t.dtype == torch.int32 for pair in (a.fwd, a.dkdv, a.dq) for t in pair)
    assert cd._varlen_tables.cache_info().maxsize is not None  # bounded


@pytest.mark.parametrize("halves", [[], [0, 0]])
def test_empty_packing_with_expanded_dout_runs_cutlass(fake, halves):
    """No token: autograd still calls the backward, with dout and dlse expands of zero strides
    that contiguous() keeps (seen on the H200: first the Triton fallback, then the binding's
    layout check raising on dlse). The backend takes the call and launches nothing: there is
    no gradient element to write."""
    backend = cd.CutlassDiffusionBackend()
    q, k, v, mask = _packed(halves, 4, 2, 128)
    out, lse = backend.varlen_fwd(q, k, v, mask, 0.125, 0.0, False)
    dout = torch.zeros(()).to(q.dtype).expand(q.shape)
    for dlse in (None, torch.zeros(()).expand(lse.shape)):
        dq, dk, dv = backend.varlen_bwd(dout, q, k, v, out, lse, dlse, mask, 0.125, 0.0, False)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert cd.STATS["varlen_bwd"] == 2 and cd.STATS["varlen_bwd_fallback"] == 0
    assert not [c for c in fake.calls if c[0] == "bwd"]


class DsExtension(FakeExtension):
    """An extension built with the dS backward (diffusion_bwd.cuh launch_bwd_ds)."""

    @staticmethod
    def ds_block(d):  # 64 queries x the dK/dV kernel's key tile; 0: not at this head dim
        return {128: 64 * 128, 256: 64 * 64}.get(d, 0)

    def varlen_ds_slots(self, cu, bs, d):
        assert self.ds_block(d)  # the binding's check
        return varlen_ds_slots(cu, bs, 64 if d == 256 else 128)


@pytest.mark.parametrize("nn,nc,d,max_bytes,takes", [
    (256, 384, 128, cd.DS_SCRATCH_MAX_BYTES, True),
    (0, 256, 128, cd.DS_SCRATCH_MAX_BYTES, True),      # block-causal (no noisy half)
    (256, 384, 256, cd.DS_SCRATCH_MAX_BYTES, True),    # D = 256: 64-key blocks
    (256, 200, 128, cd.DS_SCRATCH_MAX_BYTES, False),   # a half off the 128 grid
    (256, 256, 64, cd.DS_SCRATCH_MAX_BYTES, False),    # D = 64: the two-kernel dQ
    (256, 256, 128, 0, False),                         # the scratch's bound (0: off)
])
def test_ds_backward_where_it_applies(fake, monkeypatch, nn, nc, d, max_bytes, takes):
    """The dS backward: batched, D = 128 or 256, halves on the 128 grid, within
    DS_SCRATCH_MAX_BYTES; its scratch is (1 + B * H * visits) blocks of q's dtype, its table the
    slot table of the mask, its dQ order the 128-row one."""
    ext = DsExtension()
    _install(monkeypatch, ext)
    monkeypatch.setattr(cd, "DS_SCRATCH_MAX_BYTES", max_bytes)
    cd._ds_slots.cache_clear()
    mask = SequenceMask(nn, nc, 16)
    q, k, v = _batched(2, nn, nc, 4, 2, d)
    _, bwd = _run_batched(cd.CutlassDiffusionBackend(), q, k, v, mask)
    assert bwd[0] != "triton"
    call = dict(ext.calls)["bwd"]
    assert cd.STATS["bwd_ds"] == int(takes) and cd.STATS["bwd"] == 1
    if not takes:
        assert call["ds_scratch"] is None and call["ds_slots"] is None
        # nor the packed route: on the grid, or not BD3 halves (the same bound would decline it)
        assert cd.STATS["bwd_ds_packed"] == 0 and cd._varlen_ds_slots.cache_info().currsize == 0
        return
    key_tile = 64 if d == 256 else 128
    slots, visits = cd._ds_slots(nn, nc, 16, key_tile, "cpu")
    assert call["ds_visits"] == visits and torch.equal(call["ds_slots"], slots)
    assert slots.numel() == (nn + nc) // 64 * ((nn + nc) // key_tile)
    assert call["ds_scratch"].dtype == q.dtype
    assert call["ds_scratch"].numel() == (1 + 2 * 4 * visits) * 64 * key_tile
    assert torch.equal(call["dq_order"], ext.bwd_tile_orders(nn, nc, 16, d)[2])


@given(st.integers(0, 4), st.integers(0, 4), st.sampled_from([1, 3, 16, 64, 100, 128, 300]),
       st.sampled_from([64, 128]))
def test_ds_slots_cover_every_visible_pair_once_per_visit(nn_tiles, nc_tiles, bs, key_tile):
    """The slot table (cutlass_diffusion._ds_slots): one slot per visit of the dK/dV kernel (64-query
    tile x key tile of bwd_tiles(64, key_tile): 128 keys at D = 128, 64 at D = 256), numbered 0 ..
    visits - 1, consecutively within a key tile in its visit order (the kernel derives a visit's
    slot from its key tile's first); every visible pair lies in a visited tile, so the dQ kernel's
    zero block only stands in for 64-row halves without a visible pair."""
    nn, nc = 128 * nn_tiles, 128 * nc_tiles
    mask = SequenceMask(nn, nc, bs)
    slots, visits = cd._ds_slots(nn, nc, bs, key_tile, "cpu")
    s = nn + nc
    table = slots.view(s // 64, s // key_tile)
    visited = table[table >= 0]
    assert sorted(visited.tolist()) == list(range(visits))
    plans = mask.bwd_tiles(64, key_tile)
    assert visits == sum(len(p.visits) for p in plans)
    for kt, plan in enumerate(plans):
        column = [table[v.start // 64, kt].item() for v in plan.visits]
        assert column == list(range(column[0], column[0] + len(column))) if column else True
    if s:
        rows = torch.arange(s)
        seen = mask.visible(rows, rows)
        q_idx, k_idx = seen.nonzero(as_tuple=True)
        assert (table[q_idx // 64, k_idx // key_tile] >= 0).all()


@pytest.mark.parametrize("halves,d,max_bytes,takes", [
    ([0, 100, 37, 0, 256, 1, 300], 128, cd.DS_SCRATCH_MAX_BYTES, True),  # odd halves, empty samples
    ([3, 100, 300, 0, 1000], 256, cd.DS_SCRATCH_MAX_BYTES, True),       # D = 256: 64-key blocks
    ([1024, 1024], 128, cd.DS_SCRATCH_MAX_BYTES, True),
    ([100, 37], 64, cd.DS_SCRATCH_MAX_BYTES, False),                   # D = 64: the two-kernel dQ
    ([100, 37], 128, 0, False),                                        # the scratch's bound (0: off)
])
def test_varlen_ds_backward_where_it_applies(fake, monkeypatch, halves, d, max_bytes, takes):
    """Packed samples of any lengths take the dS backward at D = 128 / 256 (session 24): the
    extension's slot table with each sample's rows and the table's width, a scratch of 1 + H * visits
    blocks, the dQ-from-dS kernel's entries; the plain dK/dV order (no slot-major walk)."""
    ext = DsExtension()
    _install(monkeypatch, ext)
    monkeypatch.setattr(cd, "DS_SCRATCH_MAX_BYTES", max_bytes)
    q, k, v, mask = _packed(halves, 4, 2, d)
    backend = cd.CutlassDiffusionBackend()
    out, lse = backend.varlen_fwd(q, k, v, mask, 0.125, 0.0, False)
    assert cd._varlen_ds_slots.cache_info().currsize == 0  # a forward alone builds no slot table
    backend.varlen_bwd(torch.randn_like(q), q, k, v, out, lse, None, mask, 0.125, 0.0, False)
    call = dict(ext.calls)["bwd"]
    assert cd.STATS["varlen_bwd_ds"] == int(takes) and cd.STATS["varlen_bwd"] == 1
    cu = list(mask.cu_seqlens)
    if not takes:
        assert call["ds_scratch"] is None and call["ds_rows"] is None
        assert (call["dq_order"].tolist(), call["dq_sample"].tolist()) == entries(
            cu, 16, lambda m: m.fwd_tiles(64 if d > 128 else 128, 64 if d > 128 else 128))
        return
    key_tile = 64 if d == 256 else 128
    slots, rows, visits, width = varlen_ds_slots(cu, 16, key_tile)
    assert torch.equal(call["ds_slots"], slots) and torch.equal(call["ds_rows"], rows)
    assert call["ds_visits"] == visits and call["ds_k_tiles"] == width
    assert call["ds_scratch"].dtype == q.dtype
    assert call["ds_scratch"].numel() == (1 + 4 * visits) * 64 * key_tile
    assert (call["dq_order"].tolist(), call["dq_sample"].tolist()) == entries(
        cu, 16, lambda m: m.fwd_tiles(128, key_tile))
    assert call["dkdv_walk"] == cd.PLAIN_ORDER and call["dkdv_schedule"] is None


@pytest.mark.parametrize("b,nn,nc,d,takes", [
    (2, 200, 200, 128, True),    # BD3 halves off the 128 grid: the packed dS backward
    (3, 77, 77, 256, True),
    (2, 200, 200, 64, False),    # D = 64: no dS backward
    (2, 0, 200, 128, False),     # block-causal: not a packing of BD3 samples
    (2, 100, 120, 128, False),   # unequal halves: the same
])
def test_batched_off_grid_runs_the_packed_ds_backward(fake, monkeypatch, b, nn, nc, d, takes):
    """Batched BD3 halves off the 128 grid take the dS backward as B packed samples of equal
    length: (1, B S, H, D) views of q, k, v, dout and out, lse / dlse as (1, H, B S) copies, the
    packed tables of cu_seqlens 0, S, .., B S; gradients back in (B, S, H, D)."""
    ext = DsExtension()
    _install(monkeypatch, ext)
    mask, s = SequenceMask(nn, nc, 16), nn + nc
    q, k, v = _batched(b, nn, nc, 4, 2, d)
    lse, dlse = torch.randn(b, 4, s), torch.randn(b, 4, s)
    grads = cd.CutlassDiffusionBackend().bwd(torch.randn_like(q), q, k, v, torch.randn_like(q), lse,
                                             dlse, mask, 0.125, 0.0, False)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    call = dict(ext.calls)["bwd"]
    assert cd.STATS["bwd_ds_packed"] == int(takes) and cd.STATS["bwd_ds"] == int(takes)
    assert cd.STATS["bwd"] == 1 and cd.STATS["varlen_bwd"] == 0
    if not takes:
        assert call["cu_seqlens"] is None and call["ds_scratch"] is None
        return
    assert call["cu_seqlens"].tolist() == list(range(0, b * s + 1, s))
    assert call["q"].shape == (1, b * s, 4, d) and call["q"].data_ptr() == q.data_ptr()
    assert torch.equal(call["lse"][0], lse.transpose(0, 1).reshape(4, b * s))
    assert torch.equal(call["dlse"][0], dlse.transpose(0, 1).reshape(4, b * s))
    cu = list(range(0, b * s + 1, s))
    key_tile = 64 if d == 256 else 128
    slots, rows, visits, width = varlen_ds_slots(cu, 16, key_tile)
    assert torch.equal(call["ds_slots"], slots) and torch.equal(call["ds_rows"], rows)
    assert call["ds_visits"] == visits and call["ds_k_tiles"] == width
    assert (call["dq_order"].tolist(), call["dq_sample"].tolist()) == entries(
        cu, 16, lambda m: m.fwd_tiles(128, key_tile))


@given(st.lists(st.integers(0, 300), max_size=6), st.sampled_from([1, 3, 16, 100, 300]),
       st.sampled_from([64, 128]))
def test_varlen_ds_slots_cover_every_visible_pair_once_per_visit(halves, bs, key_tile):
    """The packed slot table (the mirror above; the GPU test compares the extension's to it): one
    slot per visit of every sample, numbered 0 .. visits - 1, consecutive within a key tile in visit
    order, every visible pair of a sample in a visited tile; a sample's rows are its own."""
    cu = [0]
    for n in halves:
        cu.append(cu[-1] + 2 * n)
    slots, rows, visits, width = varlen_ds_slots(cu, bs, key_tile)
    table = slots.view(-1, width)
    assert sorted(table[table >= 0].tolist()) == list(range(visits))
    samples = [m for _, m in VarlenMask(tuple(cu), bs).samples]
    assert table.shape[0] == sum(len(m._tiles(64)) for m in samples)
    for m, row0 in zip(samples, rows.tolist()):
        plans = m.bwd_tiles(64, key_tile)
        row_of = {lo: row0 + i for i, (lo, _) in enumerate(m._tiles(64))}
        for kt, plan in enumerate(plans):
            column = [table[row_of[v.start], kt].item() for v in plan.visits]
            assert column == list(range(column[0], column[0] + len(column))) if column else True
        if m.seqlen:
            pos = torch.arange(m.seqlen)
            q_idx, k_idx = m.visible(pos, pos).nonzero(as_tuple=True)
            tiles64, tiles_k = m._tiles(64), m._tiles(key_tile)
            row = torch.tensor([row_of[next(lo for lo, hi in tiles64 if lo <= i < hi)] for i in range(m.seqlen)])
            col = torch.tensor([next(t for t, (lo, hi) in enumerate(tiles_k) if lo <= i < hi)
                                for i in range(m.seqlen)])
            assert (table[row[q_idx], col[k_idx]] >= 0).all()


@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("b,nn,h,hkv,d,ds", [
    (8, 1024, 16, 16, 128, True),   # the dS backward: its persistent dK/dV kernel
    (4, 1024, 16, 4, 64, False),    # D = 64: persistent at every length
    (1, 4096, 16, 16, 128, False),  # n = 4K at D = 128 without dS: one CTA per key tile
    (1, 256, 2, 2, 128, True),      # fewer items than CTAs: the snake is the grid
    (4, 1024, 16, 16, 256, True),   # D = 256: no persistent dK/dV kernel
])
def test_persistent_dkdv_walks_the_balanced_schedule(fake, monkeypatch, balanced, b, nn, h, hkv, d, ds):
    """Batched backwards hand the persistent dK/dV kernel the balanced schedule of its work on the
    SM count's grid (geometry.order_schedule, items weighing their group of query heads) when
    it has more items than CTAs; BALANCED_SCHEDULE False, an item per CTA, or a dK/dV kernel that
    is not persistent: none (the snake). The forward walks the snake."""
    ext = DsExtension()
    _install(monkeypatch, ext)
    monkeypatch.setattr(cd, "BALANCED_SCHEDULE", balanced)
    monkeypatch.setattr(cd, "DS_SCRATCH_MAX_BYTES", cd.DS_SCRATCH_MAX_BYTES if ds else 0)
    cd._ds_slots.cache_clear()
    mask = SequenceMask(nn, nn, 16)
    q, k, v = _batched(b, nn, nn, h, hkv, d)
    _run_batched(cd.CutlassDiffusionBackend(), q, k, v, mask)
    bwd = dict(ext.calls)["bwd"]
    persistent = d in (64, 128) and (bwd["persistent_dkdv"] or bwd["ds_scratch"] is not None)
    if balanced and persistent and b * hkv * bwd["dkdv_order"].numel() > 132:
        walk = bwd["dkdv_walk"]  # test_short_halves_walk_slot_major says which
        assert torch.equal(bwd["dkdv_schedule"], ext.dkdv_schedule(nn, nn, 16, d, b * hkv, h // hkv, 132, *walk))
    else:
        assert bwd["dkdv_schedule"] is None
    if balanced and (b, nn, d) in ((8, 1024, 128), (4, 1024, 64)):  # the cases it is for: built
        assert bwd["dkdv_schedule"] is not None


@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("halves,h,hkv,d,ds,block", [
    ([512] * 8, 4, 4, 128, True, 4),            # the dS backward, short halves: slot-major by sample
    ([512, 100, 0, 700, 300, 512], 4, 4, 128, True, 4),
    ([2048, 2048], 4, 4, 128, True, 0),          # long halves: the plain order
    ([512] * 8, 16, 4, 128, True, 0),            # GQA: the plain order
    ([512] * 8, 4, 4, 64, False, 0),             # D = 64: persistent without dS, the plain order
    ([128, 64], 2, 2, 128, True, None),          # fewer items than CTAs: the snake
    ([512] * 8, 4, 4, 256, True, None),          # D = 256: no persistent dK/dV kernel
])
def test_packed_persistent_dkdv_walks_the_balanced_schedule(fake, monkeypatch, balanced, halves, h, hkv, d,
                                                            ds, block):
    """Packed backwards hand the persistent dK/dV kernel the balanced schedule of their work on the
    SM count's grid (geometry.varlen_walk / walk_schedule; `block` entries per round, 0 the plain
    order) when it has more items than CTAs, and the kernel decodes the plain order; BALANCED_SCHEDULE
    False, few items or no persistent kernel: none (the snake)."""
    ext = DsExtension()
    _install(monkeypatch, ext)
    monkeypatch.setattr(cd, "BALANCED_SCHEDULE", balanced)
    monkeypatch.setattr(cd, "DS_SCRATCH_MAX_BYTES", cd.DS_SCRATCH_MAX_BYTES if ds else 0)
    q, k, v, mask = _packed(halves, h, hkv, d)
    backend = cd.CutlassDiffusionBackend()
    out, lse = backend.varlen_fwd(q, k, v, mask, 0.125, 0.0, False)
    backend.varlen_bwd(torch.randn_like(q), q, k, v, out, lse, None, mask, 0.125, 0.0, False)
    bwd = dict(ext.calls)["bwd"]
    assert bwd["dkdv_walk"] == cd.PLAIN_ORDER and (bwd["ds_scratch"] is not None) == ds
    if balanced and block is not None:
        want = ext.varlen_dkdv_schedule(list(mask.cu_seqlens), 16, d, hkv, h // hkv, 132, block)
        assert torch.equal(bwd["dkdv_schedule"], want)
    else:
        assert bwd["dkdv_schedule"] is None


@pytest.mark.parametrize("scheduled", [True, False])
@pytest.mark.parametrize("layout,b,nn,h,hkv,d,ds,built", [
    ("batched", 8, 1024, 16, 16, 128, True, True),   # 8 x 16 slots x 8 query tiles > 132 items
    ("batched", 4, 2048, 32, 8, 256, True, True),    # GQA, D = 256
    ("batched", 1, 256, 4, 4, 128, True, False),     # 8 items: one CTA each, no schedule
    ("batched", 8, 1024, 16, 16, 128, False, False),  # no dS scratch: the two-kernel dQ
    ("batched", 4, 1000, 16, 16, 128, True, True),   # off the 128 grid: packed, the packing's schedule
    ("varlen", 0, 0, 16, 4, 128, True, True),
    ("varlen", 0, 0, 2, 2, 128, True, False),
])
def test_ds_dq_kernel_walks_its_balanced_schedule(fake, monkeypatch, scheduled, layout, b, nn, h, hkv, d, ds,
                                                  built):
    """The dS backward hands its dQ kernel the balanced schedule of that kernel's walk (the
    extension's ds_dq_schedule, or varlen_ds_dq_schedule for packed halves) for the call's B * H
    slots on the SM count's grid, built for the inputs' device, when it has more items than CTAs;
    DQ_SCHEDULE False, few items or no dS backward: none (the snake)."""
    ext = DsExtension()
    _install(monkeypatch, ext)
    monkeypatch.setattr(cd, "DQ_SCHEDULE", scheduled)
    monkeypatch.setattr(cd, "DS_SCRATCH_MAX_BYTES", cd.DS_SCRATCH_MAX_BYTES if ds else 0)
    cd._ds_slots.cache_clear()
    backend = cd.CutlassDiffusionBackend()
    if layout == "varlen":
        q, k, v, mask = _packed([512, 100, 0, 700, 300, 512] if built else [128, 64], h, hkv, d)
        out, lse = backend.varlen_fwd(q, k, v, mask, 0.125, 0.0, False)
        backend.varlen_bwd(torch.randn_like(q), q, k, v, out, lse, None, mask, 0.125, 0.0, False)
        want = ("varlen_ds_dq_schedule", mask.cu_seqlens, 16, d, h, hkv, 132, 0)
    else:
        q, k, v = _batched(b, nn, nn, h, hkv, d)
        _run_batched(backend, q, k, v, SequenceMask(nn, nn, 16))
        cu = tuple(range(0, 2 * nn * b + 1, 2 * nn))
        want = (("ds_dq_schedule", nn, nn, 16, d, b, h, hkv, 132, 0) if nn % 128 == 0 else
                ("varlen_ds_dq_schedule", cu, 16, d, h, hkv, 132, 0))
    bwd = dict(ext.calls)["bwd"]
    assert (bwd["ds_scratch"] is not None) == ds
    assert bwd["dq_schedule"] == (want if scheduled and built else None)


@pytest.mark.parametrize("b,nn,h,hkv,d,bs,narrow", [
    (8, 1024, 16, 16, 128, 16, True),     # the measured gain: n = 1K, block 16 and 4
    (8, 1024, 16, 16, 128, 4, True),
    (8, 1024, 32, 8, 128, 1, True),       # GQA: the kernel's visits do not depend on it
    (8, 1000, 16, 16, 128, 16, True),     # odd halves: the kernel's tiles start at each half's start
    (8, 1024, 16, 16, 128, 48, False),    # a block size not dividing 64: no narrow visit
    (8, 1024, 16, 16, 128, 128, False),
    (4, 2048, 16, 16, 128, 16, False),    # n = 2K: the narrow kernel measured 0.99x
    (8, 1024, 16, 16, 64, 16, True),      # D = 64 too
    (16, 512, 16, 16, 64, 4, True),
    (4, 2048, 16, 16, 64, 16, False),
    (8, 1024, 16, 16, 256, 16, False),    # not built at D = 256 (64-key tiles)
])
def test_narrow_diagonal_kernel_for_short_halves(fake, monkeypatch, b, nn, h, hkv, d, bs, narrow):
    """BD3 forwards ask for the kernel with the noisy diagonal's narrow visit (NARROW_DIAG_*) at
    D = 64 and 128 where halves (packed: the longest sample's) are at most NARROW_DIAG_MAX_HALF and
    the block size divides 64; block-causal calls (no noisy half) never do, packed samples not
    without NARROW_DIAG_VARLEN."""
    q, k, v = _batched(b, nn, nn, h, hkv, d)
    cd.CutlassDiffusionBackend().fwd(q, k, v, SequenceMask(nn, nn, bs), 0.1, 0.0, False)
    assert fake.calls[-1][1]["narrow_diag"] is narrow
    q, k, v = _batched(b, 0, 2 * nn, h, hkv, d)
    cd.CutlassDiffusionBackend().fwd(q, k, v, SequenceMask(0, 2 * nn, bs), 0.1, 0.0, False)
    assert fake.calls[-1][1]["narrow_diag"] is False
    q, k, v, mask = _packed([nn // 2, nn], h, hkv, d)
    mask = VarlenMask(mask.cu_seqlens, bs)
    cd.CutlassDiffusionBackend().varlen_fwd(q, k, v, mask, 0.1, 0.0, False)
    assert fake.calls[-1][1]["narrow_diag"] is narrow
    monkeypatch.setattr(cd, "NARROW_DIAG_VARLEN", False)
    cd.CutlassDiffusionBackend().varlen_fwd(q, k, v, mask, 0.1, 0.0, False)
    assert fake.calls[-1][1]["narrow_diag"] is False


@pytest.mark.parametrize("b,nn,h,hkv,d,ds,walked", [
    (8, 1024, 16, 16, 128, True, True),     # n = 1K, D = 128: forward and dS dK/dV slot-major
    (16, 512, 16, 16, 128, True, True),
    (4, 2048, 16, 16, 128, True, False),    # n = 2K: the plain order
    (8, 1024, 16, 16, 64, False, False),    # D = 64: level in the A/B, plain
    (8, 1024, 16, 16, 256, True, True),     # D = 256: slot-major up to n = 2K
    (4, 2048, 16, 16, 256, True, True),
    (2, 4096, 16, 16, 256, True, False),
    (8, 1000, 16, 16, 128, True, True),     # odd halves: the forward slot-major, the packed dS path plain
    (8, 1024, 32, 8, 128, True, False),     # GQA 32/8: plain (its backward lost 3 %)
])
def test_short_halves_walk_slot_major(fake, monkeypatch, b, nn, h, hkv, d, ds, walked):
    """Batched calls with one query head per K / V head and halves up to SHORT_HALF_MAX[head dim]
    walk their work in SHORT_HALF_ORDER: the forward, and the dS backward's dK/dV
    kernel, whose balanced schedule is then built over that walk; every other kernel and call walks
    the plain order (the binding rejects a dK/dV order without the dS path)."""
    ext = DsExtension()
    _install(monkeypatch, ext)
    cd._ds_slots.cache_clear()
    q, k, v = _batched(b, nn, nn, h, hkv, d)
    _run_batched(cd.CutlassDiffusionBackend(), q, k, v, SequenceMask(nn, nn, 16))
    calls = dict(ext.calls)
    short = cd.SHORT_HALF_ORDER if walked else cd.PLAIN_ORDER
    assert calls["fwd"]["walk"] == short
    bwd = calls["bwd"]
    assert (bwd["ds_scratch"] is not None) == ds
    packed = nn % 128 != 0  # batched BD3 off the 128 grid: the packed dS backward, the plain order
    assert bwd["dkdv_walk"] == (short if ds and not packed else cd.PLAIN_ORDER)
    if ds and d == 128 and not packed:  # the persistent dK/dV kernel on the schedule of its walk
        chunk, block = (None, 1) if not walked else cd.SHORT_HALF_ORDER
        bm, bn = 64, 128
        plans = SequenceMask(nn, nn, 16).bwd_tiles(bm, bn)
        expected = order_schedule(plans, _order(plans), b * hkv, h // hkv, 132, bm, bn, chunk, block)
        assert bwd["dkdv_schedule"].tolist() == expected


class NodeExtension(DsExtension):
    """An extension with the C++ autograd node: its plan records the keywords it is built with,
    attach_bwd the plan (no graph is built here: the GPU tests run the node)."""

    def __init__(self):
        super().__init__()
        self.bwd_kwargs = []

    def BwdPlan(self, **kw):  # noqa: N802 (the extension's class)
        return kw

    def attach_bwd(self, q, k, v, out, lse, plan):
        self.calls.append(("attach_bwd", plan))
        return out, lse

    def bwd(self, *tensors, **kw):
        self.bwd_kwargs.append(kw)
        super().bwd(*tensors, **kw)


@pytest.mark.parametrize("layout,b,nn,nc,d,hkv,layout_id", [
    ("batched", 2, 256, 256, 128, 4, cd.AS_GIVEN),     # the dS backward
    ("batched", 2, 256, 256, 64, 2, cd.AS_GIVEN),      # D = 64: the two-kernel dQ
    ("batched", 3, 200, 200, 128, 2, cd.AS_PACKED),    # off the grid: packed
    ("batched", 2, 0, 331, 128, 1, cd.AS_GIVEN),       # block-causal, odd
    ("varlen", 0, 0, 0, 128, 2, cd.AS_ONE_BATCH),
    ("varlen", 0, 0, 0, 64, 2, cd.AS_ONE_BATCH),
])
def test_native_plan_is_the_python_launch(fake, monkeypatch, layout, b, nn, nc, d, hkv, layout_id):
    """fwd_with_grad plans the backward the node will run (BwdPlan's keywords) exactly as the
    Python backward launches it (ext.bwd's keywords): one plan, two executors. The dS scratch's
    size is the one the Python executor allocates; the backward's STATS count at the plan."""
    ext = NodeExtension()
    _install(monkeypatch, ext)
    backend = cd.CutlassDiffusionBackend()
    if layout == "varlen":
        q, k, v, mask = _packed([0, 100, 37, 0, 256], 4, hkv, d)
        out, lse = backend.varlen_fwd_with_grad(q, k, v, mask, 0.125, 0.0, False)
        counted = dict(cd.STATS)
        backend.varlen_bwd(torch.randn_like(q), q, k, v, out, lse, None, mask, 0.125, 0.0, False)
        key = "varlen_bwd"
    else:
        q, k, v = _batched(b, nn, nc, 4, hkv, d)
        mask = SequenceMask(nn, nc, 16)
        out, lse = backend.fwd_with_grad(q, k, v, mask, 0.125, 0.0, False)
        counted = dict(cd.STATS)
        backend.bwd(torch.randn_like(q), q, k, v, out, lse, None, mask, 0.125, 0.0, False)
        key = "bwd"
    assert counted[key] == 1 and cd.STATS[key] == 2 and cd.STATS[key + "_fallback"] == 0
    plan = dict(ext.calls)["attach_bwd"]
    launched = ext.bwd_kwargs[-1]
    scratch = launched.pop("ds_scratch")
    assert plan.pop("layout") == layout_id and plan.pop("poison") is True  # conftest's poison
    assert plan.pop("ds_elems") == (0 if scratch is None else scratch.numel())
    assert plan.keys() == launched.keys()
    for name, value in plan.items():
        same = torch.equal(value, launched[name]) if isinstance(value, torch.Tensor) else (
            value == launched[name])
        assert same, name


def test_native_backward_off_runs_no_node(fake, monkeypatch):
    """NATIVE_BACKWARD False, an extension without the node, a softcap or a call Triton takes:
    fwd_with_grad declines (the Python node then runs the backward)."""
    q, k, v = _batched(2, 256, 256, 4, 4, 128)
    mask = SequenceMask(256, 256, 16)
    backend = cd.CutlassDiffusionBackend()
    assert backend.fwd_with_grad(q, k, v, mask, 0.125, 0.0, False) is None  # FakeExtension: none
    ext = NodeExtension()
    monkeypatch.setattr(cd, "_extension", lambda: ext)
    assert backend.fwd_with_grad(q, k, v, mask, 0.125, 0.5, False) is None  # softcap: Triton's
    assert backend.fwd_with_grad(q[..., :48], k[..., :48], v[..., :48], mask, 0.125, 0.0,
                                 False) is None  # D = 48: Triton's
    monkeypatch.setattr(cd, "NATIVE_BACKWARD", False)
    assert backend.fwd_with_grad(q, k, v, mask, 0.125, 0.0, False) is None
    assert not [c for c in ext.calls if c[0] == "attach_bwd"]
