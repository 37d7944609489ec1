"""Sparse attention (dlm_ops.block_sparse_attn, dlm_ops.column_sparse_attn) against dense attention
restricted to the selected blocks / columns (dlm_ops.reference builds that mask from the lists).

The torch backend runs in every dtype; the Triton kernels run under TRITON_INTERPRET=1 on CPU
(fp32/fp16, tiny shapes) and natively on a GPU (``-m gpu`` tests at the end)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dlm_ops
from dlm_ops.backends.sparse import transpose_block_index
from dlm_ops.backends.sparse_triton import TritonSparseBackend
from dlm_ops.backends.triton_backend import INTERPRET
from dlm_ops.ops import sparse as ops
from dlm_ops.reference import block_sparse_attn_ref, column_sparse_attn_ref

from .accuracy import ATOL, assert_rule, gold_dtype
from .strategies import HEADS, make_qkv

CUDA = torch.cuda.is_available()
TRITON_OK = CUDA or INTERPRET
DEVICE = "cuda" if CUDA else "cpu"
BLOCKS = [16, 32, 64]


# -- patterns -------------------------------------------------------------------------------------


def random_lists(shape, num_items, max_listed, mode, seed, device="cpu"):
    """int32 index lists (*shape, max_listed) and counts (*shape): the first count entries of each
    list are distinct items in [0, num_items), in random order; the entries past the count hold
    junk (out of range, repeated) that the ops must never read. mode: "random" counts (including
    0 and all), "empty" (all 0) or "all" (every item listed)."""
    gen = torch.Generator().manual_seed(seed)
    rows = int(torch.tensor(shape).prod()) if shape else 1
    if mode == "all":
        counts = torch.full((rows,), min(num_items, max_listed))
    elif mode == "empty":
        counts = torch.zeros(rows, dtype=torch.long)
    else:
        counts = torch.randint(0, min(num_items, max_listed) + 1, (rows,), generator=gen)
    idx = torch.randint(-5, num_items + 5, (rows, max_listed), generator=gen)
    for r in range(rows):
        c = int(counts[r])
        idx[r, :c] = torch.randperm(num_items, generator=gen)[:c]
    return (idx.view(*shape, max_listed).int().to(device),
            counts.view(shape).int().to(device))


def block_pattern(b, h, sq, sk, bsq, bsk, mode, seed, device="cpu", extra=1):
    nqb, nkb = -(-sq // bsq), -(-sk // bsk)
    return random_lists((b, h, nqb), nkb, nkb + extra, mode, seed, device)


# -- comparison with -inf lse rows ----------------------------------------------------------------


def _finite_lse(lse):
    """Rows that see nothing have lse -inf; the loss and the comparison use 0 there (the gradient
    through torch.where's other branch is 0, as it must be)."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _run(fn, inputs, dout, dlse):
    inputs = [t.detach().requires_grad_(True) for t in inputs]
    out, lse = fn(*inputs)
    loss = (out.float() * dout.float()).sum() + (_finite_lse(lse).float() * dlse.float()).sum()
    return [out, lse, *torch.autograd.grad(loss, inputs)]


def check_sparse(ours_fn, ref_fn, inputs, dtype):
    """The accuracy rule (tests/accuracy.py) for out, lse, dq, dk, dv, with a random dlse; lse must
    be -inf exactly where the reference's is (query blocks / heads with count 0)."""
    gen = torch.Generator().manual_seed(7)
    gold_out, gold_lse = ref_fn(*inputs, compute_dtype=gold_dtype(dtype))
    dout = torch.randn(gold_out.shape, generator=gen).to(device=gold_out.device, dtype=dtype)
    dlse = torch.randn(gold_lse.shape, generator=gen).to(gold_lse.device)
    ours = _run(ours_fn, inputs, dout, dlse)
    gold = _run(lambda *t: ref_fn(*t, compute_dtype=gold_dtype(dtype)), inputs, dout, dlse)
    plain = _run(lambda *t: ref_fn(*t, compute_dtype=dtype), inputs, dout, dlse)
    assert torch.equal(torch.isneginf(ours[1]), torch.isneginf(gold[1])), "lse -inf rows differ"
    ours[1], gold[1], plain[1] = (_finite_lse(x) for x in (ours[1], gold[1], plain[1]))
    for i, name in enumerate(["out", "lse", "dq", "dk", "dv"]):
        assert_rule(name, ours[i], gold[i], plain[i], dtype)
    assert ours[0].dtype == dtype and ours[1].dtype == torch.float32
    assert all(g.dtype == dtype for g in ours[2:])


@st.composite
def sparse_problem(draw, max_s=96, head_dims=(8, 16, 32)):
    h, hkv = draw(st.sampled_from(HEADS))
    return dict(b=draw(st.integers(1, 2)), sq=draw(st.integers(0, max_s)),
                sk=draw(st.integers(1, max_s)), h=h, hkv=hkv,
                d=draw(st.sampled_from(head_dims)), bsq=draw(st.sampled_from(BLOCKS)),
                bsk=draw(st.sampled_from(BLOCKS)),
                mode=draw(st.sampled_from(["random", "random", "empty", "all"])),
                seed=draw(st.integers(0, 10_000)))


def _block_case(p, dtype, backend, device="cpu"):
    q, k, v = make_qkv((p["b"], p["sq"], p["h"], p["d"]), (p["b"], p["sk"], p["hkv"], p["d"]),
                       dtype, p["seed"])
    q, k, v = (t.to(device) for t in (q, k, v))
    idx, cnt = block_pattern(p["b"], p["h"], p["sq"], p["sk"], p["bsq"], p["bsk"], p["mode"],
                             p["seed"], device)
    bsq, bsk = p["bsq"], p["bsk"]
    check_sparse(
        lambda q, k, v: dlm_ops.block_sparse_attn(q, k, v, idx, cnt, block_size_q=bsq,
                                                  block_size_k=bsk, return_lse=True,
                                                  backend=backend),
        lambda q, k, v, **kw: block_sparse_attn_ref(q, k, v, idx, cnt, bsq, bsk, **kw),
        (q, k, v), dtype)


def _column_case(p, dtype, backend, device="cpu"):
    q, k, v = make_qkv((p["b"], p["sq"], p["h"], p["d"]), (p["b"], p["sk"], p["hkv"], p["d"]),
                       dtype, p["seed"])
    q, k, v = (t.to(device) for t in (q, k, v))
    idx, cnt = random_lists((p["b"], p["h"]), p["sk"], p["sk"] + 2, p["mode"], p["seed"], device)
    check_sparse(
        lambda q, k, v: dlm_ops.column_sparse_attn(q, k, v, idx, cnt, return_lse=True,
                                                   backend=backend),
        lambda q, k, v, **kw: column_sparse_attn_ref(q, k, v, idx, cnt, **kw),
        (q, k, v), dtype)


# -- torch backend --------------------------------------------------------------------------------


@settings(max_examples=30)
@given(sparse_problem(), st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_block_sparse_torch(p, dtype):
    _block_case(p, dtype, "torch")


@settings(max_examples=30)
@given(sparse_problem(), st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_column_sparse_torch(p, dtype):
    _column_case(p, dtype, "torch")


def test_all_selected_equals_dense_attention():
    """Every key block listed (in a shuffled order) is plain attention: compare with SDPA."""
    q, k, v = make_qkv((1, 50, 4, 16), (1, 70, 2, 16), torch.float64, 3)
    idx, cnt = block_pattern(1, 4, 50, 70, 16, 32, "all", 3)
    out = dlm_ops.block_sparse_attn(q, k, v, idx, cnt, block_size_q=16, block_size_k=32)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, sdpa, atol=1e-12, rtol=0)
    cidx, ccnt = random_lists((1, 4), 70, 70, "all", 3)
    out = dlm_ops.column_sparse_attn(q, k, v, cidx, ccnt)
    torch.testing.assert_close(out, sdpa, atol=1e-12, rtol=0)


def test_torch_backend_chunks(monkeypatch):
    """Tiny score chunks (one query / key block or a few rows per step) give the same results."""
    from dlm_ops.backends import sparse as backend_module

    monkeypatch.setattr(backend_module, "_CHUNK_ELEMENTS", 64)
    p = dict(b=2, sq=70, sk=90, h=4, hkv=2, d=16, bsq=16, bsk=32, mode="random", seed=3)
    _block_case(p, torch.float32, "torch")
    _column_case(p, torch.float32, "torch")


def test_gradcheck_float64():
    """Both outputs (lse with its -inf rows zeroed) against finite differences, torch backend."""
    q, k, v = (t.requires_grad_() for t in make_qkv((1, 20, 2, 8), (1, 40, 1, 8), torch.float64, 1))
    idx, cnt = block_pattern(1, 2, 20, 40, 16, 16, "random", 5)
    cnt[0, 0, 0] = 0  # an empty query block: zero gradients, not NaN

    def block(q, k, v):
        out, lse = dlm_ops.block_sparse_attn(q, k, v, idx, cnt, block_size_q=16, block_size_k=16,
                                             return_lse=True, check_indices=False)
        return out, _finite_lse(lse)

    torch.autograd.gradcheck(block, (q, k, v), fast_mode=True)
    cidx, ccnt = random_lists((1, 2), 40, 12, "all", 5)
    ccnt[0, 0] = 9  # a shorter list: the last 3 entries must be ignored

    def column(q, k, v):
        out, lse = dlm_ops.column_sparse_attn(q, k, v, cidx, ccnt, return_lse=True,
                                              check_indices=False)
        return out, _finite_lse(lse)

    torch.autograd.gradcheck(column, (q, k, v), fast_mode=True)


def test_transposed_index_matches_brute_force():
    idx, cnt = block_pattern(2, 3, 200, 150, 16, 32, "random", 11)
    nkb = -(-150 // 32)
    off, rev = transpose_block_index(idx, cnt, nkb)
    assert off.dtype == rev.dtype == torch.int32
    b, h, nqb, _ = idx.shape
    for bi in range(b):
        for hi in range(h):
            for kb in range(nkb):
                r = (bi * h + hi) * nkb + kb
                want = [qb for qb in range(nqb) if kb in idx[bi, hi, qb, :cnt[bi, hi, qb]].tolist()]
                assert rev[off[r]:off[r + 1]].tolist() == want


def test_backward_is_deterministic_torch():
    q, k, v = make_qkv((1, 64, 4, 16), (1, 64, 2, 16), torch.float32, 2)
    idx, cnt = block_pattern(1, 4, 64, 64, 16, 16, "random", 2)
    cidx, ccnt = random_lists((1, 4), 64, 30, "random", 2)
    runs = []
    for _ in range(2):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        o1 = dlm_ops.block_sparse_attn(*inputs, idx, cnt, block_size_q=16, block_size_k=16)
        o2 = dlm_ops.column_sparse_attn(*inputs, cidx, ccnt)
        runs.append(torch.autograd.grad((o1 * o2).sum(), inputs))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


# -- validation -----------------------------------------------------------------------------------


def _valid_block():
    q, k, v = make_qkv((1, 40, 4, 16), (1, 33, 2, 16), torch.float32, 0)
    idx, cnt = block_pattern(1, 4, 40, 33, 16, 16, "random", 0, extra=2)
    return dict(q=q, k=k, v=v, kv_block_indices=idx, kv_block_counts=cnt, block_size_q=16,
                block_size_k=16)


def _block_call(**kw):
    a = dict(_valid_block(), **kw)
    return dlm_ops.block_sparse_attn(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("kv_block_indices"),
                                     a.pop("kv_block_counts"), **a)


def _with(t, pos, value):
    t = t.clone()
    t[pos] = value
    return t


@pytest.mark.parametrize("change,match", [
    (lambda a: dict(block_size_q=24), "block_size_q"),
    (lambda a: dict(block_size_k=8), "block_size_k"),
    (lambda a: dict(block_size_k=512), "block_size_k"),
    (lambda a: dict(kv_block_indices=a["kv_block_indices"].long()), "kv_block_indices must be an int32"),
    (lambda a: dict(kv_block_counts=a["kv_block_counts"][..., :-1]), "kv_block_counts must have shape"),
    (lambda a: dict(kv_block_indices=a["kv_block_indices"][:, :, :1]), "kv_block_indices must have shape"),
    (lambda a: dict(kv_block_counts=_with(a["kv_block_counts"], (0, 0, 0), 6)), "kv_block_counts must lie in"),
    (lambda a: dict(kv_block_counts=_with(a["kv_block_counts"], (0, 0, 0), -1)), "kv_block_counts must lie in"),
    (lambda a: dict(kv_block_indices=_with(a["kv_block_indices"], (0, 1, 0, 0), 3),
                    kv_block_counts=_with(a["kv_block_counts"], (0, 1, 0), 1)), "kv_block_indices: the first"),
    (lambda a: dict(kv_block_indices=_with(_with(a["kv_block_indices"], (0, 1, 0, 0), 2), (0, 1, 0, 1), 2),
                    kv_block_counts=_with(a["kv_block_counts"], (0, 1, 0), 2)), "distinct"),
    (lambda a: dict(v=a["v"][:, :32]), "v must have k's shape"),
    (lambda a: dict(k=a["k"][..., :8], v=a["v"][..., :8]), "k must have shape"),
    (lambda a: dict(q=a["q"][:, :, :3]), "head count"),
    (lambda a: dict(k=a["k"][:, :0], v=a["v"][:, :0]), "at least one key"),
    (lambda a: dict(q=a["q"].half()), "must have q's dtype"),
    (lambda a: dict(softmax_scale=-1.0), "softmax_scale"),
    (lambda a: dict(backend="flash"), "backend must be one of"),
])
def test_block_validation(change, match):
    with pytest.raises(ValueError, match=match):
        _block_call(**change(_valid_block()))


def test_block_validation_passes_junk_past_count_and_can_be_skipped():
    a = _valid_block()
    a["kv_block_indices"][..., -1] = 99  # past every count (max count 3 < 4 slots): never read
    _block_call(**a)
    bad = _with(a["kv_block_counts"], (0, 0, 0), 1)
    bad_idx = _with(a["kv_block_indices"], (0, 0, 0, 0), 99)
    with pytest.raises(ValueError):
        _block_call(kv_block_indices=bad_idx, kv_block_counts=bad)
    # check_indices=False trusts the caller (no host sync); valid lists give the same result.
    torch.testing.assert_close(_block_call(check_indices=False), _block_call())


@pytest.mark.parametrize("change,match", [
    (lambda i, c: (i.long(), c), "kv_indices must be an int32"),
    (lambda i, c: (i[0], c), "kv_indices must be a 3-D"),
    (lambda i, c: (i, c[:, :1]), "kv_counts must have shape"),
    (lambda i, c: (i, c + 100), "kv_counts must lie in"),
    (lambda i, c: (_with(i, (0, 0, 0), 33), _with(c, (0, 0), 1)), "lie in"),
    (lambda i, c: (_with(_with(i, (0, 0, 0), 5), (0, 0, 1), 5), _with(c, (0, 0), 2)), "distinct"),
])
def test_column_validation(change, match):
    q, k, v = make_qkv((1, 10, 4, 16), (1, 33, 2, 16), torch.float32, 0)
    idx, cnt = random_lists((1, 4), 33, 8, "random", 0)
    idx, cnt = change(idx, cnt)
    with pytest.raises(ValueError, match=match):
        dlm_ops.column_sparse_attn(q, k, v, idx, cnt)


@given(rows=st.integers(1, 4), m=st.integers(2, 6), limit=st.integers(2, 8), data=st.data(),
       fault=st.sampled_from(["none", "count low", "count high", "entry low", "entry high",
                              "duplicate"]))
def test_index_values_check_matches_its_definition(rows, m, limit, data, fault):
    """check_index_values raises iff a count leaves [0, m] (first), a listed entry leaves
    [0, limit) (then) or two listed entries are equal (last), naming the offending values; junk
    past the counts passes. Valid lists (row 0 with at least two entries), then one fault."""
    counts = [data.draw(st.integers(2 if r == 0 else 0, min(m, limit))) for r in range(rows)]
    idx = [data.draw(st.permutations(range(limit)))[:c]
           + data.draw(st.lists(st.integers(-3, limit + 3), min_size=m - c, max_size=m - c))
           for c in counts]
    r = data.draw(st.sampled_from([r for r in range(rows) if counts[r] >= 2]))
    i, j = data.draw(st.lists(st.integers(0, counts[r] - 1), min_size=2, max_size=2, unique=True))
    if fault.startswith("count"):
        counts[r] = data.draw(st.sampled_from([-1, -2] if fault == "count low" else [m + 1, m + 3]))
    elif fault.startswith("entry"):
        low = fault == "entry low"
        idx[r][i] = data.draw(st.sampled_from([-1, -3] if low else [limit, limit + 2]))
    elif fault == "duplicate":
        idx[r][j] = idx[r][i]
    ti = torch.tensor(idx, dtype=torch.int32)
    tc = torch.tensor(counts, dtype=torch.int32)
    listed = [x for row, c in zip(idx, counts) for x in row[:max(c, 0)]]
    if fault.startswith("count"):
        match = (rf"cnt must lie in \[0, {m}\] \(ix.shape\[-1\]\), got values in "
                 rf"\[{min(counts)}, {max(counts)}\]$")
    elif fault.startswith("entry"):
        bad = min(listed) if fault == "entry low" else max(listed)
        match = (rf"ix: the first count entries of every list must lie in \[0, {limit}\), "
                 rf"found {bad}$")
    elif fault == "duplicate":
        match = "must be distinct"
    else:
        ops.check_index_values(ti, tc, limit, "ix", "cnt")
        return
    with pytest.raises(ValueError, match=match):
        ops.check_index_values(ti, tc, limit, "ix", "cnt")


def test_index_values_check_passes_empty_tables_and_catches_counts_without_slots():
    no_slot = torch.zeros((3, 0), dtype=torch.int32)
    ops.check_index_values(no_slot, torch.zeros(3, dtype=torch.int32), 5, "ix", "cnt")
    with pytest.raises(ValueError, match=r"cnt must lie in \[0, 0\] .*got values in \[0, 1\]"):
        ops.check_index_values(no_slot, torch.tensor([0, 1, 0], dtype=torch.int32), 5, "ix", "cnt")
    ops.check_index_values(torch.zeros((2, 0, 4), dtype=torch.int32),
                           torch.zeros((2, 0), dtype=torch.int32), 5, "ix", "cnt")


# -- opcheck and torch.compile --------------------------------------------------------------------


def test_opcheck():
    q, k, v = (t.requires_grad_() for t in make_qkv((2, 40, 4, 16), (2, 33, 2, 16), torch.float32, 0))
    idx, cnt = block_pattern(2, 4, 40, 33, 16, 32, "random", 0)
    args = (q, k, v, idx, cnt, 16, 32, None, True, "torch")
    torch.library.opcheck(ops.block_sparse_attn_fwd, args)
    out, lse = ops.block_sparse_attn_fwd(*args)
    q, k, v = (t.detach() for t in (q, k, v))
    for dlse in (None, torch.randn_like(lse)):
        torch.library.opcheck(ops.block_sparse_attn_bwd,
                              (torch.randn_like(out), q, k, v, out.detach(), lse.detach(), dlse,
                               idx, cnt, 16, 32, 0.3, "torch"))
    cidx, ccnt = random_lists((2, 4), 33, 10, "random", 0)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    args = (q, k, v, cidx, ccnt, None, True, "torch")
    torch.library.opcheck(ops.column_sparse_attn_fwd, args)
    out, lse = ops.column_sparse_attn_fwd(*args)
    q, k, v = (t.detach() for t in (q, k, v))
    torch.library.opcheck(ops.column_sparse_attn_bwd,
                          (torch.randn_like(out), q, k, v, out.detach(), lse.detach(),
                           torch.randn_like(lse), cidx, ccnt, 0.3, "torch"))


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_cpu(dynamic):
    """Forward and backward of both ops under torch.compile(fullgraph=True) match eager; with
    dynamic=True, a new query length (and so a new number of query blocks) runs too."""
    torch._dynamo.reset()

    def step(q, k, v, idx, cnt, cidx, ccnt):
        o1, l1 = dlm_ops.block_sparse_attn(q * 2.0, k, v, idx, cnt, block_size_q=16,
                                           block_size_k=16, return_lse=True, backend="torch")
        o2 = dlm_ops.column_sparse_attn(q, k, v, cidx, ccnt, backend="torch")
        return (o1 * o2).sum() + torch.where(torch.isinf(l1), 0.0, l1).sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
    for sq in ([48, 70] if dynamic else [48]):
        q, k, v = make_qkv((1, sq, 4, 16), (1, 40, 2, 16), torch.float32, sq)
        pattern = (*block_pattern(1, 4, sq, 40, 16, 16, "random", sq),
                   *random_lists((1, 4), 40, 16, "random", sq))
        results = []
        for fn in (step, compiled):
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            loss = fn(*inputs, *pattern)
            results.append((loss, *torch.autograd.grad(loss, inputs)))
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


# -- Triton kernels (interpreter on CPU) ----------------------------------------------------------

triton_only = pytest.mark.skipif(not TRITON_OK, reason="needs a GPU or TRITON_INTERPRET=1")
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


@triton_only
@settings(max_examples=6)
@given(sparse_problem(max_s=80, head_dims=(16, 32)), st.sampled_from(KERNEL_DTYPES))
def test_block_sparse_triton(p, dtype):
    _block_case(p, dtype, "triton", DEVICE)


@triton_only
@settings(max_examples=6)
@given(sparse_problem(max_s=80, head_dims=(16, 32)), st.sampled_from(KERNEL_DTYPES))
def test_column_sparse_triton(p, dtype):
    _column_case(p, dtype, "triton", DEVICE)


FIXED = [  # hypothesis draws many degenerate shapes at 6 examples: these always run
    dict(b=2, sq=75, sk=100, h=4, hkv=2, d=32, bsq=16, bsk=32, mode="random", seed=1),
    dict(b=1, sq=130, sk=61, h=3, hkv=1, d=16, bsq=64, bsk=16, mode="random", seed=2),
    dict(b=1, sq=40, sk=90, h=2, hkv=2, d=32, bsq=32, bsk=64, mode="all", seed=3),
]


@triton_only
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("case", range(len(FIXED)))
def test_triton_fixed_cases(case, dtype):
    _block_case(FIXED[case], dtype, "triton", DEVICE)
    _column_case(FIXED[case], dtype, "triton", DEVICE)


@triton_only
@pytest.mark.parametrize("tile,bsq,bsk", [((16, 16), 32, 64), ((16, 16), 64, 32), ((16, 64), 16, 16),
                                          ((32, 32), 64, 16)])
def test_triton_tiles_and_blocks(tile, bsq, bsk):
    """Kernel tiles smaller than the selection blocks (SUB_M, SUB_N > 1) and key tiles gathered
    from several small blocks (BLOCK_N > block_size_k), partial last blocks, GQA: the kernels
    against the torch backend, forward and backward."""
    be = TritonSparseBackend(tile=tile)
    torch_be = dlm_ops.backends.REGISTRIES["sparse"]["torch"]
    q, k, v = (t.to(DEVICE) for t in make_qkv((1, 75, 4, 16), (1, 90, 2, 16), torch.float32, 9))
    idx, cnt = block_pattern(1, 4, 75, 90, bsq, bsk, "random", 9, DEVICE)
    a = be.block_fwd(q, k, v, idx, cnt, bsq, bsk, 0.3)
    b = torch_be.block_fwd(q, k, v, idx, cnt, bsq, bsk, 0.3)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=0)
    dout = torch.randn_like(q)
    ga = be.block_bwd(dout, q, k, v, *b, None, idx, cnt, bsq, bsk, 0.3)
    gb = torch_be.block_bwd(dout, q, k, v, *b, None, idx, cnt, bsq, bsk, 0.3)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, atol=5e-5, rtol=0)


@triton_only
def test_triton_non_contiguous_inputs():
    """(B, H, S, D) tensors viewed as (B, S, H, D) and index lists sliced out of a wider table."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, s, 32, generator=g).transpose(1, 2).to(DEVICE)
               for h, s in ((4, 50), (2, 70), (2, 70)))
    wide, cnt = block_pattern(1, 4, 50, 70, 16, 16, "random", 0, DEVICE, extra=3)
    idx = wide[..., :5]  # counts <= 5 key blocks: the listed entries survive the slice
    cidx_wide, ccnt = random_lists((1, 4), 70, 40, "random", 0, DEVICE)
    cidx, ccnt = cidx_wide[..., :20], ccnt.clamp(max=20)
    for fn in (lambda be: dlm_ops.block_sparse_attn(q, k, v, idx, cnt, block_size_q=16,
                                                    block_size_k=16, return_lse=True, backend=be),
               lambda be: dlm_ops.column_sparse_attn(q, k, v, cidx, ccnt, return_lse=True,
                                                     backend=be)):
        for x, y in zip(fn("triton"), fn("torch")):
            torch.testing.assert_close(x, y, atol=2e-5, rtol=0)


@pytest.mark.skipif(CUDA, reason="on a GPU the kernels compile natively in the tests above")
def test_kernels_compile_for_sm90_without_spills():
    """The interpreter never lowers a kernel: compile the backend's first-choice configs for sm90
    (H100/H200) in a subprocess without TRITON_INTERPRET, and check they fit the 227 KiB of shared
    memory and spill no registers (a spill costs more than any tile choice gains). Six attention
    kernels, SparseD's block mass, PulseCol's row LSE and column mass at D = 128 and 256."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-m", "tests.sparse_sm90_compile"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    if run.returncode and "cuobjdump" in run.stderr and "No such file" in run.stderr:
        pytest.skip("this Triton wheel ships no cuobjdump")
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line.split() for line in run.stdout.splitlines() if line.strip()]
    assert len(lines) == 11
    for name, smem, regs, stack in lines:
        assert int(smem) <= 227 * 1024, f"{name}: {smem} bytes of shared memory"
        assert int(stack) == 0, f"{name}: spills ({regs} registers, {stack} bytes of stack)"


