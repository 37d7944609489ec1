"""Pattern selection (dlm_ops.sparsity): formats, SparseD / BA-Att / PulseCol, step caches."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dlm_ops
from dlm_ops.reference import attention_mass_ref, column_mass_ref, masked_attention_ref
from dlm_ops.sparsity import (
    BAAttCache,
    PulseColCache,
    SparseDCache,
    ba_att_scores,
    ba_att_select,
    block_table_to_indices,
    column_mask_to_indices,
    indices_to_block_table,
    indices_to_column_mask,
    pulse_steps,
    pulsecol_column_mass,
    pulsecol_select,
    sparsed_block_mass,
    sparsed_select,
)
from dlm_ops.sparsity.ba_att import select_from_scores
from dlm_ops.sparsity.pulsecol import keep_count
from dlm_ops.sparsity.sparsed import part_k, prompt_blocks
from dlm_ops.sparsity.tables import topk_mask

from .strategies import HEADS


def _qk(b, sq, sk, h, hkv, d, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, sq, h, d, generator=gen) * scale,
            torch.randn(b, sk, hkv, d, generator=gen) * scale)


def check_index_invariants(idx, cnt, n):
    """Counts in range, first ``count`` entries ascending (so unique) and in [0, n), padding 0."""
    assert idx.dtype == torch.int32 and cnt.dtype == torch.int32
    assert idx.shape[:-1] == cnt.shape and idx.shape[-1] == max(1, int(cnt.max()))
    assert (cnt >= 0).all() and (cnt <= n).all()
    slot = torch.arange(idx.shape[-1])
    valid = slot < cnt.unsqueeze(-1)
    assert ((idx >= 0) & (idx < n))[valid].all()
    assert (idx[~valid] == 0).all()
    ascending = idx[..., 1:] > idx[..., :-1]
    assert ascending[valid[..., 1:]].all()


# --- formats -----------------------------------------------------------------------------------

@settings(max_examples=30)
@given(shape=st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 5), st.integers(1, 9)),
       density=st.sampled_from([0.0, 0.3, 0.7, 1.0]), seed=st.integers(0, 99))
def test_block_table_round_trip(shape, density, seed):
    gen = torch.Generator().manual_seed(seed)
    table = torch.rand(shape, generator=gen) < density  # includes empty and all-selected rows
    idx, cnt = block_table_to_indices(table)
    check_index_invariants(idx, cnt, shape[-1])
    assert torch.equal(cnt, table.sum(-1, dtype=torch.int32))
    assert torch.equal(indices_to_block_table(idx, cnt, shape[-1]), table)
    col = table.flatten(2)
    cidx, ccnt = column_mask_to_indices(col)
    assert torch.equal(indices_to_column_mask(cidx, ccnt, col.shape[-1]), col)


def test_block_table_layout_and_errors():
    table = torch.zeros(1, 1, 3, 5, dtype=torch.bool)
    table[0, 0, 0, [4, 1]] = True
    table[0, 0, 2] = True
    idx, cnt = block_table_to_indices(table)
    assert cnt.tolist() == [[[2, 0, 5]]]
    assert idx.tolist() == [[[[1, 4, 0, 0, 0], [0, 0, 0, 0, 0], [0, 1, 2, 3, 4]]]]
    idx, cnt = block_table_to_indices(torch.zeros(1, 2, 2, 3, dtype=torch.bool))
    assert idx.shape == (1, 2, 2, 1) and (cnt == 0).all()  # width at least 1
    with pytest.raises(ValueError, match="table"):
        block_table_to_indices(torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match="table"):
        block_table_to_indices(torch.zeros(2, 3, 4, dtype=torch.bool))


def test_topk_ties_go_to_the_lowest_index():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 3.0]])
    assert topk_mask(scores, 3).nonzero()[:, 1].tolist() == [1, 2, 4]
    flat = torch.zeros(2, 7)
    assert topk_mask(flat, 4).nonzero()[:, 1].tolist() == [0, 1, 2, 3] * 2
    per_row = topk_mask(flat, torch.tensor([1, 5]))
    assert per_row.sum(-1).tolist() == [1, 5] and per_row[1, :5].all()


# --- SparseD -----------------------------------------------------------------------------------

@settings(max_examples=12)
@given(sq=st.integers(1, 40), sk=st.integers(1, 40), heads=st.sampled_from(HEADS),
       bq=st.sampled_from([1, 4, 16]), bk=st.sampled_from([1, 4, 16]),
       prompt=st.one_of(st.none(), st.integers(0, 45)), chunks=st.integers(1, 3),
       seed=st.integers(0, 99))
def test_sparsed_chunked_mass_equals_materialised(sq, sk, heads, bq, bk, prompt, chunks, seed):
    h, hkv = heads
    q, k = _qk(2, sq, sk, h, hkv, 8, seed, scale=2.0)
    npb = prompt_blocks(prompt, sk, bk)
    split = min(sk, npb * bk) if npb else None
    ref = attention_mass_ref(q, k, block_size_q=bq, block_size_k=bk, split=split)
    for chunk_q, chunk_k in ((None, None), (bq * chunks, bk * chunks)):
        mass = sparsed_block_mass(q, k, block_size_q=bq, block_size_k=bk, prompt_len=prompt,
                                  chunk_q=chunk_q, chunk_k=chunk_k)
        torch.testing.assert_close(mass.double(), ref, rtol=1e-5, atol=1e-6)


@settings(max_examples=12)
@given(s=st.integers(8, 64), heads=st.sampled_from(HEADS), block=st.sampled_from([4, 8, 16]),
       rho=st.sampled_from([0.0, 0.1, 0.3, 0.5, 1.0]), prompt=st.integers(1, 60),
       seed=st.integers(0, 99))
def test_sparsed_selection_invariants(s, heads, block, rho, prompt, seed):
    h, hkv = heads
    q, k = _qk(2, s, s, h, hkv, 16, seed, scale=1.5)
    idx, cnt = sparsed_select(q, k, block_size_q=block, block_size_k=block, rho=rho,
                              prompt_len=prompt)
    nkb = math.ceil(s / block)
    npb = prompt_blocks(prompt, s, block)
    check_index_invariants(idx, cnt, nkb)
    parts = [(0, npb), (npb, nkb)] if 0 < npb < nkb else [(0, nkb)]
    assert (cnt == sum(part_k(b - a, rho) for a, b in parts)).all()
    table = indices_to_block_table(idx, cnt, nkb)
    split = min(s, npb * block) if 0 < npb < nkb else None
    mass = attention_mass_ref(q, k, block_size_q=block, block_size_k=block, split=split)
    for a, b in parts:  # isolated: each part present, and its selected blocks are its heaviest
        sel, m = table[..., a:b], mass[..., a:b]
        assert (sel.sum(-1) == part_k(b - a, rho)).all()
        lowest_kept = m.masked_fill(~sel, math.inf).amin(-1)
        highest_dropped = m.masked_fill(sel, -math.inf).amax(-1)
        assert (lowest_kept >= highest_dropped - 1e-6).all()


def test_sparsed_ties_are_deterministic():
    # q = 0: every probability is uniform, so all full key blocks hold equal mass; the partial
    # last block (6 of 8 keys) holds less. Each part must keep its lowest-indexed blocks.
    q, k = torch.zeros(1, 30, 2, 8), torch.randn(1, 30, 1, 8)
    idx, cnt = sparsed_select(q, k, block_size_q=8, block_size_k=4, rho=0.3, prompt_len=10)
    # 8 key blocks: prompt [0, 3) keeps int(0.9)+1 = 1, generation [3, 8) keeps int(1.5)+1 = 2.
    assert (cnt == 3).all()
    assert (idx == torch.tensor([0, 3, 4], dtype=torch.int32)).all()
    again = sparsed_select(q, k, block_size_q=8, block_size_k=4, rho=0.3, prompt_len=10,
                           chunk_q=8, chunk_k=4)
    assert torch.equal(again[0], idx)


def test_chunks_fit_the_memory_bound():
    from dlm_ops.sparsity._pooling import CHUNK_BYTES, LIVE_COPIES, chunk_sizes

    for b, h, s, blk in ((1, 32, 65536, 64), (4, 32, 16384, 128), (1, 8, 100, 16), (2, 2, 7, 3)):
        cq, ck = chunk_sizes(b, h, s, s, blk, blk)
        assert cq % blk == 0 and ck % blk == 0 and ck <= max(blk, 4096)
        assert LIVE_COPIES * 4 * b * h * cq * ck <= CHUNK_BYTES or cq == blk


def test_sparsed_validation():
    q, k = _qk(1, 8, 8, 2, 1, 8, 0)
    with pytest.raises(ValueError, match="rho"):
        sparsed_select(q, k, block_size_q=4, block_size_k=4, rho=1.5)
    with pytest.raises(ValueError, match="block_size_k"):
        sparsed_select(q, k, block_size_q=4, block_size_k=0, rho=0.5)
    with pytest.raises(ValueError, match="prompt_len"):
        sparsed_select(q, k, block_size_q=4, block_size_k=4, rho=0.5, prompt_len=-1)
    with pytest.raises(ValueError, match="head count"):
        sparsed_select(q, _qk(1, 8, 8, 2, 3, 8, 0)[1], block_size_q=4, block_size_k=4, rho=0.5)
    with pytest.raises(ValueError, match="chunk_q"):
        sparsed_block_mass(q, k, block_size_q=4, block_size_k=4, chunk_q=6)


# --- BA-Att ------------------------------------------------------------------------------------

def _heteroscedastic(seed, heads=16, s=256, d=32, block=16, clusters=6, support=4):
    """Key blocks as clusters with their own mean *and* spread, queries from the same clusters.

    Each cluster direction lives on ``support`` of the d coordinates (massive-activation channels;
    the diagonal correction sees variance along coordinates). Block J's keys: mean m_J u_c, std
    0.3 + tau_J on the cluster's coordinates, m_J and tau_J independent U(0, 3). Mean pooling sees
    m_J only; the mass depends on both.
    """
    g = torch.Generator().manual_seed(seed)
    nb = s // block
    dirs = torch.zeros(heads, clusters, d)
    for h in range(heads):
        for c in range(clusters):
            dirs[h, c, torch.randperm(d, generator=g)[:support]] = \
                torch.randn(support, generator=g).sign() / math.sqrt(support)
    kdir = dirs[torch.arange(heads)[:, None], torch.randint(0, clusters, (heads, nb), generator=g)]
    m = 3.0 * torch.rand(heads, nb, 1, 1, generator=g)
    std = 0.3 + 3.0 * torch.rand(heads, nb, 1, generator=g) * kdir.abs() * math.sqrt(support)
    k = m * kdir[:, :, None] + std[:, :, None] * torch.randn(heads, nb, block, d, generator=g)
    qdir = dirs[torch.arange(heads)[:, None], torch.randint(0, clusters, (heads, nb), generator=g)]
    q = 3.0 * qdir[:, :, None] + 0.3 * torch.randn(heads, nb, block, d, generator=g)
    to_layout = lambda x: x.reshape(heads, s, d).transpose(0, 1)[None] * d ** 0.25  # noqa: E731
    return to_layout(q), to_layout(k)


def _mass_captured(scores, oracle, k):
    sel = topk_mask(scores, k)
    return ((oracle * sel).sum(-1) / oracle.sum(-1)).mean().item()


def test_ba_att_correction_ranks_closer_to_the_oracle():
    """The variance correction captures more oracle mass than plain mean pooling (16 heads x 16
    query blocks, top 2 and 4 of 16 key blocks). Measured here: 0.64 -> 0.88 (top 2), 0.79 -> 0.97
    (top 4), against 0.94 / 0.98 for the oracle's own top-k; the margin asked is 0.05."""
    q, k = _heteroscedastic(seed=0)
    oracle = attention_mass_ref(q, k, block_size_q=16, block_size_k=16)
    for top in (2, 4):
        got = {m: _mass_captured(ba_att_scores(q, k, block_size_q=16, block_size_k=16, method=m,
                                               outliers=0), oracle, top)
               for m in ("mean", "corrected")}
        assert got["corrected"] >= got["mean"] + 0.05, got


