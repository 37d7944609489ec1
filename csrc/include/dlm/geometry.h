// The block-diffusion mask for C++ and CUDA: a mirror of dlm_ops/geometry.py (same formulas, same
// names). tests/test_csrc_geometry.py proves the two agree on random shapes, so read the notation
// block at the top of geometry.py first; only what differs is noted here.
//
// Framework-free: no torch, no CUDA runtime, C++17 standard library only. Under nvcc every function
// a kernel needs is __host__ __device__; varlen_valid and most_expensive_first (the launch-time
// checks and schedule) are host only.
//
// Integers. Positions and tile indices are int (the kernels' tile tables are int32 too, so a
// sequence or a packed varlen batch holds < 2^31 tokens); pair counts and tile areas are int64_t
// (n = 64K already gives 2^32 visible pairs).
//
// Tiles. Each half is cut into tiles of `size` positions from its own start (Tiling), so a tile
// never crosses the noisy/clean boundary. For one tile the visited tiles of the other side form at
// most two runs of consecutive tile indices (TileRuns): the union over the tile's rows of each of
// the two monotone key ranges. A kernel walks the runs and asks visit() whether each is FULL (run it
// unmasked) or PARTIAL (mask it element-wise with row_intervals); no table is needed for that. The
// only table is the schedule: the tiles of every sample, most expensive first.
#pragma once

#include <algorithm>  // std::stable_sort, heaps (host only: most_expensive_first, balanced_schedule)
#include <cstdint>
#include <utility>
#include <vector>

#if defined(__CUDACC__)
#define DLM_HD __host__ __device__ __forceinline__
#define DLM_UNROLL _Pragma("unroll")  // the two-run loops: unrolled, their arrays stay in registers
#else
#define DLM_HD inline
#define DLM_UNROLL
#endif

namespace dlm {

DLM_HD int imin(int a, int b) { return a < b ? a : b; }
// ceil(a / b) for a >= 0, b >= 1, without the overflow of (a + b - 1) / b near INT_MAX.
DLM_HD int cdiv(int a, int b) { return a / b + (a % b != 0); }

// Positions [lo, hi); empty when hi <= lo.
struct Interval {
  int lo, hi;
  DLM_HD bool empty() const { return hi <= lo; }
  DLM_HD int size() const { return hi > lo ? hi - lo : 0; }
  DLM_HD bool contains(int p) const { return lo <= p && p < hi; }
};

// geometry.py's [lo1, hi1, lo2, hi2]: `first` is [lo1, hi1), `second` is [lo2, hi2).
struct Intervals {
  Interval first, second;
  DLM_HD bool contains(int p) const { return first.contains(p) || second.contains(p); }
  DLM_HD int size() const { return first.size() + second.size(); }
};

enum class TileKind : int { kNone = 0, kPartial = 1, kFull = 2 };

// Tiles of `size` positions cut from each half's own start; the last tile of a half may be short.
// Tile indices run over the noisy half first, then the clean half.
struct Tiling {
  int n_noisy, n_clean, size;

  DLM_HD int num_noisy() const { return cdiv(n_noisy, size); }
  DLM_HD int count() const { return num_noisy() + cdiv(n_clean, size); }
  DLM_HD Interval tile(int t) const {
    const int nt = num_noisy();
    const int lo = t < nt ? t * size : n_noisy + (t - nt) * size;
    const int half_end = t < nt ? n_noisy : n_noisy + n_clean;
    return {lo, lo + imin(size, half_end - lo)};
  }
  // The tile holding position p (0 <= p < n_noisy + n_clean).
  DLM_HD int index_of(int p) const {
    return p < n_noisy ? p / size : num_noisy() + (p - n_noisy) / size;
  }
};

// For one tile: the other side's tiles it meets, as runs [begin[i], end[i]) of tile indices
// (run 0 before run 1 in position order; an empty run has begin == end).
struct TileRuns {
  int begin[2], end[2];
  DLM_HD int count() const { return (end[0] - begin[0]) + (end[1] - begin[1]); }
};

// geometry.py's Visit: the visited tile's positions and whether every pair in it is visible.
struct Visit {
  int start, end;
  bool full;
};

struct SequenceMask;

// geometry.py's fwd_tiles / bwd_tiles, computed per tile instead of listed. Forward: own tiles are
// query tiles of block_m rows and the other side key tiles of block_n columns; backward
// (transpose): own tiles are key tiles of block_n, the other side query tiles of block_m.
struct TilePlans {
  int n_noisy, n_clean, block_size;
  Tiling own, other;
  bool transpose;

