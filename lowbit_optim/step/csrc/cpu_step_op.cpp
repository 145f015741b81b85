// The operator lowbit_optim::cpu_rule_step: checks its inputs, reads the rule's host values
// (0-d CPU tensors) once per parameter, picks the instruction-set path and runs it over the
// blocks of every parameter of the call with one at::parallel_for (so torch.set_num_threads
// governs it, and a call over many parameters pays one fork and join, not one per parameter).
// Each block is computed alone, so the result does not depend on the thread count. The rule's
// functor (rules/*.h) forms its constants from the host values in each task.
// Every operator of the family has the shape of torch's _fused_adamw_: the tensor lists
// positional (at most six), everything else keyword-only and named. The functor and the
// instruction set are named by strings, looked up in the functor table (cpu_step_kernel.h's
// kFunctors) and kIsas here; cpu_functor_constants(functor) gives the names of the host values
// a functor reads, in its order, for Python to check what it passes, and cpu_encoder_layout the
// fields of a row of `encoders`, for Python to build its rows by name.
// AdamWFactored4bit's two passes have operators of their own on the same entry points:
// cpu_factored_step (the block step with the factored functor and the parameter's statistics)
// and cpu_factored_statistics (tiles of rows); cpu_factored_columns, between them, accumulates
// and normalises the column statistics.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <algorithm>
#include <mutex>
#include <iterator>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "cpu_step_args.h"