def test_ba_att_sorting_is_permutation_invariant_and_outliers_are_exact():
    q, k = _qk(1, 24, 24, 2, 1, 8, 3, scale=1.5)
    base = ba_att_scores(q, k, block_size_q=8, block_size_k=8, outliers=2)
    perm = torch.cat([torch.randperm(8, generator=torch.Generator().manual_seed(i)) + 8 * i
                      for i in range(3)])
    torch.testing.assert_close(ba_att_scores(q, k[:, perm], block_size_q=8, block_size_k=8,
                                             outliers=2), base)
    # Every key an outlier: score = log sum_j exp(s mu_Q.k_j + s^2/2 v_Q.k_j^2), exactly.
    full = ba_att_scores(q, k, block_size_q=8, block_size_k=8, outliers=8)
    s = 1 / math.sqrt(8)
    qb = q[0, :, 0].view(3, 8, 8)
    mu, var = qb.mean(1), qb.var(1, unbiased=False)
    kb = k[0, :, 0].view(3, 8, 8)
    expect = torch.logsumexp(s * torch.einsum("id,jtd->ijt", mu, kb)
                             + 0.5 * s * s * torch.einsum("id,jtd->ijt", var, kb ** 2), -1)
    torch.testing.assert_close(full[0, 0], expect, rtol=1e-5, atol=1e-5)