# -- benchmark plumbing (CPU-checkable parts) -----------------------------------------------------


def test_benchmark_cases_and_table():
    from benchmarks import sparse as bench

    a = bench.parse_args(["--seqlens", "16384,65536", "--densities", "0.1,0.5", "--no-flex"])
    assert a.seqlens == [16384, 65536] and a.densities == [0.1, 0.5] and a.no_flex
    grid = bench.cases()
    assert {c.seqlen for c in grid} == {16384, 32768, 65536}
    assert all(c.heads == 32 and c.kv_heads == 8 and c.head_dim == 128 for c in grid)
    case = bench.SparseCase(16384, 0.1)
    idx, cnt = bench.block_pattern(case, device="cpu")
    assert idx.shape == (1, 32, 128, 128) and int(cnt[0, 0, 0]) == case.listed == 13
    first = idx[..., : case.listed]
    assert (first[..., 1:] > first[..., :-1]).all()  # ascending, hence distinct
    assert torch.equal(idx.sort(-1).values[0, 0, 0], torch.arange(128, dtype=torch.int32))
    rows = [dict(seqlen=16384, density=1.0, contender="dense cudnn", ms=10.0),
            dict(seqlen=16384, density=0.1, true_density=0.1, contender="dlm_ops", ms=1.1,
                 ratio=0.11, ratio_over_density=1.1),
            dict(seqlen=16384, density=0.1, true_density=0.1, contender="flex", ms=1.5,
                 ratio=0.15, ratio_over_density=1.5),
            dict(seqlen=16384, density=0.1, true_density=0.1, contender="dlm_ops triton", ms=1.65,
                 ratio=0.165, ratio_over_density=1.65)]
    table = bench.markdown(rows)
    assert ("| 16K | 0.100 | 10.00 | 1.10 | 0.110 | 1.10 | 1.50 | 0.150 | 1.50 | 1.36x | yes | 1.65 "
            "| 1.65 | 1.50x |") in table
    assert "| - | - | - |" in bench.markdown(rows[:3])  # no forced-Triton row (an older run)


