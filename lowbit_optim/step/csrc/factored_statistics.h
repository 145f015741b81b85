// The statistics pass of the factored step (lowbit_optim/step/factored.py::second_moment_means
// and the rows' accumulate_statistic) for the CPU kernel: per row of a (rows, columns)
// gradient, the mean of (1 - beta2) * g**2 added to the row's statistic, and per tile of rows
// each column's float64 sum of the same terms. Included by cpu_step_kernel.h once per
// instruction set; the operator (cpu_step_op.cpp) runs the tiles of one chunk of rows in
// parallel and adds their column sums up in tile order, so the result does not depend on the
// thread count.
//
// Each term is the reference's, in float64: the gradient (negated to maximize, 0 where it is
// not finite, plus weight_decay * param under L2 decay, weight_decay in float64), then
// ((1 - beta2) * g) * g. The sums differ in order: sixteen float64 lanes over the columns
// (lane k takes the columns k mod 16), combined in a fixed order, then the columns past the
// last multiple of 16; and the terms are summed before the division by the column (or row)
// count, where the reference divides each term first. Both are within (n + 1) * 2**-53 of the
// exact sum of n non-negative terms, so once rounded to float32 they differ by at most one
// float32 ulp (docs/cpu_kernel.md has the bound and its consequence for the parameter). In
// float64 no sum can overflow: a term is below (2 * 3.4e38)**2 < 1e78.
#pragma once
#include <cstdint>
#include <cstring>

#include "cpu_step_args.h"

namespace lowbit_cpu {
namespace LOWBIT_ISA {
namespace {

// Eight float64 lanes, as GCC's vector extension: the same lanes and order on every
// instruction set (one AVX-512 register, two AVX2 registers, four SSE2 ones).
typedef double Lanes8 __attribute__((vector_size(64)));
typedef int64_t Mask8 __attribute__((vector_size(64)));
// The same, read and written in place at any alignment (the column sums, the gradient).
typedef double StoredLanes8 __attribute__((vector_size(64), aligned(8), may_alias));
typedef float StoredFloats8 __attribute__((vector_size(32), aligned(4), may_alias));
constexpr int kLanes = 8;
// A row is read in segments of this many elements, converted to float32 on the stack (L1).
constexpr int64_t kSegment = 2048;  // a multiple of 16
constexpr float kFloat32Max = 3.40282347e+38f;
// The gradient is prefetched 8 KB ahead: the pass took 6.1 ms per step without, 3.8-4.7 ms
// with (10 x 1024², 1 thread; 512 and 32768 bytes ahead measured slower).
constexpr int64_t kPrefetchFloats = 2048;

// n (<= kSegment) parameter or gradient values of dtype `dtype` from `base` at `offset`, as
// float32: in place for float32, else converted into `buffer` (the last partial vector through
// a zero-padded copy).
inline const float* float_segment(const void* base, int32_t dtype, int64_t offset, int64_t n, float* buffer) {
  if (dtype == kFloat32) return static_cast<const float*>(base) + offset;
  const uint16_t* values = static_cast<const uint16_t*>(base) + offset;
  int64_t k = 0;
  for (; k + V::W <= n; k += V::W) V::storef(buffer + k, V::load_param(values + k, dtype));
  if (k < n) {
    uint16_t padded[V::W] = {};
    std::memcpy(padded, values + k, (n - k) * sizeof(uint16_t));
    alignas(64) float converted[V::W];
    V::storef(converted, V::load_param(padded, dtype));
    std::memcpy(buffer + k, converted, (n - k) * sizeof(float));
  }
  return buffer;
}

// Whether this inclusion is the AVX-512 path's (LOWBIT_ISA is avx512): `#if` expands
// LOWBIT_WIDE_avx512 to 1 and the other paths' names to 0. (GCC does not define __AVX512F__
// under `#pragma GCC target`.)
#define LOWBIT_WIDE_avx512 1
#define LOWBIT_JOIN(a, b) a##b
#define LOWBIT_IS_WIDE(isa) LOWBIT_JOIN(LOWBIT_WIDE_, isa)

inline Lanes8 load_lanes(const float* values) {
#if LOWBIT_IS_WIDE(LOWBIT_ISA)
  // One conversion from memory: GCC 12 splits __builtin_convertvector's into four instructions.
  return reinterpret_cast<Lanes8>(_mm512_cvtps_pd(_mm256_loadu_ps(values)));
#else
  return __builtin_convertvector(*reinterpret_cast<const StoredFloats8*>(values), Lanes8);
#endif
}

// Whether the n float32 values are all finite (an exponent field below all ones), for the
// segment's fast path.
inline bool all_finite(const float* values, int64_t n) {
  uint32_t largest_exponent = 0;
  for (int64_t k = 0; k < n; ++k) {
    uint32_t bits;
    std::memcpy(&bits, values + k, sizeof(bits));
    bits &= 0x7F800000u;
    largest_exponent = bits > largest_exponent ? bits : largest_exponent;
  }
  return largest_exponent != 0x7F800000u;
}

inline float saturate_float32(double value) { return static_cast<float>(value < kFloat32Max ? value : kFloat32Max); }

// The float64 terms ((1 - beta2) * g) * g of one row's segment, added to the tile's column sums
// and to the row's sum, kept as 16 lanes (two accumulators of 8: the columns j mod 16 below
// and above 8; two chains of additions run at once) and `rest` for the columns past the last
// multiple of 16.
struct SquaredGradientTerms {
  double one_minus_beta2, weight_decay;
  bool maximize, l2;

