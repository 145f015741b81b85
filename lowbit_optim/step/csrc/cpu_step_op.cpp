// The operator lowbit_optim::cpu_adamw_step: reads the hyperparameters (0-d CPU tensors)
// once, forms the float64 bias corrections as the reference does, picks the instruction-set
// path and runs it over the blocks with at::parallel_for (so torch.set_num_threads governs
// it). Each block is computed alone, so the result does not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <mutex>

#include "cpu_step_args.h"

namespace lowbit_cpu {
namespace {

constexpr int64_t kMaxBlockSize = 2048;  // cpu_step_kernel.h's kMaxBlock
constexpr int64_t kEncoderFloats = 86;   // EncoderConstants as float32 values (cpu_kernel.py)

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

bool isa_supported(int64_t isa) {
#if defined(__x86_64__) || defined(_M_X64)
  if (isa == kAvx512) return __builtin_cpu_supports("avx512f");
  if (isa == kAvx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  if (isa != kScalar) return false;
#endif
  return true;
}

EncoderConstants read_encoder(const float* values) {
  EncoderConstants c;
  c.encoder = static_cast<int32_t>(values[0]);
  c.zero_free = static_cast<int32_t>(values[1]);
  c.first_edge = values[2];
  std::memcpy(c.midpoints, values + 3, 16 * sizeof(float));
  std::memcpy(c.decade_starts, values + 19, 16 * sizeof(float));
  std::memcpy(c.shifts, values + 35, 16 * sizeof(float));
  std::memcpy(c.counts, values + 51, 16 * sizeof(float));
  std::memcpy(c.lower_midpoints, values + 67, 16 * sizeof(float));
  c.upper_midpoint = values[83];
  c.max_rank = values[84];
  c.zero_code = values[85];
  return c;
}

double scalar_of(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.numel() == 1 && t.device().is_cpu(), "cpu_adamw_step: ", name, " must be a 1-element CPU tensor");
  return t.item<double>();
}

void check_block_state(const at::Tensor& codes, const at::Tensor& scales, int64_t num_blocks,
                       int64_t bytes_per_block, const char* name) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.device().is_cpu(),
              "cpu_adamw_step: ", name, " codes must be contiguous uint8 CPU tensors");
  TORCH_CHECK(codes.numel() == num_blocks * bytes_per_block, "cpu_adamw_step: ", name, " codes have ",
              codes.numel(), " bytes, expected ", num_blocks * bytes_per_block);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == num_blocks,
              "cpu_adamw_step: ", name, " scales must be ", num_blocks, " contiguous float32 values");
}