def test_benchmark_column_rows_selection_and_quick_preset():
    from benchmarks import sparse as bench

    quick = bench.parse_args(["--preset", "quick"])
    assert quick.no_flex and quick.rounds == 3 and quick.tag == "h200_sparse_quick"
    assert quick.seqlens == [16384, 32768, 65536] and quick.densities == [0.1, 0.3, 0.5]
    full = bench.parse_args([])
    assert not full.no_flex and full.rounds == 5 and full.densities == [0.1, 0.2, 0.3, 0.5]
    case = bench.SparseCase(16384, 0.3)
    idx, cnt = bench.column_pattern(case, device="cpu")
    assert idx.shape == (1, 32, case.columns) and case.columns == 4915 and (cnt == 4915).all()
    assert (idx[..., 1:] > idx[..., :-1]).all() and idx.min() >= 0 and idx.max() < 16384
    rows = [dict(seqlen=16384, kind="dense", density=1.0, contender="dense cudnn", ms=10.0),
            dict(seqlen=16384, kind="column", density=0.3, true_density=0.3, contender="dlm_ops column",
                 ms=3.3, ratio=0.33, ratio_over_density=1.1, err_ours=1e-3),
            dict(seqlen=16384, kind="select", density=1.0, contender="pulsecol select (S/8 rows)",
                 ms=2.56, ratio=0.256, amortised_64=0.004, amortised_256=0.001, amortised_1024=0.00025)]
    table = bench.markdown(rows)
    assert "| 16K | 0.300 | 10.00 | 3.30 | 0.330 | 1.10 | 1.0e-03 | yes | - | - | - |" in table
    rows.insert(2, dict(seqlen=16384, kind="column", density=0.3, true_density=0.3,
                        contender="dlm_ops column triton", ms=6.6, ratio=0.66,
                        ratio_over_density=2.2, err_ours=2e-3))
    table = bench.markdown(rows)  # one line per point: the default dispatch and forced Triton
    assert ("| 16K | 0.300 | 10.00 | 3.30 | 0.330 | 1.10 | 1.0e-03 | yes | 6.60 | 2.20 | 2.00x |"
            in table) and table.count("| 16K | 0.300 |") == 1
    assert "| 16K | pulsecol select (S/8 rows) | 2.56 | 0.256 | 0.0040 | 0.0010 | 0.0003 |" in table
    rows.insert(2, dict(seqlen=16384, kind="column", density=0.3, true_density=0.3,
                        contender="dlm_ops column gather", ms=0.0456, ratio=0.0046,
                        ratio_over_density=0.015))
    table = bench.markdown(rows)  # the cutlass path's gather alone, last
    assert ("| 16K | 0.300 | 10.00 | 3.30 | 0.330 | 1.10 | 1.0e-03 | yes | 6.60 | 2.20 | 2.00x | "
            "0.046 |" in table) and table.count("| 16K | 0.300 |") == 1


