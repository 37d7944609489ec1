"""geometry.py against masks built from the definition (dlm_ops.reference)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dlm_ops.geometry import SequenceMask, VarlenMask
from dlm_ops.reference import block_causal_mask, block_diffusion_mask


@st.composite
def masks(draw):
    """(SequenceMask, dense reference mask) for block diffusion and block-causal layouts."""
    n = draw(st.integers(0, 60))
    block_size = draw(st.one_of(st.integers(1, n + 5), st.sampled_from([1, 2, 16, 64])))
    if draw(st.booleans()):
        return SequenceMask.block_diffusion(2 * n, block_size), block_diffusion_mask(2 * n, block_size)
    return SequenceMask.block_causal(n, block_size), block_causal_mask(n, block_size)


def _tile_truth(dense, r0, r1, c0, c1):
    sub = dense[r0:r1, c0:c1]
    return bool(sub.any()), bool(sub.all())


def _check_plans(plans, dense, own, other, mask, transposed):
    s = mask.seqlen
    halves = [(0, mask.n_noisy), (mask.n_noisy, s)]
    # Own tiles cover every position once, never cross the noisy/clean boundary, are <= own long.
    covered = [p for plan in plans for p in range(plan.start, plan.end)]
    assert covered == list(range(s))
    for plan in plans:
        assert 0 < plan.end - plan.start <= own
        assert any(h0 <= plan.start and plan.end <= h1 for h0, h1 in halves)
    # Each plan lists exactly the other-side tiles that hold a visible pair, with the right flag.
    other_tiles = [(t, min(t + other, h1)) for h0, h1 in halves for t in range(h0, h1, other)]
    for plan in plans:
        listed = {(v.start, v.end): v.full for v in plan.visits}
        assert len(listed) == len(plan.visits), "a tile is listed twice"
        assert [v.start for v in plan.visits] == sorted(v.start for v in plan.visits)
        for c0, c1 in other_tiles:
            rect = (c0, c1, plan.start, plan.end) if transposed else (plan.start, plan.end, c0, c1)
            any_, all_ = _tile_truth(dense, *rect)
            assert ((c0, c1) in listed) == any_, (plan, (c0, c1))
            if any_:
                assert listed[(c0, c1)] == all_, (plan, (c0, c1))


@given(masks(), st.integers(1, 40), st.integers(1, 40))
def test_intervals_tiles_and_pairs_match_definition(mask_and_dense, block_m, block_n):
    mask, dense = mask_and_dense
    pos = torch.arange(mask.seqlen)
    assert torch.equal(mask.visible(pos, pos), dense)

    rows = mask.row_intervals(pos)
    cols = mask.col_intervals(pos)
    for iv, truth in ((rows, dense), (cols, dense.T)):  # at most two contiguous ranges per row
        ranges = torch.zeros_like(truth)
        for i, (lo1, hi1, lo2, hi2) in enumerate(iv.tolist()):
            ranges[i, lo1:hi1] = True
            ranges[i, lo2:hi2] = True
        assert torch.equal(ranges, truth)

    assert mask.num_pairs == int(dense.sum())
    _check_plans(mask.fwd_tiles(block_m, block_n), dense, block_m, block_n, mask, False)
    _check_plans(mask.bwd_tiles(block_m, block_n), dense, block_n, block_m, mask, True)


@given(masks(), st.integers(1, 40), st.integers(1, 40), st.integers(1, 64))
def test_grid_counts_match_definition(mask_and_dense, block_m, block_n, row_chunk):
    """FlexAttention-style grid from position 0 (tiles may straddle the halves), any row chunking."""
    mask, dense = mask_and_dense
    s = mask.seqlen
    want = torch.zeros((-(-s // block_m), -(-s // block_n)), dtype=torch.int64)
    for i in range(want.shape[0]):
        for j in range(want.shape[1]):
            want[i, j] = dense[i * block_m:(i + 1) * block_m, j * block_n:(j + 1) * block_n].sum()
    assert torch.equal(mask.grid_counts(block_m, block_n, row_chunk), want)


@pytest.mark.parametrize("n,block_size", [(1, 1), (7, 7), (64, 1), (64, 16), (100, 10), (4096, 64)])
def test_pair_count_closed_form_when_block_divides_n(n, block_size):
    # DESIGN.md section 1: n^2 + n*bs visible pairs out of (2n)^2, about a quarter.
    assert SequenceMask.block_diffusion(2 * n, block_size).num_pairs == n * n + n * block_size


@pytest.mark.parametrize("n,block_size", [(5, 2), (7, 3), (9, 100), (33, 8)])
def test_pair_count_ragged_blocks(n, block_size):
    assert SequenceMask.block_diffusion(2 * n, block_size).num_pairs == int(
        block_diffusion_mask(2 * n, block_size).sum())


def test_block_causal_block_size_one_is_causal():
    mask = SequenceMask.block_causal(37, 1)
    pos = torch.arange(37)
    assert torch.equal(mask.visible(pos, pos), torch.ones(37, 37, dtype=torch.bool).tril())


def test_full_tiles_inside_blocks_partial_on_boundaries():
    # n=128, bs=64, 64x64 tiles: every visited tile is whole blocks, so nothing needs masking
    # except the clean diagonal (key block <= query block holds everywhere in it too).
    plans = SequenceMask.block_diffusion(256, 64).fwd_tiles(64, 64)
    assert all(v.full for p in plans for v in p.visits)
    # With bs=16 inside 64-wide tiles, the noisy diagonal tiles are PARTIAL (block-diagonal).
    plans = SequenceMask.block_diffusion(256, 16).fwd_tiles(64, 64)
    noisy_diag = [v for p in plans[:2] for v in p.visits if v.start == p.start]
    assert noisy_diag and not any(v.full for v in noisy_diag)


@given(st.lists(st.integers(0, 20), min_size=0, max_size=5), st.integers(1, 8))
def test_varlen_samples(halves, block_size):
    cu = [0]
    for m in halves:
        cu.append(cu[-1] + 2 * m)
    vm = VarlenMask(tuple(cu), block_size)
    assert [off for off, _ in vm.samples] == cu[:-1]
    assert [m.n_noisy for _, m in vm.samples] == halves
    assert vm.num_pairs == sum(int(block_diffusion_mask(2 * m, block_size).sum()) for m in halves)


def test_invalid_geometry():
    with pytest.raises(ValueError, match="block_size"):
        SequenceMask.block_diffusion(8, 0)
    with pytest.raises(ValueError, match="even length"):
        SequenceMask.block_diffusion(7, 2)
    with pytest.raises(ValueError, match="tile sizes"):
        SequenceMask.block_diffusion(8, 2).fwd_tiles(0, 4)
