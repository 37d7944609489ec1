// The masked softmax's per-row column mask, for C++ and CUDA (framework-free, like geometry.h, so
// tests/test_csrc_geometry.py checks it on the host through csrc/bindings/geometry_host.cpp).
//
// A wgmma accumulator gives each thread, per row of a 64 x N score tile, N / 4 scores: score j at
// column k(j) = 8 (j / 2) + j % 2 past the thread's first column (hopper/common.cuh, acc_rowcol).
// k is increasing in j, so the row's visible columns [lo, hi) (relative to that first column) are
// a range of j: [below(lo), below(hi)) with below(x) = #{j : k(j) < x} = 2 (x / 8) + min(x % 8, 2)
// for x in [0, 4 kCols], clamped there. One 32-bit mask per row then masks each score by a bit
// (ptxas: R2P, seven predicates per instruction, and an FSEL per score), where two compares with
// constants took two ISETP per score (csrc/NOTES.md "Session 27").
#pragma once

#include <cstdint>

#include "dlm/geometry.h"  // DLM_HD

namespace dlm {

template <int kCols>
DLM_HD int columns_below(int x) {
  x = x < 0 ? 0 : x > 4 * kCols ? 4 * kCols : x;
  return 2 * (x >> 3) + ((x & 7) < 2 ? (x & 7) : 2);
}

// Bit j set iff score j's column k(j) lies in [lo, hi); 0 for an empty interval.
template <int kCols>
DLM_HD uint32_t visible_columns(int lo, int hi) {
  static_assert(kCols % 2 == 0 && kCols >= 2 && kCols <= 32, "one 32-bit mask per row");
  const int a = columns_below<kCols>(lo), b = columns_below<kCols>(hi);
  const int width = b > a ? b - a : 0;
#if defined(__CUDA_ARCH__)
  uint32_t m;
  asm("bmsk.clamp.b32 %0, %1, %2;" : "=r"(m) : "r"(a), "r"(width));  // bits [a, a + width)
  return m;
#else
  return static_cast<uint32_t>(((uint64_t{1} << width) - 1) << a);  // a + width <= 32
#endif
}

}  // namespace dlm