  DLM_HD int count() const { return own.count(); }
  DLM_HD Interval tile(int t) const { return own.tile(t); }
  DLM_HD TileRuns runs(int t) const { return runs_of(own.tile(t)); }
  // The same for any range of own positions inside one half (e.g. one warpgroup's part of a tile).
  DLM_HD TileRuns runs_of(Interval own_range) const;
  DLM_HD Visit visit(int t, int other_tile) const;
  // Pairs covered by tile t's visits (geometry.TilePlan.area): the cost used to order the work.
  DLM_HD int64_t area(int t) const;
};

struct SequenceMask {
  int n_noisy, n_clean, block_size;

  DLM_HD int seqlen() const { return n_noisy + n_clean; }
  DLM_HD bool is_noisy(int p) const { return p < n_noisy; }
  // Block of position p inside its own half (blocks restart in every half).
  DLM_HD int block_of(int p) const { return (p < n_noisy ? p : p - n_noisy) / block_size; }

  // The keys query `row` sees.
  DLM_HD Intervals row_intervals(int row) const {
    const int nn = n_noisy, nc = n_clean, bs = block_size, b = block_of(row);
    if (is_noisy(row)) return {{b * bs, imin((b + 1) * bs, nn)}, {nn, nn + imin(b * bs, nc)}};
    return {{nn, nn + imin((b + 1) * bs, nc)}, {nn, nn}};
  }
  // The query rows that see key `col`.
  DLM_HD Intervals col_intervals(int col) const {
    const int nn = n_noisy, nc = n_clean, bs = block_size, b = block_of(col);
    if (is_noisy(col)) return {{b * bs, imin((b + 1) * bs, nn)}, {nn + nc, nn + nc}};
    return {{imin((b + 1) * bs, nn), nn}, {nn + imin(b * bs, nc), nn + nc}};
  }
  DLM_HD bool visible(int row, int col) const { return row_intervals(row).contains(col); }

  // Visible (query, key) pairs, in closed form (geometry.py sums row_intervals; the test proves the
  // two agree): n^2 + n*bs for the BD3 mask when bs divides n.
  DLM_HD int64_t num_pairs() const {
    const int64_t nn = n_noisy, nc = n_clean, bs = block_size;
    int64_t pairs = 0;
    if (nn > 0) {  // noisy rows: their own block, plus the clean keys of earlier blocks
      const int64_t blocks = cdiv(n_noisy, block_size), last = nn - (blocks - 1) * bs;
      pairs += (blocks - 1) * bs * bs + last * last;
      // sum over noisy blocks b of rows(b) * min(b*bs, nc): every block has bs rows but the last.
      const int64_t below = imin(static_cast<int>(blocks), cdiv(n_clean, block_size));  // b*bs < nc
      const int64_t sum_min = bs * below * (below - 1) / 2 + (blocks - below) * nc;
      const int64_t last_min = (blocks - 1) * bs < nc ? (blocks - 1) * bs : nc;
      pairs += bs * sum_min - (bs - last) * last_min;
    }
    if (nc > 0) {  // clean rows of block b see (b+1)*bs keys, the last block all nc
      const int64_t blocks = cdiv(n_clean, block_size), last = nc - (blocks - 1) * bs;
      pairs += bs * bs * (blocks - 1) * blocks / 2 + last * nc;
    }
    return pairs;
  }

