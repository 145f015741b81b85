// The Muon rule's element-wise step for the CPU kernel: MuonRule.update of
// lowbit_optim/step/rules/muon.py, operation for operation as the compiled step forms it, in
// float32 (its "parameter" is the direction buffer; Newton-Schulz runs afterwards in PyTorch):
//
//   B <- lerp(B, g, 1 - momentum)
//   U <- nesterov ? lerp(g, B, momentum) : B          (returned as the new "parameter")
//
// with lerp(start, end, w) = w * (end - start) + start for |w| < 0.5, else
// (w - 1) * (end - start) + end, the compiled step's form (no fused multiply-add).
// Host values: MuonRule::kConstants, lowbit_optim/step/rules/muon.py's MuonConstants.
// One moment, momentum_buffer. Included by cpu_step_kernel.h once per instruction set, with V
// that set's vector operations; the kernel applies the shared policies around `update`.
#pragma once
#include <cmath>

#include "../cpu_step_args.h"

namespace lowbit_cpu {
namespace LOWBIT_ISA {
namespace {

struct MuonRule {
  using F = V::F;
  static constexpr int kMoments = 1;
  // The host values it reads, in this order (rule_values[0], [1]).
  static constexpr const char* kConstants[] = {"momentum", "nesterov"};
  // Each lerp's float32 weight (0-d float64 values rounded where they meet a float32 tensor),
  // as its coefficient and whether it starts from `end`.
  float momentum_coefficient, nesterov_coefficient;
  bool momentum_from_end, nesterov_from_end, nesterov;

  static void lerp_form(float weight, float& coefficient, bool& from_end) {
    from_end = !(std::fabs(weight) < 0.5f);
    coefficient = from_end ? weight - 1.0f : weight;
  }

  explicit MuonRule(const StepArgs& a) {
    const double momentum = a.rule_values[0];
    lerp_form(static_cast<float>(1.0 - momentum), momentum_coefficient, momentum_from_end);
    lerp_form(static_cast<float>(momentum), nesterov_coefficient, nesterov_from_end);
    nesterov = a.rule_values[1] != 0.0;
  }

  static inline F lerp(F start, F end, float coefficient, bool from_end) {
    return V::add(V::mul(V::set1(coefficient), V::sub(end, start)), from_end ? end : start);
  }

  inline F update(F p, F g, const F* moments, F* updated) const {
    const F buffer = lerp(moments[0], g, momentum_coefficient, momentum_from_end);
    updated[0] = buffer;
    return nesterov ? lerp(g, buffer, nesterov_coefficient, nesterov_from_end) : buffer;
  }
};

}  // namespace
}  // namespace LOWBIT_ISA
}  // namespace lowbit_cpu
