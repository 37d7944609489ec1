// A C ABI over csrc/include/dlm/geometry.h, for tests/test_csrc_geometry.py (through ctypes).
//
// Plain g++ builds it in 0.4 s on 2 cores, where torch.utils.cpp_extension.load took 42 s for one
// of these functions (torch's headers, 22 s of CPU), so the CPU suite proves cheaply that the
// header and dlm_ops/geometry.py agree. Arrays are caller-owned int32/int64 buffers; every function returns 0,
// or -1 for arguments geometry.py would reject.
#include <cstdint>
#include <vector>

#include "dlm/geometry.h"

namespace {

struct Sample {
  int offset;
  dlm::SequenceMask mask;
};

// Tiles of every sample, most expensive first: rows [start, end, sample, visit_begin, visit_end]
// (positions include the sample's offset), each tile's area, and visits [start, end, full].
// Called with null outputs it only counts (sizes = [tiles, visits]).
int plan(const std::vector<Sample>& samples, int block_m, int block_n, int transpose, int64_t* sizes,
         int32_t* tiles, int64_t* areas, int32_t* visits) {
  if (block_m < 1 || block_n < 1) return -1;
  std::vector<int32_t> rows, cells;
  std::vector<int64_t> area;
  for (int s = 0; s < static_cast<int>(samples.size()); ++s) {
    const int off = samples[s].offset;
    const dlm::SequenceMask& m = samples[s].mask;
    const dlm::TilePlans p = transpose ? m.bwd_tiles(block_m, block_n) : m.fwd_tiles(block_m, block_n);
    for (int t = 0; t < p.count(); ++t) {
      const dlm::Interval own = p.tile(t);
      const dlm::TileRuns r = p.runs(t);
      const int begin = static_cast<int>(cells.size() / 3);
      for (int i = 0; i < 2; ++i)
        for (int o = r.begin[i]; o < r.end[i]; ++o) {
          const dlm::Visit v = p.visit(t, o);
          cells.insert(cells.end(), {off + v.start, off + v.end, v.full ? 1 : 0});
        }
      rows.insert(rows.end(), {off + own.lo, off + own.hi, s, begin, static_cast<int>(cells.size() / 3)});
      area.push_back(p.area(t));
    }
  }
  const int count = static_cast<int>(area.size());
  sizes[0] = count;
  sizes[1] = static_cast<int64_t>(cells.size() / 3);
  if (!tiles) return 0;
  std::vector<int32_t> order(count);
  dlm::most_expensive_first(area.data(), count, order.data());
  for (int i = 0; i < count; ++i) {
    for (int j = 0; j < 5; ++j) tiles[5 * i + j] = rows[5 * order[i] + j];
    areas[i] = area[order[i]];
  }
  for (size_t i = 0; i < cells.size(); ++i) visits[i] = cells[i];
  return 0;
}

bool valid(int nn, int nc, int bs) { return nn >= 0 && nc >= 0 && bs >= 1; }

}  // namespace

