"""The sparse family's cutlass backend without a GPU (dlm_ops/backends/cutlass_sparse.py): which
calls run the sm90 block-sparse forward and which go to Triton (block sizes, head dims, TMA
alignment, empty list tables, a failed build; every backward), what it hands the extension
(tensors, block sizes, scale, the longest-first work order), the column-sparse forward's wiring
(the per-head gather of K / V, the shared block list, per-item block counts, key_len, its work
order and fallbacks), its dispatch (preferred where it builds, DLM_OPS_CUTLASS=0, forcing) and the
remembered build failure. A fake extension stands in for the build: it records its calls and
writes what the kernel must (block lists: the torch backend's result; with key_len: the masked
attention its contract defines, checked against that contract), so the backend's returned
tensors are checked against the reference too."""

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dlm_ops.backends import REGISTRIES, cutlass, select
from dlm_ops.backends import cutlass_sparse as cs
from dlm_ops.backends.base import GQA, Problem
from dlm_ops.backends.sparse import TorchSparseBackend
from dlm_ops.backends.sparse_triton import TritonSparseBackend
from dlm_ops.errors import UnsupportedConfig
from dlm_ops.reference import block_sparse_mask, column_sparse_attn_ref, masked_attention_ref

from .accuracy import assert_rule
from .test_sparse_attn import block_pattern, random_lists


