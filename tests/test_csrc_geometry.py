"""csrc/include/dlm/geometry.h against dlm_ops/geometry.py, through a ctypes binding.

csrc/bindings/geometry_host.cpp is built once per session with the system C++ compiler (~0.5 s; no
torch headers) and called through ctypes. geometry.py is itself checked against the definition in
tests/test_geometry.py, so agreement here means the header is right too.
"""

import ctypes
import subprocess

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dlm_ops.backends.cutlass import csrc_dir
from dlm_ops.geometry import (SequenceMask, VarlenMask, Visit, balanced_schedule, entry_schedule,
                              most_expensive_first, order_schedule, varlen_walk, walk_schedule, work_order)

I32, I64 = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int64)
_INT = ctypes.c_int
SIGNATURES = {
    "dlm_intervals": [_INT, _INT, _INT, _INT, _INT, I32, I32],
    "dlm_visible": [_INT, _INT, _INT, _INT, _INT, ctypes.POINTER(ctypes.c_uint8)],
    "dlm_num_pairs": [_INT, _INT, _INT, I64],
    "dlm_plan": [_INT, _INT, _INT, _INT, _INT, _INT, I64, I32, I64, I32],
    "dlm_varlen_num_pairs": [I32, _INT, _INT, I64],
    "dlm_varlen_plan": [I32, _INT, _INT, _INT, _INT, _INT, I64, I32, I64, I32],
    "dlm_work_order": [_INT, _INT, _INT, _INT, I32],
    "dlm_snake_walk": [_INT, _INT, _INT, I32],
    "dlm_part_runs": [_INT, _INT, _INT, _INT, _INT, _INT, _INT, ctypes.POINTER(ctypes.c_int), I32],
    "dlm_balanced_schedule": [I64, _INT, _INT, _INT, I32],
    "dlm_entry_schedule": [I64, _INT, _INT, _INT, _INT, _INT, _INT, I32],
    "dlm_order_schedule": [_INT, _INT, _INT, _INT, _INT, _INT, I32, _INT, _INT, _INT, _INT, _INT, _INT, _INT, I32],
    "dlm_varlen_walk": [I32, _INT, _INT, _INT, _INT, I32],
    "dlm_walk_schedule": [I32, I64, _INT, _INT, I32],
}


@pytest.fixture(scope="session")
def lib(tmp_path_factory, cxx):
    so = tmp_path_factory.mktemp("csrc") / "dlm_geometry_host.so"
    src = csrc_dir() / "bindings" / "geometry_host.cpp"
    cmd = [cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror",
           f"-I{csrc_dir() / 'include'}", str(src), "-o", str(so)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr}"  # a compile error is a bug, not a skip
    handle = ctypes.CDLL(str(so))
    for name, args in SIGNATURES.items():
        getattr(handle, name).argtypes = args
        getattr(handle, name).restype = ctypes.c_int
    return handle


def _p(t: torch.Tensor):
    return ctypes.cast(t.data_ptr(), {torch.int32: I32, torch.int64: I64, torch.uint8:
                                      ctypes.POINTER(ctypes.c_uint8)}[t.dtype])


def _call(fn, *args):
    assert fn(*args) == 0, f"{fn.__name__} rejected valid arguments {args[:6]}"


def _plan(lib, mask_args, block_m, block_n, transpose, varlen=False):
    """The header's schedule: [(start, end, sample, area, (Visit, ...)), ...] most expensive first."""
    fn = lib.dlm_varlen_plan if varlen else lib.dlm_plan
    sizes = torch.zeros(2, dtype=torch.int64)
    _call(fn, *mask_args, block_m, block_n, int(transpose), _p(sizes), None, None, None)
    n_tiles, n_visits = sizes.tolist()
    tiles = torch.full((max(n_tiles, 1), 5), -7, dtype=torch.int32)  # poisoned: unwritten fails
    areas = torch.full((max(n_tiles, 1),), -7, dtype=torch.int64)
    visits = torch.full((max(n_visits, 1), 3), -7, dtype=torch.int32)
    _call(fn, *mask_args, block_m, block_n, int(transpose), _p(sizes), _p(tiles), _p(areas), _p(visits))
    visit_list = [Visit(s, e, bool(f)) for s, e, f in visits[:n_visits].tolist()]
    assert all(f in (0, 1) for f in visits[:n_visits, 2].tolist())
    return [(s, e, i, a, tuple(visit_list[b:ve]))
            for (s, e, i, b, ve), a in zip(tiles[:n_tiles].tolist(), areas[:n_tiles].tolist())]


