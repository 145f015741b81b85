// The AdEMAMix rule's element-wise step for the CPU kernel: AdEMAMixRule.update of
// lowbit_optim/step/rules/ademamix.py, operation for operation, in float32:
//
//   m1 <- m1 * beta1 + g * (1 - beta1);  m2 <- m2 * beta3 + g * (1 - beta3)
//   nu <- nu * beta2 + ((1 - beta2) * g) * g;  denom = sqrt(nu) / sqrt(bc2) + eps
//   p  <- p * (1 - lr * wd) - lr * (clamp(m1 / denom, fast_bound) / bc1 + alpha * clamp(m2 / denom, slow_bound))
//
// Host values: AdEMAMixRule::kConstants, lowbit_optim/step/rules/ademamix.py's
// AdEMAMixConstants, the alpha and beta3 schedules, bias corrections and bounds already applied
// by the host at this step count. Moments: exp_avg, exp_avg_slow, exp_avg_sq. Included by cpu_step_kernel.h once per
// instruction set, with V that set's vector operations; the kernel applies the shared
// policies around `update`.
#pragma once
#include "../cpu_step_args.h"

namespace lowbit_cpu {
namespace LOWBIT_ISA {
namespace {

struct AdEMAMixRule {
  using F = V::F;
  static constexpr int kMoments = 3;
  // The host values it reads, in this order (rule_values[0], [1], ...).
  static constexpr const char* kConstants[] = {
      "lr",           "beta1",           "beta2",                 "beta3",      "alpha",     "eps",
      "weight_decay", "bias_correction1", "bias_correction2_sqrt", "fast_bound", "slow_bound"};
  // 0-d float64 values and their float64 combinations, rounded to float32 where they meet a
  // float32 tensor (as torch rounds a float64 0-d tensor there).
  float lr, beta1, one_minus_beta1, beta2, one_minus_beta2, beta3, one_minus_beta3, alpha, eps, decay;
  float bias_correction1, fast_bound, slow_bound;
  ConstantDivisor bias_correction2_sqrt;

  explicit AdEMAMixRule(const StepArgs& a) {
    const double* v = a.rule_values;  // kConstants' order
    lr = static_cast<float>(v[0]);
    beta1 = static_cast<float>(v[1]);
    one_minus_beta1 = static_cast<float>(1.0 - v[1]);
    beta2 = static_cast<float>(v[2]);
    one_minus_beta2 = static_cast<float>(1.0 - v[2]);
    beta3 = static_cast<float>(v[3]);
    one_minus_beta3 = static_cast<float>(1.0 - v[3]);
    alpha = static_cast<float>(v[4]);
    eps = static_cast<float>(v[5]);
    decay = static_cast<float>(1.0 - v[0] * v[6]);
    bias_correction1 = static_cast<float>(v[7]);
    bias_correction2_sqrt = ConstantDivisor(static_cast<float>(v[8]));
    fast_bound = static_cast<float>(v[9]);
    slow_bound = static_cast<float>(v[10]);
  }

  // clamp(-bound, bound), NaN kept as torch's clamp keeps it: the vector max/min return their
  // second operand when either is NaN.
  static inline F clamp(F x, float bound) { return V::min(V::set1(bound), V::max(V::set1(-bound), x)); }

  inline F update(F p, F g, const F* moments, F* updated) const {
    const F exp_avg = V::add(V::mul(moments[0], V::set1(beta1)), V::mul(g, V::set1(one_minus_beta1)));
    const F exp_avg_slow = V::add(V::mul(moments[1], V::set1(beta3)), V::mul(g, V::set1(one_minus_beta3)));
    const F square = V::mul(V::mul(V::set1(one_minus_beta2), g), g);
    const F exp_avg_sq = V::add(V::mul(moments[2], V::set1(beta2)), square);
    updated[0] = exp_avg;
    updated[1] = exp_avg_slow;
    updated[2] = exp_avg_sq;
    const F denom = V::add(bias_correction2_sqrt.divide(V::sqrt(exp_avg_sq)), V::set1(eps));
    const F fast = V::div(clamp(V::div(exp_avg, denom), fast_bound), V::set1(bias_correction1));
    const F slow = clamp(V::div(exp_avg_slow, denom), slow_bound);
    const F step = V::mul(V::set1(lr), V::add(fast, V::mul(V::set1(alpha), slow)));
    return V::sub(V::mul(p, V::set1(decay)), step);
  }
};

}  // namespace
}  // namespace LOWBIT_ISA
}  // namespace lowbit_cpu