  // Rows [r0, r1) x keys [c0, c1), each inside one half (geometry.py's _tile_full).
  DLM_HD TileKind tile_kind(int r0, int r1, int c0, int c1) const {
    const bool q_noisy = r0 < n_noisy, k_noisy = c0 < n_noisy;
    const int qb0 = block_of(r0), qb1 = block_of(r1 - 1), kb0 = block_of(c0), kb1 = block_of(c1 - 1);
    bool any, full;
    if (q_noisy && k_noisy) {  // same block only
      any = qb0 <= kb1 && kb0 <= qb1;
      full = qb0 == qb1 && qb1 == kb0 && kb0 == kb1;
    } else if (q_noisy) {  // noisy query, clean key: strictly earlier blocks
      any = kb0 < qb1;
      full = kb1 < qb0;
    } else if (!k_noisy) {  // clean query, clean key: earlier or same block
      any = kb0 <= qb1;
      full = kb1 <= qb0;
    } else {  // clean queries never see noisy keys
      any = full = false;
    }
    return !any ? TileKind::kNone : full ? TileKind::kFull : TileKind::kPartial;
  }

  DLM_HD TilePlans fwd_tiles(int block_m, int block_n) const {
    return {n_noisy, n_clean, block_size, {n_noisy, n_clean, block_m}, {n_noisy, n_clean, block_n},
            false};
  }
  DLM_HD TilePlans bwd_tiles(int block_m, int block_n) const {
    return {n_noisy, n_clean, block_size, {n_noisy, n_clean, block_n}, {n_noisy, n_clean, block_m},
            true};
  }
};

// The BD3-LM mask over seqlen = 2n tokens (seqlen must be even: see varlen_valid / the Python checks).
DLM_HD SequenceMask block_diffusion(int seqlen, int block_size) {
  return {seqlen / 2, seqlen / 2, block_size};
}
// Key block <= query block over seqlen tokens (block_size 1 is causal attention).
DLM_HD SequenceMask block_causal(int seqlen, int block_size) { return {0, seqlen, block_size}; }

DLM_HD TileRuns TilePlans::runs_of(Interval own_tile) const {
  const SequenceMask mask{n_noisy, n_clean, block_size};
  const Intervals first = transpose ? mask.col_intervals(own_tile.lo) : mask.row_intervals(own_tile.lo);
  const Intervals last = transpose ? mask.col_intervals(own_tile.hi - 1)
                                   : mask.row_intervals(own_tile.hi - 1);
  // Each range is monotone in the row (column) inside a half, so its union over the tile is
  // [lo of the first row, hi of the last row).
  const Interval ranges[2] = {{first.first.lo, last.first.hi}, {first.second.lo, last.second.hi}};
  TileRuns r{};
  DLM_UNROLL
  for (int i = 0; i < 2; ++i) {
    if (ranges[i].empty()) continue;
    r.begin[i] = other.index_of(ranges[i].lo);
    r.end[i] = other.index_of(ranges[i].hi - 1) + 1;
  }
  return r;
}

DLM_HD Visit TilePlans::visit(int t, int other_tile) const {
  const SequenceMask mask{n_noisy, n_clean, block_size};
  const Interval a = own.tile(t), b = other.tile(other_tile);
  const TileKind kind = transpose ? mask.tile_kind(b.lo, b.hi, a.lo, a.hi)
                                  : mask.tile_kind(a.lo, a.hi, b.lo, b.hi);
  return {b.lo, b.hi, kind == TileKind::kFull};
}

DLM_HD int64_t TilePlans::area(int t) const {
  const TileRuns r = runs(t);
  int64_t width = 0;
  DLM_UNROLL
  for (int i = 0; i < 2; ++i)  // the tiles of a run are contiguous: its width is last end - first start
    if (r.end[i] > r.begin[i]) width += other.tile(r.end[i] - 1).hi - other.tile(r.begin[i]).lo;
  return static_cast<int64_t>(own.tile(t).size()) * width;
}

// Packed samples: sample i occupies [cu_seqlens[i], cu_seqlens[i+1]), an even length 2*m_i laid
// out [noisy_i | clean_i]. cu_seqlens points to num_samples + 1 offsets (device memory in a kernel).
struct VarlenMask {
  const int32_t* cu_seqlens;
  int num_samples;
  int block_size;