@settings(max_examples=10)
@given(s=st.integers(5, 60), heads=st.sampled_from(HEADS), block=st.sampled_from([4, 16]),
       method=st.sampled_from(["mean", "corrected"]), outliers=st.integers(0, 2),
       sel=st.sampled_from([("rho", 0.2), ("rho", 0.6), ("mass", 0.5), ("mass", 0.9)]),
       seed=st.integers(0, 99))
def test_ba_att_selection_invariants(s, heads, block, method, outliers, sel, seed):
    h, hkv = heads
    q, k = _qk(2, s, s, h, hkv, 16, seed)
    kw = {sel[0]: sel[1]}
    idx, cnt = ba_att_select(q, k, block_size_q=block, block_size_k=block, method=method,
                             outliers=outliers, **kw)
    nkb = math.ceil(s / block)
    check_index_invariants(idx, cnt, nkb)
    assert (cnt >= 1).all()
    scores = ba_att_scores(q, k, block_size_q=block, block_size_k=block, method=method,
                           outliers=outliers)
    if sel[0] == "rho":
        assert (cnt == part_k(nkb, sel[1])).all()
    else:  # the fewest blocks whose estimated mass reaches the threshold
        est = torch.softmax(scores, -1)
        kept = (indices_to_block_table(idx, cnt, nkb) * est).sum(-1)
        assert (kept >= sel[1] - 1e-5).all()
        smallest_kept = est.masked_fill(~indices_to_block_table(idx, cnt, nkb), 2).amin(-1)
        assert ((kept - smallest_kept < sel[1]) | (cnt == 1)).all()


