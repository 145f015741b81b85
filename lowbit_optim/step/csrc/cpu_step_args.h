// What one call of the CPU step needs, as plain data: the translation units compiled for
// each instruction set include this and nothing from torch, so that no inline function of
// torch's headers is compiled with AVX-512 enabled and then shared with the other paths.
#pragma once
#include <cstdint>

namespace lowbit_cpu {

enum ParamDtype : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
enum StateKind : int32_t { kDynamic8 = 0, kNibble4 = 1, kFloat8 = 2 };
enum Encoder : int32_t { kDynamicSigned = 0, kDynamicUnsigned = 1, kSmallTable = 2, kLinear16 = 3, kE4M3 = 4 };

// The constants of one moment's encoder, all float32 values exactly as the reference
// encoders (lowbit_optim/formats/codecs.py) compare and compute with them: Python numbers meet
// float32 tensors there, so torch rounds each one to float32 first.
struct EncoderConstants {
  int32_t encoder;
  int32_t zero_free;       // codes below first_edge become 0 first (ZeroFreeCodec)
  float first_edge;
  float midpoints[16];     // kSmallTable: its 15 ascending midpoints, then +inf
  // kDynamic*: index d = the number of decade starts a magnitude reaches (0..6)
  float decade_starts[16]; // 6 used
  float shifts[16];
  float counts[16];
  float lower_midpoints[16];
  float upper_midpoint;
  float max_rank;
  float zero_code;
};

struct StepArgs {
  void* param;
  const void* grad;
  int32_t param_dtype;
  int32_t kind;
  int64_t numel;
  int64_t block_size;
  uint8_t* codes[3];   // exp_avg, exp_avg_sq, max_exp_avg_sq (null without amsgrad)
  float* scales[3];
  const float* tables[2];  // decode tables of the first and second moment (16 or 256 floats)
  EncoderConstants encoders[2];
  // Hyperparameters rounded to float32 where the reference multiplies a float32 tensor by a
  // float64 0-d tensor (torch rounds the scalar to float32 first).
  float one_minus_beta1, beta2, one_minus_beta2, step_size, bias_correction2_sqrt, eps;
  float max_ratio;      // step.math.adam_ratio_bound: |exp_avg / denom| is clamped to it
  float decay;          // 1 - lr * weight_decay (decoupled)
  float weight_decay;   // L2 (not decoupled)
  int32_t maximize, decoupled, amsgrad, stochastic_round;
  uint64_t seed;
  // A bfloat16 or float16 parameter's master weight correction (lowbit_optim/step/master_weights.py):
  // int8 for 24-bit master weights, int16 for 32-bit, one per element; null (and
  // master_weight_bits 0) without one.
  void* correction;
  int32_t master_weight_bits;
};

using RangeFn = void (*)(const StepArgs&, int64_t first_block, int64_t end_block);

RangeFn avx512_range();
RangeFn avx2_range();
RangeFn scalar_range();

}  // namespace lowbit_cpu