namespace lowbit_cpu {
namespace {

constexpr int64_t kMaxBlockSize = 2048;  // cpu_step_kernel.h's kMaxBlock
constexpr int64_t kElementsPerTask = int64_t{1} << 16;

// One moment's row of the operators' `encoders`: EncoderConstants' fields as float32 slots, in
// this order and width, by the names Python builds a row from (cpu_encoder_layout; the enum
// values by the names below, in their order).
struct EncoderField {
  const char* name;
  int64_t width;
};
constexpr EncoderField kEncoderFields[] = {
    {"encoder", 1}, {"zero_free", 1}, {"first_edge", 1}, {"midpoints", 16}, {"cell_sign", 1}};
// A field's first slot (the row's width for "": the slots of every field).
constexpr int64_t encoder_offset(std::string_view name) {
  int64_t offset = 0;
  for (const EncoderField& field : kEncoderFields) {
    if (name == field.name) return offset;
    offset += field.width;
  }
  return name.empty() ? offset : -1;
}
constexpr int64_t kEncoderFloats = encoder_offset("");
constexpr int64_t kEncoderSlot = encoder_offset("encoder"), kZeroFreeSlot = encoder_offset("zero_free"),
                  kFirstEdgeSlot = encoder_offset("first_edge"), kMidpointsSlot = encoder_offset("midpoints"),
                  kCellSignSlot = encoder_offset("cell_sign");
static_assert(kEncoderSlot >= 0 && kZeroFreeSlot >= 0 && kFirstEdgeSlot >= 0 && kMidpointsSlot >= 0 &&
              kCellSignSlot >= 0);
constexpr const char* kEncoderNames[] = {"cells", "small_table", "linear16", "e4m3"};  // Encoder
constexpr const char* kCellSignNames[] = {"clamped", "abs", "signed"};                // CellSign
static_assert(std::size(kEncoderNames) == kE4M3 + 1 && std::size(kCellSignNames) == kCellsSigned + 1);
constexpr int64_t encoder_width(std::string_view name) {
  for (const EncoderField& field : kEncoderFields)
    if (name == field.name) return field.width;
  return 0;
}
static_assert(encoder_width("midpoints") == sizeof(EncoderConstants::midpoints) / sizeof(float));
// A cell table's words: one half of cells, or two halves 2**15 cells apart (cell_tables.py).
constexpr int64_t kCellsPerHalf = 2945;
constexpr int64_t kSignedCells = (int64_t{1} << 15) + kCellsPerHalf;

enum Isa : int32_t { kScalar, kAvx2, kAvx512 };

// The instruction-set paths by the names Python gives them (LOWBIT_OPTIM_CPU_ISA), with their
// vector width in float32 lanes.
struct IsaPath {
  const char* name;
  Isa isa;
  int64_t width;
  FunctorTable (*functors)();
};
constexpr IsaPath kIsas[] = {
    {"scalar", kScalar, 1, &scalar_functors},
    {"avx2", kAvx2, 8, &avx2_functors},
    {"avx512", kAvx512, 16, &avx512_functors},
};

bool isa_supported(Isa isa) {
#if defined(__x86_64__) || defined(_M_X64)
  if (isa == kAvx512) return __builtin_cpu_supports("avx512f");
  if (isa == kAvx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  if (isa != kScalar) return false;
#endif
  return true;
}

const IsaPath& isa_path(c10::string_view name) {
  for (const IsaPath& path : kIsas) {
    if (name != path.name) continue;
    TORCH_CHECK(isa_supported(path.isa) && path.functors().count > 0, "lowbit_optim: instruction set '", name,
                "' is not available on this CPU");
    return path;
  }
  TORCH_CHECK(false, "lowbit_optim: unknown instruction set '", name, "' (scalar, avx2 or avx512)");
  return kIsas[0];  // unreachable
}

// The functor table is the same on every path; the portable one is always compiled.
int32_t functor_row(c10::string_view name) {
  const FunctorTable table = scalar_functors();
  for (int32_t row = 0; row < table.count; ++row)
    if (name == table.rows[row].name) return row;
  std::string known;
  for (int32_t row = 0; row < table.count; ++row) known += (row ? ", " : "") + std::string(table.rows[row].name);
  TORCH_CHECK(false, "lowbit_optim: the CPU kernel has no functor '", name, "' (it has ", known, ")");
  return 0;  // unreachable
}

const Functor& functor_of(int32_t row) { return scalar_functors().rows[row]; }

// A row of `encoders`, its fields at kEncoderFields' offsets.
EncoderConstants read_encoder(const float* values) {
  EncoderConstants c;
  c.encoder = static_cast<int32_t>(values[kEncoderSlot]);
  c.zero_free = static_cast<int32_t>(values[kZeroFreeSlot]);
  c.first_edge = values[kFirstEdgeSlot];
  std::memcpy(c.midpoints, values + kMidpointsSlot, sizeof(c.midpoints));
  c.cell_sign = static_cast<int32_t>(values[kCellSignSlot]);
  c.cells = nullptr;
  return c;
}

double scalar_of(const at::Tensor& t) {
  TORCH_CHECK(t.numel() == 1 && t.device().is_cpu(), "lowbit_optim: host values must be 1-element CPU tensors");
  // Read in place where the dtype is known: item() is a dispatcher call, and a call over many
  // parameters reads seven values for each.
  switch (t.scalar_type()) {
    case at::kDouble: return *t.const_data_ptr<double>();
    case at::kFloat: return *t.const_data_ptr<float>();
    default: return t.item<double>();
  }
}

void check_block_state(const at::Tensor& codes, const at::Tensor& scales, int64_t num_blocks,
                       int64_t bytes_per_block, int64_t moment) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.device().is_cpu(),
              "cpu_rule_step: moment ", moment, "'s codes must be contiguous uint8 CPU tensors");
  TORCH_CHECK(codes.numel() == num_blocks * bytes_per_block, "cpu_rule_step: moment ", moment, "'s codes have ",
              codes.numel(), " bytes, expected ", num_blocks * bytes_per_block);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == num_blocks,
              "cpu_rule_step: moment ", moment, "'s scales must be ", num_blocks, " contiguous float32 values");
}