def test_ba_att_validation():
    q, k = _qk(1, 8, 8, 2, 1, 8, 0)
    with pytest.raises(ValueError, match="exactly one of rho"):
        ba_att_select(q, k, block_size_q=4, block_size_k=4)
    with pytest.raises(ValueError, match="method"):
        ba_att_select(q, k, block_size_q=4, block_size_k=4, rho=0.5, method="max")
    with pytest.raises(ValueError, match="outliers"):
        ba_att_scores(q, k, block_size_q=4, block_size_k=4, outliers=-1)
    with pytest.raises(ValueError, match="mass"):
        select_from_scores(torch.zeros(1, 3), mass=2.0)


# --- PulseCol ----------------------------------------------------------------------------------

@settings(max_examples=10)
@given(sq=st.integers(1, 40), sk=st.integers(1, 40), heads=st.sampled_from(HEADS),
       rows=st.one_of(st.none(), st.integers(1, 50)), keep=st.sampled_from([0.0, 0.25, 1.0]),
       chunk=st.sampled_from([None, 3]), seed=st.integers(0, 99))
def test_pulsecol_mass_and_invariants(sq, sk, heads, rows, keep, chunk, seed):
    h, hkv = heads
    q, k = _qk(2, sq, sk, h, hkv, 8, seed, scale=2.0)
    mass = pulsecol_column_mass(q, k, sample_rows=rows, chunk_rows=chunk, chunk_k=chunk)
    picked = None if rows is None or rows >= sq else torch.arange(rows) * sq // rows
    torch.testing.assert_close(mass.double(), column_mass_ref(q, k, picked), rtol=1e-5, atol=1e-6)
    idx, cnt = pulsecol_select(q, k, keep=keep, sample_rows=rows)
    check_index_invariants(idx, cnt, sk)
    assert (cnt == keep_count(sk, keep)).all()
    chosen = indices_to_column_mask(idx, cnt, sk)
    assert (mass.masked_fill(~chosen, math.inf).amin(-1)
            >= mass.masked_fill(chosen, -math.inf).amax(-1) - 1e-6).all()


