// The forwards' traces (hopper/common.cuh Traced / trace_event) read back by the standalone
// harnesses' `trace` modes: per-phase means of an item, in microseconds at each CTA's own clock
// (clock64 against globaltimer over the producer's run), over every CTA's traced items 1 .. last - 1
// (not the first, whose start is the launch's, nor the last traced) that visit at least two key
// tiles. Consumer phases (events e = 0..7 of the consumer loops): Q wait (item top -> Q ready),
// first K (-> the turn taken for S_0), S_0 (issue -> ready), tile 0 (softmax of S_0 -> P_0 ready),
// per tile after it ((loop end - tile 0 end) / (n - 1)), last P V, epilogue (O / lse to the store),
// period (item top -> next item top). Producer: the Q slot's wait (q_empty), the item's K / V
// loads issued; Q issued -> consumer 0's Q ready. Then a line with the traced launch's time and the
// CTAs' spans (start -> consumer 0's last epilogue, where every item of the CTA was traced).
#pragma once

#include <algorithm>
#include <cstdio>
#include <vector>

#include "dlm/geometry.h"
#include "hopper/common.cuh"

namespace trace_stats {

using u64 = unsigned long long;
using dlm::sm90::kTraceEvents;
using dlm::sm90::kTraceItems;
using dlm::sm90::kTraceProducer;
using dlm::sm90::kTraceTiles;

inline void header() {
  printf("| shape | tiles / item | period | Q wait | first K | S_0 | tile 0 | per tile | last P V | epilogue | "
         "c1 first K | c1 tile 0 | c1 epilogue | prod. Q slot | prod. K/V | Q issue -> ready | GHz |\n"
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
}

// h: the whole trace buffer (ctas x kTraceItems x kTraceEvents) of one launch of `items` work
// items on `ctas` CTAs walking them in the snake order; kernel_us: that launch's time.
inline void row(const char* label, const std::vector<u64>& h, int ctas, int items, double kernel_us) {
  auto traced_items = [&](int cta) {
    int k = 0;
    while (k < kTraceItems && dlm::snake_index(k, ctas, cta) < items) ++k;
    return k;
  };
  constexpr int kCols = 15;
  double sum[kCols] = {}, n = 0, tiles = 0, ghz_sum = 0, first_top = 0, span = 0, span_max = 0, spanned = 0;
  for (int cta = 0; cta < ctas; ++cta) {
    const u64* e0 = &h[(size_t)cta * kTraceItems * kTraceEvents];
    const double ghz = double(e0[kTraceEvents - 2] - e0[kTraceEvents - 4]) /
                       double(e0[kTraceEvents - 1] - e0[kTraceEvents - 3]);
    auto us = [&](u64 a, u64 z) { return (double(z) - double(a)) / ghz / 1000.0; };
    first_top += us(e0[kTraceEvents - 4], e0[0]);
    const int mine = traced_items(cta);
    if (mine > 0 && mine < kTraceItems) {
      const double sp = us(e0[kTraceEvents - 4], e0[(size_t)(mine - 1) * kTraceEvents + 7]);
      span += sp;
      span_max = std::max(span_max, sp);
      spanned += 1;
    }
    for (int it = 1; it + 1 < mine; ++it) {
      const u64* e = e0 + (size_t)it * kTraceEvents;
      const u64* nx = e + kTraceEvents;
      const u64* pr = e + kTraceProducer;
      const int tl = (int)e[kTraceTiles];
      if (tl < 2) continue;
      const double v[kCols] = {us(e[0], nx[0]),   us(e[0], e[1]),   us(e[1], e[2]),   us(e[2], e[3]),
                               us(e[3], e[4]),    us(e[4], e[5]) / (tl - 1),          us(e[5], e[6]),
                               us(e[6], e[7]),    us(e[9], e[10]),  us(e[11], e[12]), us(e[14], e[15]),
                               us(pr[0], pr[1]),  us(pr[1], pr[2]), us(pr[1], e[1]), ghz};
      for (int k = 0; k < kCols; ++k) sum[k] += v[k];
      tiles += tl;
      n += 1;
    }
  }
  if (n == 0) {
    printf("| %s | no item with two or more key tiles was traced |\n", label);
    return;
  }
  printf("| %s | %.1f |", label, tiles / n);
  for (int k = 0; k + 1 < kCols; ++k) printf(" %.2f |", sum[k] / n);
  printf(" %.3f |\n", sum[kCols - 1] / n);
  printf("|   | kernel %.1f us (the traced launch); CTA start -> first item %.2f us; CTA start -> last "
         "epilogue: mean %.1f, max %.1f us (%d CTAs traced whole) |\n", kernel_us, first_top / ctas,
         spanned ? span / spanned : 0.0, span_max, (int)spanned);
  fflush(stdout);
}

}  // namespace trace_stats
