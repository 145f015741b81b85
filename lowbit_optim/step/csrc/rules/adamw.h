// The AdamW (and Adam, L2 decay) rule's element-wise step for the CPU kernel: the update of
// lowbit_optim/step/math.py::adamw_update, operation for operation, in float32.
//
// Host values: AdamWMath::kConstants, lowbit_optim/step/rules/adamw.py's AdamWConstants
// (decoupled: 1 for AdamW's decoupled decay, 0 for Adam's L2 term; max_ratio: that step's
// math.adam_ratio_bound, computed by the host). Moments: exp_avg, exp_avg_sq and, with amsgrad,
// max_exp_avg_sq. Included by cpu_step_kernel.h once per instruction set, with V
// that set's vector operations; the kernel applies the shared policies (maximize, a non-finite
// gradient keeping its element, rounding, master weights) around `update`.
#pragma once
#include "../cpu_step_args.h"

namespace lowbit_cpu {
namespace LOWBIT_ISA {
namespace {

// AdamW's float32 constants and the pieces of its update that the factored variant
// (rules/adamw_factored.h) shares: the gradient with L2 decay, the first moment's update and
// the parameter's update from the new moments.
struct AdamWMath {
  using F = V::F;
  // The host values it reads, in this order (rule_values[0], [1], ...).
  static constexpr const char* kConstants[] = {"lr",           "beta1", "beta2",     "eps",
                                               "weight_decay", "step",  "decoupled", "max_ratio"};
  // As adamw_update computes them from 0-d float64 tensors: every 0-d result is float64,
  // rounded to float32 where it meets a float32 tensor; the bias corrections are pow and sqrt
  // in float64, as torch's scalar kernels compute them.
  float one_minus_beta1, beta2, one_minus_beta2, step_size, eps;
  ConstantDivisor bias_correction2_sqrt;
  float max_ratio;     // |exp_avg / denom| is clamped to it
  float decay;         // 1 - lr * weight_decay (decoupled)
  float weight_decay;  // L2 (not decoupled)
  bool decoupled;

  explicit AdamWMath(const StepArgs& a) {
    const double* v = a.rule_values;  // kConstants' order
    const double lr = v[0], beta1_v = v[1], beta2_v = v[2], eps_v = v[3], weight_decay_v = v[4], step = v[5];
    decoupled = v[6] != 0.0;
    max_ratio = static_cast<float>(v[7]);
    const double bias_correction1 = 1.0 - __builtin_pow(beta1_v, step);
    const double correction2_sqrt = __builtin_sqrt(1.0 - __builtin_pow(beta2_v, step));
    one_minus_beta1 = static_cast<float>(1.0 - beta1_v);
    beta2 = static_cast<float>(beta2_v);
    one_minus_beta2 = static_cast<float>(1.0 - beta2_v);
    step_size = static_cast<float>(lr / bias_correction1);
    bias_correction2_sqrt = ConstantDivisor(static_cast<float>(correction2_sqrt));
    eps = static_cast<float>(eps_v);
    decay = static_cast<float>(1.0 - lr * weight_decay_v);
    weight_decay = static_cast<float>(weight_decay_v);
  }

  // math.effective_gradient's L2 term (torch.optim.Adam): g + weight_decay * p.
  inline F gradient(F p, F g) const { return decoupled ? g : V::add(g, V::mul(V::set1(weight_decay), p)); }

  // math.first_moment_update: torch's lerp.
  inline F first_moment(F exp_avg, F g) const {
    return V::add(exp_avg, V::mul(V::set1(one_minus_beta1), V::sub(g, exp_avg)));
  }

  // math.parameter_update: the new parameter from `p` (the master weight where there is one),
  // the new first moment and the second moment the denominator reads.
  inline F parameter(F p, F new_exp_avg, F second) const {
    const F denom = V::add(bias_correction2_sqrt.divide(V::sqrt(second)), V::set1(eps));
    const F decayed = decoupled ? V::mul(p, V::set1(decay)) : p;
    // clamp(-max_ratio, max_ratio), NaN kept as torch's clamp keeps it: the vector max/min
    // return their second operand when either is NaN.
    F ratio = V::div(new_exp_avg, denom);
    ratio = V::min(V::set1(max_ratio), V::max(V::set1(-max_ratio), ratio));
    return V::sub(decayed, V::mul(V::set1(step_size), ratio));
  }
};

// kAmsgrad: a third moment, max_exp_avg_sq, the maximum of the second (a template parameter, so
// that every loop over the moments has a constant count: measured 4-5% faster than a count
// read at run time).
template <bool kAmsgrad>
struct AdamWRule : AdamWMath {
  static constexpr int kMoments = kAmsgrad ? 3 : 2;

  explicit AdamWRule(const StepArgs& a) : AdamWMath(a) {}

  // The new parameter from `p` (the master weight where there is one) and a finite gradient
  // `g`; the new moments into `updated`.
  inline F update(F p, F g, const F* moments, F* updated) const {
    g = gradient(p, g);
    const F new_exp_avg = first_moment(moments[0], g);
    const F square = V::mul(V::mul(V::set1(one_minus_beta2), g), g);
    const F new_exp_avg_sq = V::add(V::mul(moments[1], V::set1(beta2)), square);
    F second = new_exp_avg_sq;
    if constexpr (kAmsgrad) {
      second = V::max(moments[2], new_exp_avg_sq);  // no NaN reaches it: torch.maximum's NaN rule is moot
      updated[2] = second;
    }
    updated[0] = new_exp_avg;
    updated[1] = new_exp_avg_sq;
    return parameter(p, new_exp_avg, second);
  }
};

}  // namespace
}  // namespace LOWBIT_ISA
}  // namespace lowbit_cpu
