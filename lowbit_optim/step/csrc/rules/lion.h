// The Lion rule's element-wise step for the CPU kernel: LionRule.update of
// lowbit_optim/step/rules/lion.py, operation for operation, in float32:
//
//   p <- p * (1 - lr * weight_decay) - lr * sign(m * beta1 + g * (1 - beta1))
//   m <- m * beta2 + g * (1 - beta2)
//
// Host values: LionRule::kConstants, lowbit_optim/step/rules/lion.py's LionConstants. One moment, exp_avg. Included by cpu_step_kernel.h once per instruction set,
// with V that set's vector operations; the kernel applies the shared policies around `update`.
#pragma once
#include "../cpu_step_args.h"

namespace lowbit_cpu {
namespace LOWBIT_ISA {
namespace {

struct LionRule {
  using F = V::F;
  static constexpr int kMoments = 1;
  // The host values it reads, in this order (rule_values[0], [1], ...).
  static constexpr const char* kConstants[] = {"lr", "beta1", "beta2", "weight_decay"};
  // 0-d float64 values and their float64 combinations, rounded to float32 where they meet a
  // float32 tensor (as torch rounds a float64 0-d tensor there).
  float lr, beta1, one_minus_beta1, beta2, one_minus_beta2, decay;

  explicit LionRule(const StepArgs& a) {
    const double* v = a.rule_values;  // kConstants' order
    const double lr_v = v[0], beta1_v = v[1], beta2_v = v[2], weight_decay = v[3];
    lr = static_cast<float>(lr_v);
    beta1 = static_cast<float>(beta1_v);
    one_minus_beta1 = static_cast<float>(1.0 - beta1_v);
    beta2 = static_cast<float>(beta2_v);
    one_minus_beta2 = static_cast<float>(1.0 - beta2_v);
    decay = static_cast<float>(1.0 - lr_v * weight_decay);
  }

  // torch.sign: +1, -1, and +0 for either zero (no NaN reaches it: the moment is finite and
  // the gradient finite, so the interpolation is at worst an infinity).
  static inline F sign(F x) {
    const F zero = V::set1(0.0f);
    return V::select(V::gt(x, zero), V::set1(1.0f), V::select(V::lt(x, zero), V::set1(-1.0f), zero));
  }

  inline F update(F p, F g, const F* moments, F* updated) const {
    const F exp_avg = moments[0];
    const F direction = sign(V::add(V::mul(exp_avg, V::set1(beta1)), V::mul(g, V::set1(one_minus_beta1))));
    updated[0] = V::add(V::mul(exp_avg, V::set1(beta2)), V::mul(g, V::set1(one_minus_beta2)));
    return V::sub(V::mul(p, V::set1(decay)), V::mul(V::set1(lr), direction));
  }
};

}  // namespace
}  // namespace LOWBIT_ISA
}  // namespace lowbit_cpu