void cpu_adamw_step(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg_codes,
                    at::Tensor exp_avg_scales, at::Tensor exp_avg_sq_codes, at::Tensor exp_avg_sq_scales,
                    const c10::optional<at::Tensor>& max_exp_avg_sq_codes,
                    const c10::optional<at::Tensor>& max_exp_avg_sq_scales,
                    const c10::optional<at::Tensor>& weight_correction, const at::Tensor& exp_avg_table,
                    const at::Tensor& exp_avg_sq_table, const at::Tensor& encoders, const at::Tensor& lr,
                    const at::Tensor& beta1, const at::Tensor& beta2, const at::Tensor& eps,
                    const at::Tensor& weight_decay, const at::Tensor& step, int64_t kind, int64_t block_size,
                    bool maximize, bool decoupled_weight_decay, bool stochastic_round, int64_t isa) {
  TORCH_CHECK(param.device().is_cpu() && param.is_contiguous(), "cpu_adamw_step: param must be a contiguous CPU tensor");
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous() && grad.scalar_type() == param.scalar_type() &&
                  grad.numel() == param.numel(),
              "cpu_adamw_step: grad must be a contiguous CPU tensor of param's dtype and size");
  TORCH_CHECK(kind >= kDynamic8 && kind <= kFloat8, "cpu_adamw_step: unknown state kind ", kind);
  TORCH_CHECK(block_size >= 2 && block_size <= kMaxBlockSize && block_size % 4 == 0,
              "cpu_adamw_step: block_size must be a multiple of 4 in [4, ", kMaxBlockSize, "], got ", block_size);
  TORCH_CHECK(isa >= kScalar && isa <= kAvx512 && isa_supported(isa), "cpu_adamw_step: instruction set ", isa,
              " is not available on this CPU");
  StepArgs a{};
  switch (param.scalar_type()) {
    case at::kFloat: a.param_dtype = kFloat32; break;
    case at::kBFloat16: a.param_dtype = kBFloat16; break;
    case at::kHalf: a.param_dtype = kFloat16; break;
    default: TORCH_CHECK(false, "cpu_adamw_step: parameters of dtype ", param.scalar_type(), " are not supported");
  }
  const int64_t num_blocks = (param.numel() + block_size - 1) / block_size;
  const int64_t bytes_per_block = kind == kNibble4 ? block_size / 2 : block_size;
  check_block_state(exp_avg_codes, exp_avg_scales, num_blocks, bytes_per_block, "exp_avg");
  check_block_state(exp_avg_sq_codes, exp_avg_sq_scales, num_blocks, bytes_per_block, "exp_avg_sq");
  const bool amsgrad = max_exp_avg_sq_codes.has_value();
  TORCH_CHECK(amsgrad == max_exp_avg_sq_scales.has_value(), "cpu_adamw_step: max_exp_avg_sq needs codes and scales");
  if (amsgrad)
    check_block_state(*max_exp_avg_sq_codes, *max_exp_avg_sq_scales, num_blocks, bytes_per_block, "max_exp_avg_sq");
  const int64_t table_size = kind == kNibble4 ? 16 : 256;
  for (const at::Tensor* table : {&exp_avg_table, &exp_avg_sq_table})
    TORCH_CHECK(table->scalar_type() == at::kFloat && table->is_contiguous() && table->numel() == table_size,
                "cpu_adamw_step: decode tables must be ", table_size, " contiguous float32 values");
  TORCH_CHECK(encoders.scalar_type() == at::kFloat && encoders.is_contiguous() &&
                  encoders.numel() == 2 * kEncoderFloats,
              "cpu_adamw_step: encoders must be (2, ", kEncoderFloats, ") float32");

  a.param = param.data_ptr();
  a.grad = grad.data_ptr();
  a.kind = static_cast<int32_t>(kind);
  a.numel = param.numel();
  a.block_size = block_size;
  a.codes[0] = exp_avg_codes.data_ptr<uint8_t>();
  a.codes[1] = exp_avg_sq_codes.data_ptr<uint8_t>();
  a.scales[0] = exp_avg_scales.data_ptr<float>();
  a.scales[1] = exp_avg_sq_scales.data_ptr<float>();
  if (amsgrad) {
    a.codes[2] = max_exp_avg_sq_codes->data_ptr<uint8_t>();
    a.scales[2] = max_exp_avg_sq_scales->data_ptr<float>();
  }
  if (weight_correction.has_value()) {
    // A bfloat16 or float16 parameter's master weight correction (int8: 24-bit, int16:
    // 32-bit). The master weight already keeps what rounding loses, so stochastic rounding is
    // refused with it (as the optimizer refuses the combination).
    const at::Tensor& correction = *weight_correction;
    TORCH_CHECK(param.scalar_type() == at::kBFloat16 || param.scalar_type() == at::kHalf,
                "cpu_adamw_step: a weight correction needs a bfloat16 or float16 parameter, got ",
                param.scalar_type());
    TORCH_CHECK((correction.scalar_type() == at::kChar || correction.scalar_type() == at::kShort) &&
                    correction.is_contiguous() && correction.device().is_cpu() && correction.numel() == param.numel(),
                "cpu_adamw_step: the weight correction must be a contiguous int8 or int16 CPU tensor of param's size");
    TORCH_CHECK(!stochastic_round, "cpu_adamw_step: stochastic rounding with a weight correction");
    a.correction = correction.data_ptr();
    a.master_weight_bits = correction.scalar_type() == at::kChar ? 24 : 32;
  }
  a.tables[0] = exp_avg_table.data_ptr<float>();
  a.tables[1] = exp_avg_sq_table.data_ptr<float>();
  a.encoders[0] = read_encoder(encoders.data_ptr<float>());
  a.encoders[1] = read_encoder(encoders.data_ptr<float>() + kEncoderFloats);

  // As step.math.adamw_update computes them from 0-d float64 tensors: every 0-d result is
  // float64, rounded to float32 where it meets a float32 tensor; the bias corrections are
  // std::pow and std::sqrt in float64, as torch's scalar kernels compute them.
  const double lr_v = scalar_of(lr, "lr"), beta1_v = scalar_of(beta1, "beta1"), beta2_v = scalar_of(beta2, "beta2");
  const double eps_v = scalar_of(eps, "eps"), wd_v = scalar_of(weight_decay, "weight_decay");
  const double step_v = scalar_of(step, "step");
  const double bias_correction1 = 1.0 - std::pow(beta1_v, step_v);
  const double bias_correction2_sqrt = std::sqrt(1.0 - std::pow(beta2_v, step_v));
  // step.math.adam_ratio_bound, operation for operation (torch squares with a multiply).
  const double gamma = beta1_v * beta1_v / beta2_v;
  const double geometric = gamma == 1.0 ? step_v : (1.0 - std::pow(gamma, step_v)) / (1.0 - gamma);
  const double bound = (1.0 - beta1_v) * std::sqrt(geometric / (1.0 - beta2_v)) * bias_correction2_sqrt;
  a.max_ratio = beta2_v <= 0.0 ? INFINITY : static_cast<float>(bound);
  a.one_minus_beta1 = static_cast<float>(1.0 - beta1_v);
  a.beta2 = static_cast<float>(beta2_v);
  a.one_minus_beta2 = static_cast<float>(1.0 - beta2_v);
  a.step_size = static_cast<float>(lr_v / bias_correction1);
  a.bias_correction2_sqrt = static_cast<float>(bias_correction2_sqrt);
  a.eps = static_cast<float>(eps_v);
  a.decay = static_cast<float>(1.0 - lr_v * wd_v);
  a.weight_decay = static_cast<float>(wd_v);
  a.maximize = maximize;
  a.decoupled = decoupled_weight_decay;
  a.amsgrad = amsgrad;
  a.stochastic_round = stochastic_round && param.scalar_type() == at::kBFloat16;
  if (a.stochastic_round) {
    // One draw from torch's default CPU generator per call: torch.manual_seed makes a run
    // reproducible, and each element's noise is a hash of this seed and its index, so it
    // does not depend on the thread count.
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    a.seed = at::check_generator<at::CPUGeneratorImpl>(gen)->random64();
  }

  RangeFn run = isa == kAvx512 ? avx512_range() : isa == kAvx2 ? avx2_range() : scalar_range();
  const int64_t width = isa == kAvx512 ? 16 : isa == kAvx2 ? 8 : 1;
  const int64_t vector_span = kind == kNibble4 ? block_size / 2 : block_size;
  if (vector_span % width != 0) run = scalar_range();  // a block the vectors do not tile
  // About 64K elements per task: large enough that a task's overhead is negligible, small
  // enough that a few large parameters still spread over every thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / block_size);
  at::parallel_for(0, num_blocks, grain, [&](int64_t begin, int64_t end) { run(a, begin, end); });
}

}  // namespace
}  // namespace lowbit_cpu

TORCH_LIBRARY_FRAGMENT(lowbit_optim, m) {
  m.def(
      "cpu_adamw_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg_codes, Tensor(c!) exp_avg_scales, "
      "Tensor(d!) exp_avg_sq_codes, Tensor(e!) exp_avg_sq_scales, Tensor(f!)? max_exp_avg_sq_codes, "
      "Tensor(g!)? max_exp_avg_sq_scales, Tensor(h!)? weight_correction, Tensor exp_avg_table, "
      "Tensor exp_avg_sq_table, Tensor encoders, "
      "Tensor lr, Tensor beta1, Tensor beta2, Tensor eps, Tensor weight_decay, Tensor step, int kind, "
      "int block_size, bool maximize, bool decoupled_weight_decay, bool stochastic_round, int isa) -> ()");
}

TORCH_LIBRARY_IMPL(lowbit_optim, CPU, m) { m.impl("cpu_adamw_step", &lowbit_cpu::cpu_adamw_step); }