// The checked arguments of a block step (cpu_rule_step's, cpu_factored_step's).
StepArgs rule_args(at::Tensor param, const at::Tensor& grad, at::TensorList codes, at::TensorList scales,
                   const c10::optional<at::Tensor>& weight_correction, at::TensorList tables,
                   const at::Tensor& encoders, at::TensorList cells, at::TensorList values, int32_t functor,
                   int64_t bits, int64_t block_size, bool maximize, bool stochastic_round) {
  TORCH_CHECK(param.device().is_cpu() && param.is_contiguous(), "cpu_rule_step: param must be a contiguous CPU tensor");
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous() && grad.scalar_type() == param.scalar_type() &&
                  grad.numel() == param.numel(),
              "cpu_rule_step: grad must be a contiguous CPU tensor of param's dtype and size");
  TORCH_CHECK(bits == 4 || bits == 8, "cpu_rule_step: moments of ", bits, " bits (4 or 8)");
  const int32_t kind = bits == 4 ? kNibble4 : kBytes8;
  TORCH_CHECK(block_size >= 2 && block_size <= kMaxBlockSize && block_size % 4 == 0,
              "cpu_rule_step: block_size must be a multiple of 4 in [4, ", kMaxBlockSize, "], got ", block_size);
  const Functor& shape = functor_of(functor);
  const int64_t moment_count = static_cast<int64_t>(codes.size());
  TORCH_CHECK(moment_count >= shape.min_moments && moment_count <= shape.max_moments &&
                  static_cast<int64_t>(scales.size()) == moment_count &&
                  static_cast<int64_t>(tables.size()) == moment_count,
              "cpu_rule_step: functor '", shape.name, "' keeps ", shape.min_moments, " to ", shape.max_moments,
              " moments, each with codes, scales and a decode table; got ", moment_count, " codes, ",
              scales.size(), " scales and ", tables.size(), " tables");
  TORCH_CHECK(static_cast<int64_t>(values.size()) == shape.constant_count, "cpu_rule_step: functor '",
              shape.name, "' reads ", shape.constant_count, " host values, got ", values.size());
  StepArgs a{};
  switch (param.scalar_type()) {
    case at::kFloat: a.param_dtype = kFloat32; break;
    case at::kBFloat16: a.param_dtype = kBFloat16; break;
    case at::kHalf: a.param_dtype = kFloat16; break;
    default: TORCH_CHECK(false, "cpu_rule_step: parameters of dtype ", param.scalar_type(), " are not supported");
  }
  const int64_t num_blocks = (param.numel() + block_size - 1) / block_size;
  const int64_t bytes_per_block = kind == kNibble4 ? block_size / 2 : block_size;
  const int64_t table_size = kind == kNibble4 ? 16 : 256;
  for (int64_t m = 0; m < moment_count; ++m) {
    check_block_state(codes[m], scales[m], num_blocks, bytes_per_block, m);
    TORCH_CHECK(tables[m].scalar_type() == at::kFloat && tables[m].is_contiguous() && tables[m].numel() == table_size,
                "cpu_rule_step: decode tables must be ", table_size, " contiguous float32 values");
    a.codes[m] = codes[m].data_ptr<uint8_t>();
    a.scales[m] = scales[m].data_ptr<float>();
    a.tables[m] = tables[m].data_ptr<float>();
  }
  TORCH_CHECK(encoders.scalar_type() == at::kFloat && encoders.is_contiguous() &&
                  encoders.numel() == moment_count * kEncoderFloats,
              "cpu_rule_step: encoders must be (", moment_count, ", ", kEncoderFloats, ") float32");
  TORCH_CHECK(static_cast<int64_t>(cells.size()) == moment_count, "cpu_rule_step: one cell table per moment");
  for (int64_t m = 0; m < moment_count; ++m) {
    a.encoders[m] = read_encoder(encoders.data_ptr<float>() + m * kEncoderFloats);
    TORCH_CHECK(a.encoders[m].encoder >= kCells && a.encoders[m].encoder <= kE4M3, "cpu_rule_step: moment ", m,
                "'s encoder ", a.encoders[m].encoder, " is unknown");
    if (a.encoders[m].encoder != kCells) continue;
    const int64_t words = a.encoders[m].cell_sign == kCellsSigned ? kSignedCells : kCellsPerHalf;
    TORCH_CHECK(a.encoders[m].cell_sign >= kCellsClamped && a.encoders[m].cell_sign <= kCellsSigned,
                "cpu_rule_step: moment ", m, "'s cell table reads signs as ", a.encoders[m].cell_sign);
    TORCH_CHECK(cells[m].scalar_type() == at::kInt && cells[m].is_contiguous() && cells[m].numel() == words,
                "cpu_rule_step: moment ", m, "'s cell table must be ", words, " contiguous int32 words");
    a.encoders[m].cells = cells[m].data_ptr<int32_t>();
  }
  for (size_t i = 0; i < values.size(); ++i) a.rule_values[i] = scalar_of(values[i]);

  a.param = param.data_ptr();
  a.grad = grad.data_ptr();
  a.functor = functor;
  a.moment_count = static_cast<int32_t>(moment_count);
  a.kind = kind;
  a.numel = param.numel();
  a.block_size = block_size;
  if (weight_correction.has_value()) {
    // A bfloat16 or float16 parameter's master weight correction (int8: 24-bit, int16:
    // 32-bit). The master weight already keeps what rounding loses, so stochastic rounding is
    // refused with it (as the optimizer refuses the combination).
    const at::Tensor& correction = *weight_correction;
    TORCH_CHECK(param.scalar_type() == at::kBFloat16 || param.scalar_type() == at::kHalf,
                "cpu_rule_step: a weight correction needs a bfloat16 or float16 parameter, got ",
                param.scalar_type());
    TORCH_CHECK((correction.scalar_type() == at::kChar || correction.scalar_type() == at::kShort) &&
                    correction.is_contiguous() && correction.device().is_cpu() && correction.numel() == param.numel(),
                "cpu_rule_step: the weight correction must be a contiguous int8 or int16 CPU tensor of param's size");
    TORCH_CHECK(!stochastic_round, "cpu_rule_step: stochastic rounding with a weight correction");
    a.correction = correction.data_ptr();
    a.master_weight_bits = correction.scalar_type() == at::kChar ? 24 : 32;
  }
  a.maximize = maximize;
  a.stochastic_round = stochastic_round && param.scalar_type() == at::kBFloat16;
  if (a.stochastic_round) {
    // One draw from torch's default CPU generator per call: torch.manual_seed makes a run
    // reproducible, and each element's noise is a hash of this seed and its index, so it
    // does not depend on the thread count.
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    a.seed = at::check_generator<at::CPUGeneratorImpl>(gen)->random64();
  }

  return a;
}