def test_pulsecol_ties_and_rows():
    q, k = torch.zeros(1, 9, 2, 8), torch.randn(1, 12, 2, 8)
    idx, cnt = pulsecol_select(q, k, keep=0.25)  # uniform mass: the lowest 3 columns
    assert idx.tolist() == [[[0, 1, 2], [0, 1, 2]]] and (cnt == 3).all()
    with pytest.raises(ValueError, match="sample_rows"):
        pulsecol_select(q, k, keep=0.5, sample_rows=torch.tensor([0, 9]))
    with pytest.raises(ValueError, match="keep"):
        pulsecol_select(q, k, keep=-0.1)


# --- step caches -------------------------------------------------------------------------------

def block_sparse_ref(q, k, v, indices, counts, *, block_size_q, block_size_k, softmax_scale=None,
                     compute_dtype=torch.float32):
    """Dense attention restricted to the listed key blocks (an explicit mask)."""
    nkb = math.ceil(k.shape[1] / block_size_k)
    table = indices_to_block_table(indices, counts, nkb)
    mask = table.repeat_interleave(block_size_q, 2)[:, :, :q.shape[1]]
    mask = mask.repeat_interleave(block_size_k, 3)[..., :k.shape[1]]
    return masked_attention_ref(q, k, v, mask, softmax_scale=softmax_scale,
                                compute_dtype=compute_dtype)[0].to(q.dtype)


def column_sparse_ref(q, k, v, indices, counts, *, softmax_scale=None):
    mask = indices_to_column_mask(indices, counts, k.shape[1])[:, :, None, :]
    return masked_attention_ref(q, k, v, mask, softmax_scale=softmax_scale)[0].to(q.dtype)


def _qkv(b=2, s=32, h=4, hkv=2, d=16, seed=0):
    q, k = _qk(b, s, s, h, hkv, d, seed)
    return q, k, torch.randn(b, s, hkv, d, generator=torch.Generator().manual_seed(seed + 1))


def test_cache_schedule_selects_at_first_sparse_step_and_refreshes():
    calls = []
    cache = PulseColCache(num_steps=10, skip=0.3, keep=0.5, refresh_steps=(6, 8),
                          sparse_attention=lambda *a, **kw: calls.append(a[3]) or column_sparse_ref(*a, **kw))
    q, k, v = _qkv()
    selected = {}  # (layer, step) -> the index tensor held after that step
    for step in range(10):
        for layer in (0, 1):
            cache.attend(layer, step, q, k, v)
            if layer in cache.patterns:
                selected[layer, step] = cache.patterns[layer][0]
    decisions = [d for layer, _, d in cache.history if layer == 0]
    assert decisions == ["full"] * 3 + ["select", "reuse", "reuse", "select", "reuse", "select", "reuse"]
    assert [s for _, s, d in cache.history if d == "select"] == [3, 3, 6, 6, 8, 8]
    assert len(calls) == 2 * 7  # every sparse step of both layers ran the sparse op
    for step in range(3, 10):  # each sparse step used the pattern of the latest selection
        for layer in (0, 1):
            assert calls[2 * (step - 3) + layer] is selected[layer, step]
            latest = max(s for s in (3, 6, 8) if s <= step)
            assert selected[layer, step] is selected[layer, latest]
    assert selected[0, 3] is not selected[0, 6] and selected[0, 3] is not selected[1, 3]
    assert pulse_steps(64, 0.25, 3) == (28, 40, 52)


def test_cache_reuses_the_pattern_and_matches_restricted_dense_attention():
    q, k, v = _qkv()
    cache = SparseDCache(num_steps=4, skip=0.25, rho=0.3, block_size=8, prompt_len=12,
                         sparse_attention=block_sparse_ref)
    out0 = cache.attend("L", 0, q, k, v)  # full: SDPA
    torch.testing.assert_close(out0, masked_attention_ref(q, k, v, torch.ones(32, 32, dtype=torch.bool))[0])
    out1 = cache.attend("L", 1, q, k, v)  # select + sparse
    idx, cnt = sparsed_select(q, k, block_size_q=8, block_size_k=8, rho=0.3, prompt_len=12)
    assert torch.equal(cache.patterns["L"][0], idx)
    torch.testing.assert_close(out1, block_sparse_ref(q, k, v, idx, cnt, block_size_q=8, block_size_k=8))
    held = cache.patterns["L"]
    q2, k2, v2 = _qkv(seed=5)  # new inputs, old pattern: reuse must not reselect
    out2 = cache.attend("L", 2, q2, k2, v2)
    assert cache.patterns["L"] is held
    torch.testing.assert_close(out2, block_sparse_ref(q2, k2, v2, idx, cnt, block_size_q=8, block_size_k=8))
    assert cache.memory_bytes() == idx.numel() * 4 + cnt.numel() * 4


