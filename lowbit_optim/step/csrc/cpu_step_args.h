// What one call of the CPU step needs, as plain data: the translation units compiled for
// each instruction set include this and nothing from torch, so that no inline function of
// torch's headers is compiled with AVX-512 enabled and then shared with the other paths.
#pragma once
#include <cstdint>

namespace lowbit_cpu {

enum ParamDtype : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
// How a moment's codes are stored: a byte per value, or two 4-bit codes per byte.
enum StateKind : int32_t { kBytes8 = 0, kNibble4 = 1 };
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

constexpr int kMaxMoments = 3;
constexpr int kMaxRuleValues = 16;

// The factored second moment of a (rows, columns) matrix (lowbit_optim/state/factored.py).
// The update (functor "adamw_factored") reads this step's row statistics and the normalised
// columns; the statistics pass ("factored_statistics") adds each row's mean of (1 - beta2) * g**2
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
  double host_beta2, weight_decay;  // as the host holds them (0-d float64 tensors)
  double* column_sums;
};

struct StepArgs {
  void* param;
  const void* grad;
  int32_t param_dtype;
  int32_t kind;
  int64_t numel;
  int64_t block_size;
  int32_t functor;       // its row in the functor table (FunctorTable)
  int32_t moment_count;  // codes, scales, tables and encoders in use, in the rule's moment order
  uint8_t* codes[kMaxMoments];
  float* scales[kMaxMoments];
  const float* tables[kMaxMoments];  // decode tables (16 or 256 floats)
  EncoderConstants encoders[kMaxMoments];
  // The rule's per-step values as the host holds them (0-d float64 tensors, read once per
  // call), in the order its functor declares them (Functor::constants): the functor forms its
  // float32 constants from them as the reference's 0-d float64 arithmetic does (rules/*.h).
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

// One row of the functor table: a rule's functor (rules/<name>.h) or the factored statistics
// pass, by the name Python gives it (an UpdateRule's cpu_functor), with the names of the host
// values it reads in the order it reads them (its kConstants: rule_values[0], [1], ...; the
// operator cpu_functor_constants returns them, and lowbit_optim/step/cpu_kernel.py checks them
// against the fields of the NamedTuple Python passes), its fewest and most moments, and its
// entry on one instruction set. cpu_step_kernel.h defines the table, the same on every path;
// a functor's row index never leaves the C++ side.
struct Functor {
  const char* name;
  const char* const* constants;
  int32_t constant_count, min_moments, max_moments;
  RangeFn run;
};

struct FunctorTable {
  const Functor* rows;
  int32_t count;  // 0: the path is not compiled for this CPU architecture
};

FunctorTable avx512_functors();
FunctorTable avx2_functors();
FunctorTable scalar_functors();

}  // namespace lowbit_cpu