// Every block of every parameter of `steps`, with the path of `isa`, in one parallel loop over
// tasks of about 64K elements: large enough that a task's overhead is negligible, small enough
// that a few large parameters still spread over every thread; a parameter smaller than a task
// is one task, so many small ones spread too.
void run_blocks(const std::vector<StepArgs>& steps, const IsaPath& isa) {
  if (steps.empty()) return;
  const StepArgs& first = steps.front();  // every parameter of a call shares functor, kind and block size
  const int64_t vector_span = first.kind == kNibble4 ? first.block_size / 2 : first.block_size;
  // A block the vectors do not tile steps on the portable path.
  const FunctorTable table = vector_span % isa.width == 0 ? isa.functors() : scalar_functors();
  const RangeFn run = table.rows[first.functor].run;
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / first.block_size);
  // first_task[i]: the index of parameter i's first task; its tasks are `grain` blocks each.
  std::vector<int64_t> first_task(steps.size() + 1, 0);
  for (size_t i = 0; i < steps.size(); ++i) {
    const int64_t num_blocks = (steps[i].numel + steps[i].block_size - 1) / steps[i].block_size;
    first_task[i + 1] = first_task[i] + (num_blocks + grain - 1) / grain;
  }
  at::parallel_for(0, first_task.back(), 1, [&](int64_t begin, int64_t end) {
    size_t i = std::upper_bound(first_task.begin(), first_task.end(), begin) - first_task.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= first_task[i + 1]) ++i;
      const int64_t num_blocks = (steps[i].numel + steps[i].block_size - 1) / steps[i].block_size;
      const int64_t first_block = (task - first_task[i]) * grain;
      run(steps[i], first_block, std::min(num_blocks, first_block + grain));
    }
  });
}