  DLM_HD int offset(int i) const { return cu_seqlens[i]; }
  DLM_HD SequenceMask sample(int i) const {
    return block_diffusion(cu_seqlens[i + 1] - cu_seqlens[i], block_size);
  }
  DLM_HD int64_t num_pairs() const {
    int64_t pairs = 0;
    for (int i = 0; i < num_samples; ++i) pairs += sample(i).num_pairs();
    return pairs;
  }
};

// Host only (not DLM_HD): the host checks cu_seqlens and builds the schedule before a launch.
// What dlm_ops/ops/validation.py checks before any kernel runs: starts at 0, non-decreasing, even
// sample lengths, block_size >= 1.
inline bool varlen_valid(const VarlenMask& m) {
  if (m.block_size < 1 || m.num_samples < 0 || m.cu_seqlens[0] != 0) return false;
  for (int i = 0; i < m.num_samples; ++i) {
    const int len = m.cu_seqlens[i + 1] - m.cu_seqlens[i];
    if (len < 0 || len % 2) return false;
  }
  return true;
}

// The walk over a kernel's work: (entry e, slot j) pairs, entries its tiles most expensive first
// (most_expensive_first), slots its (batch, head) pairs. Entry-major over all B * H slots (the
// order up to session 6) puts every head in flight at once, and what a slot re-reads per visit
// (K / V in the forward and dQ, Q / dO in dK/dV) is then B * H times a head's share: 134 MB at
// 16K tokens, H = 16, D = 128, against 60 MB of L2 on the H200 (ncu, n = 1K: L2 hit rate 25 /
// 27 / 20 % in forward / dK/dV / dQ). WorkOrder cuts the entries into blocks of `block`
// consecutive ones and the slots into chunks of `chunk`, and walks block by block, chunk by chunk
// inside a block, entry-major inside that: the slots in flight are about one chunk's, and the
// most expensive items still come first at the granularity of a block (chunk-major alone, block
// >= entries, let the last chunk's longest items start last: the forward lost 5 % at n = 8K,
// where that chunk was one head). chunk >= slots is the plain entry-major order. hopper/common.cuh
// work_order picks chunk and block for a device.
struct WorkOrder {
  int slots, chunk, block;
  // Work index w in [0, entries * slots) -> (entry, slot); a bijection (tests/test_csrc_geometry.py).
  DLM_HD void decode(int w, int entries, int& entry, int& slot) const {
    const int blk = block < entries ? block : entries;  // block * slots must not overflow
    const int per_block = blk * slots, b = w / per_block, first_entry = b * blk;
    const int rows = entries - first_entry < blk ? entries - first_entry : blk;
    const int r = w - b * per_block, per_chunk = chunk * rows, c = r / per_chunk;
    const int first_slot = c * chunk, width = slots - first_slot < chunk ? slots - first_slot : chunk;
    const int q = r - c * per_chunk, e = q / width;
    entry = first_entry + e;
    slot = first_slot + q - e * width;
  }
};

// A persistent CTA's walk: the work index of CTA `cta`'s item-th item (item = 0, 1, ...) on a grid
// of `ctas` CTAs. Round j hands out indices [j ctas, (j + 1) ctas) to CTAs 0 .. ctas - 1 when j is
// even and ctas - 1 .. 0 when it is odd (a snake); a CTA's indices only grow, so it stops at its
// first one past the end, and every index goes to one CTA (tests/test_csrc_geometry.py). Work comes
// most expensive first: a plain stride (cta, cta + ctas, ...) gave CTA 0 the dearest item of every
// round (csrc/NOTES.md session 9). One CTA per item (ctas = items): item 0 is `cta`, item 1 is past
// the end. hopper/common.cuh snake_item is the kernels' call.
DLM_HD int snake_index(int item, int ctas, int cta) {
  return item * ctas + (item & 1 ? ctas - 1 - cta : cta);
}

// A balanced walk (host-built): the CTAs' items listed in one int32 array, `ctas + 1` offsets into
// that same array first (CTA c's items are schedule[schedule[c] .. schedule[c + 1])), then the
// items. Returns CTA `cta`'s item-th work index, or `num_items` past its list. hopper/common.cuh
// walk_item is the kernels' call; balanced_schedule builds the array.
DLM_HD int scheduled_index(const int32_t* schedule, int item, int cta, int num_items) {
  const int i = schedule[cta] + item;
  return i < schedule[cta + 1] ? schedule[i] : num_items;
}

// The balanced schedule (host only): work indices 0 .. count-1 in order, each given to the CTA
// with the least cost so far (ties: the lowest CTA), so that with work most expensive first this
// is the longest-processing-time rule. The snake hands out whole rounds: with the work of n <= 2K
// (2048 items of 1-16 tiles on 132 CTAs) its busiest CTA gets 3.1 % more than the mean, where
// this rule's gets 0.5-1.3 % more (order_schedule's cost model; tests/test_csrc_geometry.py
// counts it). tail_rounds > 0: the last tail_rounds * ctas items are handed out most expensive
// first (ties in work order). A walk that is not most expensive first as a whole (L2 chunks of
// slots, each restarting at the dearest tiles: the dQ-from-dS kernel's) can hand a dear item out
// late, when every CTA is already near the mean, and then the busiest CTA ends that item's cost
// above it; LPT's bound only needs the items handed out last to be the cheapest. Writes ctas + 1 +
// count int32 to `out` (scheduled_index's layout); a CTA's items stay in work order, so a CTA
// still runs the tail's items where the walk puts them.
inline void balanced_schedule(const int64_t* cost, int count, int ctas, int32_t* out, int tail_rounds = 0) {
  std::vector<std::pair<int64_t, int>> heap;  // (load, cta), a min-heap
  for (int c = 0; c < ctas; ++c) heap.emplace_back(0, c);
  std::vector<int32_t> hand(count), owner(count);  // hand: the work indices in the order handed out
  for (int w = 0; w < count; ++w) hand[w] = w;
  const int64_t tail = std::min<int64_t>(count, int64_t{tail_rounds > 0 ? tail_rounds : 0} * ctas);
  std::stable_sort(hand.begin() + (count - tail), hand.end(),
                   [cost](int32_t a, int32_t b) { return cost[a] > cost[b]; });
  auto later = [](const std::pair<int64_t, int>& a, const std::pair<int64_t, int>& b) { return a > b; };
  for (const int32_t w : hand) {
    std::pop_heap(heap.begin(), heap.end(), later);
    owner[w] = heap.back().second;
    heap.back().first += cost[w];
    std::push_heap(heap.begin(), heap.end(), later);
  }
  std::vector<int32_t> next(ctas + 1, 0);
  for (int w = 0; w < count; ++w) ++next[owner[w] + 1];
  next[0] = ctas + 1;
  for (int c = 0; c < ctas; ++c) next[c + 1] += next[c];
  for (int c = 0; c <= ctas; ++c) out[c] = next[c];
  for (int w = 0; w < count; ++w) out[next[owner[w]]++] = w;
}

// The balanced schedule of a kernel's work walked in WorkOrder `walk` (work index w -> (entry,
// slot); chunk >= slots is the plain entry-major order w = entry * slots + slot), entry e being tile
// order[e] of `plans`, on `ctas` CTAs. An item costs the pairs its tile's visits cover (area)
// `weight` times (the dK/dV kernel walks its K / V head's group of query heads per item) plus
// kScheduleItemHalfTiles / 2 tiles of own x other positions for its fixed part: its Q or K / V
// load and its epilogue (session 17's trace of the forward at n = 1K: ~2.4 us of a 12 us item
// against 1.66 us per full tile). tail_rounds: balanced_schedule's.
constexpr int kScheduleItemHalfTiles = 3;
// The same for entries of any cost (packed samples' tiles): every item of entry e costs
// entry_cost[e]. order_schedule is this with its tiles' costs.
inline std::vector<int32_t> entry_schedule(const int64_t* entry_cost, int entries, const WorkOrder& walk, int ctas,
                                           int tail_rounds = 0) {
  const int count = entries * walk.slots;
  std::vector<int64_t> cost(static_cast<size_t>(count));
  for (int w = 0; w < count; ++w) {
    int e, slot;
    walk.decode(w, entries, e, slot);
    cost[w] = entry_cost[e];
  }
  std::vector<int32_t> out(ctas + 1 + cost.size());
  balanced_schedule(cost.data(), count, ctas, out.data(), tail_rounds);
  return out;
}
inline std::vector<int32_t> order_schedule(const TilePlans& plans, const int32_t* order, int entries,
                                           const WorkOrder& walk, int weight, int ctas, int tail_rounds = 0) {
  const int64_t fixed = int64_t{kScheduleItemHalfTiles} * plans.own.size * plans.other.size / 2;
  std::vector<int64_t> entry_cost(static_cast<size_t>(entries));
  for (int e = 0; e < entries; ++e) entry_cost[e] = weight * plans.area(order[e]) + fixed;
  return entry_schedule(entry_cost.data(), entries, walk, ctas, tail_rounds);
}

// Packed samples' work (kStartVarlen kernels: entry e is a tile of sample sample[e], entries most
// expensive first over all samples, work index w = e * slots + slot, the plain order they decode)
// listed in the order a balanced schedule should hand it out. block 0: w = 0, 1, ... (the plain
// order). block >= 1: as the batched slot-major WorkOrder (chunk 1, `block` entries) with (sample,
// slot) pairs as its slots: round r lists, sample by sample and slot by slot, that slot's items of
// the sample's entries [r block, r block + block) (a sample's own entries in their order), so the
// CTAs running side by side work on one (sample, head) and share what it re-reads in L2 (the dK/dV
// kernel: Q / dO). With equal samples this is the batched walk item for item. Returns the work
// indices (entries * slots, a permutation).
inline std::vector<int32_t> varlen_walk(const int32_t* sample, int entries, int num_samples, int slots, int block) {
  std::vector<int32_t> walk;
  walk.reserve(static_cast<size_t>(entries) * slots);
  if (block <= 0) {
    for (int w = 0; w < entries * slots; ++w) walk.push_back(w);
    return walk;
  }
  std::vector<std::vector<int32_t>> own(static_cast<size_t>(num_samples));
  for (int e = 0; e < entries; ++e) own[sample[e]].push_back(e);
  size_t longest = 0;
  for (const auto& list : own) longest = list.size() > longest ? list.size() : longest;
  for (size_t first = 0; first < longest; first += block)
    for (const auto& list : own)
      for (int slot = 0; slot < slots; ++slot)
        for (size_t j = first; j < list.size() && j < first + block; ++j) walk.push_back(list[j] * slots + slot);
  return walk;
}

// balanced_schedule of work handed out in the order `walk` (work indices; cost[i] is walk[i]'s):
// the CTAs' lists hold work indices, each CTA's in walk order (scheduled_index's layout).
inline std::vector<int32_t> walk_schedule(const std::vector<int32_t>& walk, const int64_t* cost, int ctas) {
  const int count = static_cast<int>(walk.size());
  std::vector<int32_t> out(ctas + 1 + static_cast<size_t>(count));
  balanced_schedule(cost, count, ctas, out.data());
  for (int i = ctas + 1; i < ctas + 1 + count; ++i) out[i] = walk[out[i]];
  return out;
}

// The schedule: order[] = indices 0..count-1 of `area`, largest area first, ties in index order
// (a stable sort, as triton_backend.tile_tables does), so the most expensive tiles start in the
// first wave and do not finish last. Index work tiles sample by sample, tile by tile.
inline void most_expensive_first(const int64_t* area, int count, int32_t* order) {
  for (int i = 0; i < count; ++i) order[i] = i;
  std::stable_sort(order, order + count, [area](int32_t a, int32_t b) { return area[a] > area[b]; });
}

}  // namespace dlm