def _expected_plan(samples, block_m, block_n, transpose):
    """The same schedule from geometry.py: every sample's plans, then most_expensive_first."""
    rows = []
    for i, (off, mask) in enumerate(samples):
        plans = mask.bwd_tiles(block_m, block_n) if transpose else mask.fwd_tiles(block_m, block_n)
        rows += [(off + p.start, off + p.end, i, p.area,
                  tuple(Visit(off + v.start, off + v.end, v.full) for v in p.visits)) for p in plans]
    return [rows[i] for i in most_expensive_first([r[3] for r in rows])]


@st.composite
def sequence_masks(draw):
    """BD3 (2n tokens), block-causal (n_noisy = 0) and uneven halves, block sizes 1 to > n."""
    kind = draw(st.sampled_from(["bd3", "causal", "uneven"]))
    nn = draw(st.integers(0, 50))
    nc = nn if kind == "bd3" else draw(st.integers(0, 50))
    nn = 0 if kind == "causal" else nn
    bs = draw(st.one_of(st.integers(1, max(nn, nc) + 5), st.sampled_from([1, 2, 16, 64])))
    return SequenceMask(nn, nc, bs)


TILE = st.one_of(st.integers(1, 40), st.sampled_from([16, 64, 128]))


@given(sequence_masks())
def test_intervals_visibility_and_pairs(lib, mask):
    s, args = mask.seqlen, (mask.n_noisy, mask.n_clean, mask.block_size)
    pos = torch.arange(s, dtype=torch.int32)
    for transpose, want in ((0, mask.row_intervals(pos)), (1, mask.col_intervals(pos))):
        got = torch.full((s, 4), -7, dtype=torch.int32)
        _call(lib.dlm_intervals, *args, transpose, s, _p(pos), _p(got))
        assert torch.equal(got.long(), want), ("cols" if transpose else "rows", mask)
    vis = torch.full((s, s), 7, dtype=torch.uint8)
    _call(lib.dlm_visible, *args, s, s, _p(vis))
    assert torch.equal(vis, mask.visible(pos, pos).to(torch.uint8))  # 0/1 only: poison was 7
    pairs = torch.full((1,), -7, dtype=torch.int64)
    _call(lib.dlm_num_pairs, *args, _p(pairs))
    assert pairs.item() == mask.num_pairs


@given(sequence_masks(), TILE, TILE, st.integers(1, 70))
def test_runs_of_a_tile_part_are_the_other_tiles_it_sees(lib, mask, block_m, block_n, part):
    """TilePlans::runs_of (a dK/dV warpgroup's own keys): for every part of every tile, exactly the
    other side's tiles with a visible pair, from the definition, as two runs inside the tile's."""
    args = (mask.n_noisy, mask.n_clean, mask.block_size)
    for transpose in (False, True):
        plans = mask.bwd_tiles(block_m, block_n) if transpose else mask.fwd_tiles(block_m, block_n)
        size = block_m if transpose else block_n  # the other side's tiles, in index order
        other_tiles = [(lo, min(lo + size, end)) for start, end in
                       ((0, mask.n_noisy), (mask.n_noisy, mask.seqlen)) for lo in range(start, end, size)]
        count = ctypes.c_int(-7)
        _call(lib.dlm_part_runs, *args, block_m, block_n, int(transpose), part, ctypes.byref(count), None)
        got = torch.full((max(count.value, 1), 4), -7, dtype=torch.int32)
        _call(lib.dlm_part_runs, *args, block_m, block_n, int(transpose), part, ctypes.byref(count), _p(got))
        i = 0
        for p in sorted(plans, key=lambda p: p.start):
            tile_runs = {o for o, (s, e) in enumerate(other_tiles)
                         if any(v.start == s and v.end == e for v in p.visits)}
            for lo in range(p.start, p.end, part):
                own = torch.arange(lo, min(lo + part, p.end))
                b0, e0, b1, e1 = got[i].tolist()
                assert b0 <= e0 and b1 <= e1 and (e0 <= b1 or b1 == e1 or b0 == e0)
                runs = set(range(b0, e0)) | set(range(b1, e1))
                want = set()
                for o, (s, e) in enumerate(other_tiles):
                    rows, cols = (torch.arange(s, e), own) if transpose else (own, torch.arange(s, e))
                    if mask.visible(rows, cols).any():
                        want.add(o)
                assert runs == want and runs <= tile_runs, (mask, transpose, lo, got[i].tolist())
                i += 1
        assert i == count.value