def test_cache_is_batch_aware():
    q, k, v = _qkv(b=3)
    cache = BAAttCache(num_steps=3, skip=0.0, rho=0.25, block_size=8, sparse_attention=block_sparse_ref)
    cache.attend(0, 0, q, k, v)
    idx, cnt = cache.patterns[0]
    per_sample = [ba_att_select(q[i:i + 1], k[i:i + 1], block_size_q=8, block_size_k=8, rho=0.25)
                  for i in range(3)]
    for i, (pi, _) in enumerate(per_sample):  # each sample got its own pattern
        assert torch.equal(idx[i:i + 1], pi)
    keep = [2, 0]  # sample 1 finished; the others keep their patterns
    out = cache.attend(0, 1, q[keep], k[keep], v[keep], samples=keep)
    torch.testing.assert_close(out, block_sparse_ref(q[keep], k[keep], v[keep], idx[keep], cnt[keep],
                                                     block_size_q=8, block_size_k=8))
    with pytest.raises(ValueError, match="samples"):
        cache.attend(0, 2, q[:2], k[:2], v[:2])
    with pytest.raises(ValueError, match="step"):
        cache.decide(0, 3)
    with pytest.raises(ValueError, match="refresh_steps"):
        SparseDCache(num_steps=4, skip=0.5, rho=0.3, block_size=8, refresh_steps=(4,))


@pytest.mark.parametrize("make", [
    lambda: SparseDCache(num_steps=6, skip=0.0, rho=0.3, block_size=16, prompt_len=24, refresh_steps=(4,)),
    lambda: PulseColCache(num_steps=6, skip=0.0, keep=0.5, refresh_steps=(4,)),
])
def test_cache_checks_a_pattern_once_per_selection_and_shape(make, monkeypatch):
    """The index check (a host sync per call) runs at a pattern's first sparse step and again only
    when a length changes, not at every reuse step; the outputs stay the op's."""
    import dlm_ops.ops.sparse as sparse_ops

    checks = []
    real = sparse_ops.check_index_values
    monkeypatch.setattr(sparse_ops, "check_index_values", lambda *a: checks.append(a) or real(*a))
    q, k, v = _qkv(s=80)
    cache = make()
    for step in range(4):  # select, reuse x 3
        cache.attend(0, step, q, k, v)
    assert len(checks) == 1
    cache.attend(0, 4, q, k, v)  # refresh: a new pattern, checked
    assert len(checks) == 2
    k2, v2 = k[:, :64], v[:, :64]  # fewer keys: the held pattern is checked again
    try:
        cache.attend(0, 5, q, k2, v2)
    except ValueError as e:  # (when it lists a key past the 64th, as it may)
        assert "must lie in" in str(e)
    assert len(checks) == 3


def test_cache_calls_block_sparse_attn():
    q, k, v = _qkv(s=80)  # 5 blocks of 16 (the op's smallest block), prompt ends mid-block
    cache = SparseDCache(num_steps=2, skip=0.0, rho=0.3, block_size=16, prompt_len=24)
    out = cache.attend(0, 0, q, k, v)
    idx, cnt = cache.patterns[0]
    torch.testing.assert_close(out, block_sparse_ref(q, k, v, idx, cnt, block_size_q=16, block_size_k=16),
                               rtol=1e-5, atol=1e-5)


def test_cache_calls_column_sparse_attn():
    q, k, v = _qkv()
    cache = PulseColCache(num_steps=2, skip=0.0, keep=0.4)
    out = cache.attend(0, 0, q, k, v)
    idx, cnt = cache.patterns[0]
    torch.testing.assert_close(out, column_sparse_ref(q, k, v, idx, cnt), rtol=1e-5, atol=1e-5)


# --- the fused selection kernel (Triton; CPU runs it under TRITON_INTERPRET=1) ---------------------

