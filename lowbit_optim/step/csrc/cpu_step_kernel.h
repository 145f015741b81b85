// The one-pass block step, written once over a vector type V: cpu_step_avx512.cpp,
// cpu_step_avx2.cpp (through cpu_step_vector_ops.h) and cpu_step_scalar.cpp each define V
// and include this file once.
//
// Per block: load parameter, gradient, codes and scales -> decode -> the rule's update -> the
// block's absmax -> encode -> store. The updated moments wait in a block-sized buffer on the
// stack (L1) between the update and the encode, because the encode needs the whole block's
// absmax first; nothing of the parameter's size is ever written besides the outputs.
//
// The update rule is a functor (rules/adamw.h, rules/lion.h, rules/ademamix.h, rules/muon.h: the names of the
// host values it reads, in its order, kConstants; its float32 constants, formed once per call
// from those values; its number of moments kMoments; and `update` on vectors: parameter,
// gradient and decoded moments -> new parameter and moments), named by one row of kFunctors;
// the block step is instantiated once per rule (AdamW: with and without amsgrad) and parameter
// width. What every rule shares lives here, not in the functors
// (as lowbit_optim/step/rule_step.py::apply_rule): maximize negates the gradient, an element
// whose gradient is NaN or +-inf keeps its parameter and moments, bfloat16/float16 rounding,
// stochastic rounding and master weights.
//
// Every float operation is the one the reference (the rule's update, formats/codecs.py and
// the shared policies, eager or compiled) performs, in the same order, in float32, and the file is built
// with -ffp-contract=off, so no multiply-add is fused: parameters and codes come out bit for
// bit as the reference's, on every path (vector width changes nothing, every operation is
// elementwise and the absmax is exact in any order).
//
// With master weights (a bfloat16 or float16 parameter and an int8 or int16 correction) the
// update reads and writes the float32 master weight instead of the parameter, with the
// encodings of lowbit_optim/step/master_weights.py (read_master, split_master) done in the
// same pass: bfloat16's integer bit split, float16's scaled residual.
#include <cstdint>
#include <iterator>
#include <type_traits>

// The block step's per-vector functions are forced inline: GCC's inliner gave up on
// Block::update for bfloat16/float16 parameters on every path and, once the update had a
// guarded and an unguarded form, for some float32 ones, and called it once per vector with its
// vectors passed through memory (AdamW8bit on the AVX2 path: 1.24x the time; forced, bfloat16
// AdamW4bit and AdamW8bit took 0.86x and 0.85x the time of the build without it).
#define LOWBIT_BLOCK_INLINE inline __attribute__((always_inline))

#include "constant_divisor.h"
#include "cpu_step_args.h"
#include "factored_statistics.h"
#include "rules/ademamix.h"
#include "rules/adamw.h"
#include "rules/adamw_factored.h"
#include "rules/lion.h"
#include "rules/muon.h"