extern "C" {

// out[4*i ..] = [lo1, hi1, lo2, hi2] of pos[i]: row intervals, or column intervals when transpose.
int dlm_intervals(int nn, int nc, int bs, int transpose, int count, const int32_t* pos, int32_t* out) {
  if (!valid(nn, nc, bs)) return -1;
  const dlm::SequenceMask m{nn, nc, bs};
  for (int i = 0; i < count; ++i) {
    const dlm::Intervals iv = transpose ? m.col_intervals(pos[i]) : m.row_intervals(pos[i]);
    const int32_t row[4] = {iv.first.lo, iv.first.hi, iv.second.lo, iv.second.hi};
    for (int j = 0; j < 4; ++j) out[4 * i + j] = row[j];
  }
  return 0;
}

// out[i*cols + j] = visible(rows[i], cols[j]).
int dlm_visible(int nn, int nc, int bs, int n_rows, int n_cols, uint8_t* out) {
  if (!valid(nn, nc, bs)) return -1;
  const dlm::SequenceMask m{nn, nc, bs};
  for (int r = 0; r < n_rows; ++r)
    for (int c = 0; c < n_cols; ++c) out[r * n_cols + c] = m.visible(r, c);
  return 0;
}

int dlm_num_pairs(int nn, int nc, int bs, int64_t* out) {
  if (!valid(nn, nc, bs)) return -1;
  *out = dlm::SequenceMask{nn, nc, bs}.num_pairs();
  return 0;
}

int dlm_plan(int nn, int nc, int bs, int block_m, int block_n, int transpose, int64_t* sizes,
             int32_t* tiles, int64_t* areas, int32_t* visits) {
  if (!valid(nn, nc, bs)) return -1;
  return plan({{0, {nn, nc, bs}}}, block_m, block_n, transpose, sizes, tiles, areas, visits);
}

int dlm_varlen_num_pairs(const int32_t* cu, int num_samples, int bs, int64_t* out) {
  const dlm::VarlenMask m{cu, num_samples, bs};
  if (!dlm::varlen_valid(m)) return -1;
  *out = m.num_pairs();
  return 0;
}

int dlm_varlen_plan(const int32_t* cu, int num_samples, int bs, int block_m, int block_n,
                    int transpose, int64_t* sizes, int32_t* tiles, int64_t* areas, int32_t* visits) {
  const dlm::VarlenMask m{cu, num_samples, bs};
  if (!dlm::varlen_valid(m)) return -1;
  std::vector<Sample> samples;
  for (int i = 0; i < num_samples; ++i) samples.push_back({m.offset(i), m.sample(i)});
  return plan(samples, block_m, block_n, transpose, sizes, tiles, areas, visits);
}

// The runs of every part of `part` own positions of every own tile (a tile's last part may be
// short), in tile order: out[4*i ..] = [begin0, end0, begin1, end1] of part i (TilePlans::runs_of,
// what a dK/dV warpgroup visits of its 64 keys). Called with a null out it only counts (*count).
int dlm_part_runs(int nn, int nc, int bs, int block_m, int block_n, int transpose, int part,
                  int* count, int32_t* out) {
  if (!valid(nn, nc, bs) || block_m < 1 || block_n < 1 || part < 1) return -1;
  const dlm::SequenceMask m{nn, nc, bs};
  const dlm::TilePlans p = transpose ? m.bwd_tiles(block_m, block_n) : m.fwd_tiles(block_m, block_n);
  int i = 0;
  for (int t = 0; t < p.count(); ++t) {
    const dlm::Interval tile = p.tile(t);
    for (int lo = tile.lo; lo < tile.hi; lo += part, ++i) {
      if (!out) continue;
      const dlm::TileRuns r = p.runs_of({lo, dlm::imin(lo + part, tile.hi)});
      const int32_t row[4] = {r.begin[0], r.end[0], r.begin[1], r.end[1]};
      for (int j = 0; j < 4; ++j) out[4 * i + j] = row[j];
    }
  }
  *count = i;
  return 0;
}

// out[2*w ..] = (entry, slot) of work index w of WorkOrder{slots, chunk, block} over `entries`.
int dlm_work_order(int entries, int slots, int chunk, int block, int32_t* out) {
  if (entries < 1 || slots < 1 || chunk < 1 || chunk > slots || block < 1) return -1;
  const dlm::WorkOrder o{slots, chunk, block};
  for (int w = 0; w < entries * slots; ++w) o.decode(w, entries, out[2 * w], out[2 * w + 1]);
  return 0;
}

// out[c * max_items + i] = the work index of CTA c's i-th item (snake_index), -1 past its walk's
// end (the first index >= items); max_items >= ceil(items / ctas) + 1.
int dlm_snake_walk(int items, int ctas, int max_items, int32_t* out) {
  if (items < 0 || ctas < 1 || max_items < 1) return -1;
  for (int c = 0; c < ctas; ++c) {
    int i = 0;
    for (int w = dlm::snake_index(0, ctas, c); w < items; w = dlm::snake_index(++i, ctas, c)) {
      if (i >= max_items) return -1;
      out[c * max_items + i] = w;
    }
    for (; i < max_items; ++i) out[c * max_items + i] = -1;
  }
  return 0;
}

// out (ctas + 1 + count int32): balanced_schedule of `cost` on `ctas` CTAs, its last tail_rounds
// rounds handed out most expensive first.
int dlm_balanced_schedule(const int64_t* cost, int count, int ctas, int tail_rounds, int32_t* out) {
  if (count < 0 || ctas < 1 || tail_rounds < 0) return -1;
  dlm::balanced_schedule(cost, count, ctas, out, tail_rounds);
  return 0;
}

// out (ctas + 1 + entries * slots int32): entry_schedule of entries costing entry_cost[] per item,
// walked in WorkOrder{slots, chunk, block}.
int dlm_entry_schedule(const int64_t* entry_cost, int entries, int slots, int chunk, int block, int ctas,
                       int tail_rounds, int32_t* out) {
  if (entries < 0 || slots < 1 || chunk < 1 || chunk > slots || block < 1 || ctas < 1 || tail_rounds < 0)
    return -1;
  const std::vector<int32_t> sched =
      dlm::entry_schedule(entry_cost, entries, dlm::WorkOrder{slots, chunk, block}, ctas, tail_rounds);
  std::copy(sched.begin(), sched.end(), out);
  return 0;
}

// out (ctas + 1 + entries * slots int32): order_schedule of the mask's forward (transpose 0) or
// backward (1) plans of block_m x block_n tiles, entries `order` (entries of them), walked in
// WorkOrder{slots, chunk, block}, its last tail_rounds rounds handed out most expensive first.
int dlm_order_schedule(int nn, int nc, int bs, int block_m, int block_n, int transpose, const int32_t* order,
                       int entries, int slots, int chunk, int block, int weight, int ctas, int tail_rounds,
                       int32_t* out) {
  if (!valid(nn, nc, bs) || block_m < 1 || block_n < 1 || slots < 1 || chunk < 1 || chunk > slots ||
      block < 1 || weight < 1 || ctas < 1 || tail_rounds < 0)
    return -1;
  const dlm::SequenceMask m{nn, nc, bs};
  const dlm::TilePlans plans = transpose ? m.bwd_tiles(block_m, block_n) : m.fwd_tiles(block_m, block_n);
  for (int e = 0; e < entries; ++e)
    if (order[e] < 0 || order[e] >= plans.count()) return -1;
  const std::vector<int32_t> sched =
      dlm::order_schedule(plans, order, entries, dlm::WorkOrder{slots, chunk, block}, weight, ctas, tail_rounds);
  std::copy(sched.begin(), sched.end(), out);
  return 0;
}

// out (entries * slots int32): varlen_walk of entries of samples sample[] (each in [0, num_samples)).
int dlm_varlen_walk(const int32_t* sample, int entries, int num_samples, int slots, int block, int32_t* out) {
  if (entries < 0 || num_samples < 0 || slots < 1 || block < 0) return -1;
  for (int e = 0; e < entries; ++e)
    if (sample[e] < 0 || sample[e] >= num_samples) return -1;
  const std::vector<int32_t> walk = dlm::varlen_walk(sample, entries, num_samples, slots, block);
  std::copy(walk.begin(), walk.end(), out);
  return 0;
}

// out (ctas + 1 + count int32): walk_schedule of the count work indices `walk` costing cost[].
int dlm_walk_schedule(const int32_t* walk, const int64_t* cost, int count, int ctas, int32_t* out) {
  if (count < 0 || ctas < 1) return -1;
  const std::vector<int32_t> sched = dlm::walk_schedule(std::vector<int32_t>(walk, walk + count), cost, ctas);
  std::copy(sched.begin(), sched.end(), out);
  return 0;
}

}  // extern "C"