class FakeExtension:
    """The extension's interface: the kernel's coverage rule, a forward that records its
    arguments and writes what the kernel must (the torch backend's out and lse), and the column
    gather (column_gather.cuh), which checks the binding's preconditions, records its call and
    writes the torch reference's buffers and plan (its contents are checked against the
    definition by the tests; the CUDA kernel against the reference by the GPU test below)."""

    def __init__(self):
        self.calls = []
        self.gathers = []

    def column_gather(self, k, v, kv_indices, kv_counts, kg, vg, key_len, block_counts,
                      shared_list, work_order, block_k):
        self.gathers.append(dict(k=k, v=v, idx=kv_indices, counts=kv_counts, kg=kg, vg=vg,
                                 key_len=key_len, blocks=block_counts, shared=shared_list,
                                 order=work_order, block_k=block_k))
        b, _, _, d = k.shape
        _, h, m = kv_indices.shape
        nqb = block_counts.shape[-1]
        assert k.stride(-1) == 1 and v.stride(-1) == 1 and v.shape == k.shape and m >= 1
        for t, shape in ((kv_indices, (b, h, m)), (kv_counts, (b, h)), (key_len, (b, h)),
                         (block_counts, (b, h, nqb)), (shared_list, (-(-m // block_k),))):
            assert t.dtype == torch.int32 and t.is_contiguous() and t.shape == shape
        for t in (kg, vg):
            assert t.dtype == k.dtype and t.is_contiguous() and t.shape == (b, m, h, d)
        if work_order is not None:
            assert work_order.dtype == torch.int32 and work_order.shape == (b * h * nqb,)
        want_len = kv_counts.clamp(0, m)
        gk, gv = cs.gather_columns(k, v, kv_indices, want_len)
        shared, blocks, order = cs.column_plan(want_len, nqb, m)
        for out, src in ((kg, gk), (vg, gv), (key_len, want_len), (block_counts, blocks),
                         (shared_list, shared), (work_order, order)):
            if out is not None:
                out.copy_(src)

    @staticmethod
    def split_scratch_floats(d, ctas):  # block_sparse_fwd.cuh
        return ctas * 2 * 128 * (64 * d // 128 + 4)

    @staticmethod
    def supports(block_q, block_k, d):  # block_sparse_fwd_supports in block_sparse_fwd.cuh
        return block_q == 128 and block_k == 128 and d in (64, 128)

    def fwd(self, q, k, v, out, lse, kv_block_indices, kv_block_counts, work_order, block_q,
            block_k, scale, key_len=None, max_ctas=0, split_parts=0, split_partials=None,
            split_counters=None):
        assert isinstance(max_ctas, int) and max_ctas >= 0
        assert isinstance(split_parts, int) and split_parts >= 0
        if split_parts and max_ctas:  # the binding's checks: the caller's scratch, counters zeroed
            assert split_partials.dtype == torch.float32
            assert split_partials.numel() >= self.split_scratch_floats(q.shape[-1], max_ctas)
            assert split_counters.dtype == torch.int32 and split_counters.numel() >= 2 * max_ctas
            assert not split_counters.any()
        self.calls.append(dict(q=q, k=k, v=v, out=out, lse=lse, idx=kv_block_indices,
                               counts=kv_block_counts, order=work_order, block_q=block_q,
                               block_k=block_k, scale=scale, key_len=key_len, max_ctas=max_ctas,
                               split_parts=split_parts))
        if key_len is None:
            o, l = TorchSparseBackend().block_fwd(q, k, v, kv_block_indices, kv_block_counts,
                                                  block_q, block_k, scale)
        else:
            o, l = self.key_len_fwd(q, k, v, kv_block_indices, kv_block_counts, block_q, block_k,
                                    scale, key_len)
        out.copy_(o), lse.copy_(l)

    @staticmethod
    def key_len_fwd(q, k, v, idx, counts, block_q, block_k, scale, key_len):
        """The kernel with key_len, the column form (block_sparse_fwd.cuh KeyLenConsumerSide):
        item (b, h, qb) sees the keys of its listed blocks below key_len[b, h], and the list is
        one arange shared by every item (the binding checks that it is shared; the kernel takes
        its entries as their indices). Asserts the contract the binding cannot check without a
        sync: the arange, key_len in [0, Sk], listed blocks below ceil(key_len / block_k), list
        slots for every count."""
        b, sq, h, _ = q.shape
        nqb, sk = counts.shape[-1], k.shape[1]
        assert idx.dim() == 1 and torch.equal(idx.cpu(), torch.arange(idx.numel(), dtype=idx.dtype))
        lists = idx.expand(b, h, nqb, idx.shape[-1])
        assert ((key_len >= 0) & (key_len <= sk)).all() and (counts <= lists.shape[-1]).all()
        listed = torch.arange(lists.shape[-1]) < counts.unsqueeze(-1)
        limit = (key_len + block_k - 1) // block_k
        assert (~listed | ((lists >= 0) & (lists < limit[..., None, None]))).all()
        mask = block_sparse_mask(lists, counts, sq, sk, block_q, block_k)
        mask = mask & (torch.arange(sk) < key_len[:, :, None, None])
        return masked_attention_ref(q, k, v, mask, softmax_scale=scale)


TRITON_ENTRY_POINTS = ("block_fwd", "block_bwd", "column_fwd", "column_bwd")


@pytest.fixture(autouse=True)
def sm_count_of_cpu_tensors(monkeypatch):
    """The fake extension's calls run on CPU tensors, where no GPU says how many SMs it has:
    the grid rule then sees an H200's 132 (GPU tests ask the device)."""
    real = cs._sm_count
    monkeypatch.setattr(cs, "_sm_count",
                        lambda device: 132 if torch.device(device).type != "cuda" else real(device))


@pytest.fixture
def fake(monkeypatch):
    """The backend wired to a FakeExtension; Triton's entry points replaced by markers."""
    ext = FakeExtension()
    monkeypatch.setattr(cs, "_EXT", ext)
    monkeypatch.setattr(cs, "_extension", lambda: ext)
    monkeypatch.setattr(cs, "STATS", dict.fromkeys(cs.STATS, 0))
    for name in TRITON_ENTRY_POINTS:
        monkeypatch.setattr(TritonSparseBackend, name, lambda self, *a, _n=name: ("triton", _n))
    return ext


def _inputs(b, sq, sk, h, hkv, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g).to(dtype)
    k, v = (torch.randn(b, sk, hkv, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def _stable_longest_first(counts):
    flat = counts.reshape(-1).tolist()
    return sorted(range(len(flat)), key=lambda e: (-flat[e], e))


@given(b=st.integers(1, 2), sq=st.integers(0, 400), sk=st.integers(1, 400),
       heads=st.sampled_from([(2, 2), (4, 1), (4, 2)]), d=st.sampled_from([64, 128]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       mode=st.sampled_from(["random", "random", "empty", "all"]), seed=st.integers(0, 1000))
def test_covered_forwards_run_cutlass_with_their_arguments(b, sq, sk, heads, d, dtype, mode, seed):
    """Selection blocks 128, D 64 / 128, any Sq / Sk (partial last blocks), GQA, empty and full
    lists: the kernel runs, gets the caller's tensors, contiguous int32 lists, the block sizes,
    the scale and a stable longest-list-first work order; out / lse are what it wrote."""
    ext = FakeExtension()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cs, "_extension", lambda: ext)
        mp.setattr(cs, "STATS", dict.fromkeys(cs.STATS, 0))
        mp.setattr(TritonSparseBackend, "block_fwd", lambda self, *a: ("triton", "block_fwd"))
        h, hkv = heads
        q, k, v = _inputs(b, sq, sk, h, hkv, d, dtype, seed)
        idx, cnt = block_pattern(b, h, sq, sk, 128, 128, mode, seed, extra=2)
        out, lse = cs.CutlassSparseBackend().block_fwd(q, k, v, idx, cnt, 128, 128, 0.3)
        stats = dict(cs.STATS)
    assert stats == dict(cs.STATS, fwd=1, fwd_fallback=0)
    (call,) = ext.calls
    assert call["q"] is q and call["k"] is k and call["v"] is v
    assert call["out"] is out and call["lse"] is lse
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    assert (call["block_q"], call["block_k"], call["scale"]) == (128, 128, 0.3)
    assert call["max_ctas"] == 132  # the persistent grid: one CTA per SM (cutlass_sparse.PERSISTENT)
    assert call["split_parts"] == cs._launch_grid(q.device, cnt.numel())["split_parts"]
    for t, src in ((call["idx"], idx), (call["counts"], cnt)):
        assert t.dtype == torch.int32 and t.is_contiguous() and torch.equal(t, src)
    order = call["order"]
    assert order.dtype == torch.int32 and order.device == cnt.device and order.is_contiguous()
    assert order.tolist() == _stable_longest_first(cnt)
    # returned as written (the fake writes the torch backend's result, tested against the
    # reference in test_sparse_attn.py), every element: the outputs start NaN-poisoned
    expect = TorchSparseBackend().block_fwd(q, k, v, idx, cnt, 128, 128, 0.3)
    assert torch.equal(out, expect[0]) and torch.equal(lse, expect[1])


def test_work_order_is_longest_first_stable_and_sync_free():
    counts = torch.tensor([[[3, 0, 5], [5, 1, 3]], [[0, 0, 7], [2, 5, 2]]], dtype=torch.int32)
    order = cs.work_order(counts)
    assert order.dtype == torch.int32 and order.shape == (12,)
    assert order.tolist() == [8, 2, 3, 10, 0, 5, 9, 11, 4, 1, 6, 7]
    assert cs.work_order(torch.zeros((1, 2, 0), dtype=torch.int32)).numel() == 0


class _OrderExtension:
    """The extension's work_order interface (csrc/bindings/work_order_sm90.cu), computed by torch,
    with its bounds: records each call."""
    work_order_max_items = 1000
    work_order_max_count = 7

    def __init__(self):
        self.calls = []

    def work_order(self, counts, order, max_count):
        assert counts.dtype == order.dtype == torch.int32 and counts.is_contiguous()
        assert order.shape == (counts.numel(),)
        self.calls.append(max_count)
        order.copy_(torch.argsort(counts.reshape(-1).clamp(0, max_count), descending=True,
                                  stable=True))


def test_work_order_takes_the_extensions_sort_within_its_bounds():
    """The extension's sort runs when it exists, the list width is given and both the
    items and the width fit its shared memory; torch's argsort otherwise (an older build, no
    width, too many items, too long lists). Both give the same order."""
    counts = torch.tensor([[[3, 0, 5], [5, 1, 3]], [[0, 0, 7], [2, 5, 2]]], dtype=torch.int32)
    want = cs.work_order(counts)
    ext = _OrderExtension()
    assert torch.equal(cs.work_order(counts, ext, 7), want) and ext.calls == [7]
    for max_count, n in ((None, 12), (8, 12), (7, 2000)):
        c = counts if n == 12 else torch.randint(0, 8, (n,), dtype=torch.int32)
        assert torch.equal(cs.work_order(c, ext, max_count), cs.work_order(c))
    assert ext.calls == [7]


def test_block_forward_passes_the_list_width_to_the_work_order(fake, monkeypatch):
    ext = _OrderExtension()
    monkeypatch.setattr(fake, "work_order", ext.work_order, raising=False)
    monkeypatch.setattr(fake, "work_order_max_items", 10_000, raising=False)
    monkeypatch.setattr(fake, "work_order_max_count", 64, raising=False)
    q, k, v = _inputs(1, 300, 260, 4, 2, 128)
    idx, cnt = block_pattern(1, 4, 300, 260, 128, 128, "random", 5, extra=2)  # 3 key blocks + 2
    cs.CutlassSparseBackend().block_fwd(q, k, v, idx, cnt, 128, 128, 0.3)
    assert ext.calls == [5]  # the list width: counts lie in [0, 5]
    assert torch.equal(fake.calls[-1]["order"], cs.work_order(cnt))


def test_uncovered_forwards_fall_back_to_triton(fake, monkeypatch):
    backend = cs.CutlassSparseBackend()
    q, k, v = _inputs(1, 300, 260, 4, 2, 128)

    def fwd(q, k, v, bsq=128, bsk=128, max_blocks=4):
        idx, cnt = block_pattern(1, 4, q.shape[1], k.shape[1], bsq, bsk, "random", 1)
        return backend.block_fwd(q, k, v, idx[..., :max_blocks], cnt.clamp(max=max_blocks), bsq,
                                 bsk, 0.1)

    assert fwd(q, k, v)[0] != "triton"  # the covered call, for contrast
    for bsq, bsk in ((64, 128), (128, 64), (64, 64), (256, 256), (16, 128)):
        assert fwd(q, k, v, bsq, bsk) == ("triton", "block_fwd")
    q256, k256, v256 = _inputs(1, 300, 260, 4, 2, 256)  # a head dim the kernel lacks
    assert fwd(q256, k256, v256) == ("triton", "block_fwd")
    shifted = torch.randn(q.numel() + 4).to(q.dtype)[4:].view(q.shape)  # 8 bytes off: not TMA-ready
    assert fwd(shifted, k, v) == ("triton", "block_fwd")
    padded = torch.randn(1, 260, 2, 136).to(k.dtype)[..., :128]  # row stride 272 B: TMA-ready
    assert fwd(q, padded, v)[0] != "triton"
    odd = torch.randn(1, 260, 2, 129).to(k.dtype)[..., :128]  # 258-byte rows
    assert fwd(q, odd, v) == ("triton", "block_fwd")
    assert fwd(q, k, v, max_blocks=0) == ("triton", "block_fwd")  # no list slot at all
    monkeypatch.setattr(cs, "_extension", lambda: None)  # a failed build
    assert fwd(q, k, v) == ("triton", "block_fwd")
    assert cs.STATS["fwd"] == 2 and cs.STATS["fwd_fallback"] == 10
    assert len(fake.calls) == 2


def test_backwards_run_triton_counted(fake):
    backend = cs.CutlassSparseBackend()
    q, k, v = _inputs(1, 256, 256, 2, 2, 128)
    idx, cnt = block_pattern(1, 2, 256, 256, 128, 128, "all", 0)
    out, lse = backend.block_fwd(q, k, v, idx, cnt, 128, 128, 0.1)
    assert backend.block_bwd(q, q, k, v, out, lse, None, idx, cnt, 128, 128, 0.1) == \
        ("triton", "block_bwd")
    cidx = torch.arange(10, dtype=torch.int32).expand(1, 2, 10).contiguous()
    ccnt = torch.full((1, 2), 10, dtype=torch.int32)
    cout, clse = backend.column_fwd(q, k, v, cidx, ccnt, 0.1)  # the CUTLASS forward ...
    # ... and Triton's backward, which reads only its out and lse (public layouts)
    assert backend.column_bwd(q, q, k, v, cout, clse, None, cidx, ccnt, 0.1) == \
        ("triton", "column_bwd")
    assert cs.STATS == dict(fwd=1, fwd_fallback=0, bwd_fallback=1, column_fwd=1,
                            column_fwd_fallback=0, column_bwd_fallback=1)


# -- column-sparse forward -------------------------------------------------------------------------


@given(b=st.integers(1, 2), sq=st.integers(0, 300), sk=st.integers(1, 400),
       heads=st.sampled_from([(2, 2), (4, 1), (4, 2)]), d=st.sampled_from([64, 128]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       mode=st.sampled_from(["random", "random", "empty", "all"]),
       slots=st.sampled_from([1, 127, 128, 129, 260, None]), seed=st.integers(0, 1000),
       gather=st.sampled_from(["kernel", "kernel, torch order", "torch"]))
def test_column_forward_runs_cutlass_over_gathered_keys(b, sq, sk, heads, d, dtype, mode, slots,
                                                        seed, gather):
    """Any Sq / Sk, GQA, K (list slots) around the 128-key tile, counts 0 / K / random, junk past
    the counts: the kernel gets q, per-query-head gathered K / V (B, K, H, D) whose listed slots
    are the listed keys and whose other slots are finite keys of the input, the shared list
    0 .. ceil(K / 128) - 1, block counts ceil(count / 128) per (b, h, query block), key_len =
    counts, a stable heads-longest-first work order, blocks 128 and the scale; what it writes
    (the fake: the kernel's contract, asserted) meets the accuracy rule against the reference.
    The same whether the extension's column_gather prepares them in one launch (ranking the
    heads, or with work_order None above RANK_MAX_HEADS and torch's sort) or, in an extension
    without it, the torch reference does; the gather gets the caller's k / v, int32 lists, fresh
    buffers and block 128, and the forward reads exactly what it wrote."""
    ext = FakeExtension()
    h, hkv = heads
    m = sk + 2 if slots is None else slots
    q, k, v = _inputs(b, sq, sk, h, hkv, d, dtype, seed)
    idx, cnt = random_lists((b, h), sk, m, mode, seed)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cs, "_extension", lambda: ext)
        mp.setattr(cs, "STATS", dict.fromkeys(cs.STATS, 0))
        mp.setattr(TritonSparseBackend, "column_fwd", lambda self, *a: ("triton", "column_fwd"))
        if gather == "torch":
            mp.delattr(FakeExtension, "column_gather")  # an extension built before it
        if gather == "kernel, torch order":
            mp.setattr(cs, "RANK_MAX_HEADS", b * h - 1)
        out, lse = cs.CutlassSparseBackend().column_fwd(q, k, v, idx, cnt, 0.3)
        stats = dict(cs.STATS)
    assert stats == dict(cs.STATS, column_fwd=1, column_fwd_fallback=0)
    (call,) = ext.calls
    if gather == "torch":
        assert not ext.gathers
    else:
        (g,) = ext.gathers
        assert g["k"] is k and g["v"] is v and g["block_k"] == 128
        assert torch.equal(g["idx"], idx) and torch.equal(g["counts"], cnt)
        # the forward reads what the gather wrote
        for fwd_arg, name in (("k", "kg"), ("v", "vg"), ("key_len", "key_len"),
                              ("counts", "blocks"), ("idx", "shared")):
            assert call[fwd_arg] is g[name]
        assert (g["order"] is call["order"]) == (gather == "kernel")
        assert (g["order"] is None) == (gather == "kernel, torch order")
    assert call["q"] is q and call["out"] is out and call["lse"] is lse
    assert (call["block_q"], call["block_k"], call["scale"]) == (128, 128, 0.3)
    assert call["max_ctas"] == 132
    assert call["split_parts"] == cs._launch_grid(q.device, call["counts"].numel())["split_parts"]
    kg, vg = call["k"], call["v"]
    for t, src in ((kg, k), (vg, v)):
        assert t.shape == (b, m, h, d) and t.dtype == dtype and t.is_contiguous()
        for bi in range(b):
            for hi in range(h):
                c, kvh = int(cnt[bi, hi]), hi // (h // hkv)
                rows = src[bi, :, kvh]
                assert torch.equal(t[bi, :c, hi], rows[idx[bi, hi, :c].long()])
                # unlisted slots: a row of the input (finite where the input is), masked anyway
                fill = rows[int(idx[bi, hi, 0])] if c else rows[0]
                assert torch.equal(t[bi, c:, hi], fill.expand(m - c, d))
    nqb, nkb = -(-sq // 128), -(-m // 128)
    shared, blocks, key_len = call["idx"], call["counts"], call["key_len"]
    assert shared.dtype == torch.int32 and shared.tolist() == list(range(nkb))
    assert blocks.dtype == torch.int32 and blocks.is_contiguous() and blocks.shape == (b, h, nqb)
    assert torch.equal(blocks, ((cnt + 127) // 128).unsqueeze(-1).expand(b, h, nqb))
    assert key_len.dtype == torch.int32 and key_len.is_contiguous() and torch.equal(key_len, cnt)
    order = call["order"]
    assert order.dtype == torch.int32 and order.is_contiguous()
    assert order.tolist() == _stable_longest_first(blocks)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    gold = column_sparse_attn_ref(q, k, v, idx, cnt, softmax_scale=0.3)
    plain = column_sparse_attn_ref(q, k, v, idx, cnt, softmax_scale=0.3, compute_dtype=dtype)
    empty = torch.isneginf(gold[1])
    assert torch.equal(torch.isneginf(lse), empty) and not (out.transpose(1, 2)[empty] != 0).any()
    fin = lambda x: torch.where(empty, 0.0, x)
    assert_rule("out", out, gold[0], plain[0], dtype)
    assert_rule("lse", fin(lse), fin(gold[1]), fin(plain[1]), dtype)


def test_column_plan_work_order_is_the_items_longest_first():
    """Sorting heads (B * H) and expanding is the stable longest-first order of the items."""
    counts = torch.tensor([[300, 0, 129, 256], [128, 300, 1, 257]], dtype=torch.int32)
    shared, blocks, order = cs.column_plan(counts, 3, 300)
    assert shared.tolist() == [0, 1, 2]
    assert blocks[:, :, 0].tolist() == [[3, 0, 2, 2], [1, 3, 1, 3]]
    assert order.tolist() == _stable_longest_first(blocks)
    assert order.tolist()[:9] == [0, 1, 2, 15, 16, 17, 21, 22, 23]
    shared, blocks, order = cs.column_plan(counts, 0, 300)  # Sq = 0: no item
    assert blocks.shape == (2, 4, 0) and order.numel() == 0


def test_column_forward_clamps_unchecked_counts_to_the_list():
    """check_indices=False with counts past K: key_len and the block counts stay within the
    gathered keys and the shared list (the kernel never reads past either)."""
    ext = FakeExtension()
    q, k, v = _inputs(1, 130, 300, 2, 2, 64)
    idx = torch.arange(200, dtype=torch.int32).expand(1, 2, 200).contiguous()
    cnt = torch.tensor([[250, -3]], dtype=torch.int32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cs, "_extension", lambda: ext)
        cs.CutlassSparseBackend().column_fwd(q, k, v, idx, cnt, 0.1)
    (call,) = ext.calls
    assert call["key_len"].tolist() == [[200, 0]]
    assert call["counts"][:, :, 0].tolist() == [[2, 0]] and call["idx"].numel() == 2


def test_uncovered_column_forwards_fall_back_to_triton(fake, monkeypatch):
    backend = cs.CutlassSparseBackend()
    q, k, v = _inputs(1, 300, 260, 4, 2, 128)
    idx, cnt = random_lists((1, 4), 260, 100, "random", 3)

    def fwd(q, k, v, idx=idx, cnt=cnt):
        return backend.column_fwd(q, k, v, idx, cnt, 0.1)

    assert fwd(q, k, v)[0] != "triton"  # the covered call, for contrast
    odd = torch.randn(1, 260, 2, 129).to(k.dtype)[..., :128]  # 258-byte rows: gathered, so fine
    assert fwd(q, odd, v)[0] != "triton"
    q256, k256, v256 = _inputs(1, 300, 260, 4, 2, 256)  # a head dim the kernel lacks
    assert fwd(q256, k256, v256) == ("triton", "column_fwd")
    shifted = torch.randn(q.numel() + 4).to(q.dtype)[4:].view(q.shape)  # q 8 bytes off
    assert fwd(shifted, k, v) == ("triton", "column_fwd")
    assert fwd(q, k, v, idx[..., :0], cnt * 0) == ("triton", "column_fwd")  # K = 0: no slot
    monkeypatch.setattr(cs, "_extension", lambda: None)  # a failed build
    assert fwd(q, k, v) == ("triton", "column_fwd")
    assert cs.STATS["column_fwd"] == 2 and cs.STATS["column_fwd_fallback"] == 4
    assert len(fake.calls) == 2


def test_column_gather_needs_a_unit_stride_in_d(fake):
    """k / v with a stride in D (not what the CUDA gather reads) take the torch gather; the
    forward still runs CUTLASS over the same buffers."""
    q, _, v = _inputs(1, 130, 200, 4, 2, 64)
    k = torch.randn(1, 200, 2, 128).to(torch.bfloat16)[..., ::2]  # stride 2 in D
    idx, cnt = random_lists((1, 4), 200, 50, "random", 4)
    cs.CutlassSparseBackend().column_fwd(q, k, v, idx, cnt, 0.1)
    assert not fake.gathers and len(fake.calls) == 1
    assert torch.equal(fake.calls[0]["k"], cs.gather_columns(k, v, idx, cnt)[0])
    cs.CutlassSparseBackend().column_fwd(q, k.contiguous(), v, idx, cnt, 0.1)
    assert len(fake.gathers) == 1 and fake.gathers[0]["k"].is_contiguous()


@pytest.fixture
def buildable(monkeypatch):
    """Dispatch as on an sm90 machine whose toolchain can build the extension."""
    monkeypatch.setattr(cutlass, "_TOOLCHAIN", [None])
    monkeypatch.setattr(cs, "_BUILD_ERROR", None)
    monkeypatch.delenv("DLM_OPS_CUTLASS", raising=False)


def test_dispatch_prefers_cutlass_where_it_builds(buildable, monkeypatch):
    assert isinstance(REGISTRIES["sparse"]["cutlass"], cs.CutlassSparseBackend)
    pick = lambda dtype=torch.bfloat16, d=128, forced=None: select(
        Problem("cuda", dtype, d, frozenset({GQA})), forced, family="sparse").name
    assert pick() == "cutlass" and pick(torch.float16, 64) == "cutlass"
    # what the kernel cannot take at all selects Triton directly
    assert pick(torch.float32) == "triton" and pick(d=256) == "triton" and pick(d=96) == "triton"
    assert select(Problem("cpu", torch.bfloat16, 128), family="sparse").name == "torch"
    monkeypatch.setenv("DLM_OPS_CUTLASS", "0")  # opted out: Triton everywhere, forcing still works
    assert pick() == "triton" and pick(forced="cutlass") == "cutlass"
    monkeypatch.setattr(cutlass, "_TOOLCHAIN", ["no CUDA GPU visible"])
    monkeypatch.delenv("DLM_OPS_CUTLASS")
    assert pick() == "triton"
    with pytest.raises(UnsupportedConfig, match="no CUDA GPU visible"):
        pick(forced="cutlass")


def test_a_failed_build_is_remembered_warned_once_and_reported(buildable, monkeypatch):
    builds = []

    def failing_build(name, sources):
        builds.append((name, list(sources)))
        raise RuntimeError("nvcc: error in block_sparse_fwd.cuh")

    monkeypatch.setattr(cs.cutlass, "build", failing_build)
    monkeypatch.setattr(cs, "_EXT", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cs._extension() is None and cs._extension() is None
    assert len(builds) == 1 and len(caught) == 1 and "triton backend runs instead" in str(caught[0].message)
    name, sources = builds[0]
    assert name == "dlm_sparse_sm90"  # its own extension: none of the block-diffusion units
    assert "bindings/sparse_sm90.cpp" in sources and not any("diffusion" in s for s in sources)
    assert {f"hopper/block_sparse_fwd_{t}_d{d}.cu" for t in ("bf16", "fp16") for d in (64, 128)} \
        <= set(sources)
    reason = cs.CutlassSparseBackend().unavailable_reason()
    assert "sm90 build failed" in reason and "block_sparse_fwd.cuh" in reason
    assert select(Problem("cuda", torch.bfloat16, 128), family="sparse").name == "triton"


def test_sources_exist_in_csrc():
    """Every unit the build names is in csrc/: the bindings here, the kernel units beside the
    kernel header (hopper/block_sparse_fwd.cuh, written on the sm90 kernel's branch)."""
    from dlm_ops.backends.cutlass import csrc_dir

    root = csrc_dir()
    bindings = [s for s in cs.SOURCES if s.startswith("bindings/")]
    assert bindings and all((root / s).is_file() for s in bindings)
    if not (root / "hopper" / "block_sparse_fwd.cuh").is_file():
        pytest.skip("the sm90 block-sparse kernel is not in this checkout yet")
    missing = [s for s in cs.SOURCES if not (root / s).is_file()]
    assert not missing, f"missing from csrc/: {missing}"


# -- on the H200 (-m gpu): the CUDA gather against the torch reference ----------------------------


@pytest.fixture(scope="module")
def sparse_ext():
    """The built dlm_sparse_sm90 extension; skipped where the toolchain cannot build it, a failed
    build fails."""
    reason = cutlass.unavailable_reason()
    if reason:
        pytest.skip(f"the CUTLASS extension cannot be built here: {reason}")
    ext = cs._extension()
    assert ext is not None, cs._BUILD_ERROR
    return ext


def _gpu_kv(b, sk, hkv, d, dtype, layout, seed):
    """k and v (B, Sk, Hkv, D) in a layout: "contiguous"; "transposed" (made (B, Hkv, Sk, D) and
    viewed back: key stride D, head stride Sk D); "padded" (rows D + 4 apart: 8-byte strides, the
    8-byte vector path); "offset" (one element past an aligned base: the 2-byte path)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, device="cuda", generator=g).to(dtype)
    if layout == "transposed":
        return tuple(make(b, hkv, sk, d).transpose(1, 2) for _ in range(2))
    if layout == "padded":
        return tuple(make(b, sk, hkv, d + 4)[..., :d] for _ in range(2))
    if layout == "offset":
        return tuple(make(b * sk * hkv * d + 1)[1:].view(b, sk, hkv, d) for _ in range(2))
    return make(b, sk, hkv, d), make(b, sk, hkv, d)


@pytest.mark.gpu
@pytest.mark.parametrize("n,max_count,kind", [
    (1, 0, "uniform"), (4096, 13, "uniform"), (4096, 128, "random"), (31, 5, "random"),
    (8193, 40, "random"), (12000, 3, "random"), (5000, 65535, "random"), (3000, 9, "unchecked"),
    (2 ** 14, 512, "random"), (1000, 1, "two"), (2, 7, "random")])
def test_gpu_work_order_is_torchs_stable_argsort(sparse_ext, n, max_count, kind):
    """ext.work_order (csrc/hopper/work_order.cuh) against torch's stable descending argsort,
    into a poisoned buffer: uniform counts (the identity path), random ones with many ties (the
    radix sort), one and two items, n not a multiple of the block, the largest count and item
    number the kernel takes, two values; "unchecked": counts outside [0, max_count] are clamped
    (what an unchecked call may pass: the order stays a permutation)."""
    g = torch.Generator(device="cuda").manual_seed(n + max_count)
    if kind == "uniform":
        counts = torch.full((n,), max_count, dtype=torch.int32, device="cuda")
    elif kind == "two":
        counts = torch.randint(0, 2, (n,), generator=g, device="cuda").to(torch.int32)
    else:
        lo, hi = (-3, max_count + 4) if kind == "unchecked" else (0, max_count + 1)
        counts = torch.randint(lo, hi, (n,), generator=g, device="cuda").to(torch.int32)
    order = torch.full((n,), -7, dtype=torch.int32, device="cuda")
    sparse_ext.work_order(counts, order, max_count)
    want = torch.argsort(counts.clamp(0, max_count), descending=True, stable=True)
    assert torch.equal(order.long(), want)
    assert torch.equal(cs.work_order(counts.clamp(0, max_count).view(1, 1, n), sparse_ext,
                                     max_count).long(), want)


_REFUSALS = textwrap.dedent("""
    import torch
    from dlm_ops.backends import cutlass_sparse as cs
    ext = cs._extension()
    counts = torch.zeros(ext.work_order_max_items + 1, dtype=torch.int32, device="cuda")
    for args in ((counts, torch.empty_like(counts), 3),
                 (counts[:8], torch.empty_like(counts[:8]), ext.work_order_max_count + 1)):
        try:
            ext.work_order(*args)
            print("returned")
        except RuntimeError as e:
            print("raised:", str(e).splitlines()[0])
    """)


@pytest.mark.gpu
def test_gpu_work_order_refuses_what_its_shared_memory_cannot_hold(sparse_ext):
    """Past its bounds the binding raises (the backend sorts with torch there: CPU test above).
    In a subprocess: an extension built with a toolchain that links libstdc++ statically ended
    the process (SIGSEGV) when a binding raised (csrc/NOTES.md "Session 30"; fixed by linking the
    process's libstdc++, "Session 32"), and a regression there should fail this test alone
    instead of ending the run before the GPU cases below."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _REFUSALS], capture_output=True, text=True, env=env,
                       timeout=900)
    assert r.returncode == 0, (f"the process ended with {r.returncode} (negative: a signal, the "
                               f"device build's crash on a C++ exception): {r.stderr[-2000:]}")
    outcomes = [line for line in r.stdout.splitlines() if line.startswith(("raised", "returned"))]
    assert len(outcomes) == 2 and all(o.startswith("raised") for o in outcomes), r.stdout
    assert "items" in outcomes[0] and "max_count" in outcomes[1], outcomes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "padded", "offset"])
@pytest.mark.parametrize("m,nqb", [(300, 3), (1, 2), (128, 0)])
def test_gpu_column_gather_matches_the_torch_gather_bitwise(sparse_ext, dtype, d, heads, layout,
                                                            m, nqb):
    """ext.column_gather against gather_columns and column_plan, bit for bit, into poisoned
    buffers: counts 0 / 1 / 127 / 128 / 129 / K / random / past K / negative per head (clamped to
    [0, K]: what an unchecked call may pass), junk past the counts (out of range: never read),
    GQA and MQA, k / v in four layouts (each vector width), D 64 / 128, bf16 / fp16, K = 1,
    Sq = 0 (no item); and with work_order None the rest is written alike."""
    h, hkv = heads
    b, sk = 2, 700
    k, v = _gpu_kv(b, sk, hkv, d, dtype, layout, seed=m + d + hkv)
    g = torch.Generator(device="cuda").manual_seed(m)
    idx = torch.randint(-5, sk + 5, (b, h, m), device="cuda", generator=g, dtype=torch.int32)
    counts = torch.tensor([0, 1, 127, 128, 129, m, m + 5, -2, 40, 200, 3, 299, 64, 0, 250, 17],
                          dtype=torch.int32, device="cuda").view(b, h).clamp(max=m + 5)
    listed = torch.rand(b, h, sk, device="cuda", generator=g).argsort(-1)[..., :m].int()
    clamped = counts.clamp(0, m)
    slot = torch.arange(m, device="cuda")
    idx = torch.where(slot < clamped.unsqueeze(-1), listed, idx).contiguous()
    want_k, want_v = cs.gather_columns(k, v, idx, clamped)
    want_shared, want_blocks, want_order = cs.column_plan(clamped, nqb, m)
    for with_order in (True, False):
        kg = torch.full((b, m, h, d), float("nan"), dtype=dtype, device="cuda")
        vg = torch.full_like(kg, float("nan"))
        poison = lambda *shape: torch.full(shape, -7, dtype=torch.int32, device="cuda")
        key_len, blocks, shared = poison(b, h), poison(b, h, nqb), poison(-(-m // 128))
        order = poison(b * h * nqb) if with_order else None
        sparse_ext.column_gather(k, v, idx, counts, kg, vg, key_len, blocks, shared, order, 128)
        assert torch.equal(kg, want_k) and torch.equal(vg, want_v)
        assert torch.equal(key_len, clamped) and torch.equal(blocks, want_blocks)
        assert torch.equal(shared, want_shared)
        if with_order:
            assert torch.equal(order, want_order)


@pytest.mark.gpu
def test_gpu_column_gather_reads_zeros_for_rows_outside_the_keys(sparse_ext):
    """An unchecked call listing a key outside [0, Sk): that slot reads zeros (like TMA's fill),
    never memory past k / v; the other slots as listed."""
    k, v = _gpu_kv(1, 50, 1, 64, torch.bfloat16, "contiguous", seed=0)
    idx = torch.tensor([[[3, 50, -1, 7]]], dtype=torch.int32, device="cuda")
    counts = torch.tensor([[4]], dtype=torch.int32, device="cuda")
    kg, vg = (torch.full((1, 4, 1, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
              for _ in range(2))
    plan = [torch.empty(s, dtype=torch.int32, device="cuda")
            for s in ((1, 1), (1, 1, 1), (1,), (1,))]
    sparse_ext.column_gather(k, v, idx, counts, kg, vg, *plan, 128)
    for got, src in ((kg, k), (vg, v)):
        assert torch.equal(got[0, [0, 3], 0], src[0, [3, 7], 0])
        assert not (got[0, [1, 2]] != 0).any()
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_gpu_column_forward_is_the_same_with_either_gather(sparse_ext, monkeypatch, layout):
    """The column-sparse forward through the CUDA gather and through the torch one: the same
    kernel inputs, so the same out and lse bit for bit (the kernel is deterministic), at a head
    count above RANK_MAX_HEADS too (torch's sort of the work order)."""
    b, sq, sk, h, hkv, d = 2, 300, 900, 8, 2, 128
    q = torch.randn(b, sq, h, d, device="cuda").bfloat16()
    k, v = _gpu_kv(b, sk, hkv, d, torch.bfloat16, layout, seed=1)
    idx = torch.rand(b, h, sk, device="cuda").argsort(-1)[..., :400].int().contiguous()
    cnt = torch.randint(0, 401, (b, h), device="cuda").int()
    backend = cs.CutlassSparseBackend()
    runs = [backend.column_fwd(q, k, v, idx, cnt, 0.09)]
    monkeypatch.setattr(cs, "RANK_MAX_HEADS", 1)
    runs.append(backend.column_fwd(q, k, v, idx, cnt, 0.09))
    monkeypatch.setattr(cs, "_extension", lambda: _WithoutGather(sparse_ext))
    runs.append(backend.column_fwd(q, k, v, idx, cnt, 0.09))
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])


class _WithoutGather:
    """The extension as built before column_gather: everything but that function."""

    def __init__(self, ext):
        self._ext = ext

    def __getattr__(self, name):
        if name == "column_gather":
            raise AttributeError(name)
        return getattr(self._ext, name)


def test_the_grid_rule(monkeypatch):
    """Both forwards run the persistent grid (one CTA per SM) unless PERSISTENT is off; the last
    round is split where it holds at most half a grid of items (each then gets two CTAs or more)."""
    cpu = torch.device("cpu")
    assert cs._max_ctas(cpu) == 132
    parts = cs.SPLIT_PARTS
    assert parts >= 2
    for items, split in ((4096, parts), (4092, 0), (4092 + 66, parts), (4092 + 67, 0),
                         (1, parts), (66, parts), (67, 0), (132, 0), (0, 0)):
        assert cs._launch_grid(cpu, items) == {"max_ctas": 132, "split_parts": split}, items
    monkeypatch.setattr(cs, "PERSISTENT", False)
    assert cs._max_ctas(cpu) == 0
    assert cs._launch_grid(cpu, 4096) == {"max_ctas": 0, "split_parts": 0}


@pytest.mark.parametrize("d", [64, 128])
def test_the_split_scratch_is_allocated_by_the_backend(d):
    """launch_args adds the split tail's scratch where the grid splits (the partials the kernel's
    size, the counters zeroed), and nothing where it does not: the binding allocates nothing, so
    an out-of-memory error raises in Python (csrc/NOTES.md "Session 23")."""
    ext, q = FakeExtension(), torch.zeros(1, 4, 2, d)
    split = cs.launch_args(ext, q, 4096)
    assert split["split_parts"] == cs.SPLIT_PARTS and split["max_ctas"] == 132
    assert split["split_partials"].dtype == torch.float32
    assert split["split_partials"].numel() == ext.split_scratch_floats(d, 132)
    assert split["split_counters"].dtype == torch.int32 and split["split_counters"].numel() == 2 * 132
    assert not split["split_counters"].any()
    assert cs.launch_args(ext, q, 4092) == {"max_ctas": 132, "split_parts": 0}