# -- GPU (-m gpu) ---------------------------------------------------------------------------------


def _gpu_qkv(b, sq, sk, h, hkv, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, h, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(b, sk, hkv, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(b, sk, hkv, d, device="cuda", generator=g).to(dtype)
    return q, k, v


def _gpu_block_pattern(b, h, sq, sk, bsq, bsk, density, seed):
    """Random sets of about density * nKb key blocks per query block, some query blocks empty."""
    nqb, nkb = -(-sq // bsq), -(-sk // bsk)
    g = torch.Generator(device="cuda").manual_seed(seed)
    order = torch.rand(b, h, nqb, nkb, device="cuda", generator=g).argsort(-1).int()
    counts = torch.randint(0, max(2, int(2 * density * nkb)), (b, h, nqb), device="cuda",
                           generator=g).clamp(max=nkb).int()
    counts[:, 0, 0] = 0
    return order, counts


@pytest.mark.gpu
def test_gpu_default_backend():
    """cutlass where it can be built (sm90 + toolchain: its uncovered calls run Triton inside it),
    Triton elsewhere; fp32 and head dims the kernel lacks select Triton directly."""
    from dlm_ops.backends import cutlass_sparse, select

    q, k, _ = _gpu_qkv(1, 8, 8, 2, 2, 64, torch.bfloat16)
    ready = cutlass_sparse.CutlassSparseBackend().unavailable_reason() is None
    assert select(ops._problem(q, k), family="sparse").name == ("cutlass" if ready else "triton")
    q32, k32, _ = _gpu_qkv(1, 8, 8, 2, 2, 64, torch.float32)
    assert select(ops._problem(q32, k32), family="sparse").name == "triton"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sq,sk,h,hkv,d,bsq,bsk", [
    (1000, 1500, 8, 2, 128, 64, 128), (2048, 2048, 4, 4, 64, 128, 128), (777, 300, 4, 1, 128, 16, 32),
    (1024, 4096, 4, 2, 256, 128, 64),
])
def test_gpu_block_sparse_accuracy(dtype, sq, sk, h, hkv, d, bsq, bsk):
    q, k, v = _gpu_qkv(1, sq, sk, h, hkv, d, dtype, seed=sq)
    idx, cnt = _gpu_block_pattern(1, h, sq, sk, bsq, bsk, 0.3, sq)
    check_sparse(
        lambda q, k, v: dlm_ops.block_sparse_attn(q, k, v, idx, cnt, block_size_q=bsq,
                                                  block_size_k=bsk, return_lse=True),
        lambda q, k, v, **kw: block_sparse_attn_ref(q, k, v, idx, cnt, bsq, bsk, **kw),
        (q, k, v), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sq,sk,h,hkv,d,kmax", [(1000, 3000, 8, 2, 128, 700), (512, 512, 4, 4, 64, 512)])
def test_gpu_column_sparse_accuracy(dtype, sq, sk, h, hkv, d, kmax):
    q, k, v = _gpu_qkv(2, sq, sk, h, hkv, d, dtype, seed=sk)
    g = torch.Generator(device="cuda").manual_seed(sk)
    idx = torch.rand(2, h, sk, device="cuda", generator=g).argsort(-1)[..., :kmax].int().contiguous()
    cnt = torch.randint(1, kmax + 1, (2, h), device="cuda", generator=g).int()
    cnt[0, 0] = 0
    check_sparse(
        lambda q, k, v: dlm_ops.column_sparse_attn(q, k, v, idx, cnt, return_lse=True),
        lambda q, k, v, **kw: column_sparse_attn_ref(q, k, v, idx, cnt, **kw),
        (q, k, v), dtype)


@pytest.mark.gpu
def test_gpu_triton_agrees_with_torch_backend():
    q, k, v = _gpu_qkv(2, 700, 900, 8, 2, 128, torch.float32, seed=5)
    idx, cnt = _gpu_block_pattern(2, 8, 700, 900, 64, 64, 0.4, 5)
    dout = torch.randn_like(q)
    res = {}
    for be in ("triton", "torch"):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = dlm_ops.block_sparse_attn(*inputs, idx, cnt, block_size_q=64, block_size_k=64,
                                        backend=be)
        res[be] = (out, *torch.autograd.grad(out, inputs, dout))
    for a, b in zip(res["triton"], res["torch"]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_backward_is_bitwise_reproducible():
    q, k, v = _gpu_qkv(1, 2048, 2048, 8, 2, 128, torch.bfloat16, seed=3)
    idx, cnt = _gpu_block_pattern(1, 8, 2048, 2048, 64, 64, 0.3, 3)
    cidx = torch.arange(0, 2048, 3, device="cuda", dtype=torch.int32).expand(1, 8, -1).contiguous()
    ccnt = torch.full((1, 8), cidx.shape[-1], device="cuda", dtype=torch.int32)
    dout = torch.randn_like(q)
    runs = []
    for _ in range(5):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        o = dlm_ops.block_sparse_attn(*inputs, idx, cnt, block_size_q=64, block_size_k=64)
        o = o + dlm_ops.column_sparse_attn(*inputs, cidx, ccnt)
        runs.append((o, *torch.autograd.grad(o, inputs, dout)))
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))


@pytest.mark.gpu
def test_gpu_compile_fullgraph():
    torch._dynamo.reset()
    q, k, v = _gpu_qkv(1, 1024, 1024, 8, 2, 64, torch.bfloat16, seed=1)
    idx, cnt = _gpu_block_pattern(1, 8, 1024, 1024, 64, 64, 0.3, 1)

    def step(q, k, v):
        return dlm_ops.block_sparse_attn(q * 1.5, k, v, idx, cnt, block_size_q=64,
                                         block_size_k=64).float().pow(2).sum()

    compiled = torch.compile(step, fullgraph=True)
    res = []
    for fn in (step, compiled):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        loss = fn(*inputs)
        res.append((loss, *torch.autograd.grad(loss, inputs)))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-5)
    torch._dynamo.reset()


