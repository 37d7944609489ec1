// Host mirror of which keys the sm90 forward's consumers let through, per query row, for tiles
// that start anywhere (kStartAny; a varlen sample is the same at its own offset): the work items,
// runs, visits, FULL / PARTIAL, the column mask, and the stored rows, against the mask's
// definition written out here (not geometry.h's). Written for issue #7's varlen failure at n = 500,
// bs = 300; it mirrors csrc/hopper/diffusion_fwd.cuh by hand, so a change to the consumer's mask
// logic must be made here too.
//
//   fwd_mask_mirror MODE N BS BN   one shape: prints the first wrong rows, then "bad <rows>"
//   fwd_mask_mirror MODE NMAX      n in 1..NMAX x bs in {1, 4, 5, 16, 32, 64, 100, 128, 200, 256,
//                                  300, 500, 700} x BN in {128, 64}: "failing <shapes>"
// MODE 0: the shipped loop (v5, e151295: FULL from hoisted bounds, which needs the full width,
// and online_softmax<masked>'s one interval per row; v9: with BN = 128 and block sizes dividing
// 64, a noisy tile's first visit, its diagonal, narrow: each consumer's 64 keys). MODE 1: the loop before v5 (f2a2bfb, TRIM_
// 0), whose online_softmax took a visit as unmasked when FULL and not shorter than its `BN`, which
// was its thread's column count (BN / 4), not the tile's: a FULL short key tile (the last of a
// half, 116 keys at n = 500) let its keys past the half through, which failed on the H200.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "dlm/geometry.h"

using namespace dlm;

static bool defined_visible(int nn, int bs, int q, int k) {  // DESIGN.md's BD3 mask
  const bool qc = q >= nn, kc = k >= nn;
  const int qb = (qc ? q - nn : q) / bs, kb = (kc ? k - nn : k) / bs;
  if (qc == kc && qb == kb) return true;
  if (!qc && kc) return kb < qb;
  return qc && kc && kb <= qb;
}

// Rows stored wrongly (keys let through != keys visible, or a key twice) plus rows not stored
// exactly once, for a BM = 128 forward (two consumers of 64 rows) with BN-key tiles.
static int mirror(int mode, int n, int bs, int BN, bool verbose) {
  constexpr int BM = 128, kConsumerRows = 64;
  const SequenceMask mask = block_diffusion(2 * n, bs);
  const int S = 2 * n;
  const TilePlans plans = mask.fwd_tiles(BM, BN);
  std::vector<int> stored(S, 0);
  int bad = 0;
  for (int qt = 0; qt < plans.count(); ++qt) {
    const Interval q_tile = plans.tile(qt);
    const TileRuns runs = plans.runs(qt);
    const int n_first = runs.end[0] - runs.begin[0], n_tiles = runs.count();
    const Intervals first_row = mask.row_intervals(q_tile.lo), last_row = mask.row_intervals(q_tile.hi - 1);
    const Intervals all_keys{{last_row.first.lo, first_row.first.hi}, {last_row.second.lo, first_row.second.hi}};
    for (int row = q_tile.lo; row < q_tile.lo + BM; ++row) {  // both consumers' 64 rows each
      const Intervals seen = mask.row_intervals(row);
      // One interval per row, from the range that meets the visit (online_softmax's bounds).
      auto let_through = [&](const Visit& visit, int width, bool masked, std::vector<int>& keys) {
        const bool in_first = seen.first.hi > visit.start && seen.first.lo < visit.end;
        const int lo = in_first ? seen.first.lo : seen.second.lo;
        const int hi = std::min(in_first ? seen.first.hi : seen.second.hi, visit.end);
        for (int col = visit.start; col < visit.start + width; ++col) {  // the box's keys
          bool pass = true;
          if (masked) pass = mode == 0 ? lo <= col && col < hi : col < visit.end && seen.contains(col);
          if (pass) keys.push_back(col);
        }
      };
      std::vector<int> keys;
      int j0 = 0;
      // MODE 0, narrow_first_visit / narrow_visit: the consumer's 64 keys of the diagonal, masked.
      if (mode == 0 && BN == BM && q_tile.lo < mask.n_noisy && n_first == 1 && kConsumerRows % bs == 0) {
        const int consumer = (row - q_tile.lo) / kConsumerRows;
        const Interval t = plans.other.tile(runs.begin[0]);
        const Visit mine{t.lo + consumer * kConsumerRows, std::min(t.lo + (consumer + 1) * kConsumerRows, t.hi),
                         false};
        let_through(mine, kConsumerRows, true, keys);
        j0 = 1;
      }
      for (int j = j0; j < n_tiles; ++j) {
        const int kt = j < n_first ? runs.begin[0] + j : runs.begin[1] + (j - n_first);
        Visit visit = plans.visit(qt, kt);  // MODE 1: tile_kind's FULL
        if (mode == 0) {                     // step_visit
          const Interval t = plans.other.tile(kt);
          const Interval all = j < n_first ? all_keys.first : all_keys.second;
          visit = {t.lo, t.hi, t.hi - t.lo == BN && t.lo >= all.lo && t.hi <= all.hi};
        }
        const int width = mode == 1 ? BN / 4 : BN;
        let_through(visit, BN, !visit.full || visit.end - visit.start < width, keys);
      }
      if (row >= q_tile.hi) continue;  // rows past the tile are not stored
      ++stored[row];
      std::vector<int> want;
      for (int k = 0; k < S; ++k)
        if (defined_visible(n, bs, row, k)) want.push_back(k);
      std::sort(keys.begin(), keys.end());
      if (keys != want) {
        if (verbose && bad < 5)
          printf("n=%d bs=%d BN=%d row %d (query tile %d, consumer %d): %zu keys let through, %zu visible\n",
                 n, bs, BN, row, qt, (row - q_tile.lo) / kConsumerRows, keys.size(), want.size());
        ++bad;
      }
    }
  }
  for (int i = 0; i < S; ++i) bad += stored[i] != 1;
  return bad;
}

int main(int argc, char** argv) {
  if (argc != 3 && argc != 5) {
    fprintf(stderr, "usage: %s MODE N BS BN | %s MODE NMAX\n", argv[0], argv[0]);
    return 2;
  }
  const int mode = atoi(argv[1]);
  if (argc == 5) {
    printf("bad %d\n", mirror(mode, atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), true));
    return 0;
  }
  int failing = 0;
  for (int BN : {128, 64})
    for (int n = 1; n <= atoi(argv[2]); ++n)
      for (int bs : {1, 4, 5, 16, 32, 64, 100, 128, 200, 256, 300, 500, 700})
        if (const int bad = mirror(mode, n, bs, BN, false); bad && ++failing <= 10)
          printf("BN=%d n=%d bs=%d: %d bad rows\n", BN, n, bs, bad);
  printf("failing %d\n", failing);
  return 0;
}
