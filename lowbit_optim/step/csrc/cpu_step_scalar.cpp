// The portable path of the one-pass CPU step: one element at a time, the same operations
// as the vector paths (cpu_step_kernel.h), for CPUs without AVX2 and for block sizes the
// vector paths do not divide.
#include <cstring>

#include "cpu_step_args.h"

namespace lowbit_cpu {
namespace scalar {
namespace {

struct V {
  using F = float;
  using I = int32_t;
  using M = bool;
  static constexpr int W = 1;
  static constexpr bool kDividesByReciprocal = false;  // constant_divisor.h
  static inline F set1(float x) { return x; }
  static inline I set1i(int32_t x) { return x; }
  static inline F loadf(const float* p) { return *p; }
  static inline void storef(float* p, F x) { *p = x; }
  static inline F add(F a, F b) { return a + b; }
  static inline F sub(F a, F b) { return a - b; }
  static inline F mul(F a, F b) { return a * b; }
  static inline F div(F a, F b) { return a / b; }
  static inline F sqrt(F a) { return __builtin_sqrtf(a); }
  // a * b + c, rounded once (the linear 4-bit encoder).
  static inline F fmadd(F a, F b, F c) { return __builtin_fmaf(a, b, c); }
  // The least integer at least a (a within int32's range).
  static inline I ceil_to_int(F a) { return f2i(ceil(a)); }
  // A quotient of values by one at least their finite magnitude: NaN -> 0, clamped to [-1, 1].
  static inline F saturate_quotient(F n) { return min(max(select(eq(n, n), n, set1(0.0f)), set1(-1.0f)), set1(1.0f)); }
  // The vector instructions' rule (the second operand unless the first is larger or
  // smaller): no NaN reaches them, so this equals torch's maximum, minimum and clamp.
  static inline F max(F a, F b) { return a > b ? a : b; }
  static inline F min(F a, F b) { return a < b ? a : b; }
  static inline I bits(F a) { I b; std::memcpy(&b, &a, 4); return b; }
  static inline F as_float(I b) { F a; std::memcpy(&a, &b, 4); return a; }
  static inline F abs(F a) { return as_float(bits(a) & 0x7FFFFFFF); }
  static inline F neg(F a) { return as_float(bits(a) ^ INT32_MIN); }
  static inline F ceil(F a) { return __builtin_ceilf(a); }
  static inline M lt(F a, F b) { return a < b; }
  static inline M gt(F a, F b) { return a > b; }
  static inline M eq(F a, F b) { return a == b; }
  static inline M ilt(I a, I b) { return a < b; }
  static inline M ult(I a, I b) { return static_cast<uint32_t>(a) < static_cast<uint32_t>(b); }
  static inline I srl_where(M m, I a, int n) { return m ? srl(a, n) : a; }
  static inline bool all(M m) { return m; }
  static inline M isfinite(F a) { return (bits(a) & 0x7FFFFFFF) < 0x7F800000; }
  static inline F select(M m, F a, F b) { return m ? a : b; }
  static inline I iselect(M m, I a, I b) { return m ? a : b; }
  static inline I f2i(F a) { return static_cast<I>(a); }
  static inline F i2f(I a) { return static_cast<F>(a); }
  static inline F round_even(F a) { return __builtin_roundevenf(a); }
  static inline I iadd(I a, I b) { return static_cast<I>(static_cast<uint32_t>(a) + static_cast<uint32_t>(b)); }
  static inline I isub(I a, I b) { return static_cast<I>(static_cast<uint32_t>(a) - static_cast<uint32_t>(b)); }
  static inline I iand(I a, I b) { return a & b; }
  static inline I imax(I a, I b) { return a > b ? a : b; }
  static inline I ior(I a, I b) { return a | b; }
  static inline I ixor(I a, I b) { return a ^ b; }
  static inline I imul(I a, I b) { return static_cast<I>(static_cast<uint32_t>(a) * static_cast<uint32_t>(b)); }
  static inline I srl(I a, int n) { return static_cast<I>(static_cast<uint32_t>(a) >> n); }
  static inline I sra(I a, int n) { return a >> n; }  // arithmetic: gcc's (and C++20's) signed shift
  static inline I sll(I a, int n) { return static_cast<I>(static_cast<uint32_t>(a) << n); }
  static inline I iadd_if(M m, I a) { return m ? a + 1 : a; }
  static inline I iota() { return 0; }
  static inline F lookup16(const float* table, I index) { return table[index & 15]; }  // its low 4 bits
  static inline F lookup8(const float* table, I index) { return table[index]; }
  static inline F gather256(const float* table, I index) { return table[index]; }
  static inline I gather_i32(const int32_t* table, I index) { return table[index]; }
  static inline I load_u8(const uint8_t* p) { return *p; }
  static inline void store_u8(uint8_t* p, I x) { *p = static_cast<uint8_t>(x); }
  static inline I load_u16(const uint16_t* p) { return *p; }
  static inline void store16(uint16_t* p, I x) { *p = static_cast<uint16_t>(x); }
  static inline float reduce_max(F a) { return a; }
  static inline F half_to_float(uint16_t h) {
    // IEEE binary16 -> binary32, exact.
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
    uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    if (exponent == 0x1F) return as_float(static_cast<I>(sign | 0x7F800000 | (mantissa << 13)));
    if (exponent == 0) {
      const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // 2**-24, exact
      return sign ? -magnitude : magnitude;
    }
    return as_float(static_cast<I>(sign | ((exponent + 112) << 23) | (mantissa << 13)));
  }
  static inline uint16_t float_to_half(F f) {
    // IEEE round to nearest even (the F16C instruction's result; torch's c10::Half equal):
    // the scale trick of FP16 (Maratyszcza), which lets float32 addition do the rounding.
    const uint32_t w = static_cast<uint32_t>(bits(f));
    const uint32_t shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    float base = (abs(f) * 0x1.0p+112f) * 0x1.0p-110f;  // 2**112, 2**-110
    base = as_float(static_cast<I>((bias >> 1) + 0x07800000u)) + base;
    const uint32_t base_bits = static_cast<uint32_t>(bits(base));
    const uint32_t nonsign = ((base_bits >> 13) & 0x7C00u) + (base_bits & 0x0FFFu);
    return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
  }
  static inline I to_half_bits(F x) { return float_to_half(x); }
  static inline F from_half_bits(I x) { return half_to_float(static_cast<uint16_t>(x)); }
  static inline F load_param(const float* p, int) { return *p; }
  static inline F load_param(const uint16_t* p, int dtype) {
    return dtype == kFloat16 ? half_to_float(*p) : as_float(static_cast<I>(static_cast<uint32_t>(*p) << 16));
  }
  static inline uint16_t bf16_nearest(F x) {
    if (x != x) return 0x7FC0;
    const uint32_t b = static_cast<uint32_t>(bits(x));
    return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
  }
  static inline void store_param(float* p, F x, int) { *p = x; }
  static inline void store_param(uint16_t* p, F x, int dtype) {
    *p = dtype == kFloat16 ? float_to_half(x) : bf16_nearest(x);
  }
  static inline void store_bf16_stochastic(uint16_t* p, F x, I noise) {
    *p = isfinite(x) ? static_cast<uint16_t>(static_cast<uint32_t>(iadd(bits(x), noise)) >> 16) : bf16_nearest(x);
  }
  static inline I hash_noise(I index, uint32_t key) {
    uint32_t h = static_cast<uint32_t>(index) * 0x9E3779B1u + key;
    h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; h ^= h >> 16;
    return static_cast<I>(h & 0xFFFFu);
  }
};

}  // namespace
}  // namespace scalar
}  // namespace lowbit_cpu

#define LOWBIT_ISA scalar
#include "cpu_step_kernel.h"
#undef LOWBIT_ISA

namespace lowbit_cpu {
FunctorTable scalar_functors() {
  return {scalar::kFunctors, static_cast<int32_t>(std::size(scalar::kFunctors))};
}
}  // namespace lowbit_cpu