// The parameters of one call, checked, as StepArgs (param-major lists: moment_count codes and
// scales, and value_count values, per parameter; one weight correction per parameter or none),
// all with the same rule, state kind, block size, moment formats and flags. A non-contiguous
// parameter or correction steps a contiguous copy, which write_back copies into it.
struct StepBatch {
  StepBatch(at::TensorList params, at::TensorList grads, at::TensorList codes, at::TensorList scales,
            at::TensorList weight_corrections, at::TensorList tables, const at::Tensor& encoders,
            at::TensorList cells, at::TensorList values, int32_t functor, int64_t bits, int64_t block_size,
            bool maximize, bool stochastic_round)
      : params(params), weight_corrections(weight_corrections) {
    const size_t count = params.size();
    TORCH_CHECK(count >= 1 && grads.size() == count, "cpu_rule_step: one gradient per parameter, got ",
                grads.size(), " for ", count, " parameters");
    TORCH_CHECK(codes.size() % count == 0 && scales.size() == codes.size() && values.size() % count == 0 &&
                    (weight_corrections.empty() || weight_corrections.size() == count),
                "cpu_rule_step: codes, scales and values must come as many per parameter (", count,
                " parameters, ", codes.size(), " codes, ", scales.size(), " scales, ", values.size(),
                " values), and one weight correction per parameter or none");
    const size_t moments = codes.size() / count, value_count = values.size() / count;
    works.reserve(count);
    contiguous_grads.reserve(count);
    work_corrections.reserve(weight_corrections.size());
    steps.reserve(count);
    for (size_t i = 0; i < count; ++i) {
      works.push_back(params[i].contiguous());
      contiguous_grads.push_back(grads[i].contiguous());
      c10::optional<at::Tensor> correction;
      if (!weight_corrections.empty()) {
        work_corrections.push_back(weight_corrections[i].contiguous());
        correction = work_corrections.back();
      }
      steps.push_back(rule_args(works.back(), contiguous_grads.back(), codes.slice(i * moments, moments),
                                scales.slice(i * moments, moments), correction, tables, encoders, cells,
                                values.slice(i * value_count, value_count), functor, bits, block_size, maximize,
                                stochastic_round));
    }
  }

  void write_back() const {
    for (size_t i = 0; i < params.size(); ++i) {
      if (!works[i].is_same(params[i])) params[i].copy_(works[i]);
      if (!weight_corrections.empty() && !work_corrections[i].is_same(weight_corrections[i]))
        weight_corrections[i].copy_(work_corrections[i]);
    }
  }

  at::TensorList params, weight_corrections;
  std::vector<at::Tensor> works, contiguous_grads, work_corrections;
  std::vector<StepArgs> steps;
};

void cpu_rule_step(at::TensorList params, at::TensorList grads, at::TensorList codes, at::TensorList scales,
                   at::TensorList weight_corrections, at::TensorList values, c10::string_view functor,
                   at::TensorList tables, const at::Tensor& encoders, at::TensorList cells, int64_t bits,
                   int64_t block_size, bool maximize, bool stochastic_round, c10::string_view isa) {
  TORCH_CHECK(functor != "adamw_factored" && functor != "factored_statistics", "cpu_rule_step: functor '",
              functor, "' has an operator of its own (cpu_factored_step, cpu_factored_statistics)");
  const IsaPath& path = isa_path(isa);
  const StepBatch batch(params, grads, codes, scales, weight_corrections, tables, encoders, cells, values,
                        functor_row(functor), bits, block_size, maximize, stochastic_round);
  run_blocks(batch.steps, path);
  batch.write_back();
}

void check_statistic(const at::Tensor& statistic, int64_t size, const char* name) {
  TORCH_CHECK(statistic.scalar_type() == at::kFloat && statistic.is_contiguous() && statistic.device().is_cpu() &&
                  statistic.numel() == size,
              "cpu_factored: ", name, " must be ", size, " contiguous float32 CPU values");
}