  // kChecked: the gradient may hold NaN or +-inf (else the segment was found finite).
  // Without L2 decay maximize changes no term: ((1 - beta2) * -g) * -g rounds as the same
  // product of magnitudes.
  template <bool kChecked, bool kL2>
  inline Lanes8 terms(Lanes8 g, const float* param) const {
    const Lanes8 zero = {};
    if (kL2 && maximize) g = -g;
    if (kChecked) {
      const Mask8 finite = (g - g) == zero;  // false for NaN and +-inf
      g = finite ? g : zero;
    }
    if (kL2) g = g + weight_decay * load_lanes(param);
    return one_minus_beta2 * g * g;
  }

  inline double term(double g, const float* param) const {
    if (maximize) g = -g;
    if (g - g != 0.0) g = 0.0;
    if (l2) g = g + weight_decay * static_cast<double>(*param);
    return one_minus_beta2 * g * g;
  }

  inline void add(const float* grad, const float* param, int64_t n, double* sums, Lanes8 row[2], double& rest) const {
    if (l2) {
      add_group<true, true>(grad, param, n, sums, row, rest);
    } else if (all_finite(grad, n)) {
      add_group<false, false>(grad, param, n, sums, row, rest);
    } else {
      add_group<true, false>(grad, param, n, sums, row, rest);
    }
  }

  template <bool kChecked, bool kL2>
  inline void add_group(const float* grad, const float* param, int64_t n, double* sums, Lanes8 row[2],
                        double& rest) const {
    // Local accumulators: the stores to `sums` could otherwise alias them.
    Lanes8 low = row[0], high = row[1];
    int64_t k = 0;
    for (; k + 2 * kLanes <= n; k += 2 * kLanes) {
      // The gradient's cache line kPrefetchFloats ahead (past the segment: the next row's, the
      // matrix being contiguous; a prefetch never faults).
      __builtin_prefetch(grad + k + kPrefetchFloats, 0);
      const Lanes8 low_terms = terms<kChecked, kL2>(load_lanes(grad + k), param + k);
      const Lanes8 high_terms = terms<kChecked, kL2>(load_lanes(grad + k + kLanes), param + k + kLanes);
      *reinterpret_cast<StoredLanes8*>(sums + k) += low_terms;
      *reinterpret_cast<StoredLanes8*>(sums + k + kLanes) += high_terms;
      low += low_terms;
      high += high_terms;
    }
    double tail = rest;
    for (; k < n; ++k) {  // only the last segment has a partial group: kSegment is a multiple of 16
      const double value = term(static_cast<double>(grad[k]), param + k);
      sums[k] += value;
      tail += value;
    }
    row[0] = low;
    row[1] = high;
    rest = tail;
  }
};

// The tiles [first_tile, end_tile) of the chunk of rows from a.factored.first_row.
void run_statistics(const StepArgs& a, int64_t first_tile, int64_t end_tile) {
  const FactoredArgs& f = a.factored;
  const SquaredGradientTerms terms{1.0 - f.host_beta2, f.weight_decay, a.maximize != 0, f.decoupled == 0};
  const int64_t columns = f.columns;
  const int64_t chunk_end = f.first_row + f.chunk_rows < f.rows ? f.first_row + f.chunk_rows : f.rows;
  alignas(64) float grad_buffer[kSegment];
  alignas(64) float param_buffer[kSegment];
  for (int64_t tile = first_tile; tile < end_tile; ++tile) {
    double* sums = f.column_sums + tile * columns;
    std::memset(sums, 0, columns * sizeof(double));
    const int64_t tile_first = f.first_row + tile * f.tile_rows;
    const int64_t tile_end = tile_first + f.tile_rows < chunk_end ? tile_first + f.tile_rows : chunk_end;
    for (int64_t row = tile_first; row < tile_end; ++row) {
      Lanes8 row_lanes[2] = {};
      double rest = 0.0;
      for (int64_t start = 0; start < columns; start += kSegment) {
        const int64_t n = columns - start < kSegment ? columns - start : kSegment;
        const float* grad = float_segment(a.grad, a.param_dtype, row * columns + start, n, grad_buffer);
        const float* param = terms.l2 ? float_segment(f.param, f.param_dtype, row * columns + start, n, param_buffer)
                                      : nullptr;
        terms.add(grad, param, n, sums + start, row_lanes, rest);
      }
      const Lanes8 lanes = row_lanes[0] + row_lanes[1];
      const double sum =
          ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
      const float mean = saturate_float32((sum + rest) / static_cast<double>(columns));
      // factored.accumulate_statistic in float32: row = beta2 * row + mean, saturated.
      const float accumulated = f.row_statistics[row] * f.beta2 + mean;
      f.row_statistics[row] = accumulated < kFloat32Max ? accumulated : kFloat32Max;
    }
  }
}

}  // namespace
}  // namespace LOWBIT_ISA
}  // namespace lowbit_cpu