@given(sequence_masks(), TILE, TILE)
def test_fwd_and_bwd_tiles_in_schedule_order(lib, mask, block_m, block_n):
    args = (mask.n_noisy, mask.n_clean, mask.block_size)
    for transpose in (False, True):
        got = _plan(lib, args, block_m, block_n, transpose)
        assert got == _expected_plan([(0, mask)], block_m, block_n, transpose), (mask, transpose)


@given(st.lists(st.integers(0, 30), max_size=5), st.integers(1, 40), TILE, TILE)
def test_varlen_including_empty_samples(lib, halves, block_size, block_m, block_n):
    cu = [0]
    for m in halves:
        cu.append(cu[-1] + 2 * m)
    mask = VarlenMask(tuple(cu), block_size)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    args = (_p(cu_t), len(halves), block_size)
    pairs = torch.full((1,), -7, dtype=torch.int64)
    _call(lib.dlm_varlen_num_pairs, *args, _p(pairs))
    assert pairs.item() == mask.num_pairs
    for transpose in (False, True):
        got = _plan(lib, args, block_m, block_n, transpose, varlen=True)
        assert got == _expected_plan(mask.samples, block_m, block_n, transpose), (cu, transpose)


@given(st.integers(46341, 70000), st.sampled_from([1, 3, 16, 1000, 2**18]))
def test_pair_counts_past_int32(lib, n, block_size):
    """n^2 + n*bs passes 2^31 at n = 46341: the closed form must count in int64."""
    mask = SequenceMask.block_diffusion(2 * n, block_size)
    pairs = torch.full((1,), -7, dtype=torch.int64)
    _call(lib.dlm_num_pairs, mask.n_noisy, mask.n_clean, block_size, _p(pairs))
    assert pairs.item() == mask.num_pairs


def test_rejects_what_geometry_py_rejects(lib):
    out = torch.zeros(16, dtype=torch.int64)
    for nn, nc, bs in ((4, 4, 0), (-1, 4, 2), (4, -2, 2)):
        with pytest.raises(ValueError):
            SequenceMask(nn, nc, bs)
        assert lib.dlm_num_pairs(nn, nc, bs, _p(out)) == -1
    for block_m, block_n in ((0, 4), (4, 0)):
        with pytest.raises(ValueError):
            SequenceMask(4, 4, 2).fwd_tiles(block_m, block_n)
        assert lib.dlm_plan(4, 4, 2, block_m, block_n, 0, _p(out), None, None, None) == -1
    for cu in ([0, 3], [2, 6], [0, 4, 2]):  # odd length, not starting at 0, decreasing
        cu_t = torch.tensor(cu, dtype=torch.int32)
        assert lib.dlm_varlen_num_pairs(_p(cu_t), len(cu) - 1, 4, _p(out)) == -1