// AdamWFactored4bit's element pass (rules/adamw_factored.h) of every parameter of the call (as
// cpu_rule_step's lists, with each parameter's row statistics and normalised columns): the
// block step of the first moment with each element's second moment row[i] * col_normalized[j]
// of the (rows, columns) view of the parameter, columns = col_normalized's length.
void cpu_factored_step(at::TensorList params, at::TensorList grads, at::TensorList codes, at::TensorList scales,
                       at::TensorList weight_corrections, at::TensorList values, at::TensorList rows,
                       at::TensorList col_normalized, at::TensorList tables, const at::Tensor& encoders,
                       at::TensorList cells, int64_t bits, int64_t block_size, bool maximize, bool stochastic_round,
                       c10::string_view isa) {
  const IsaPath& path = isa_path(isa);
  StepBatch batch(params, grads, codes, scales, weight_corrections, tables, encoders, cells, values,
                  functor_row("adamw_factored"), bits, block_size, maximize, stochastic_round);
  TORCH_CHECK(rows.size() == params.size() && col_normalized.size() == params.size(),
              "cpu_factored_step: one row statistic and one normalised column per parameter");
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t row_count = rows[i].numel(), columns = col_normalized[i].numel();
    TORCH_CHECK(row_count >= 1 && columns >= 1 && row_count * columns == params[i].numel(), "cpu_factored_step: ",
                row_count, " rows and ", columns, " columns do not make param's ", params[i].numel(), " elements");
    check_statistic(rows[i], row_count, "row");
    check_statistic(col_normalized[i], columns, "col_normalized");
    FactoredArgs& f = batch.steps[i].factored;
    f.row = rows[i].data_ptr<float>();
    f.col_normalized = col_normalized[i].data_ptr<float>();
    f.rows = row_count;
    f.columns = columns;
  }
  run_blocks(batch.steps, path);
  batch.write_back();
}

// The statistics pass (factored_statistics.h) of a (rows, columns) gradient, `param` read
// under L2 decay (the gradient's dtype, or its float32 master weight): each row's mean of
// (1 - beta2) * g**2 accumulated into `row` (row = beta2 * row + mean, float32, saturated),
// and column_means set to this shard's share of the column means: a chunk of chunk_rows rows
// at a time, the chunk's column sums divided by all_rows, saturated to float32 and added up in
// float32 (saturated), as lowbit_optim/step/factored.py accumulates them.
void factored_statistics(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& row,
                         const at::Tensor& column_means, double beta2, double weight_decay, int64_t all_rows,
                         int64_t chunk_rows, bool maximize, bool decoupled, const IsaPath& isa) {
  const int64_t rows = row.numel(), columns = column_means.numel();
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous() && grad.numel() == rows * columns && rows >= 1,
              "cpu_factored_statistics: grad must be a contiguous CPU tensor of rows * columns elements");
  TORCH_CHECK(param.device().is_cpu() && param.is_contiguous() && param.numel() == grad.numel() &&
                  (param.scalar_type() == grad.scalar_type() || param.scalar_type() == at::kFloat),
              "cpu_factored_statistics: param must be contiguous, of grad's size and dtype or float32");
  check_statistic(row, rows, "row");
  check_statistic(column_means, columns, "column_means");
  TORCH_CHECK(all_rows >= rows && chunk_rows >= 1, "cpu_factored_statistics: all_rows (", all_rows,
              ") must be at least the rows (", rows, ") and chunk_rows (", chunk_rows, ") at least 1");
  StepArgs a{};
  const auto dtype_of = [](const at::Tensor& t) -> int32_t {
    switch (t.scalar_type()) {
      case at::kFloat: return kFloat32;
      case at::kBFloat16: return kBFloat16;
      case at::kHalf: return kFloat16;
      default: TORCH_CHECK(false, "cpu_factored_statistics: dtype ", t.scalar_type(), " is not supported");
    }
    return kFloat32;  // unreachable
  };
  a.functor = functor_row("factored_statistics");
  a.grad = grad.data_ptr();
  a.param_dtype = dtype_of(grad);
  a.maximize = maximize;
  FactoredArgs& f = a.factored;
  f.host_beta2 = beta2;
  f.weight_decay = weight_decay;
  f.param = param.data_ptr();
  f.param_dtype = dtype_of(param);
  f.decoupled = decoupled;
  f.rows = rows;
  f.columns = columns;
  f.chunk_rows = chunk_rows;
  // Tiles of about 64K elements: fixed by the shape alone, so that the sums' order, and hence
  // the result, does not depend on the thread count.
  f.tile_rows = std::max<int64_t>(1, kElementsPerTask / columns);
  const int64_t tiles_per_chunk = (std::min(chunk_rows, rows) + f.tile_rows - 1) / f.tile_rows;
  std::vector<double> column_sums(tiles_per_chunk * columns);
  f.column_sums = column_sums.data();
  f.row_statistics = row.data_ptr<float>();
  f.beta2 = static_cast<float>(beta2);
  float* means = column_means.data_ptr<float>();
  std::fill(means, means + columns, 0.0f);
  const RangeFn run = isa.functors().rows[a.functor].run;
  const double divisor = static_cast<double>(all_rows);
  constexpr double kFloat32Max = 3.4028234663852886e+38;
  for (int64_t first = 0; first < rows; first += chunk_rows) {
    f.first_row = first;
    const int64_t tiles = (std::min(chunk_rows, rows - first) + f.tile_rows - 1) / f.tile_rows;
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) { run(a, begin, end); });
    for (int64_t j = 0; j < columns; ++j) {
      double sum = 0.0;
      for (int64_t tile = 0; tile < tiles; ++tile) sum += column_sums[tile * columns + j];
      const double share = sum / divisor;
      const float total = means[j] + static_cast<float>(share < kFloat32Max ? share : kFloat32Max);
      means[j] = total < static_cast<float>(kFloat32Max) ? total : static_cast<float>(kFloat32Max);
    }
  }
}

