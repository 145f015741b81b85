// The AVX2 path of the one-pass CPU step (AVX2 + F16C). Compiled for AVX2 by the pragma
// below whatever flags the build uses, and called only after the CPU was checked
// (cpu_step_op.cpp); nothing from torch is included, so no shared inline function is
// compiled for AVX2 here.
#include "cpu_step_args.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

namespace lowbit_cpu {
namespace avx2 {
namespace {

struct Primitives {
  using F = __m256;
  using I = __m256i;
  using M = __m256;  // all-ones lanes where true
  static constexpr int W = 8;
  static constexpr bool kDividesByReciprocal = false;  // constant_divisor.h
  static inline F set1(float x) { return _mm256_set1_ps(x); }
  static inline I set1i(int32_t x) { return _mm256_set1_epi32(x); }
  static inline F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static inline void storef(float* p, F x) { _mm256_storeu_ps(p, x); }
  static inline F add(F a, F b) { return _mm256_add_ps(a, b); }
  static inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static inline F div(F a, F b) { return _mm256_div_ps(a, b); }
  static inline F sqrt(F a) { return _mm256_sqrt_ps(a); }
  // a * b + c, rounded once (the linear 4-bit encoder).
  static inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  // The least integer at least a (a within int32's range).
  static inline I ceil_to_int(F a) { return f2i(ceil(a)); }
  // A quotient of values by one at least their finite magnitude: NaN -> 0, clamped to [-1, 1].
  static inline F saturate_quotient(F n) { return min(max(select(eq(n, n), n, set1(0.0f)), set1(-1.0f)), set1(1.0f)); }
  static inline F max(F a, F b) { return _mm256_max_ps(a, b); }
  static inline F min(F a, F b) { return _mm256_min_ps(a, b); }
  static inline I bits(F a) { return _mm256_castps_si256(a); }
  static inline F as_float(I a) { return _mm256_castsi256_ps(a); }
  static inline F abs(F a) { return as_float(_mm256_and_si256(bits(a), set1i(0x7FFFFFFF))); }
  static inline F neg(F a) { return as_float(_mm256_xor_si256(bits(a), set1i(INT32_MIN))); }
  static inline F ceil(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC); }
  static inline M lt(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static inline M gt(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  static inline M eq(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
  static inline M ilt(I a, I b) { return as_float(_mm256_cmpgt_epi32(b, a)); }
  // Unsigned a < b: flipping both sign bits maps unsigned order onto signed order.
  static inline M ult(I a, I b) { return ilt(ixor(a, set1i(INT32_MIN)), ixor(b, set1i(INT32_MIN))); }
  static inline I srl_where(M m, I a, int n) { return iselect(m, srl(a, n), a); }
  static inline bool all(M m) { return _mm256_movemask_ps(m) == 0xFF; }
  static inline M isfinite(F a) { return ilt(_mm256_and_si256(bits(a), set1i(0x7FFFFFFF)), set1i(0x7F800000)); }
  static inline F select(M m, F a, F b) { return _mm256_blendv_ps(b, a, m); }
  static inline I iselect(M m, I a, I b) { return bits(_mm256_blendv_ps(as_float(b), as_float(a), m)); }
  static inline I f2i(F a) { return _mm256_cvttps_epi32(a); }
  static inline F i2f(I a) { return _mm256_cvtepi32_ps(a); }
  static inline F round_even(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static inline I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static inline I isub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static inline I iand(I a, I b) { return _mm256_and_si256(a, b); }
  static inline I imax(I a, I b) { return _mm256_max_epi32(a, b); }
  static inline I ior(I a, I b) { return _mm256_or_si256(a, b); }
  static inline I ixor(I a, I b) { return _mm256_xor_si256(a, b); }
  static inline I imul(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static inline I srl(I a, int n) { return _mm256_srli_epi32(a, n); }
  static inline I sra(I a, int n) { return _mm256_srai_epi32(a, n); }
  static inline I sll(I a, int n) { return _mm256_slli_epi32(a, n); }
  static inline I iadd_if(M m, I a) { return _mm256_sub_epi32(a, bits(m)); }  // true lanes are -1
  static inline I iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  // The entry at the index's low 4 bits (each permute reads the low 3, the blend bit 3).
  static inline F lookup16(const float* table, I index) {
    F low = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table), index);
    F high = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table + 8), index);
    return _mm256_blendv_ps(low, high, as_float(_mm256_slli_epi32(index, 28)));  // bit 3 -> sign
  }
  static inline F lookup8(const float* table, I index) {
    return _mm256_permutevar8x32_ps(_mm256_loadu_ps(table), index);
  }
  static inline F gather256(const float* table, I index) { return _mm256_i32gather_ps(table, index, 4); }
  static inline I gather_i32(const int32_t* table, I index) { return _mm256_i32gather_epi32(table, index, 4); }
  static inline I load_u8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static inline void store_u8(uint8_t* p, I x) {
    const I low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                         0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    I packed = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(x, low_bytes), _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static inline I load_u16(const uint16_t* p) {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline float reduce_max(F a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  static inline F load_param(const float* p, int) { return loadf(p); }
  static inline F load_param(const uint16_t* p, int dtype) {
    __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if (dtype == kFloat16) return _mm256_cvtph_ps(half);
    return as_float(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  }
  static inline __m128i narrow16(I x) {
    // Every lane holds a value below 2**16, so the saturating pack only narrows.
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(x, x), 0x08));
  }
  static inline void store16(uint16_t* p, I x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow16(x)); }
  static inline void store_half(uint16_t* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // float32 -> float16 bits (round to nearest even), one per 32-bit lane, and back.
  static inline I to_half_bits(F x) {
    return _mm256_cvtepu16_epi32(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static inline F from_half_bits(I x) { return _mm256_cvtph_ps(narrow16(x)); }
};

}  // namespace
}  // namespace avx2
}  // namespace lowbit_cpu

#define LOWBIT_ISA avx2
#include "cpu_step_vector_ops.h"
#include "cpu_step_kernel.h"
#undef LOWBIT_ISA

namespace lowbit_cpu {
FunctorTable avx2_functors() {
  return {avx2::kFunctors, static_cast<int32_t>(std::size(avx2::kFunctors))};
}
}  // namespace lowbit_cpu
#pragma GCC pop_options

#else
namespace lowbit_cpu {
FunctorTable avx2_functors() { return {nullptr, 0}; }
}  // namespace lowbit_cpu
#endif