@given(st.integers(1, 40), st.integers(1, 40), st.data())
def test_work_order_walks_every_item_once_in_its_documented_order(lib, entries, slots, data):
    """The kernels' grid / persistent walk (dlm/geometry.h WorkOrder) = geometry.work_order: every
    (entry, slot) exactly once, blocks of `block` entries one after the other, inside a block the
    slots chunk by chunk; chunk = slots is the plain entry-major order, chunk 1 gives each slot its
    block's entries side by side, and a block past the entries (the harness's 1 << 30) is one
    block."""
    chunk = data.draw(st.integers(1, slots))
    block = data.draw(st.one_of(st.integers(1, entries + 3), st.just(1 << 30)))
    out = torch.full((2 * entries * slots,), -1, dtype=torch.int32)
    _call(lib.dlm_work_order, entries, slots, chunk, block, _p(out))
    got = [tuple(p) for p in out.view(-1, 2).tolist()]
    assert got == work_order(entries, slots, chunk, block)  # the Python mirror
    assert sorted(got) == [(e, j) for e in range(entries) for j in range(slots)]
    blocks = [e // block for e, _ in got]
    assert blocks == sorted(blocks)
    chunks = [(e // block, j // chunk) for e, j in got]
    assert chunks == sorted(chunks)
    if chunk == 1:  # slot-major: a slot's entries of one block run side by side
        rows = min(block, entries)
        assert all(len({j for _, j in got[i:i + rows]}) == 1 for i in range(0, rows * slots, rows))
    if chunk == slots:
        assert got == [(e, j) for e in range(entries) for j in range(slots)]


@given(st.integers(0, 3000), st.integers(1, 300))
def test_snake_walk_gives_every_item_to_one_cta_in_rounds(lib, items, ctas):
    """The persistent kernels' walk (dlm/geometry.h snake_index): every work index exactly once, each
    CTA's indices increasing, round j covering [j ctas, (j + 1) ctas) forwards or backwards."""
    width = -(-items // ctas) + 1
    out = torch.full((ctas * width,), -2, dtype=torch.int32)
    _call(lib.dlm_snake_walk, items, ctas, width, _p(out))
    walks = [[w for w in row if w >= 0] for row in out.view(ctas, width).tolist()]
    assert sorted(w for walk in walks for w in walk) == list(range(items))
    for c, walk in enumerate(walks):
        assert walk == sorted(walk)
        for j, w in enumerate(walk):
            assert w == j * ctas + (ctas - 1 - c if j % 2 else c)
    if ctas >= items:  # one CTA per item: the CTA's own index, nothing after it
        assert walks == [[c] if c < items else [] for c in range(ctas)]


def test_snake_walk_balances_most_expensive_first_work(lib):
    """The dK/dV kernel's items at n = 4K, block 16 (64 key tiles most expensive first x 32
    (batch, head) slots, each costing its tile's visible pairs) on 132 CTAs: the snake keeps every
    CTA within 1 % of the mean work, where a plain stride (cta, cta + 132, ...) gave one 1.12x
    (csrc/NOTES.md session 9)."""
    areas = sorted((t.area for t in SequenceMask(4096, 4096, 16).bwd_tiles(64, 128)), reverse=True)
    slots, ctas = 32, 132
    cost = [areas[w // slots] for w in range(len(areas) * slots)]
    items, width = len(cost), -(-len(cost) // ctas) + 1
    out = torch.empty((ctas * width,), dtype=torch.int32)
    _call(lib.dlm_snake_walk, items, ctas, width, _p(out))
    snake = [sum(cost[w] for w in row if w >= 0) for row in out.view(ctas, width).tolist()]
    stride = [sum(cost[w] for w in range(c, items, ctas)) for c in range(ctas)]
    mean = sum(cost) / ctas
    assert max(snake) / mean < 1.01 and max(stride) / mean > 1.1


def _walks(schedule: list[int], ctas: int) -> list[list[int]]:
    """Each CTA's items of a balanced schedule, read as the kernels read it (scheduled_index)."""
    assert schedule[0] == ctas + 1 and schedule[ctas] == len(schedule)
    return [schedule[schedule[c]:schedule[c + 1]] for c in range(ctas)]


@given(st.lists(st.integers(0, 10**6), max_size=400), st.integers(1, 40), st.integers(0, 5))
def test_balanced_schedule_header_equals_python_and_gives_each_item_once(lib, costs, ctas, tail_rounds):
    """dlm/geometry.h balanced_schedule = geometry.balanced_schedule; every work index goes to one
    CTA, each CTA's in work order, and each went to a CTA with the least cost so far, handed out in
    work order but for the last tail_rounds rounds, handed out most expensive first."""
    out = torch.empty((ctas + 1 + len(costs),), dtype=torch.int32)
    cost = torch.tensor(costs + [0], dtype=torch.int64)  # held: _p does not keep the tensor alive
    _call(lib.dlm_balanced_schedule, _p(cost), len(costs), ctas, tail_rounds, _p(out))
    got = out.tolist()
    assert got == balanced_schedule(costs, ctas, tail_rounds)
    walks = _walks(got, ctas)
    assert sorted(w for walk in walks for w in walk) == list(range(len(costs)))
    owner = {w: c for c, walk in enumerate(walks) for w in walk}
    cut = max(0, len(costs) - tail_rounds * ctas)
    handed = list(range(cut)) + sorted(range(cut, len(costs)), key=lambda w: (-costs[w], w))
    load = [0] * ctas
    for w in handed:
        assert load[owner[w]] == min(load)
        load[owner[w]] += costs[w]
    assert all(walk == sorted(walk) for walk in walks)
    if tail_rounds == 0:  # no tail: work order throughout
        assert handed == list(range(len(costs)))


@given(st.lists(st.integers(0, 1000), max_size=40), st.integers(1, 6), st.integers(1, 6), st.integers(1, 7),
       st.integers(1, 9), st.integers(0, 3))
def test_entry_schedule_header_equals_python(lib, entry_costs, slots, chunk, block, ctas, tail_rounds):
    """dlm/geometry.h entry_schedule (packed samples' dQ-from-dS schedule: entries of any cost in
    a WorkOrder) = geometry.entry_schedule, which costs every item by its entry."""
    chunk = min(chunk, slots)
    count = len(entry_costs) * slots
    out = torch.empty((ctas + 1 + count,), dtype=torch.int32)
    cost_t = torch.tensor(entry_costs + [0], dtype=torch.int64)
    _call(lib.dlm_entry_schedule, _p(cost_t), len(entry_costs), slots, chunk, block, ctas, tail_rounds, _p(out))
    got = out.tolist()
    walk = work_order(len(entry_costs), slots, chunk, block)
    assert got == entry_schedule(entry_costs, slots, ctas, chunk, block, tail_rounds)
    assert got == balanced_schedule([entry_costs[e] for e, _ in walk], ctas, tail_rounds)


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("n,block_size,slots,weight,ctas", [(256, 16, 3, 1, 5), (384, 5, 4, 2, 7),
                                                            (1024, 64, 2, 4, 132), (1024, 16, 16, 1, 132)])
@pytest.mark.parametrize("chunk,block,tail_rounds", [(None, 1, 0), (1, 4, 0), (1, 2, 1), (3, 5, 4)])
def test_order_schedule_header_equals_python(lib, transpose, n, block_size, slots, weight, ctas, chunk, block,
                                             tail_rounds):
    """The schedule the bindings build for a kernel's work in a WorkOrder (dlm/geometry.h
    order_schedule) = geometry.order_schedule, forward and backward tiles, the plain order (chunk
    None: the header's chunk = slots) and slot-major ones; every work index goes to one CTA."""
    mask, bm, bn = SequenceMask(n, n, block_size), 64, 128
    plans = mask.bwd_tiles(bm, bn) if transpose else mask.fwd_tiles(bm, bn)
    order = most_expensive_first([p.area for p in plans])
    out = torch.empty((ctas + 1 + len(order) * slots,), dtype=torch.int32)
    order_t = torch.tensor(order, dtype=torch.int32)  # held: _p does not keep the tensor alive
    header_chunk = slots if chunk is None else min(chunk, slots)
    _call(lib.dlm_order_schedule, n, n, block_size, bm, bn, int(transpose), _p(order_t), len(order), slots,
          header_chunk, block, weight, ctas, tail_rounds, _p(out))
    got = out.tolist()
    assert got == order_schedule(plans, order, slots, weight, ctas, bm, bn, chunk, block, tail_rounds)
    assert sorted(w for walk in _walks(got, ctas) for w in walk) == list(range(len(order) * slots))


def test_order_schedule_costs_each_item_by_its_entry():
    """The plain order's schedule costs work index w by entry w // slots; a slot-major order's by
    the entry its walk puts there (a different list of the same costs)."""
    mask, slots, ctas = SequenceMask(256, 256, 16), 3, 4
    plans = mask.fwd_tiles(128, 128)
    order = most_expensive_first([p.area for p in plans])
    fixed = 3 * 128 * 128 // 2
    plain = [plans[order[w // slots]].area + fixed for w in range(len(order) * slots)]
    assert order_schedule(plans, order, slots, 1, ctas, 128, 128) == balanced_schedule(plain, ctas)
    walk = work_order(len(order), slots, 1, 4)
    slot_major = [plans[order[e]].area + fixed for e, _ in walk]
    assert sorted(slot_major) == sorted(plain) and slot_major != plain
    assert order_schedule(plans, order, slots, 1, ctas, 128, 128, 1, 4) == balanced_schedule(slot_major, ctas)


@given(st.lists(st.integers(0, 5), max_size=60), st.integers(1, 4), st.integers(0, 7), st.integers(1, 9),
       st.data())
def test_varlen_walk_and_its_schedule_header_equal_python(lib, samples, slots, block, ctas, data):
    """dlm/geometry.h varlen_walk / walk_schedule = geometry's, on entries of up to 6 samples in any
    order (some empty); the walk lists every work index once, keeps each (sample, slot)'s entries in
    their order, and its schedule gives each CTA its items in walk order."""
    entries, count = len(samples), len(samples) * slots
    sample_t = torch.tensor(samples + [0], dtype=torch.int32)  # held: _p does not keep the tensor alive
    out = torch.empty((count + 1,), dtype=torch.int32)
    _call(lib.dlm_varlen_walk, _p(sample_t), entries, 6, slots, block, _p(out))
    walk = out[:count].tolist()
    assert walk == varlen_walk(samples, slots, block)
    assert sorted(walk) == list(range(count))
    for i in set(samples):
        for slot in range(slots):
            mine = [w // slots for w in walk if w % slots == slot and samples[w // slots] == i]
            assert mine == [e for e in range(entries) if samples[e] == i]
    costs = data.draw(st.lists(st.integers(0, 1000), min_size=count, max_size=count))
    walk_t = torch.tensor(walk + [0], dtype=torch.int32)
    cost_t = torch.tensor(costs + [0], dtype=torch.int64)
    sched = torch.empty((ctas + 1 + count,), dtype=torch.int32)
    _call(lib.dlm_walk_schedule, _p(walk_t), _p(cost_t), count, ctas, _p(sched))
    got = sched.tolist()
    assert got == walk_schedule(walk, costs, ctas)
    position = {w: i for i, w in enumerate(walk)}
    for items in _walks(got, ctas):
        assert [position[w] for w in items] == sorted(position[w] for w in items)
    assert sorted(w for items in _walks(got, ctas) for w in items) == list(range(count))


@pytest.mark.parametrize("n,block_size,batch,heads,block", [(512, 16, 4, 3, 2), (1024, 4, 8, 2, 4), (256, 7, 3, 5, 1)])
def test_varlen_walk_of_equal_samples_is_the_batched_slot_major_walk(n, block_size, batch, heads, block):
    """Packed samples of equal length walk their (tile, sample, head) items as the batched
    slot-major WorkOrder (chunk 1, `block` entries) walks its (tile, b, head) ones."""
    plans = SequenceMask(n, n, block_size).bwd_tiles(64, 128)
    order = most_expensive_first([p.area for p in plans])
    entries = [(t, i) for i in range(batch) for t in range(len(plans))]  # the bindings' varlen_entries
    by_cost = most_expensive_first([plans[t].area for t, _ in entries])
    tile, sample = zip(*[entries[e] for e in by_cost])
    packed = [(tile[w // heads], sample[w // heads], w % heads) for w in varlen_walk(sample, heads, block)]
    batched = [(order[e], slot // heads, slot % heads) for e, slot in work_order(len(order), batch * heads, 1, block)]
    assert packed == batched


@pytest.mark.parametrize("kind", ["fwd", "dkdv"])
@pytest.mark.parametrize("n,batch", [(1024, 8), (2048, 4)])
def test_balanced_schedule_beats_the_snake_at_short_halves(lib, kind, n, batch):
    """The claim in geometry.h: at n <= 2K (16K tokens, H = 16, block 16, 132 CTAs; items costed
    as order_schedule costs them) the snake's busiest CTA gets 3.1 % more than the mean work,
    the balanced schedule's at most 1.3 %."""
    mask, slots, ctas = SequenceMask(n, n, 16), batch * 16, 132
    bm, bn = (128, 128) if kind == "fwd" else (64, 128)
    plans = mask.fwd_tiles(bm, bn) if kind == "fwd" else mask.bwd_tiles(bm, bn)
    order = most_expensive_first([p.area for p in plans])
    fixed = 3 * bm * bn // 2
    cost = [plans[t].area + fixed for t in order for _ in range(slots)]
    mean = sum(cost) / ctas
    width = -(-len(cost) // ctas) + 1
    out = torch.empty((ctas * width,), dtype=torch.int32)
    _call(lib.dlm_snake_walk, len(cost), ctas, width, _p(out))
    snake = max(sum(cost[w] for w in row if w >= 0) for row in out.view(ctas, width).tolist())
    walks = _walks(order_schedule(plans, order, slots, 1, ctas, bm, bn), ctas)
    balanced = max(sum(cost[w] for w in walk) for walk in walks)
    assert snake / mean > 1.025 and balanced / mean < 1.013


def _snake_max(lib, cost: list[int], ctas: int) -> int:
    """The busiest CTA's work under the snake walk (dlm/geometry.h snake_index)."""
    width = -(-len(cost) // ctas) + 1
    out = torch.empty((ctas * width,), dtype=torch.int32)
    _call(lib.dlm_snake_walk, len(cost), ctas, width, _p(out))
    return max(sum(cost[w] for w in row if w >= 0) for row in out.view(ctas, width).tolist())


@pytest.mark.parametrize("head_dim,key_tile", [(128, 128), (256, 64)])
@pytest.mark.parametrize("n", [1024, 2048, 4096, 8192])
def test_tail_rounds_balance_the_dq_from_ds_walk(lib, head_dim, key_tile, n):
    """The claim behind the dQ-from-dS kernel's schedule (cutlass_diffusion.DQ_SCHEDULE_TAIL_ROUNDS):
    its walk, L2 chunks of (batch, head) slots in 4-wave blocks of entries (hopper/common.cuh
    work_order on an H200: 60 MB of L2, 132 SMs; 16K tokens, H = 16, block 16), is not most
    expensive first as a whole. Costed as order_schedule costs it, the snake's busiest CTA gets
    2-4 % more than the mean at D = 128 and 5-20 % at D = 256, the balanced schedule handing out
    in walk order up to 4.5 %, and with its last 4 rounds handed out most expensive first at most
    1.2 %."""
    batch, heads, ctas, l2 = 8192 // n, 16, 132, 60 << 20
    slots = batch * heads
    chunk = max(1, min(slots, l2 // 2 // (2 * n * head_dim * 2)))  # each slot re-reads its K
    block = -(-4 * ctas // chunk)
    plans = SequenceMask(n, n, 16).fwd_tiles(128, key_tile)
    order = most_expensive_first([p.area for p in plans])
    fixed = 3 * 128 * key_tile // 2
    cost = [plans[order[e]].area + fixed for e, _ in work_order(len(order), slots, chunk, block)]
    mean = sum(cost) / ctas

    def busiest(tail_rounds):
        walks = _walks(order_schedule(plans, order, slots, 1, ctas, 128, key_tile, chunk, block, tail_rounds), ctas)
        return max(sum(cost[w] for w in walk) for walk in walks) / mean

    snake, in_order, tail = _snake_max(lib, cost, ctas) / mean, busiest(0), busiest(4)
    assert (1.02 < snake < 1.04) if head_dim == 128 else (1.05 < snake < 1.21)
    assert 1.006 < in_order < 1.045 and tail < 1.012 and tail < min(snake, in_order)