# -- GPU: the sm90 CUTLASS forward (dlm_ops/backends/cutlass_sparse.py) ----------------------------


def _cutlass_reason():
    """Why the sparse cutlass backend cannot run here (None: it can). On sm90 the GPU machine has
    the toolchain, so a reason there fails the test rather than skipping it."""
    from dlm_ops.backends import cutlass_sparse

    return cutlass_sparse.CutlassSparseBackend().unavailable_reason()


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _forward_rule(out, lse, ref, dtype):
    """The accuracy rule on the forward alone (out, lse) against ref(compute_dtype=...), -inf rows
    exactly the reference's and their out exactly 0."""
    gold = ref(compute_dtype=torch.float32)
    plain = ref(compute_dtype=dtype)
    empty = torch.isneginf(gold[1])
    assert torch.equal(torch.isneginf(lse), empty), "lse -inf rows differ"
    assert not (out.transpose(1, 2)[empty] != 0).any(), "a query block with no key block must give out 0"
    fin = lambda x: torch.where(empty, 0.0, x)
    assert_rule("out", out, gold[0], plain[0], dtype)
    assert_rule("lse", fin(lse), fin(gold[1]), fin(plain[1]), dtype)
    return gold


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the cutlass backend is sm90 only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sq,sk,h,hkv,d,mode", [
    (1000, 1500, 8, 2, 128, "random"),  # GQA 4, both lengths partial
    (2048, 2048, 4, 4, 64, "random"),
    (300, 700, 4, 1, 128, "all"),  # MQA, every key block listed
    (640, 333, 4, 2, 64, "empty"),  # no list: out 0, lse -inf everywhere
])
def test_gpu_cutlass_block_sparse_forward(dtype, sq, sk, h, hkv, d, mode):
    """The sm90 forward at selection blocks 128 (the default dispatch on sm90 runs it) meets the
    accuracy rule against the explicit-mask reference, and agrees with Triton's forward: its error
    at most twice Triton's (+ a tiny atol)."""
    assert _cutlass_reason() is None, _cutlass_reason()
    from dlm_ops.backends import cutlass_sparse as cs

    q, k, v = _gpu_qkv(2, sq, sk, h, hkv, d, dtype, seed=sq + d)
    if mode == "random":
        idx, cnt = _gpu_block_pattern(2, h, sq, sk, 128, 128, 0.4, sq)
    else:
        nqb, nkb = -(-sq // 128), -(-sk // 128)
        idx = torch.arange(nkb, device="cuda", dtype=torch.int32).flip(0).expand(2, h, nqb, nkb)
        idx = idx.contiguous()  # descending: order is free (the kernel need not get ascending)
        cnt = torch.full((2, h, nqb), nkb if mode == "all" else 0, device="cuda", dtype=torch.int32)
    before = dict(cs.STATS)
    with torch.no_grad():
        out, lse = dlm_ops.block_sparse_attn(q, k, v, idx, cnt, block_size_q=128, block_size_k=128,
                                             return_lse=True)
        out_t, lse_t = dlm_ops.block_sparse_attn(q, k, v, idx, cnt, block_size_q=128,
                                                 block_size_k=128, return_lse=True,
                                                 backend="triton")
    assert cs.STATS["fwd"] == before["fwd"] + 1, "the CUTLASS forward did not run"
    assert cs.STATS["fwd_fallback"] == before["fwd_fallback"]
    gold = _forward_rule(out, lse, lambda **kw: block_sparse_attn_ref(q, k, v, idx, cnt, 128, 128,
                                                                      **kw), dtype)
    _no_worse_than_triton(out, lse, out_t, lse_t, gold, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the cutlass backend is sm90 only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form,d,parts", [("block", 128, 2), ("block", 128, 8), ("block", 64, 4),
                                          ("column", 128, 4), ("column", 64, 8)])
