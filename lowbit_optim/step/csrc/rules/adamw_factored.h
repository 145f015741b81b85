// AdamW with a factored second moment (AdamWFactored4bit) for the CPU kernel: the element pass
// of lowbit_optim/step/rules/adamw.py::AdamWFactoredRule.update, operation for operation, in float32.
//
// One moment, the quantized first; the second moment of the element at flat index f is
// row[i] * col_normalized[j], i = f / columns (clamped to the last row: the zero padding of a
// partial last block reads it), j = f - (f / columns) * columns. Host values
// (AdamWMath::kConstants) and the update are AdamW's (rules/adamw.h: AdamWMath, shared, so the
// parameter's update is written once), with this step's row statistics and normalised columns
// read from StepArgs::factored. The kernel's
// shared policies (maximize, a non-finite gradient keeping its element, rounding, master
// weights) wrap `update` as for every rule.
#pragma once
#include "../cpu_step_args.h"
#include "adamw.h"

namespace lowbit_cpu {
namespace LOWBIT_ISA {
namespace {

struct AdamWFactoredRule : AdamWMath {
  static constexpr int kMoments = 1;
  // Block::update passes the block and offset of the W elements it updates (cpu_step_kernel.h).
  static constexpr bool kReadsPosition = true;
  const float* row;
  const float* col_normalized;
  int64_t block_size, last_row, columns;
  double inverse_columns;
  // Where the block being stepped starts: Block holds its own copy of the functor per block,
  // so the split of its first index is found once, at its first vector.
  mutable int64_t current_block = -1, block_row = 0, block_column = 0;
  mutable float block_row_value = 0.0f;

  explicit AdamWFactoredRule(const StepArgs& a)
      : AdamWMath(a),
        row(a.factored.row),
        col_normalized(a.factored.col_normalized),
        block_size(a.block_size),
        last_row(a.factored.rows - 1),
        columns(a.factored.columns),
        inverse_columns(1.0 / static_cast<double>(a.factored.columns)) {}

  // (i, j) of flat index `flat`: i = flat / columns from a float64 multiply by 1 / columns,
  // corrected to the exact quotient (indices < 2**53 are exact in float64 and the product is
  // off by at most one), so no integer division runs.
  inline void split(int64_t flat, int64_t& i, int64_t& j) const {
    i = static_cast<int64_t>(static_cast<double>(flat) * inverse_columns);
    j = flat - i * columns;
    if (j < 0) {
      --i;
      j += columns;
    } else if (j >= columns) {
      ++i;
      j -= columns;
    }
  }

  inline float row_value(int64_t i) const { return row[i < last_row ? i : last_row]; }

  // The second moments of the W elements at `offset` in block `at`, as the reference's float32
  // product row[i] * col_normalized[j].
  inline F second_moment(int64_t at, int64_t offset) const {
    if (at != current_block) {
      current_block = at;
      split(at * block_size, block_row, block_column);
      block_row_value = row_value(block_row);
    }
    int64_t i = block_row, j = block_column + offset;
    if (j + V::W <= columns)  // in the block's first row: a broadcast and a contiguous load
      return V::mul(V::set1(block_row_value), V::loadf(col_normalized + j));
    split(at * block_size + offset, i, j);
    if (j + V::W <= columns) return V::mul(V::set1(row_value(i)), V::loadf(col_normalized + j));
    alignas(64) float row_values[V::W];
    alignas(64) float col_values[V::W];
    for (int lane = 0; lane < V::W; ++lane) {
      row_values[lane] = row_value(i);
      col_values[lane] = col_normalized[j];
      if (++j == columns) {
        j = 0;
        ++i;
      }
    }
    return V::mul(V::loadf(row_values), V::loadf(col_values));
  }

  // The new parameter from `p` (the master weight where there is one) and a finite gradient
  // `g` of the W elements at `offset` in `block`; the new first moment into `updated`.
  inline F update(F p, F g, const F* moments, F* updated, int64_t block, int64_t offset) const {
    g = gradient(p, g);
    const F new_exp_avg = first_moment(moments[0], g);
    updated[0] = new_exp_avg;
    return parameter(p, new_exp_avg, second_moment(block, offset));
  }
};

}  // namespace
}  // namespace LOWBIT_ISA
}  // namespace lowbit_cpu