// factored_statistics of every parameter of the call, one after another (lists of one entry
// per parameter; beta2 and weight_decay shared).
void cpu_factored_statistics(at::TensorList params, at::TensorList grads, at::TensorList rows,
                             at::TensorList column_means, const at::Tensor& beta2, const at::Tensor& weight_decay,
                             at::IntArrayRef all_rows, at::IntArrayRef chunk_rows, bool maximize, bool decoupled,
                             c10::string_view isa) {
  const IsaPath& path = isa_path(isa);
  const double beta2_value = scalar_of(beta2), weight_decay_value = scalar_of(weight_decay);
  const size_t count = params.size();
  TORCH_CHECK(grads.size() == count && rows.size() == count && column_means.size() == count &&
                  all_rows.size() == count && chunk_rows.size() == count,
              "cpu_factored_statistics: one gradient, row statistic, column means, row count and chunk per "
              "parameter");
  for (size_t i = 0; i < count; ++i)
    factored_statistics(params[i].contiguous(), grads[i].contiguous(), rows[i], column_means[i], beta2_value,
                        weight_decay_value, all_rows[i], chunk_rows[i], maximize, decoupled, path);
}

// Between the two passes, for every parameter of the call: its column statistic accumulated,
// col = min(beta2 * col + column_means, float32 max) in place (factored.accumulate_statistics:
// the same float32 operations, beta2 rounded to float32 as torch rounds a 0-d float64 factor),
// then col_normalized = col / max(mean(col), tiny) (state/factored.py's normalized_columns): the
// mean in float64, its sum in index order where torch's follows its reduction's tiling, so it
// may round to the neighbouring float32 (docs/cpu_kernel.md bounds it), then divided in float32.
void cpu_factored_columns(at::TensorList cols, at::TensorList column_means, at::TensorList col_normalized,
                          const at::Tensor& beta2) {
  TORCH_CHECK(column_means.size() == cols.size() && col_normalized.size() == cols.size(),
              "cpu_factored_columns: one column mean and one normalised column buffer per column statistic");
  const float decay = static_cast<float>(scalar_of(beta2));
  constexpr float kFloat32Max = 3.4028234663852886e+38f;
  constexpr double kTiny = 1.1754943508222875e-38;  // torch.finfo(torch.float32).tiny
  for (size_t i = 0; i < cols.size(); ++i) {
    const int64_t columns = cols[i].numel();
    TORCH_CHECK(columns >= 1, "cpu_factored_columns: an empty column statistic");
    check_statistic(cols[i], columns, "col");
    check_statistic(column_means[i], columns, "column_means");
    check_statistic(col_normalized[i], columns, "col_normalized");
    float* col = cols[i].data_ptr<float>();
    const float* means = column_means[i].const_data_ptr<float>();
    double sum = 0.0;
    for (int64_t j = 0; j < columns; ++j) {
      const float accumulated = decay * col[j] + means[j];  // two roundings: -ffp-contract=off
      col[j] = accumulated > kFloat32Max ? kFloat32Max : accumulated;  // NaN kept, as clamp_max keeps it
      sum += col[j];
    }
    double mean = sum / static_cast<double>(columns);
    mean = mean < kTiny ? kTiny : mean;  // NaN kept, as clamp_min keeps it
    const float divisor = static_cast<float>(mean);
    float* normalized = col_normalized[i].data_ptr<float>();
    for (int64_t j = 0; j < columns; ++j) normalized[j] = col[j] / divisor;
  }
}

