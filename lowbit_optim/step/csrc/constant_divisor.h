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
// A divisor outside the range (a zero scale divides by inf) takes the divider.
// Where q0 is 0, infinite or NaN it is the quotient already (V::unless_special): the correction
// would turn an infinity into NaN, and -0 into +0 (r = -0 - d * -0 = +0, and +0 * y + -0 = +0).
#pragma once

namespace lowbit_cpu {
namespace LOWBIT_ISA {
namespace {

class ConstantDivisor {
 public:
  ConstantDivisor() : ConstantDivisor(1.0f) {}
  explicit ConstantDivisor(float divisor)
      : divisor_(divisor), reciprocal_(1.0f / divisor), by_reciprocal_(divisor >= 0x1p-60f && divisor <= 0x1p60f) {}

  inline typename V::F divide(typename V::F x) const {
    if (!by_reciprocal_) return V::div(x, V::set1(divisor_));
    return V::unless_special(corrected(x), estimate(x));
  }

  // The quotient with NaN made 0 and infinities clamped to +-1 (V::saturate_quotient), for
  // values no larger than the divisor in magnitude where finite: on the reciprocal path one
  // fix-up, from the estimate's class, does both (the estimate is NaN or infinite exactly where
  // x is: a finite x, at most the divisor in magnitude, gives |x * y| of about 1 at most).
  inline typename V::F divide_saturated(typename V::F x) const {
    if (!by_reciprocal_) return V::saturate_quotient(V::div(x, V::set1(divisor_)));
    return V::saturate_unless_special(corrected(x), estimate(x));
  }

 private:
  inline typename V::F estimate(typename V::F x) const { return V::mul(x, V::set1(reciprocal_)); }

  inline typename V::F corrected(typename V::F x) const {
    const typename V::F q0 = estimate(x);
    return V::fmadd(V::fnmadd(q0, V::set1(divisor_), x), V::set1(reciprocal_), q0);
  }

  float divisor_, reciprocal_;
  bool by_reciprocal_;
};

}  // namespace
}  // namespace LOWBIT_ISA
}  // namespace lowbit_cpu