namespace lowbit_cpu {
namespace LOWBIT_ISA {
namespace {

using F = typename V::F;
using I = typename V::I;
using M = typename V::M;
constexpr int W = V::W;
constexpr int kMaxBlock = 2048;
// The parameter and gradient are prefetched this far ahead of the block being stepped: without
// it a quarter of the 4-bit step's time went to waiting for their loads (profiled; the block's
// arithmetic is too long for the out-of-order window to reach the next loads early). 1-16 KB
// measured alike.
constexpr int64_t kPrefetchBytes = 2048;
constexpr int64_t kLineBytes = 64;

// The cell tables' layout (lowbit_optim/formats/cell_tables.py, checked against it by
// cpu_kernel.py): binades 2**-23 .. 2**-1 in 2**7 cells each and 1.0 itself; a float's bits
// shifted right by 23 - 7 index its cell, counted from the floor's; a signed table's positive
// half starts 2**15 cells in.
constexpr float kCellFloor = 0x1p-23f;
constexpr int kCellShift = 23 - 7;
constexpr int32_t kCellFirst = (127 - 23) << 7;
constexpr int32_t kCellPositiveStart = (1 << 15) - kCellFirst;
// Shifting out the sign, the 8 exponent bits and the 7 index bits leaves the position in the cell.
constexpr int kCellPositionShift = 1 + 8 + 7;

// The float8 encoder's anchor (BlockEncoder<kE4M3>): float32's exponent field, e4m3fn's least
// exponent (-6) in it, and the anchor 2**20 times the binade's start (e4m3fn keeps 3 of
// float32's 23 mantissa bits, so 20 are dropped). The anchor's bits shifted right by 20 are
// 8 (127 + e + 20); the code of a normal is 8 (e + 7) + steps - 8 and of a subnormal
// (e = -6) steps: both are steps + (anchor >> 20) - 8 (127 - 6 + 20), the offset 1128.
constexpr int32_t kFloat32ExponentMask = 0x7F800000;
constexpr int kE4M3DroppedBits = 23 - 3;
constexpr int32_t kE4M3LeastExponent = (127 - 6) << 23;
constexpr int32_t kE4M3AnchorShift = kE4M3DroppedBits << 23;
constexpr int32_t kE4M3AnchorCodeOffset = (127 - 6 + kE4M3DroppedBits) << 3;

// An encoder's constants (cpu_step_args.h's EncoderConstants) as its block loop reads them, built
// once per range of blocks. Built for every block, the search's 48 midpoints were written one
// float at a time and then read as vectors, which cannot be forwarded from those stores: ~4% of
// AdamW4bit's profile. This and Block's constructor made its step 0.90-0.93x as long (AVX-512;
// AVX2 0.94x, portable 0.98x; alternated in one process).
struct EncoderTables {
  explicit EncoderTables(const EncoderConstants& c)
      : zero_free(c.zero_free != 0), first_edge(c.first_edge), cell_sign(c.cell_sign), cells(c.cells),
        middle(c.midpoints[7]) {
    // searched[level][code]: the midpoint the search compares with at that level (halves 4, 2,
    // 1) from the code found so far, midpoints[code + half - 1]; a lookup by the code itself.
    for (int level = 0; level < 3; ++level)
      for (int code = 0; code < 16; ++code) {
        const int index = code + (4 >> level) - 1;
        searched[level][code] = index < 16 ? c.midpoints[index] : __builtin_inff();
      }
    // Paths narrower than 16 lanes: at `level` the code found so far is a multiple of
    // 8 >> level, so it can look up at most 8 midpoints (2, 4, 8): one permute of 8 lanes by
    // code >> (3 - level) instead of a 16-entry lookup's two permutes and a blend (AVX2,
    // AdamW4bit: 0.74-0.90x the time, alternated in one process).
    // (Entries past a level's count are never read; the mask keeps their index in range.)
    if constexpr (W < 16)
      for (int level = 0; level < 3; ++level)
        for (int k = 0; k < 8; ++k) compact[level][k] = searched[level][(k << (3 - level)) & 15];
  }

  bool zero_free;
  float first_edge;
  int32_t cell_sign;
  const int32_t* cells;
  float middle;  // the search's first midpoint, the 8th
  alignas(64) float searched[3][16];
  alignas(32) float compact[3][8];
};

// An encoder of one kind (cpu_step_args.h's Encoder) with a copy of its tables: a local of the
// block's encode, which no store of codes can change, so the loop over a block keeps them in
// registers and has no branch on the kind (the profile showed the kind read and branched on,
// and the midpoints reloaded, for every vector: the codes' stores may alias the arguments).
template <int32_t kEncoder>
struct BlockEncoder : EncoderTables {
  explicit BlockEncoder(const EncoderTables& tables) : EncoderTables(tables) {}