// kEncoderFields' names and widths, and the encoders' and cell signs' names in their values' order.
std::tuple<std::vector<std::string>, std::vector<int64_t>, std::vector<std::string>, std::vector<std::string>>
cpu_encoder_layout() {
  std::vector<std::string> names;
  std::vector<int64_t> widths;
  for (const EncoderField& field : kEncoderFields) {
    names.emplace_back(field.name);
    widths.push_back(field.width);
  }
  return {names, widths, std::vector<std::string>(std::begin(kEncoderNames), std::end(kEncoderNames)),
          std::vector<std::string>(std::begin(kCellSignNames), std::end(kCellSignNames))};
}

// The names of the host values `functor` reads, in the order it reads them (its kConstants).
std::vector<std::string> cpu_functor_constants(c10::string_view functor) {
  const Functor& row = functor_of(functor_row(functor));
  return std::vector<std::string>(row.constants, row.constants + row.constant_count);
}

}  // namespace
}  // namespace lowbit_cpu

TORCH_LIBRARY_FRAGMENT(lowbit_optim, m) {
  m.def(
      "cpu_rule_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] codes, Tensor(c!)[] scales, "
      "Tensor(d!)[] weight_corrections, Tensor[] values, *, str functor, Tensor[] tables, Tensor encoders, "
      "Tensor[] cells, int bits, int block_size, bool maximize, bool stochastic_round, str isa) -> ()");
  m.def(
      "cpu_factored_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] codes, Tensor(c!)[] scales, "
      "Tensor(d!)[] weight_corrections, Tensor[] values, *, Tensor[] rows, Tensor[] col_normalized, "
      "Tensor[] tables, Tensor encoders, Tensor[] cells, int bits, int block_size, bool maximize, "
      "bool stochastic_round, str isa) -> ()");
  m.def(
      "cpu_factored_statistics(Tensor[] params, Tensor[] grads, Tensor(a!)[] rows, Tensor(b!)[] column_means, *, "
      "Tensor beta2, Tensor weight_decay, int[] all_rows, int[] chunk_rows, bool maximize, bool decoupled, "
      "str isa) -> ()");
  m.def(
      "cpu_factored_columns(Tensor(a!)[] cols, Tensor[] column_means, Tensor(b!)[] col_normalized, *, "
      "Tensor beta2) -> ()");
  // No tensor argument to dispatch on: one kernel for every backend.
  m.def("cpu_functor_constants(str functor) -> str[]", &lowbit_cpu::cpu_functor_constants);
  m.def("cpu_encoder_layout() -> (str[] fields, int[] widths, str[] encoders, str[] cell_signs)",
        &lowbit_cpu::cpu_encoder_layout);
}

TORCH_LIBRARY_IMPL(lowbit_optim, CPU, m) {
  m.impl("cpu_rule_step", &lowbit_cpu::cpu_rule_step);
  m.impl("cpu_factored_step", &lowbit_cpu::cpu_factored_step);
  m.impl("cpu_factored_statistics", &lowbit_cpu::cpu_factored_statistics);
  m.impl("cpu_factored_columns", &lowbit_cpu::cpu_factored_columns);
}