def test_gpu_cutlass_split_tail(monkeypatch, dtype, form, d, parts):
    """The split tail (cutlass_sparse.SPLIT_PARTS; block_sparse_fwd.cuh tail_part): 136 items on
    the H200's 132 CTAs leave 4 for the last round, each split into parts over 33 CTAs and merged
    by the last part to finish. The result meets the accuracy rule, its error at most twice
    the unsplit launch's (+ a tiny atol), and split launches in a row agree: the counters are
    fresh per call."""
    assert _cutlass_reason() is None, _cutlass_reason()
    from dlm_ops.backends import cutlass_sparse as cs

    b, h, hkv, sq, sk = 1, 4, 2, 34 * 128 - 5, 3000
    if cs._max_ctas(torch.device("cuda")) != 132:
        pytest.skip("the shape is sized for 132 SMs")
    q, k, v = _gpu_qkv(b, sq, sk, h, hkv, d, dtype, seed=parts + d)
    if form == "block":
        idx, cnt = _gpu_block_pattern(b, h, sq, sk, 128, 128, 0.6, parts)
        items = cnt.numel()
        run = lambda: dlm_ops.block_sparse_attn(q, k, v, idx, cnt, block_size_q=128,
                                                block_size_k=128, return_lse=True)
        ref = lambda **kw: block_sparse_attn_ref(q, k, v, idx, cnt, 128, 128, **kw)
    else:
        idx, cnt = _gpu_column_pattern(b, h, sk, 2000, "random", parts)
        items = b * h * -(-sq // 128)
        run = lambda: dlm_ops.column_sparse_attn(q, k, v, idx, cnt, return_lse=True)
        ref = lambda **kw: column_sparse_attn_ref(q, k, v, idx, cnt, **kw)
    monkeypatch.setattr(cs, "SPLIT_PARTS", parts)
    assert cs._launch_grid(q.device, items)["split_parts"] == parts
    with torch.no_grad():
        out, lse = run()
        again = run()
        monkeypatch.setattr(cs, "SPLIT_PARTS", 0)
        out_plain, lse_plain = run()
    gold = _forward_rule(out, lse, ref, dtype)
    _no_worse_than_triton(out, lse, out_plain, lse_plain, gold, dtype)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the cutlass backend is sm90 only")
def test_gpu_cutlass_split_tail_in_a_cuda_graph(monkeypatch):
    """A split launch (the tail as a programmatic dependent launch, its scratch from the caching
    allocator) captured in a CUDA graph and replayed on new inputs gives the eager result bit for
    bit."""
    assert _cutlass_reason() is None, _cutlass_reason()
    from dlm_ops.backends import cutlass_sparse as cs

    b, h, hkv, sq, sk, d = 1, 4, 2, 34 * 128, 2048, 128
    if cs._max_ctas(torch.device("cuda")) != 132:
        pytest.skip("the shape is sized for 132 SMs")
    monkeypatch.setattr(cs, "SPLIT_PARTS", 4)
    q, k, v = _gpu_qkv(b, sq, sk, h, hkv, d, torch.bfloat16, seed=7)
    idx, cnt = _gpu_block_pattern(b, h, sq, sk, 128, 128, 0.6, 7)
    assert cs._launch_grid(q.device, cnt.numel())["split_parts"] == 4
    run = lambda: dlm_ops.block_sparse_attn(q, k, v, idx, cnt, block_size_q=128, block_size_k=128,
                                            return_lse=True, check_indices=False)
    with torch.no_grad():
        run()  # warm: the build, the work-order kernel, the allocator's blocks
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = run()
        for seed in (8, 9):
            q2, k2, v2 = _gpu_qkv(b, sq, sk, h, hkv, d, torch.bfloat16, seed=seed)
            q.copy_(q2), k.copy_(k2), v.copy_(v2)
            graph.replay()
            want, want_lse = run()
            torch.cuda.synchronize()
            assert torch.equal(out, want) and torch.equal(lse, want_lse)


def _no_worse_than_triton(out, lse, out_t, lse_t, gold, dtype):
    """The CUTLASS forward's error at most twice Triton's (+ a tiny atol), out and finite lse."""
    empty = torch.isneginf(gold[1])
    fin = lambda x: torch.where(empty, 0.0, x)
    for name, ours, triton, ref in (("out", out, out_t, gold[0]), ("lse", fin(lse), fin(lse_t), fin(gold[1]))):
        err = (ours.double() - ref.double()).abs().max().item()
        err_t = (triton.double() - ref.double()).abs().max().item()
        assert err <= 2 * err_t + ATOL[dtype], f"{name}: cutlass {err:.3g} vs triton {err_t:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the cutlass backend is sm90 only")