@pytest.mark.parametrize("dtype,sq,sk,heads,d,bq,bk,prompt", [
    (torch.float32, 70, 50, (4, 2), 24, 16, 16, 20),   # partial blocks both ways, GQA, D not pow2
    (torch.float32, 64, 96, (2, 2), 16, 32, 16, None),  # Sq != Sk, one part
    (torch.float16, 48, 48, (3, 1), 32, 16, 32, 40),   # MQA, prompt ends mid-block
])
def test_triton_block_mass_matches_torch(dtype, sq, sk, heads, d, bq, bk, prompt):
    h, hkv = heads
    q, k = (t.to(dtype) for t in _qk(2, sq, sk, h, hkv, d, 7, scale=1.5))
    kw = dict(block_size_q=bq, block_size_k=bk, prompt_len=prompt)
    ours = sparsed_block_mass(q, k, backend="triton", **kw)
    gold = sparsed_block_mass(q.double(), k.double(), backend="torch", **kw)
    plain = sparsed_block_mass(q, k, backend="torch", **kw)  # fp32 compute on the same inputs
    assert torch.isfinite(ours).all()  # every entry written (outputs start as NaN in tests)
    err, base = (ours.double() - gold).abs().max(), (plain.double() - gold).abs().max()
    assert err <= 2 * base + 1e-5, (err, base)  # fp32 logits both: a fused-vs-chunked rounding gap
    idx_t = sparsed_select(q, k, rho=0.3, backend="triton", **kw)
    idx_c = sparsed_select(q, k, rho=0.3, backend="torch", **kw)
    assert torch.equal(idx_t[1], idx_c[1])


