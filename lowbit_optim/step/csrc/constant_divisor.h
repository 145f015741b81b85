// Division by a divisor that many values share (a block's scale, a step's bias correction),
// rounded exactly as V::div rounds it, without the divider: the division unit takes several
// cycles per vector and is not pipelined, and was the CPU step's bottleneck. Included by
// cpu_step_kernel.h once per instruction set, after V is defined.
//
// The quotient is x times the divisor's reciprocal y = RN(1 / d), corrected once:
//   q0 = RN(x * y),  r = x - d * q0 (one fused multiply-add: exact),  q = RN(q0 + r * y).
// Markstein's theorem (Muller et al., Handbook of Floating-Point Arithmetic, 2nd ed., 4.7):
// with y within half an ulp of 1/d and q0 within one ulp of x/d, r is exact and q = RN(x/d).
// Its conditions hold when nothing underflows: d within [2**-60, 2**60] (y and q0 normal) and
// |x| >= 2**-100 (r normal), with a normal quotient. Measured against the AVX-512 divider:
// 3.2e9 random quotients of such x and d, bit-identical but for one subnormal quotient.
//
// Both callers stay within those conditions or do not depend on them:
// - the bias correction divides sqrt(v) >= 2**-75 (the square root of the least float32) or 0;
// - a block's scale divides values at most the scale in magnitude. Where the quotient is at
//   least 2**-30 in magnitude x is at least 2**-90 and the quotient is exact; below, every
//   encoder gives the code of 0 of the same sign (the least threshold of any format is
//   2**-23, the cell tables' floor), and q keeps x's sign and stays below 2**-29.
// A divisor outside the range (a zero scale divides by inf) takes the divider, and so does
// every divisor on the paths whose V::kDividesByReciprocal is false: on AVX2, without the
// fix-up instruction, the correction costs more than the divider (AdamW4bit at one thread,
// 10 x 1024²: 31.7 ms with it, 22.4 ms without), while on AVX-512 it is faster (1.12-1.16x ->
// 0.97x torch's fused step, same process, alternated).
// Where q0 is 0, infinite or NaN it is the quotient already (V::unless_special): the correction
// would turn an infinity into NaN, and -0 into +0 (r = -0 - d * -0 = +0, and +0 * y + -0 = +0).
// A divisor of exactly 1 returns x itself, which is x / 1 for every float32 (no operation of the
// kernel divides a subnormal, the one case flush-to-zero would change): the bias correction's
// square root rounds to 1 once beta2**step is below 2**-24 (after ~16,600 steps at beta2 =
// 0.999, ~325 at 0.95), so for most of a long run AdamW skips its four operations per vector
// (0.93-0.95x the step time at step 20,000; 1.00x at step 4).
#pragma once

namespace lowbit_cpu {
namespace LOWBIT_ISA {
namespace {

// A template over the vector type only so that the reciprocal path, discarded by `if constexpr`
// where V has no fix-up instruction, is not compiled there.
template <typename Vec>
class BasicConstantDivisor {
 public:
  BasicConstantDivisor() : BasicConstantDivisor(1.0f) {}
  explicit BasicConstantDivisor(float divisor)
      : divisor_(divisor),
        reciprocal_(1.0f / divisor),
        by_reciprocal_(Vec::kDividesByReciprocal && divisor >= 0x1p-60f && divisor <= 0x1p60f),
        unit_(divisor == 1.0f) {}

  inline typename Vec::F divide(typename Vec::F x) const {
    if (unit_) return x;
    if constexpr (Vec::kDividesByReciprocal) {
      if (by_reciprocal_) return Vec::unless_special(corrected(x), estimate(x));
    }
    return Vec::div(x, Vec::set1(divisor_));
  }

  // The quotient with NaN made 0 and infinities clamped to +-1 (Vec::saturate_quotient), for
  // values no larger than the divisor in magnitude where finite: on the reciprocal path one
  // fix-up, from the estimate's class, does both (the estimate is NaN or infinite exactly where
  // x is: a finite x, at most the divisor in magnitude, gives |x * y| of about 1 at most).
  inline typename Vec::F divide_saturated(typename Vec::F x) const {
    if constexpr (Vec::kDividesByReciprocal) {
      if (by_reciprocal_) return Vec::saturate_unless_special(corrected(x), estimate(x));
    }
    return Vec::saturate_quotient(Vec::div(x, Vec::set1(divisor_)));
  }

 private:
  inline typename Vec::F estimate(typename Vec::F x) const { return Vec::mul(x, Vec::set1(reciprocal_)); }

  inline typename Vec::F corrected(typename Vec::F x) const {
    const typename Vec::F q0 = estimate(x);
    return Vec::fmadd(Vec::fnmadd(q0, Vec::set1(divisor_), x), Vec::set1(reciprocal_), q0);
  }

  float divisor_, reciprocal_;
  bool by_reciprocal_, unit_;
};

using ConstantDivisor = BasicConstantDivisor<V>;

}  // namespace
}  // namespace LOWBIT_ISA
}  // namespace lowbit_cpu