def test_gpu_cutlass_training_step_and_fallbacks():
    """Training through the default dispatch: the CUTLASS forward's lse feeds Triton's backward
    (the full accuracy rule on out, lse, dq, dk, dv); selection blocks 64 and non-TMA-ready rows
    run Triton's forward, counted."""
    assert _cutlass_reason() is None, _cutlass_reason()
    from dlm_ops.backends import cutlass_sparse as cs

    q, k, v = _gpu_qkv(1, 700, 900, 8, 2, 128, torch.bfloat16, seed=11)
    idx, cnt = _gpu_block_pattern(1, 8, 700, 900, 128, 128, 0.5, 11)
    before = dict(cs.STATS)
    check_sparse(
        lambda q, k, v: dlm_ops.block_sparse_attn(q, k, v, idx, cnt, block_size_q=128,
                                                  block_size_k=128, return_lse=True),
        lambda q, k, v, **kw: block_sparse_attn_ref(q, k, v, idx, cnt, 128, 128, **kw),
        (q, k, v), torch.bfloat16)
    assert cs.STATS["fwd"] > before["fwd"] and cs.STATS["bwd_fallback"] > before["bwd_fallback"]
    idx64, cnt64 = _gpu_block_pattern(1, 8, 700, 900, 64, 64, 0.5, 11)
    shifted = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)[1:].view(q.shape).copy_(q)
    fallbacks = cs.STATS["fwd_fallback"]
    with torch.no_grad():
        dlm_ops.block_sparse_attn(q, k, v, idx64, cnt64, block_size_q=64, block_size_k=64)
        out, lse = dlm_ops.block_sparse_attn(shifted, k, v, idx, cnt, block_size_q=128,
                                             block_size_k=128, return_lse=True)
    assert cs.STATS["fwd_fallback"] == fallbacks + 2
    _forward_rule(out, lse, lambda **kw: block_sparse_attn_ref(shifted, k, v, idx, cnt, 128, 128,
                                                               **kw), torch.bfloat16)


