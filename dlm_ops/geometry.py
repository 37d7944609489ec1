"""The block-diffusion mask: the one place that knows which keys a query sees.

Notation
--------
A *sequence* is laid out ``[noisy | clean]``: ``n_noisy`` noisy tokens followed by ``n_clean``
clean tokens. BD3-LM training uses ``n_noisy == n_clean == n`` (2n tokens); block-causal attention
(the clean half alone, SDAR / Fast-dLLM v2 prefill) is the same geometry with ``n_noisy == 0``.
Positions are counted from the start of the sequence; ``p`` is the position inside its half and
``b = p // block_size`` its block (blocks restart in every half, the last one may be short).

Visibility (DESIGN.md section 1): query q sees key k iff
    (same half and same block)
 or (q noisy, k clean, block(k) <  block(q))
 or (q clean, k clean, block(k) <= block(q)).

Row intervals. The keys a row sees form at most two contiguous ranges, ``[lo1, hi1)`` and
``[lo2, hi2)`` (both may be empty):
    noisy row, block b:  [b*bs, min((b+1)*bs, n_noisy))   and  [n_noisy, n_noisy + min(b*bs, n_clean))
    clean row, block b:  [n_noisy, n_noisy + min((b+1)*bs, n_clean))   and  (empty)
Column intervals (the rows that see a key, for backward kernels) are their transpose:
    noisy key, block b:  [b*bs, min((b+1)*bs, n_noisy))   and  (empty)
    clean key, block b:  [min((b+1)*bs, n_noisy), n_noisy) and  [n_noisy + min(b*bs, n_clean), S)
Both are monotone in the row (column) index inside a half, which is what makes tiles cheap: the
union over a tile's rows of each range is ``[lo of its first row, hi of its last row)``.

Tiles never cross the noisy/clean boundary: each half is cut into tiles of BM rows (queries) or BN
columns (keys) from its own start, so a half whose length is not a multiple of the tile size ends in
a short tile. A visited tile is FULL when every pair in it is visible (kernels run it unmasked) and
PARTIAL when it crosses a block boundary (kernels mask it element-wise). Tiles with no visible pair
are never listed.

Every kernel, the CPU path and the flex rewrite read the mask from here; ``dlm_ops.reference``
alone rebuilds it from the definition above so that a bug here cannot hide behind it. The C++/CUDA
kernels read its mirror, ``csrc/include/dlm/geometry.h`` (same formulas and names; a change here
goes there too, and tests/test_csrc_geometry.py proves they agree).
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import NamedTuple, Sequence

import torch

__all__ = ["SequenceMask", "VarlenMask", "Visit", "TilePlan", "most_expensive_first", "balanced_schedule",
           "work_order", "order_schedule"]


class Visit(NamedTuple):
    """A tile visited by a tile: positions ``[start, end)`` and whether all its pairs are visible."""

    start: int
    end: int
    full: bool


class TilePlan(NamedTuple):
    """One tile ``[start, end)`` and the tiles of the other side it meets, in position order.

    Forward plans are query tiles listing key tiles; backward plans are key tiles listing the query
    tiles that see them.
    """

    start: int
    end: int
    visits: tuple[Visit, ...]

    @property
    def area(self) -> int:
        """Pairs covered by the visited tiles (an upper bound of the work, used to order tiles)."""
        return (self.end - self.start) * sum(v.end - v.start for v in self.visits)


@dataclass(frozen=True)
class SequenceMask:
    """The mask of one ``[noisy | clean]`` sequence (positions relative to its start)."""

    n_noisy: int
    n_clean: int
    block_size: int

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.n_noisy < 0 or self.n_clean < 0:
            raise ValueError(f"half lengths must be >= 0, got {self.n_noisy} and {self.n_clean}")

    @classmethod
    def block_diffusion(cls, seqlen: int, block_size: int) -> SequenceMask:
        """The BD3-LM mask over ``seqlen = 2n`` tokens laid out ``[noisy | clean]``."""
        if seqlen % 2:
            raise ValueError(f"a block-diffusion sequence has an even length 2n, got {seqlen}")
        return cls(seqlen // 2, seqlen // 2, block_size)

    @classmethod
    def block_causal(cls, seqlen: int, block_size: int) -> SequenceMask:
        """Key block <= query block over ``seqlen`` tokens (block_size 1 is causal attention)."""
        return cls(0, seqlen, block_size)

    @property
    def seqlen(self) -> int:
        return self.n_noisy + self.n_clean

    # -- element level -------------------------------------------------------------------------

    def _half_and_block(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        noisy = pos < self.n_noisy
        local = torch.where(noisy, pos, pos - self.n_noisy)
        return noisy, local // self.block_size

    def row_intervals(self, rows: torch.Tensor) -> torch.Tensor:
        """``(len(rows), 4)`` int64 ``[lo1, hi1, lo2, hi2]``: the keys each query row sees."""
        rows = rows.to(torch.int64)
        nn, nc, bs = self.n_noisy, self.n_clean, self.block_size
        noisy, blk = self._half_and_block(rows)
        lo1 = torch.where(noisy, blk * bs, nn)
        hi1 = torch.where(noisy, ((blk + 1) * bs).clamp(max=nn), nn + ((blk + 1) * bs).clamp(max=nc))
        lo2 = torch.full_like(rows, nn)
        hi2 = torch.where(noisy, nn + (blk * bs).clamp(max=nc), nn)
        return torch.stack([lo1, hi1, lo2, hi2], dim=-1)

    def col_intervals(self, cols: torch.Tensor) -> torch.Tensor:
        """``(len(cols), 4)`` int64 ``[lo1, hi1, lo2, hi2]``: the query rows that see each key."""
        cols = cols.to(torch.int64)
        nn, nc, bs = self.n_noisy, self.n_clean, self.block_size
        noisy, blk = self._half_and_block(cols)
        lo1 = torch.where(noisy, blk * bs, ((blk + 1) * bs).clamp(max=nn))
        hi1 = torch.where(noisy, ((blk + 1) * bs).clamp(max=nn), nn)
        lo2 = torch.where(noisy, nn + nc, nn + (blk * bs).clamp(max=nc))
        hi2 = torch.full_like(cols, nn + nc)
        return torch.stack([lo1, hi1, lo2, hi2], dim=-1)

    def visible(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Boolean ``(len(rows), len(cols))``: which (query, key) pairs are visible."""
        iv = self.row_intervals(rows).unsqueeze(1)
        c = cols.to(torch.int64).unsqueeze(0)
        return ((iv[..., 0] <= c) & (c < iv[..., 1])) | ((iv[..., 2] <= c) & (c < iv[..., 3]))

    @cached_property
    def num_pairs(self) -> int:
        """Visible (query, key) pairs: ``n^2 + n*bs`` for the BD3 mask when bs divides n."""
        iv = self.row_intervals(torch.arange(self.seqlen))
        return int(((iv[:, 1] - iv[:, 0]) + (iv[:, 3] - iv[:, 2])).sum())

    # -- tile level ----------------------------------------------------------------------------

    def grid_counts(self, block_m: int, block_n: int, row_chunk: int = 4096) -> torch.Tensor:
        """int64 ``(ceil(S/block_m), ceil(S/block_n))``: visible pairs per tile of a plain grid cut
        from position 0 (FlexAttention's BlockMask tiling; unlike ``fwd_tiles``, its tiles may
        straddle the two halves). Memory: ``row_chunk x ceil(S/block_n)`` int64 at a time."""
        s = self.seqlen
        c0 = torch.arange(0, s, block_n, dtype=torch.int64)
        c1 = (c0 + block_n).clamp(max=s)
        counts = torch.zeros((-(-s // block_m), len(c0)), dtype=torch.int64)
        row_chunk = max(block_m, row_chunk // block_m * block_m)
        for r0 in range(0, s, row_chunk):
            rows = torch.arange(r0, min(r0 + row_chunk, s))
            iv = self.row_intervals(rows).unsqueeze(1)  # (rows, 1, 4) against (tiles,) bounds
            per_row = ((torch.minimum(iv[..., 1], c1) - torch.maximum(iv[..., 0], c0)).clamp(min=0)
                       + (torch.minimum(iv[..., 3], c1) - torch.maximum(iv[..., 2], c0)).clamp(min=0))
            counts.index_add_(0, rows // block_m, per_row)
        return counts


    def _tiles(self, size: int) -> list[tuple[int, int]]:
        """Cut each half into tiles of ``size`` positions from its own start."""
        tiles = []
        for h0, h1 in ((0, self.n_noisy), (self.n_noisy, self.seqlen)):
            tiles += [(s, min(s + size, h1)) for s in range(h0, h1, size)]
        return tiles

    def _tile_full(self, r0: int, r1: int, c0: int, c1: int) -> bool | None:
        """Rows ``[r0, r1)`` x keys ``[c0, c1)``, each inside one half: None when no pair is
        visible, True when every pair is (FULL), False otherwise (PARTIAL)."""
        nn, bs = self.n_noisy, self.block_size
        q_noisy, k_noisy = r0 < nn, c0 < nn
        qb0, qb1 = ((r - (0 if q_noisy else nn)) // bs for r in (r0, r1 - 1))
        kb0, kb1 = ((c - (0 if k_noisy else nn)) // bs for c in (c0, c1 - 1))
        if q_noisy and k_noisy:  # same block only
            any_, full = qb0 <= kb1 and kb0 <= qb1, qb0 == qb1 == kb0 == kb1
        elif q_noisy:  # noisy query, clean key: strictly earlier blocks
            any_, full = kb0 < qb1, kb1 < qb0
        elif not k_noisy:  # clean query, clean key: earlier or same block
            any_, full = kb0 <= qb1, kb1 <= qb0
        else:  # clean queries never see noisy keys
            any_, full = False, False
        return full if any_ else None

    def _plan(self, own: int, other: int, transpose: bool) -> tuple[TilePlan, ...]:
        intervals = self.col_intervals if transpose else self.row_intervals
        other_tiles = self._tiles(other)
        other_ends = [c1 for _, c1 in other_tiles]
        plans = []
        for t0, t1 in self._tiles(own):
            first, last = intervals(torch.tensor([t0, t1 - 1])).tolist()
            visits = []
            # The union over the tile of each monotone range is [lo of first, hi of last).
            for lo, hi in ((first[0], last[1]), (first[2], last[3])):
                i = bisect.bisect_right(other_ends, lo)  # first other tile ending after lo
                while lo < hi and i < len(other_tiles) and other_tiles[i][0] < hi:
                    c0, c1 = other_tiles[i]
                    full = self._tile_full(c0, c1, t0, t1) if transpose else self._tile_full(t0, t1, c0, c1)
                    assert full is not None, "a tile meeting a visible range has a visible pair"
                    visits.append(Visit(c0, c1, full))
                    i += 1
            plans.append(TilePlan(t0, t1, tuple(visits)))
        return tuple(plans)

    def fwd_tiles(self, block_m: int, block_n: int) -> tuple[TilePlan, ...]:
        """Per query tile of ``block_m`` rows, the key tiles of ``block_n`` columns it must visit."""
        return _cached_plan(self, block_m, block_n, False)

    def bwd_tiles(self, block_m: int, block_n: int) -> tuple[TilePlan, ...]:
        """Per key tile of ``block_n`` columns, the query tiles of ``block_m`` rows that see it."""
        return _cached_plan(self, block_n, block_m, True)


@lru_cache(maxsize=256)
def _cached_plan(mask: SequenceMask, own: int, other: int, transpose: bool) -> tuple[TilePlan, ...]:
    if own < 1 or other < 1:
        raise ValueError(f"tile sizes must be >= 1, got {own} and {other}")
    return mask._plan(own, other, transpose)


def most_expensive_first(areas: Sequence[int]) -> list[int]:
    """The order work tiles run in: indices of ``areas`` (``TilePlan.area`` of every sample's tiles,
    sample by sample), largest first, ties in index order, so that the most expensive tiles start
    in the first wave and do not finish last."""
    return sorted(range(len(areas)), key=lambda i: -areas[i])  # sorted() is stable


def balanced_schedule(costs: Sequence[int], ctas: int, tail_rounds: int = 0) -> list[int]:
    """A persistent grid's walk: work indices ``0..len(costs)-1`` in order, each given to the CTA
    with the least cost so far (ties: the lowest CTA); with work most expensive first this is the
    longest-processing-time rule. ``tail_rounds`` > 0: the last ``tail_rounds * ctas`` items are
    handed out most expensive first (ties in work order), so that a walk that is not most
    expensive first as a whole (L2 chunks of slots, each restarting at the dearest tiles) cannot
    hand a dear item out last (the header says why). Returned as the kernels read it
    (``scheduled_index`` in the header): ``ctas + 1`` offsets into this same list (CTA c's items are
    ``out[out[c]:out[c+1]]``), then the items, each CTA's in work order."""
    if ctas < 1:
        raise ValueError(f"ctas must be >= 1, got {ctas}")
    count = len(costs)
    cut = count - min(count, max(tail_rounds, 0) * ctas)
    hand = list(range(cut)) + sorted(range(cut, count), key=lambda w: -costs[w])  # sorted() is stable
    heap = [(0, c) for c in range(ctas)]  # sorted, hence a heap
    owner = [0] * count
    for w in hand:
        load, cta = heapq.heappop(heap)
        owner[w] = cta
        heapq.heappush(heap, (load + costs[w], cta))
    owned: list[list[int]] = [[] for _ in range(ctas)]
    for w in range(count):
        owned[owner[w]].append(w)
    offsets = [ctas + 1]
    for items in owned:
        offsets.append(offsets[-1] + len(items))
    return offsets + [w for items in owned for w in items]


def work_order(entries: int, slots: int, chunk: int | None = None, block: int = 1) -> list[tuple[int, int]]:
    """The (entry, slot) of every work index of a kernel's walk (the header's ``WorkOrder``): blocks
    of ``block`` consecutive entries, inside a block chunks of ``chunk`` slots, entry-major inside
    a chunk. ``chunk`` None (or >= slots): the plain entry-major order, work index ``entry * slots +
    slot``; chunk 1: slot-major inside each block, so that a slot's ``block`` entries run side by
    side."""
    chunk = slots if chunk is None else chunk
    if entries < 0 or slots < 1 or not 1 <= chunk or block < 1:
        raise ValueError(f"work_order: entries >= 0, slots >= 1, chunk >= 1 and block >= 1, got "
                         f"{entries}, {slots}, {chunk}, {block}")
    walk = []
    for first in range(0, entries, block):
        rows = range(first, min(first + block, entries))
        for first_slot in range(0, slots, chunk):
            cols = range(first_slot, min(first_slot + chunk, slots))
            walk += [(e, j) for e in rows for j in cols]
    return walk


# The fixed cost of a work item in order_schedule, in half tiles (own x other positions): its Q or
# K / V load and its epilogue (session 17's trace of the forward at n = 1K: ~2.4 us of a 12 us item
# against 1.66 us per full tile).
SCHEDULE_ITEM_HALF_TILES = 3


def entry_schedule(entry_costs: Sequence[int], slots: int, ctas: int, chunk: int | None = None, block: int = 1,
                   tail_rounds: int = 0) -> list[int]:
    """``balanced_schedule`` of work walked in ``work_order(len(entry_costs), slots, chunk, block)``
    whose every item of entry ``e`` costs ``entry_costs[e]`` (the header's ``entry_schedule``)."""
    walk = work_order(len(entry_costs), slots, chunk, block)
    return balanced_schedule([entry_costs[e] for e, _ in walk], ctas, tail_rounds)


def order_schedule(plans: Sequence[TilePlan], order: Sequence[int], slots: int, weight: int, ctas: int,
                   own: int, other: int, chunk: int | None = None, block: int = 1, tail_rounds: int = 0) -> list[int]:
    """``entry_schedule`` of a kernel's work walked in ``work_order(len(order), slots, chunk,
    block)`` (None: the plain order), entry ``e`` being tile ``order[e]`` of ``plans`` (tiles of
    ``own`` positions visiting tiles of ``other``): an item costs its tile's ``area`` ``weight``
    times (the dK/dV kernel walks a K / V head's group of query heads per item) plus
    ``SCHEDULE_ITEM_HALF_TILES / 2`` tiles of ``own x other`` pairs."""
    fixed = SCHEDULE_ITEM_HALF_TILES * own * other // 2
    return entry_schedule([weight * plans[t].area + fixed for t in order], slots, ctas, chunk, block, tail_rounds)


def varlen_walk(samples: Sequence[int], slots: int, block: int) -> list[int]:
    """Packed samples' work indices (``entry * slots + slot``, entry ``e`` a tile of sample
    ``samples[e]``, entries most expensive first over all samples) in the order a balanced schedule
    hands them out (the header's ``varlen_walk``). ``block`` 0: the plain order. ``block`` >= 1: the
    batched slot-major walk (chunk 1, ``block`` entries) with (sample, slot) pairs as its slots:
    round r lists, sample by sample and slot by slot, the items of the sample's own entries ``[r
    block, r block + block)``, so that the CTAs running side by side share one (sample, head)'s
    re-read data in L2."""
    if slots < 1 or block < 0:
        raise ValueError(f"varlen_walk: slots >= 1 and block >= 0, got {slots}, {block}")
    if block == 0:
        return list(range(len(samples) * slots))
    own: dict[int, list[int]] = {}
    for e, i in enumerate(samples):
        own.setdefault(i, []).append(e)
    lists = [own[i] for i in sorted(own)]
    longest = max((len(x) for x in lists), default=0)
    return [e * slots + slot for first in range(0, longest, block) for x in lists for slot in range(slots)
            for e in x[first:first + block]]


def walk_schedule(walk: Sequence[int], costs: Sequence[int], ctas: int) -> list[int]:
    """``balanced_schedule`` of work handed out in the order ``walk`` (``costs[i]`` is ``walk[i]``'s):
    the CTAs' lists hold work indices, each CTA's in walk order (the header's ``walk_schedule``)."""
    out = balanced_schedule(costs, ctas)
    return out[:ctas + 1] + [walk[i] for i in out[ctas + 1:]]


@dataclass(frozen=True)
class VarlenMask:
    """Packed samples: sample i occupies ``[cu_seqlens[i], cu_seqlens[i+1])``, an even length
    ``2*m_i`` laid out ``[noisy_i | clean_i]`` with blocks restarting in every half."""

    cu_seqlens: tuple[int, ...]
    block_size: int

    @property
    def samples(self) -> list[tuple[int, SequenceMask]]:
        """``(offset, mask)`` per sample, zero-length samples included."""
        cu = self.cu_seqlens
        return [(cu[i], SequenceMask.block_diffusion(cu[i + 1] - cu[i], self.block_size))
                for i in range(len(cu) - 1)]

    @property
    def num_pairs(self) -> int:
        return sum(mask.num_pairs for _, mask in self.samples)