def test_select_backend_dispatch():
    q, k = _qk(1, 32, 32, 2, 2, 16, 0)
    with pytest.raises(dlm_ops.UnsupportedConfig, match="any_block_size"):
        sparsed_block_mass(q, k, block_size_q=8, block_size_k=16, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        sparsed_block_mass(q, k, block_size_q=16, block_size_k=16, backend="cuda")
    from dlm_ops.backends import REGISTRIES, select
    from dlm_ops.backends.base import Problem
    assert select(Problem("cpu", torch.float32, 16), family="sparse_select").name == "torch"
    assert {"torch", "triton"} <= set(REGISTRIES["sparse_select"])


# --- dlm::sparse_block_mass: opcheck and torch.compile -------------------------------------------

@pytest.mark.parametrize("sq,sk,heads,bq,bk,split", [(20, 20, (4, 2), 4, 4, 8), (13, 9, (2, 2), 8, 2, 9)])
def test_opcheck_sparse_block_mass(sq, sk, heads, bq, bk, split):
    q, k = _qk(2, sq, sk, *heads, 16, 0)
    torch.library.opcheck(torch.ops.dlm.sparse_block_mass.default,
                          (q, k, bq, bk, split, None, None, None, "torch"))
    with pytest.raises(ValueError, match="split"):
        torch.ops.dlm.sparse_block_mass(q, k, bq, bk, 3, None, None, None, "torch")


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_sparsed_select_matches_eager(dynamic):
    from torch._dynamo.testing import CompileCounterWithBackend

    def select(q, k):
        return sparsed_select(q * 1.5, k, block_size_q=4, block_size_k=4, rho=0.3, prompt_len=8,
                              backend="torch")

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(select, backend=counter, fullgraph=True, dynamic=dynamic)
    for s in ([24, 32] if dynamic else [24]):
        q, k = _qk(2, s, s, 4, 2, 16, s)
        for got, want in zip(compiled(q, k), select(q, k)):
            assert torch.equal(got, want)
    torch._dynamo.reset()


# --- GPU (run with -m gpu on a CUDA machine) -------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("s,bq,bk,prompt", [(2048, 64, 64, 1500), (3000, 128, 32, None), (1024, 16, 128, 512)])
def test_gpu_triton_block_mass(dtype, s, bq, bk, prompt):
    gen = torch.Generator(device="cuda").manual_seed(s)
    q = torch.randn(2, s, 32, 128, device="cuda", generator=gen).to(dtype)
    k = torch.randn(2, s, 8, 128, device="cuda", generator=gen).to(dtype)
    kw = dict(block_size_q=bq, block_size_k=bk, prompt_len=prompt)
    ours = sparsed_block_mass(q, k, **kw)  # auto: the Triton kernel on CUDA
    gold = sparsed_block_mass(q.double(), k.double(), backend="torch", **kw)
    plain = sparsed_block_mass(q, k, backend="torch", **kw)
    assert torch.isfinite(ours).all()
    err, base = (ours.double() - gold).abs().max(), (plain.double() - gold).abs().max()
    assert err <= 2 * base + 1e-4, (err, base)
    # The kernel's pattern: every block it keeps is among the heaviest up to fp32 rounding.
    idx, cnt = sparsed_select(q, k, rho=0.2, **kw)
    nkb = math.ceil(s / bk)
    npb = prompt_blocks(prompt, s, bk)
    table = indices_to_block_table(idx, cnt, nkb)
    for a, b in ([(0, npb), (npb, nkb)] if 0 < npb < nkb else [(0, nkb)]):
        sel, m = table[..., a:b], gold[..., a:b]
        lowest_kept = m.masked_fill(~sel, math.inf).amin(-1)
        highest_dropped = m.masked_fill(sel, -math.inf).amax(-1)
        assert (lowest_kept >= highest_dropped - 1e-3).all()


@pytest.mark.gpu
def test_gpu_caches_full_steps_and_selection():
    q, k, v = (t.cuda().to(torch.bfloat16) for t in _qkv(b=2, s=512, h=8, hkv=2, d=64))
    for cache in (SparseDCache(num_steps=3, skip=0.4, rho=0.2, block_size=64, prompt_len=200,
                               sparse_attention=block_sparse_ref),
                  BAAttCache(num_steps=3, skip=0.4, rho=0.2, block_size=64,
                             sparse_attention=block_sparse_ref),
                  PulseColCache(num_steps=3, skip=0.4, keep=0.2, sample_rows=64,
                                sparse_attention=column_sparse_ref)):
        full = cache.attend(0, 0, q, k, v)
        gold = masked_attention_ref(q, k, v, torch.ones(512, 512, dtype=torch.bool, device="cuda"))[0]
        plain = masked_attention_ref(q, k, v, torch.ones(512, 512, dtype=torch.bool, device="cuda"),
                                     compute_dtype=torch.bfloat16)[0]
        assert (full.float() - gold).abs().max() <= 2 * (plain.float() - gold).abs().max() + 1e-4
        sparse = cache.attend(0, 1, q, k, v)
        assert torch.isfinite(sparse).all() and cache.history[-1][2] == "select"
        assert all(t.device.type == "cuda" for t in cache.patterns[0])


@pytest.mark.gpu
def test_gpu_cache_with_block_sparse_attn():
    q, k, v = (t.cuda().to(torch.bfloat16) for t in _qkv(b=2, s=1024, h=8, hkv=2, d=64))
    cache = SparseDCache(num_steps=2, skip=0.0, rho=0.2, block_size=64, prompt_len=300)
    out = cache.attend(0, 0, q, k, v)
    idx, cnt = cache.patterns[0]
    gold = block_sparse_ref(q.float(), k.float(), v.float(), idx, cnt, block_size_q=64, block_size_k=64)
    plain = block_sparse_ref(q, k, v, idx, cnt, block_size_q=64, block_size_k=64,
                             compute_dtype=torch.bfloat16)
    assert (out.float() - gold).abs().max() <= 2 * (plain.float() - gold).abs().max() + 1e-4


def test_sparse_quality_benchmark_runs_on_cpu():
    """The benchmark's CPU parts: arguments, the planted problem, one tiny quality sweep."""
    from benchmarks import sparse_quality as sq

    a = sq.parse_args(["--out", "x", "--device", "cpu", "--seqlen", "128"])
    assert (a.device, a.seqlen, a.block) == ("cpu", 128, 32)
    q, k, v = sq.planted_qkv(1, 96, 4, 2, 32, 16, seed=0)
    assert q.shape == (1, 96, 4, 32) and k.shape == v.shape == (1, 96, 2, 32)
    rows = sq.quality_rows(seqlen=128, heads=2, kv_heads=2, head_dim=32, block=16, seeds=(0,))
    err = {(r["selector"], r["density_target"]): r["rel_error"] for r in rows}
    assert set(sq.DENSITIES) == {d for _, d in err}
    for d in sq.DENSITIES:  # every pattern beats random blocks at equal density
        assert max(e for (n, dd), e in err.items() if dd == d and n != "random") < err["random", d]
    assert "| 10% |" in sq.summarize(rows)