def _gpu_column_pattern(b, h, sk, kmax, mode, seed):
    """Per (b, h) kmax distinct keys in random order (not ascending); counts 0, 1, 127, 128, 129,
    kmax first (clipped to kmax), then random ("random"), all kmax ("all") or all 0 ("empty")."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    idx = torch.rand(b, h, sk, device="cuda", generator=g).argsort(-1)[..., :kmax]
    idx = idx.int().contiguous()
    if mode == "all":
        return idx, torch.full((b, h), kmax, device="cuda", dtype=torch.int32)
    if mode == "empty":
        return idx, torch.zeros((b, h), device="cuda", dtype=torch.int32)
    cnt = torch.randint(0, kmax + 1, (b * h,), device="cuda", generator=g)
    fixed = torch.tensor([0, 1, 127, 128, 129, kmax], device="cuda")[: b * h].clamp(max=kmax)
    cnt[: fixed.numel()] = fixed
    return idx, cnt.view(b, h).int()


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the cutlass backend is sm90 only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sq,sk,h,hkv,d,kmax,mode", [
    (1000, 1500, 8, 2, 128, 700, "random"),  # GQA 4, Sq / Sk / K not multiples of 128
    (512, 512, 4, 4, 64, 512, "all"),  # count = K = Sk, multiples of 128
    (300, 777, 4, 1, 128, 129, "random"),  # MQA, K one past a tile
    (640, 333, 4, 2, 64, 200, "empty"),  # every count 0: out 0, lse -inf everywhere
    (129, 4000, 16, 4, 128, 3000, "random"),  # long lists, a short last query block
])
def test_gpu_cutlass_column_sparse_forward(dtype, sq, sk, h, hkv, d, kmax, mode):
    """The sm90 column-sparse forward (gathered keys, the block-sparse kernel with key_len; the
    default dispatch on sm90) meets the accuracy rule against the explicit-mask reference, its
    error at most twice Triton's (+ a tiny atol), counted in STATS; duplicates are rejected
    before any kernel runs."""
    assert _cutlass_reason() is None, _cutlass_reason()
    from dlm_ops.backends import cutlass_sparse as cs

    q, k, v = _gpu_qkv(2, sq, sk, h, hkv, d, dtype, seed=sq + kmax)
    idx, cnt = _gpu_column_pattern(2, h, sk, kmax, mode, sq)
    before = dict(cs.STATS)
    with torch.no_grad():
        out, lse = dlm_ops.column_sparse_attn(q, k, v, idx, cnt, return_lse=True)
        out_t, lse_t = dlm_ops.column_sparse_attn(q, k, v, idx, cnt, return_lse=True,
                                                  backend="triton")
    assert cs.STATS["column_fwd"] == before["column_fwd"] + 1, "the CUTLASS forward did not run"
    assert cs.STATS["column_fwd_fallback"] == before["column_fwd_fallback"]
    gold = _forward_rule(out, lse, lambda **kw: column_sparse_attn_ref(q, k, v, idx, cnt, **kw),
                         dtype)
    _no_worse_than_triton(out, lse, out_t, lse_t, gold, dtype)
    if kmax >= 2:
        dup = idx.clone()
        dup[0, 0, 1] = dup[0, 0, 0]
        cnt2 = cnt.clone()
        cnt2[0, 0] = 2
        with pytest.raises(ValueError, match="distinct"):
            dlm_ops.column_sparse_attn(q, k, v, dup, cnt2)
        assert cs.STATS["column_fwd"] == before["column_fwd"] + 1


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the cutlass backend is sm90 only")
def test_gpu_cutlass_column_training_step_and_fallbacks():
    """Training through the default dispatch: the CUTLASS column forward's out / lse feed Triton's
    backward (the full accuracy rule on out, lse, dq, dk, dv); head dim 256 and a q that is not
    TMA-ready run Triton's forward, counted; DLM_OPS_CUTLASS=0 (read per call) selects Triton."""
    assert _cutlass_reason() is None, _cutlass_reason()
    from dlm_ops.backends import cutlass_sparse as cs

    q, k, v = _gpu_qkv(1, 700, 900, 8, 2, 128, torch.bfloat16, seed=12)
    idx, cnt = _gpu_column_pattern(1, 8, 900, 400, "random", 12)
    before = dict(cs.STATS)
    check_sparse(
        lambda q, k, v: dlm_ops.column_sparse_attn(q, k, v, idx, cnt, return_lse=True),
        lambda q, k, v, **kw: column_sparse_attn_ref(q, k, v, idx, cnt, **kw),
        (q, k, v), torch.bfloat16)
    assert cs.STATS["column_fwd"] > before["column_fwd"]
    assert cs.STATS["column_bwd_fallback"] > before["column_bwd_fallback"]
    shifted = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)[1:].view(q.shape).copy_(q)
    fallbacks, runs = cs.STATS["column_fwd_fallback"], cs.STATS["column_fwd"]
    with torch.no_grad():
        out, lse = dlm_ops.column_sparse_attn(shifted, k, v, idx, cnt, return_lse=True)
        q256, k256, v256 = _gpu_qkv(1, 300, 400, 4, 2, 256, torch.bfloat16, seed=1)
        pattern = _gpu_column_pattern(1, 4, 400, 100, "random", 1)
        dlm_ops.column_sparse_attn(q256, k256, v256, *pattern)
    assert cs.STATS["column_fwd_fallback"] == fallbacks + 1  # d 256 selects Triton directly
    _forward_rule(out, lse, lambda **kw: column_sparse_attn_ref(shifted, k, v, idx, cnt, **kw),
                  torch.bfloat16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DLM_OPS_CUTLASS", "0")
        with torch.no_grad():
            dlm_ops.column_sparse_attn(q, k, v, idx, cnt)
    assert cs.STATS["column_fwd"] == runs
