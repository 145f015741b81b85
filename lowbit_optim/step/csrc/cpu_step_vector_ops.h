// What the two vector paths build the same way from their primitives: bfloat16 rounding,
// the parameter store, and the stochastic-rounding noise. Included once by
// cpu_step_avx512.cpp and cpu_step_avx2.cpp, with LOWBIT_ISA set, after each defines its
// Primitives (vector types, elementwise operations, store16, store_half) and inside its
// target pragma, so each gets this code compiled for its own instruction set.
// (cpu_step_scalar.cpp writes the same operations on single lanes.)
namespace lowbit_cpu {
namespace LOWBIT_ISA {
namespace {

struct V : Primitives {
  static inline I bf16_nearest(F x) {
    // c10::BFloat16's round to nearest even; NaN -> 0x7FC0.
    I b = bits(x);
    I rounded = srl(iadd(b, iadd(set1i(0x7FFF), iand(srl(b, 16), set1i(1)))), 16);
    return iselect(eq(x, x), rounded, set1i(0x7FC0));
  }
  static inline void store_param(float* p, F x, int) { storef(p, x); }
  static inline void store_param(uint16_t* p, F x, int dtype) {
    if (dtype == kFloat16) {
      store_half(p, x);
    } else {
      store16(p, bf16_nearest(x));
    }
  }
  static inline void store_bf16_stochastic(uint16_t* p, F x, I noise) {
    I truncated = srl(iadd(bits(x), noise), 16);
    store16(p, iselect(isfinite(x), truncated, bf16_nearest(x)));
  }
  static inline I hash_noise(I index, uint32_t key) {
    I h = iadd(imul(index, set1i(static_cast<int32_t>(0x9E3779B1u))), set1i(static_cast<int32_t>(key)));
    h = ixor(h, srl(h, 16));
    h = imul(h, set1i(static_cast<int32_t>(0x85EBCA6Bu)));
    h = ixor(h, srl(h, 13));
    h = imul(h, set1i(static_cast<int32_t>(0xC2B2AE35u)));
    h = ixor(h, srl(h, 16));
    return iand(h, set1i(0xFFFF));
  }
};

}  // namespace
}  // namespace LOWBIT_ISA
}  // namespace lowbit_cpu
