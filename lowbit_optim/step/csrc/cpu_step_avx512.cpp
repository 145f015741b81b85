// The AVX-512 path of the one-pass CPU step (AVX-512F only). Compiled for AVX-512 by the
// pragma below whatever flags the build uses, and called only after the CPU was checked
// (cpu_step_op.cpp); nothing from torch is included, so no shared inline function is
// compiled for AVX-512 here.
#include "cpu_step_args.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#include <immintrin.h>

namespace lowbit_cpu {
namespace avx512 {
namespace {

struct Primitives {
  using F = __m512;
  using I = __m512i;
  using M = __mmask16;
  static constexpr int W = 16;
  static constexpr bool kDividesByReciprocal = true;  // constant_divisor.h
  static inline F set1(float x) { return _mm512_set1_ps(x); }
  static inline I set1i(int32_t x) { return _mm512_set1_epi32(x); }
  static inline F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static inline void storef(float* p, F x) { _mm512_storeu_ps(p, x); }
  static inline F add(F a, F b) { return _mm512_add_ps(a, b); }
  static inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static inline F div(F a, F b) { return _mm512_div_ps(a, b); }
  static inline F sqrt(F a) { return _mm512_sqrt_ps(a); }
  // a * b + c and c - a * b, rounded once (constant_divisor.h, the linear 4-bit encoder).
  static inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static inline F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  // `value` where `estimate` is a nonzero finite number, else `estimate`: one fix-up instruction
  // classifying `estimate`, its table a response per class, four bits each from the lowest:
  // QNaN, SNaN, zero -> estimate (1); +1 -> value (0); -inf, +inf -> estimate; negative,
  // positive -> value.
  static inline F unless_special(F value, F estimate) {
    return _mm512_fixupimm_ps(value, estimate, _mm512_set1_epi32(0x00110111), 0);
  }
  // saturate_quotient(unless_special(value, estimate)) in one fix-up classifying `estimate`:
  // QNaN, SNaN -> +0 (8); zero -> estimate (1); +1 -> value (0); -inf -> -1 (9); +inf -> +1
  // (10); negative, positive -> value.
  static inline F saturate_unless_special(F value, F estimate) {
    return _mm512_fixupimm_ps(value, estimate, _mm512_set1_epi32(0x00A90188), 0);
  }
  // The least integer at least a (a within int32's range).
  static inline I ceil_to_int(F a) { return _mm512_cvt_roundps_epi32(a, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC); }
  // A quotient of values by one at least their finite magnitude: NaN -> +0, +-inf -> +-1, every
  // other value (within [-1, 1], -0 included) kept. One fix-up instruction: its table holds a
  // response per class of the value, four bits each from the lowest: QNaN, SNaN -> +0 (8);
  // zero, +1 -> the value (1); -inf -> -1 (9); +inf -> +1 (10); negative, positive -> the value.
  static inline F saturate_quotient(F n) { return _mm512_fixupimm_ps(n, n, _mm512_set1_epi32(0x11A91188), 0); }
  static inline F max(F a, F b) { return _mm512_max_ps(a, b); }
  static inline F min(F a, F b) { return _mm512_min_ps(a, b); }
  static inline I bits(F a) { return _mm512_castps_si512(a); }
  static inline F as_float(I a) { return _mm512_castsi512_ps(a); }
  static inline F abs(F a) { return _mm512_castsi512_ps(_mm512_and_si512(bits(a), set1i(0x7FFFFFFF))); }
  static inline F neg(F a) { return _mm512_castsi512_ps(_mm512_xor_si512(bits(a), set1i(INT32_MIN))); }
  static inline M lt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static inline M gt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static inline M eq(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  static inline M isfinite(F a) {
    return _mm512_cmplt_epi32_mask(_mm512_and_si512(bits(a), set1i(0x7FFFFFFF)), set1i(0x7F800000));
  }
  static inline bool all(M m) { return m == 0xFFFF; }
  static inline F select(M m, F a, F b) { return _mm512_mask_blend_ps(m, b, a); }
  static inline I iselect(M m, I a, I b) { return _mm512_mask_blend_epi32(m, b, a); }
  static inline I f2i(F a) { return _mm512_cvttps_epi32(a); }
  static inline F i2f(I a) { return _mm512_cvtepi32_ps(a); }
  static inline F round_even(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static inline I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static inline I isub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static inline I iand(I a, I b) { return _mm512_and_si512(a, b); }
  static inline I imax(I a, I b) { return _mm512_max_epi32(a, b); }
  static inline I ior(I a, I b) { return _mm512_or_si512(a, b); }
  static inline I ixor(I a, I b) { return _mm512_xor_si512(a, b); }
  static inline I imul(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static inline I srl(I a, int n) { return _mm512_srli_epi32(a, n); }
  static inline I sra(I a, int n) { return _mm512_srai_epi32(a, n); }
  static inline I sll(I a, int n) { return _mm512_slli_epi32(a, n); }
  static inline M ilt(I a, I b) { return _mm512_cmplt_epi32_mask(a, b); }
  static inline M ult(I a, I b) { return _mm512_cmplt_epu32_mask(a, b); }  // unsigned
  static inline I srl_where(M m, I a, int n) { return _mm512_mask_srli_epi32(a, m, a, n); }
  static inline I iadd_if(M m, I a) { return _mm512_mask_add_epi32(a, m, a, set1i(1)); }
  static inline I iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  // The entry at the index's low 4 bits (the permute reads no others).
  static inline F lookup16(const float* table, I index) { return _mm512_permutexvar_ps(index, _mm512_loadu_ps(table)); }
  // The 4-bit search's 8-entry lookup (cpu_step_kernel.h) for narrower paths; here lookup16
  // serves, and this only has to compile.
  static inline F lookup8(const float* table, I index) {
    return _mm512_permutexvar_ps(index, _mm512_castps256_ps512(_mm256_loadu_ps(table)));
  }
  static inline F gather256(const float* table, I index) { return _mm512_i32gather_ps(index, table, 4); }
  static inline I gather_i32(const int32_t* table, I index) { return _mm512_i32gather_epi32(index, table, 4); }
  static inline I load_u8(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline void store_u8(uint8_t* p, I x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x));
  }
  static inline float reduce_max(F a) { return _mm512_reduce_max_ps(a); }
  static inline I load_u16(const uint16_t* p) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline F load_param(const float* p, int) { return loadf(p); }
  static inline F load_param(const uint16_t* p, int dtype) {
    __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if (dtype == kFloat16) return _mm512_cvtph_ps(half);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  }
  static inline void store16(uint16_t* p, I x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(x));
  }
  static inline void store_half(uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // float32 -> float16 bits (round to nearest even), one per 32-bit lane, and back.
  static inline I to_half_bits(F x) {
    return _mm512_cvtepu16_epi32(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static inline F from_half_bits(I x) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x)); }
};

}  // namespace
}  // namespace avx512
}  // namespace lowbit_cpu

#define LOWBIT_ISA avx512
#include "cpu_step_vector_ops.h"
#include "cpu_step_kernel.h"
#undef LOWBIT_ISA

namespace lowbit_cpu {
FunctorTable avx512_functors() {
  return {avx512::kFunctors, static_cast<int32_t>(std::size(avx512::kFunctors))};
}
}  // namespace lowbit_cpu
#pragma GCC pop_options

#else
namespace lowbit_cpu {
FunctorTable avx512_functors() { return {nullptr, 0}; }
}  // namespace lowbit_cpu
#endif
