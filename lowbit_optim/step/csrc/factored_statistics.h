// The statistics pass of the factored step (lowbit_optim/step/factored.py::second_moment_means)
// for the CPU kernel: per row of a (rows, columns) gradient, the mean of (1 - beta2) * g**2,
// and per tile of rows each column's float64 sum of the same terms. Included by
// cpu_step_kernel.h once per instruction set; the operator (cpu_step_op.cpp) runs the tiles of
// one chunk of rows in parallel and adds their column sums up in tile order, so the result does
// not depend on the thread count.
//
// Each term is the reference's, in float64: the gradient (negated to maximize, 0 where it is
// not finite, plus weight_decay * param under L2 decay, weight_decay in float64), then
// ((1 - beta2) * g) * g. The sums differ in order: eight float64 lanes over the columns
// (lane k takes the columns k mod 8), combined in a fixed order, then the columns past the last
// multiple of 8; and the terms are summed before the division by columns (or rows), where the
// reference divides each term first. Both are within n * 2**-53 of the exact sum of n
// non-negative terms, so once rounded to float32 they differ by at most one float32 ulp
// (docs/cpu_kernel.md has the bound and its consequence for the parameter). In float64 no sum
// can overflow: a term is below (2 * 3.4e38)**2 < 1e78.
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
typedef float Floats8 __attribute__((vector_size(32)));
typedef int64_t Mask8 __attribute__((vector_size(64)));
constexpr int kLanes = 8;
// A row is read in segments of this many elements, converted to float32 on the stack (L1).
constexpr int64_t kSegment = 2048;
constexpr float kFloat32Max = 3.40282347e+38f;

// n (<= kSegment) parameter or gradient values of dtype `dtype` from `base` at `offset`, as
// float32, into `out` (the last partial vector through a zero-padded copy).
inline void load_segment(const void* base, int32_t dtype, int64_t offset, int64_t n, float* out) {
  int64_t k = 0;
  if (dtype == kFloat32) {
    std::memcpy(out, static_cast<const float*>(base) + offset, n * sizeof(float));
    return;
  }
  const uint16_t* values = static_cast<const uint16_t*>(base) + offset;
  for (; k + V::W <= n; k += V::W) V::storef(out + k, V::load_param(values + k, dtype));
  if (k < n) {
    uint16_t padded[V::W] = {};
    std::memcpy(padded, values + k, (n - k) * sizeof(uint16_t));
    alignas(64) float converted[V::W];
    V::storef(converted, V::load_param(padded, dtype));
    std::memcpy(out + k, converted, (n - k) * sizeof(float));
  }
}

inline double squared_gradient_term(double g, double one_minus_beta2) { return one_minus_beta2 * g * g; }

inline float saturate_float32(double value) { return static_cast<float>(value < kFloat32Max ? value : kFloat32Max); }

// The tiles [first_tile, end_tile) of the chunk of rows from a.factored.first_row.
void run_statistics(const StepArgs& a, int64_t first_tile, int64_t end_tile) {
  const FactoredArgs& f = a.factored;
  const double one_minus_beta2 = 1.0 - a.rule_values[0], weight_decay = a.rule_values[1];
  const bool l2 = !f.decoupled;
  const int64_t columns = f.columns;
  const int64_t chunk_end = f.first_row + f.chunk_rows < f.rows ? f.first_row + f.chunk_rows : f.rows;
  alignas(64) float grad[kSegment];
  alignas(64) float param[kSegment];
  const Lanes8 zero = {};
  for (int64_t tile = first_tile; tile < end_tile; ++tile) {
    double* sums = f.column_sums + tile * columns;
    std::memset(sums, 0, columns * sizeof(double));
    const int64_t tile_first = f.first_row + tile * f.tile_rows;
    const int64_t tile_end = tile_first + f.tile_rows < chunk_end ? tile_first + f.tile_rows : chunk_end;
    for (int64_t row = tile_first; row < tile_end; ++row) {
      Lanes8 row_lanes = zero;
      double row_rest = 0.0;
      for (int64_t start = 0; start < columns; start += kSegment) {
        const int64_t n = columns - start < kSegment ? columns - start : kSegment;
        load_segment(a.grad, a.param_dtype, row * columns + start, n, grad);
        if (l2) load_segment(f.param, f.param_dtype, row * columns + start, n, param);
        int64_t k = 0;
        for (; k + kLanes <= n; k += kLanes) {
          Floats8 loaded;
          std::memcpy(&loaded, grad + k, sizeof(loaded));
          Lanes8 g = __builtin_convertvector(loaded, Lanes8);
          if (a.maximize) g = -g;
          const Mask8 finite = (g - g) == zero;  // false for NaN and +-inf
          g = finite ? g : zero;
          if (l2) {
            std::memcpy(&loaded, param + k, sizeof(loaded));
            g = g + weight_decay * __builtin_convertvector(loaded, Lanes8);
          }
          const Lanes8 term = one_minus_beta2 * g * g;
          Lanes8 column;
          std::memcpy(&column, sums + start + k, sizeof(column));
          column += term;
          std::memcpy(sums + start + k, &column, sizeof(column));
          row_lanes += term;
        }
        for (; k < n; ++k) {
          double g = static_cast<double>(grad[k]);
          if (a.maximize) g = -g;
          if (g - g != 0.0) g = 0.0;
          if (l2) g = g + weight_decay * static_cast<double>(param[k]);
          const double term = squared_gradient_term(g, one_minus_beta2);
          sums[start + k] += term;
          row_rest += term;  // only the last segment has a partial vector: kSegment is 8k long
        }
      }
      const double lanes = ((row_lanes[0] + row_lanes[1]) + (row_lanes[2] + row_lanes[3])) +
                           ((row_lanes[4] + row_lanes[5]) + (row_lanes[6] + row_lanes[7]));
      f.row_means[row] = saturate_float32((lanes + row_rest) / static_cast<double>(columns));
    }
  }
}

}  // namespace
}  // namespace LOWBIT_ISA
}  // namespace lowbit_cpu