  // Encode normalised values in [-1, 1] (NaN already 0) exactly as the reference codecs do: the
  // code is each lane's low byte (the cell encoder leaves bits above it, which no store keeps).
  inline I operator()(F n) const {
    if (zero_free) n = V::select(V::lt(n, V::set1(first_edge)), V::set1(0.0f), n);
    if constexpr (kEncoder == kSmallTable) {
      // The reference counts the midpoints n exceeds; they ascend strictly, so a 4-step
      // binary search over them (code = midpoints exceeded so far) finds the same count.
      I code = V::iselect(V::gt(n, V::set1(middle)), V::set1i(8), V::set1i(0));
      for (int level = 0; level < 3; ++level) {
        F midpoint;
        if constexpr (W >= 16) {
          midpoint = V::lookup16(searched[level], code);
        } else {
          midpoint = V::lookup8(compact[level], V::srl(code, 3 - level));
        }
        code = V::iselect(V::gt(n, midpoint), V::iadd(code, V::set1i(4 >> level)), code);
      }
      return code;
    } else if constexpr (kEncoder == kLinear16) {
      // ceil(16 n - 1.5) clamped to [0, 15]: 16 n is exact, so one fused operation rounds as
      // the reference's two do; n <= 1 keeps it below 15, and clamping below 0 before the
      // ceiling gives what clamping after it gives.
      const F t = V::fmadd(n, V::set1(16.0f), V::set1(-1.5f));
      return V::ceil_to_int(V::max(t, V::set1(0.0f)));
    } else if constexpr (kEncoder == kE4M3) {
      // The bits of 448 n rounded to e4m3fn (codecs.Float8Codec's integer arithmetic, by one
      // float addition here): adding the anchor 2**(e + 20), e the exponent of |y| but at
      // least e4m3fn's least, -6, leaves float32's last bit worth e4m3fn's step in that binade,
      // so the hardware's addition rounds |y| to nearest even there, normals and subnormals
      // alike. The sum's bits above the anchor's count those steps (8 + mantissa for a normal,
      // the mantissa for a subnormal), and the anchor's exponent bits add e's codes below.
      const F y = V::mul(n, V::set1(448.0f));
      // A zero-free format's n is +0 or past its first edge (the select above): no sign to move.
      const I magnitude = zero_free ? V::bits(y) : V::iand(V::bits(y), V::set1i(0x7FFFFFFF));
      const I binade = V::imax(V::iand(magnitude, V::set1i(kFloat32ExponentMask)), V::set1i(kE4M3LeastExponent));
      const I anchor = V::iadd(binade, V::set1i(kE4M3AnchorShift));
      const I steps = V::isub(V::bits(V::add(V::as_float(magnitude), V::as_float(anchor))), anchor);
      const I below = V::isub(V::srl(anchor, kE4M3DroppedBits), V::set1i(kE4M3AnchorCodeOffset));
      const I code = V::iadd(steps, below);
      return zero_free ? code : V::ior(code, V::iand(V::srl(V::bits(y), 24), V::set1i(0x80)));
    } else {
      static_assert(kEncoder == kCells);
      // The code from the value's top bits (lowbit_optim/formats/cell_tables.py has the
      // argument: each codec is monotone on either sign, so a cell of 2**-7 of a binade holds
      // at most one bin edge, whose position the cell's word records with the codes on either
      // side). Integer operations only, so the code is the codec's exactly. n is normalised
      // (no NaN, within [-1, 1]); the clamp to the floor puts 0 and values below every edge
      // on the first cell; no clamp above is needed, normalize leaves |n| <= 1.
      F magnitude = cell_sign == kCellsClamped ? n : V::abs(n);
      magnitude = V::max(magnitude, V::set1(kCellFloor));
      I bits = V::bits(magnitude);
      I cell;
      if (cell_sign == kCellsSigned) {
        // n's sign bit on the magnitude becomes the index's bit 15: the negative half sits
        // 2**15 cells below the positive one.
        I with_sign = V::ior(bits, V::iand(V::bits(n), V::set1i(INT32_MIN)));
        cell = V::iadd(V::sra(with_sign, kCellShift), V::set1i(kCellPositiveStart));
      } else {
        cell = V::isub(V::srl(bits, kCellShift), V::set1i(kCellFirst));
      }
      I word = V::gather_i32(cells, cell);
      // The position in the cell above the word's two code bytes: position > edge (unsigned)
      // picks the code past the edge, the word's second byte. The code is the low byte; the
      // bits above it are left (two operations fewer per 16 elements with the clamp above,
      // AdamW8bit 0.98x the time): V::store_u8 keeps only the low byte, and a 4-bit code
      // packed into a nibble pair leaves them above the byte too.
      I position = V::sll(bits, kCellPositionShift);
      return V::srl_where(V::ult(word, position), word, 8);
    }
  }
};

// fn(encoder) with the BlockEncoder of `kind` over `tables` (the operator accepts no other kind).
template <typename Fn>
inline void with_encoder(int32_t kind, const EncoderTables& tables, Fn&& fn) {
  switch (kind) {
    case kSmallTable: fn(BlockEncoder<kSmallTable>(tables)); break;
    case kLinear16: fn(BlockEncoder<kLinear16>(tables)); break;
    case kE4M3: fn(BlockEncoder<kE4M3>(tables)); break;
    default: fn(BlockEncoder<kCells>(tables)); break;
  }
}

// QuantFormat._normalize: an exact division (by inf for a zero scale), NaN -> 0, clamp. The
// scale is at least every finite |x|, so a finite quotient is within [-1, 1] already (division
// is monotone and 1 is a float): only infinities need the clamp (V::saturate_quotient).
inline F normalize(F x, const ConstantDivisor& divisor) { return divisor.divide_saturated(x); }

inline F finite_magnitude(F x) { return V::select(V::isfinite(x), V::abs(x), V::set1(0.0f)); }

// The largest finite magnitude of `count` values: a block's scale, where its running maximum
// (which counts infinities) came out infinite.
inline float finite_absmax(const float* values, int64_t count) {
  F absmax = V::set1(0.0f);
  for (int64_t j = 0; j < count; j += W) absmax = V::max(absmax, finite_magnitude(V::loadf(values + j)));
  return V::reduce_max(absmax);
}

// Whether all `count` gradients are finite: g * 0 + sum is NaN from the first NaN or infinite g
// on, and +0 while every g is finite. One multiply-add per vector, against the finiteness mask
// (two operations) and the selects of gradient, parameter and each moment (four for AdamW) per
// vector that a block with a non-finite gradient needs (Block::update<true>).
template <typename T>
inline bool gradients_finite(const T* grad, int64_t count, int32_t dtype) {
  F sum = V::set1(0.0f);
  for (int64_t j = 0; j < count; j += W) sum = V::fmadd(V::load_param(grad + j, dtype), V::set1(0.0f), sum);
  return V::all(V::eq(sum, sum));
}

inline uint32_t mix32(uint64_t x) {
  x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

// The master weight's bit layout (master_weights.py): a bfloat16 value is the upper half of
// a float32's bits; a 24-bit master weight also drops the lowest 8 of them.
constexpr int kBFloat16Shift = 16;
constexpr int kMaster24Dropped = 8;
constexpr int32_t kCanonicalNan = 0x7FC00000;
// float16's scaled residual (master_weights.py): the correction counts units of 2**(E - 24)
// (int16) or 2**(E - 17) (int8), E the parameter's exponent (field - 15; -14 for zero and
// subnormals, field 0, which take the smallest normal field's unit). The unit is built as
// float32 bits: its exponent field is float16's field plus kUnitFieldOffset.
constexpr int kFloat16MantissaBits = 10;
constexpr int32_t kFloat16ExponentField = 0x1F;
constexpr int32_t kFloat16MinNormalField = 1;
constexpr int kFloat32MantissaBits = 23;
constexpr int32_t kUnitFieldOffset16 = 127 - 15 - 24;
constexpr int32_t kUnitFieldOffset8 = 127 - 15 - 17;
constexpr int32_t kCanonicalHalfNan = 0x7E00;

// The float32 unit of a float16 parameter's correction, from the parameter's bits.
LOWBIT_BLOCK_INLINE F float16_unit(I half_bits, bool master24) {
  I field = V::iand(V::srl(half_bits, kFloat16MantissaBits), V::set1i(kFloat16ExponentField));
  field = V::iadd_if(V::ilt(field, V::set1i(kFloat16MinNormalField)), field);  // 0 -> 1
  const int32_t offset = master24 ? kUnitFieldOffset8 : kUnitFieldOffset16;
  return V::as_float(V::sll(V::iadd(field, V::set1i(offset)), kFloat32MantissaBits));
}

// read_master of a float16 parameter: the parameter minus the negated correction times its
// unit (subtracted, so that a -0.0 parameter with a zero correction stays -0.0; exact).
LOWBIT_BLOCK_INLINE F read_float16_master(I half_bits, I correction_steps, bool master24) {
  F negated = V::i2f(V::isub(V::set1i(0), correction_steps));
  return V::sub(V::from_half_bits(half_bits), V::mul(negated, float16_unit(half_bits, master24)));
}

// master_weights._float16_residual: `value` rounded to float16 (nearest even, NaN one quiet
// NaN), returned as bits, and its residual in units rounded to nearest even into `steps`
// (0 where the parameter is not finite: past float16's range, or NaN).
LOWBIT_BLOCK_INLINE I float16_residual(F value, bool master24, I& steps) {
  I half = V::to_half_bits(value);
  F base = V::from_half_bits(half);
  F residual = V::round_even(V::div(V::sub(value, base), float16_unit(half, master24)));
  steps = V::f2i(V::select(V::isfinite(base), residual, V::set1(0.0f)));
  return V::iselect(V::eq(value, value), half, V::set1i(kCanonicalHalfNan));
}

// Whether a rule's update also reads the position of the elements it updates, their block and
// offset in it (the factored second moment, rules/adamw_factored.h: kReadsPosition).
template <typename Rule, typename = void>
struct ReadsPosition : std::false_type {};
template <typename Rule>
struct ReadsPosition<Rule, std::void_t<decltype(Rule::kReadsPosition)>> : std::true_type {};

template <typename Rule, typename T>
struct Block {
  const StepArgs& a;
  // A copy, local to the block's step: the compiler then knows no store of the block's floats
  // can change the rule's constants, and keeps them in registers (measured on 8-bit AdamW: 4-7%
  // faster than reading them through a reference).
  const Rule rule;
  // The call's flags, copied for the same reason: the vector stores may alias anything, so a
  // flag read through `a` is read again after every store, and branched on per vector.
  const int32_t param_dtype, master_weight_bits;
  const bool maximize, stochastic_round, nibble;
  const float* const* tables;  // the moments' decode tables (a.tables)
  T* param;
  const T* grad;
  void* correction;  // the block's master weight correction, or null
  int64_t block;
  float scale[kMaxMoments];
  F absmax[kMaxMoments];
  float* moments[kMaxMoments];  // the updated moments of the block, before encoding
  alignas(64) float scaled_table[kMaxMoments][16];  // a nibble format's decode table times the scale
  uint32_t noise_key;

  // Only the rule's moments' scale and running maximum are set: value-initialising the whole
  // object (an aggregate's {}) zeroed ~400 bytes per block, ~3% of AdamW4bit's profile.
  Block(const StepArgs& a, const Rule& rule, T* param, const T* grad, void* correction, int64_t block,
        float* buffers)
      : a(a), rule(rule), param_dtype(a.param_dtype), master_weight_bits(a.master_weight_bits),
        maximize(a.maximize != 0), stochastic_round(a.stochastic_round != 0), nibble(a.kind == kNibble4),
        tables(a.tables), param(param), grad(grad), correction(correction), block(block),
        moments{buffers, buffers + kMaxBlock, buffers + 2 * kMaxBlock},
        noise_key(a.stochastic_round ? mix32(a.seed ^ (static_cast<uint64_t>(block) * 0x9E3779B97F4A7C15ULL)) : 0u) {
    for (int s = 0; s < Rule::kMoments; ++s) {
      scale[s] = a.scales[s][block];
      absmax[s] = V::set1(0.0f);
      if (nibble)
        for (int i = 0; i < 16; i += W) V::storef(scaled_table[s] + i, V::mul(V::loadf(tables[s] + i), V::set1(scale[s])));
    }
  }

  // Update the W elements starting at `offset` of the block, their codes given. kGuarded: the
  // block has a NaN or infinite gradient, and such an element keeps its parameter and moments;
  // a block whose gradients are all finite (gradients_finite) needs none of the masks.
  template <bool kGuarded>
  LOWBIT_BLOCK_INLINE void update(int64_t offset, const I codes[kMaxMoments]) {
    constexpr int count = Rule::kMoments;
    F decoded[kMaxMoments], updated[kMaxMoments];
    for (int s = 0; s < count; ++s) decoded[s] = decode(s, codes[s]);
    F p = load_weight(offset);
    F g = V::load_param(grad + offset, param_dtype);
    if (maximize) g = V::neg(g);
    M finite{};
    if constexpr (kGuarded) {
      finite = V::isfinite(g);
      g = V::select(finite, g, V::set1(0.0f));
    }
    F new_param;
    if constexpr (ReadsPosition<Rule>::value) {
      new_param = rule.update(p, g, decoded, updated, block, offset);
    } else {
      new_param = rule.update(p, g, decoded, updated);
    }
    if constexpr (kGuarded) new_param = V::select(finite, new_param, p);
    store_weight(offset, new_param);
    for (int s = 0; s < count; ++s) {
      F kept = updated[s];
      if constexpr (kGuarded) kept = V::select(finite, updated[s], decoded[s]);
      V::storef(moments[s] + offset, kept);
      // max returns its second operand where either is NaN, so a NaN never enters the running
      // maximum; an infinity does, and the block's scale is then found again without it
      // (finite_absmax): rare, and two operations fewer per vector than filtering here.
      absmax[s] = V::max(V::abs(kept), absmax[s]);
    }
  }

  // The correction of the W elements at `offset`, sign-extended to int32.
  LOWBIT_BLOCK_INLINE I load_correction(int64_t offset) const {
    return master_weight_bits == 24
        ? V::sra(V::sll(V::load_u8(static_cast<const uint8_t*>(correction) + offset), 24), 24)
        : V::sra(V::sll(V::load_u16(static_cast<const uint16_t*>(correction) + offset), 16), 16);
  }

  // The parameter the update reads: the float32 master weight where there is a correction
  // (read_master). bfloat16: its bits above the remainder, in int32.
  LOWBIT_BLOCK_INLINE F load_weight(int64_t offset) const {
    if constexpr (sizeof(T) == 2) {
      if (master_weight_bits) {
        const bool master24 = master_weight_bits == 24;
        I correction_steps = load_correction(offset);
        if (param_dtype == kFloat16)
          return read_float16_master(V::load_u16(param + offset), correction_steps, master24);
        I upper = V::sll(V::load_u16(param + offset), kBFloat16Shift);
        I remainder = master24 ? V::sll(correction_steps, kMaster24Dropped) : correction_steps;
        return V::as_float(V::iadd(upper, remainder));
      }
    }
    return V::load_param(param + offset, param_dtype);
  }

  // Store the updated parameter: split into parameter and correction (split_master), or
  // stochastically rounded, or rounded. bfloat16: NaN made one quiet NaN, a 24-bit master
  // rounded half up to a multiple of 2**8, the upper half rounded half up, the remainder the
  // correction. float16: the residual split, then the exact split of the master weight that
  // pair holds (the parameter is that master weight rounded to nearest even).
  LOWBIT_BLOCK_INLINE void store_weight(int64_t offset, F value) {
    if constexpr (sizeof(T) == 2) {
      if (master_weight_bits) {
        const bool master24 = master_weight_bits == 24;
        if (param_dtype == kFloat16) {
          I correction_steps;
          I half = float16_residual(value, master24, correction_steps);
          half = float16_residual(read_float16_master(half, correction_steps, master24), master24, correction_steps);
          V::store16(param + offset, half);
          store_correction(offset, correction_steps);
          return;
        }
        I bits = V::iselect(V::eq(value, value), V::bits(value), V::set1i(kCanonicalNan));
        if (master24)
          bits = V::iand(V::iadd(bits, V::set1i(1 << (kMaster24Dropped - 1))), V::set1i(-(1 << kMaster24Dropped)));
        I upper = V::sra(V::iadd(bits, V::set1i(1 << (kBFloat16Shift - 1))), kBFloat16Shift);
        I remainder = V::isub(bits, V::sll(upper, kBFloat16Shift));
        V::store16(param + offset, V::iand(upper, V::set1i(0xFFFF)));
        store_correction(offset, master24 ? V::sra(remainder, kMaster24Dropped) : remainder);
        return;
      }
      if (stochastic_round && param_dtype == kBFloat16) {
        I index = V::iadd(V::iota(), V::set1i(static_cast<int32_t>(offset)));
        V::store_bf16_stochastic(param + offset, value, V::hash_noise(index, noise_key));
        return;
      }
    }
    V::store_param(param + offset, value, param_dtype);
  }

  // Store W corrections (int32 lanes within the correction dtype's range) at `offset`.
  LOWBIT_BLOCK_INLINE void store_correction(int64_t offset, I correction_steps) {
    if (master_weight_bits == 24) {
      V::store_u8(static_cast<uint8_t*>(correction) + offset, correction_steps);
    } else {
      V::store16(static_cast<uint16_t*>(correction) + offset, V::iand(correction_steps, V::set1i(0xFFFF)));
    }
  }

  // A nibble format's value times the block's scale is looked up from its 16 products, formed
  // once per block (the same float32 products, one multiplication per vector fewer).
  LOWBIT_BLOCK_INLINE F decode(int moment, I codes) const {
    if (nibble) return V::lookup16(scaled_table[moment], codes);
    return V::mul(V::gather256(tables[moment], codes), V::set1(scale[moment]));
  }

};

// The block's parameter, gradient and correction (if any) as its step reads them.
template <typename T>
struct BlockData {
  T* param;
  const T* grad;
  void* correction;
  int64_t block;
};

template <typename Rule, typename T>
void step_block(const StepArgs& a, const Rule& rule, const EncoderTables* encoders, const BlockData<T>& data,
                float* buffers) {
  const int64_t size = a.block_size;
  const int64_t block = data.block;
  constexpr int slots = Rule::kMoments;
  Block<Rule, T> b(a, rule, data.param, data.grad, data.correction, block, buffers);
  const uint8_t* block_codes[kMaxMoments];  // locals, not re-read through `a` after each store
  for (int s = 0; s < slots; ++s) block_codes[s] = a.codes[s] + block * (b.nibble ? size / 2 : size);
  const auto update_block = [&](auto guarded) {
    constexpr bool kGuarded = decltype(guarded)::value;
    I codes[kMaxMoments];
    if (b.nibble) {
      const int64_t half = size / 2;
      for (int64_t j = 0; j < half; j += W) {
        I packed[kMaxMoments];
        for (int s = 0; s < slots; ++s) packed[s] = V::load_u8(block_codes[s] + j);
        // The low nibble needs no mask: its decode (V::lookup16) reads the index's low 4 bits.
        b.template update<kGuarded>(j, packed);
        for (int s = 0; s < slots; ++s) codes[s] = V::srl(packed[s], 4);
        b.template update<kGuarded>(half + j, codes);
      }
    } else {
      for (int64_t j = 0; j < size; j += W) {
        for (int s = 0; s < slots; ++s) codes[s] = V::load_u8(block_codes[s] + j);
        b.template update<kGuarded>(j, codes);
      }
    }
  };
  if (gradients_finite(data.grad, size, a.param_dtype)) {
    update_block(std::false_type{});
  } else {
    update_block(std::true_type{});
  }
  for (int s = 0; s < slots; ++s) {
    float scale = V::reduce_max(b.absmax[s]);
    if (scale == __builtin_inff()) scale = finite_absmax(b.moments[s], size);
    a.scales[s][block] = scale;
    // A zero scale divides by inf: finite values become 0, as the reference's select gives.
    const ConstantDivisor divisor(scale > 0.0f ? scale : __builtin_inff());
    const float* values = b.moments[s];
    with_encoder(a.encoders[s].encoder, encoders[s], [&](const auto& encode) {
      if (a.kind == kNibble4) {
        const int64_t half = size / 2;
        uint8_t* codes_out = a.codes[s] + block * half;
        for (int64_t j = 0; j < half; j += W) {
          I low = encode(normalize(V::loadf(values + j), divisor));
          I high = encode(normalize(V::loadf(values + half + j), divisor));
          V::store_u8(codes_out + j, V::ior(low, V::sll(high, 4)));
        }
      } else {
        uint8_t* codes_out = a.codes[s] + block * size;
        for (int64_t j = 0; j < size; j += W) V::store_u8(codes_out + j, encode(normalize(V::loadf(values + j), divisor)));
      }
    });
  }
}

template <typename Rule, typename T>
void step_range(const StepArgs& a, const Rule& rule, int64_t first_block, int64_t end_block) {
  static_assert(kMaxMoments == 3, "one EncoderTables per moment below");
  const EncoderTables encoders[kMaxMoments] = {EncoderTables(a.encoders[0]), EncoderTables(a.encoders[1]),
                                               EncoderTables(a.encoders[2])};
  alignas(64) float buffers[3 * kMaxBlock];
  T* param = static_cast<T*>(a.param);
  const T* grad = static_cast<const T*>(a.grad);
  uint8_t* correction = static_cast<uint8_t*>(a.correction);
  const int64_t correction_bytes = a.master_weight_bits == 24 ? 1 : 2;
  const int64_t size = a.block_size;
  const int64_t whole_blocks = a.numel / size;
  for (int64_t block = first_block; block < end_block; ++block) {
    uint8_t* block_correction = correction ? correction + block * size * correction_bytes : nullptr;
    const int64_t ahead = block * size + kPrefetchBytes / static_cast<int64_t>(sizeof(T));
    if (ahead + size <= a.numel) {
      for (int64_t i = 0; i < size; i += kLineBytes / static_cast<int64_t>(sizeof(T))) {
        __builtin_prefetch(param + ahead + i, 1);
        __builtin_prefetch(grad + ahead + i, 0);
      }
    }
    if (block < whole_blocks) {
      step_block(a, rule, encoders, BlockData<T>{param + block * size, grad + block * size, block_correction, block},
                 buffers);
      continue;
    }
    // The partial last block, zero-padded as step.chunks.for_each_block_chunk pads it: the
    // padding's moments stay exactly 0 and never set the block's scale.
    alignas(64) T param_block[kMaxBlock];
    alignas(64) T grad_block[kMaxBlock];
    alignas(64) uint8_t correction_block[2 * kMaxBlock];
    const int64_t tail = a.numel - whole_blocks * size;
    for (int64_t i = 0; i < size; ++i) {
      param_block[i] = i < tail ? param[block * size + i] : T{};
      grad_block[i] = i < tail ? grad[block * size + i] : T{};
    }
    if (correction)
      for (int64_t i = 0; i < size * correction_bytes; ++i)
        correction_block[i] = i < tail * correction_bytes ? block_correction[i] : 0;
    step_block(a, rule, encoders, BlockData<T>{param_block, grad_block, correction ? correction_block : nullptr, block},
               buffers);
    for (int64_t i = 0; i < tail; ++i) param[block * size + i] = param_block[i];
    if (correction)
      for (int64_t i = 0; i < tail * correction_bytes; ++i) block_correction[i] = correction_block[i];
  }
}

template <typename Rule>
void run_rule(const StepArgs& a, int64_t first_block, int64_t end_block) {
  const Rule rule(a);
  switch (a.param_dtype) {
    case kFloat32: step_range<Rule, float>(a, rule, first_block, end_block); break;
    default: step_range<Rule, uint16_t>(a, rule, first_block, end_block); break;
  }
}

void run_adamw(const StepArgs& a, int64_t first_block, int64_t end_block) {
  if (a.moment_count == 3) {
    run_rule<AdamWRule<true>>(a, first_block, end_block);
  } else {
    run_rule<AdamWRule<false>>(a, first_block, end_block);
  }
}

template <typename Rule>
constexpr Functor functor(const char* name, int32_t min_moments, int32_t max_moments, RangeFn run) {
  static_assert(std::size(Rule::kConstants) <= kMaxRuleValues, "StepArgs::rule_values holds kMaxRuleValues");
  return {name, Rule::kConstants, static_cast<int32_t>(std::size(Rule::kConstants)), min_moments, max_moments, run};
}

// The functor table (cpu_step_args.h's Functor): a rule's functor is one row here and its
// #include above; the operator finds a row by its name.
constexpr Functor kFunctors[] = {
    functor<AdamWMath>("adamw", 2, 3, &run_adamw),  // amsgrad: a third moment
    functor<LionRule>("lion", 1, 1, &run_rule<LionRule>),
    functor<AdEMAMixRule>("ademamix", 3, 3, &run_rule<AdEMAMixRule>),
    functor<MuonRule>("muon", 1, 1, &run_rule<MuonRule>),
    functor<AdamWFactoredRule>("adamw_factored", 1, 1, &run_rule<AdamWFactoredRule>),
    // Tiles of rows, not blocks; its host values are FactoredArgs', set by its operator.
    {"factored_statistics", nullptr, 0, 0, 0, &run_statistics},
};

}  // namespace
}  // namespace LOWBIT_ISA
}  // namespace lowbit_cpu

#undef LOWBIT_BLOCK_INLINE
