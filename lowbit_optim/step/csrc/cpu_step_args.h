// What one call of the CPU step needs, as plain data: the translation units compiled for
// each instruction set include this and nothing from torch, so that no inline function of
// torch's headers is compiled with AVX-512 enabled and then shared with the other paths.
#pragma once
#include <cstdint>

namespace lowbit_cpu {

enum ParamDtype : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
enum StateKind : int32_t { kDynamic8 = 0, kNibble4 = 1, kFloat8 = 2 };
enum Encoder : int32_t { kCells = 0, kSmallTable = 1, kLinear16 = 2, kE4M3 = 3 };
// How a cell table (kCells, lowbit_optim/formats/cell_tables.py) reads negative values: as 0
// (zero-free maps), as their magnitude, or from a half of cells of their own.
enum CellSign : int32_t { kCellsClamped = 0, kCellsAbs = 1, kCellsSigned = 2 };

// The constants of one moment's encoder, all float32 values exactly as the reference
// encoders (lowbit_optim/formats/codecs.py) compare and compute with them: Python numbers meet
// float32 tensors there, so torch rounds each one to float32 first.
struct EncoderConstants {
  int32_t encoder;
  int32_t zero_free;       // codes below first_edge become 0 first (ZeroFreeCodec)
  float first_edge;
  float midpoints[16];     // kSmallTable: its 15 ascending midpoints, then +inf
  int32_t cell_sign;       // kCells: CellSign
  const int32_t* cells;    // kCells: the format's cell words (cell_tables.cell_words)
};

// The update rules the kernel steps, each a functor in rules/<name>.h (cpu_step_kernel.h
// instantiates the block step once per rule); the number is lowbit_optim/step/cpu_kernel.py's
// RULE_FUNCTORS.
// kAdamWFactored: AdamW with a factored second moment (rules/adamw_factored.h); its
// statistics pass, kFactoredStatistics (factored_statistics.h), runs over tiles of rows, not
// over blocks, through the same per-instruction-set entry point.
enum RuleId : int32_t { kAdamW = 0, kLion = 1, kAdEMAMix = 2, kAdamWFactored = 3, kFactoredStatistics = 4,
                    kMuon = 5 };
constexpr int kMaxMoments = 3;
constexpr int kMaxRuleValues = 16;

// What the operator checks of a rule's inputs before any block runs: how many host values its
// functor reads (rule_values) and how many moments it keeps.
struct RuleShape {
  int32_t values, min_moments, max_moments;
};
constexpr RuleShape kRuleShapes[] = {
    {7, 2, 3},    // kAdamW: lr, beta1, beta2, eps, weight_decay, step, decoupled; amsgrad's third moment
    {4, 1, 1},    // kLion: LionConstants
    {11, 3, 3},   // kAdEMAMix: AdEMAMixConstants
    {7, 1, 1},    // kAdamWFactored: kAdamW's values; the first moment only
    {2, 0, 0},    // kFactoredStatistics: beta2, weight_decay
    {2, 1, 1},    // kMuon: MuonConstants
};

// The factored second moment of a (rows, columns) matrix (lowbit_optim/state/factored.py).
// The update (kAdamWFactored) reads this step's row statistics and the normalised columns;
// the statistics pass (kFactoredStatistics) adds each row's mean of (1 - beta2) * g**2
// (saturated float32) to beta2 * row_statistics, and writes each tile's column sums (float64)
// into column_sums, tile after tile, for the operator to add up in tile order.
struct FactoredArgs {
  const float* row;
  const float* col_normalized;
  int64_t rows, columns;
  // The statistics pass: its parameter's dtype (a float32 master weight may stand for a
  // bfloat16 or float16 parameter under L2 decay) and tiling.
  const void* param;
  int32_t param_dtype;
  int32_t decoupled;
  int64_t first_row, chunk_rows, tile_rows;
  float* row_statistics;
  float beta2;  // as the float32 statistics meet it
  double* column_sums;
};

struct StepArgs {
  void* param;
  const void* grad;
  int32_t param_dtype;
  int32_t kind;
  int64_t numel;
  int64_t block_size;
  int32_t rule;          // RuleId
  int32_t moment_count;  // codes, scales, tables and encoders in use, in the rule's moment order
  uint8_t* codes[kMaxMoments];
  float* scales[kMaxMoments];
  const float* tables[kMaxMoments];  // decode tables (16 or 256 floats)
  EncoderConstants encoders[kMaxMoments];
  // The rule's per-step values as the host holds them (0-d float64 tensors, read once per
  // call): its functor forms its float32 constants from them as the reference's 0-d float64
  // arithmetic does (rules/*.h).
  double rule_values[kMaxRuleValues];
  int32_t maximize, stochastic_round;
  uint64_t seed;
  // A bfloat16 or float16 parameter's master weight correction (lowbit_optim/step/master_weights.py):
  // int8 for 24-bit master weights, int16 for 32-bit, one per element; null (and
  // master_weight_bits 0) without one.
  void* correction;
  int32_t master_weight_bits;
  FactoredArgs factored;
};

using RangeFn = void (*)(const StepArgs&, int64_t first_block, int64_t end_block);

RangeFn avx512_range();
RangeFn avx2_range();
RangeFn scalar_range();

}  // namespace lowbit_cpu
