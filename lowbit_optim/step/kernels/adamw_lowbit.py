"""Fused low-bit AdamW in Triton: dequantize -> AdamW -> requantize, one pass over memory.

Per element, with ``m, v`` (and ``v_max`` under amsgrad) decoded from their codes,
``m = table_m[code_m] * scale_m`` and so on, and ``g`` the gradient (negated if maximize)::

    finite  = isfinite(g)
    m'      = m + (1 - beta1) * (g - m)
    v'      = v * beta2 + ((1 - beta2) * g) * g
    v_max'  = max(v_max, v')                        (amsgrad; the denominator uses it)
    denom   = sqrt(v') * (1 / sqrt(1 - beta2**t)) + eps
    ratio   = clamp(m' / denom, -max_ratio, max_ratio)   (Adam's own bound: adam_ratio_bound)
    p'      = p * (1 - lr * weight_decay) - lr / (1 - beta1**t) * ratio
    (p', m', v', v_max') = finite ? (p', m', v', v_max') : (p, m, v, v_max)

then each moment is requantized per block: ``scale = max |x|`` over the block's finite
values, ``code = nearest(x * (1 / scale))``. With master weights (the ``MASTER_WEIGHT_BITS``
variants) ``p`` is the float32 master weight read from the bfloat16 or float16 parameter and
its correction, and ``p'`` is split back into both (``master_weight_split``, exactly as
``lowbit_optim.step.master_weights`` reads and splits). The oracle is
``lowbit_optim.step.quantized.quantized_adamw_step`` (tests/test_triton.py). The moments
``m', v', v_max'`` and the block scales are computed operation for operation as there
(multiply-add contraction is off: ``enable_fp_fusion=False``), so scales match bit for bit.
Three places trade IEEE-exact forms for cheap ones (the IEEE forms cost ~45 SASS
instructions per element, measured with benchmarks/kernel_stats.py), with these bounds
(``RN`` is float32 round-to-nearest):

* Normalisation: one reciprocal per block, ``r = 1 / scale`` (``div.full.f32``: <= 2 ulp on
  the GPU, correctly rounded under ``TRITON_INTERPRET=1``), then ``x = v * r`` (a block whose
  scale is below 2**-125, where ``1 / scale`` could overflow, first multiplies ``v`` and
  ``scale`` by 2**64, which is exact). So ``|x - v / scale| <= (2**-22 + 2**-24) |v / scale|``
  and ``|x - RN(v / scale)| <= 2**-21 |x|``: a code may differ from the reference's only
  when the normalised value is within ``2**-21 |x|`` of a bin edge.
* Encoders: exact, given the normalised value. Encoding is a comparison, and every encoder
  returns ``codec.encode(x)`` of the reference codec (``lowbit_optim.formats.codecs``) for
  every float32 ``x`` in [-1, 1], ties at bin edges included (and for NaN, +-inf and values
  past +-1, the code of the reference's NaN -> 0 and clamp to [-1, 1]). So a code differs from
  the reference's only where the normalisation above does, within ``2**-21 |x|`` of a bin
  edge, and then by one step of the map.

  - Table maps (the 8-bit and 4-bit dynamic maps, float8 e4m3fn, their zero-free
    variants): a cell table indexed by the top bits of ``x``'s float32 pattern, then one
    comparison (``_encode_cells``). The magnitude is clamped to [2**-23, 1] (max and min:
    exact, and NaN lands on the floor); its exponent and top 7 mantissa bits pick one of 2**7
    equal cells of its binade; the cell's int32 word holds the code of the cell's first
    float, the code past the cell's one bin edge and where in the cell that edge is. Each
    reference codec is a monotone function of ``x`` on either sign (each float32 operation in
    it rounds monotonically), so it is fixed by the floats where its code changes; the words
    are built from ``codec.encode`` itself by bisection over each cell's bit patterns
    (``top_bits.cell_words``, which refuses a format with two edges in one cell or one below
    the floor), and the kernel forms the bits and compares them with integer operations
    only, so no rounding separates its code from the codec's. The numerical argument in full
    is in ``lowbit_optim/step/kernels/top_bits.py``; tests/test_triton_encoders.py runs this
    encoder against ``codec.encode`` on every float32 within 300 ulps of every table value
    and midpoint, at every cell boundary, on subnormals, NaN, +-inf, +-0 and a sample of all
    of [-1, 1]. The table is read with ``ld.global.nc`` (per element, L1-resident: 11.5 KB per
    unsigned format, 23 KB read of 143 KB for a signed one); 9-11 SASS instructions per value
    against ~38 for the binary search over 255 midpoints it replaces (~16 over 15 for 4-bit).
  - The linear map ``(k + 1) / 16`` encodes as ``clamp(ceil(v * (16 r) - 1.5), 0, 15)`` with
    one FMA: for ``r = 1`` that is ``LinearNonzeroCodec`` exactly (``16 x - 1.5`` is exact
    wherever the ceiling can change), otherwise a single rounding of a value whose error the
    normalisation bound covers; it decodes as ``fma(k, 1/16, 1/16)``, exactly the table's
    value.

  Every map but the linear one decodes with ``tl.gather`` from its table (shared memory).
* The update: ``sqrt`` is ``sqrt.approx.f32`` (relative error <= 2**-22; a subnormal ``v'``
  may flush to 0, which moves ``denom`` by less than 2**-63 / sqrt(1 - beta2**t)),
  ``1 / sqrt(1 - beta2**t)`` is formed on the host and ``+ eps`` is one FMA, and
  ``m' / denom`` is ``div.approx.ftz.f32`` (<= 2 ulp for ``denom`` in [2**-126, 2**126],
  which holds for ``eps >= 2**-126``: ``denom <= sqrt(FLT_MAX) / sqrt(1 - beta2**t)``; a
  subnormal ``m'`` flushes to 0, an error below 2**-126 / eps in the quotient). The quotient
  ``q`` is then within ``2**-20`` relative of the reference's, and ``p' = fma(-step, q, p *
  decay)``, so ``|p'_kernel - p'_reference| <= 2**-20 |lr / (1 - beta1**t) * q| + 1 ulp`` of
  the parameter dtype. Under the interpreter (numpy: every operation IEEE, the division
  exact) only the host reciprocal and the FMAs differ: ``2**-22`` relative.

Layout: a program takes ``ROWS`` consecutive blocks of one parameter and works on the low and
high halves of each block, which is exactly the 4-bit packing (byte ``k`` holds element ``k``
in its low nibble and element ``k + block_size / 2`` in its high nibble). Which parameter a
program serves, and where that parameter's tensors are, comes from the multi-tensor layout
(``lowbit_optim.step.kernels.layout``): one launch covers every parameter of a kind whose tensors
are 16-element aligned and whose size is a multiple of 16, with ``tl.multiple_of`` hints so
that parameters, gradients and codes move with 128-bit loads and stores; the others go to a
second launch of the unaligned variant, so a misaligned tensor slows only itself. An aligned
parameter of odd size sends only its last, partial block there (``layout.split_tails``).
"""

import contextlib
import math

import torch
import triton
import triton.language as tl

from lowbit_optim.formats.catalog import QuantFormat
from lowbit_optim.step import master_weights
from lowbit_optim.step import math as math_spec
from lowbit_optim.step.kernels import layout as layouts
from lowbit_optim.step.kernels import master_weight_split, tables, top_bits
from lowbit_optim.step.kernels.tables import codec_kind, device_tables

# Elements per program: 2048 with 4 warps is 16 elements per thread (four 16-byte loads of
# float32), which keeps the ~10 live float32 values per element in registers.
GPU_TILE_ELEMENTS = 2048
# Register cap (ptxas maxnreg) for the aligned launch without amsgrad, the common case: 96 lets
# five 128-thread programs share an SM (65536 registers) and costs no spill there
# (benchmarks/kernel_stats.py). Amsgrad and unaligned launches would spill under it and go
# uncapped.
MAX_REGISTERS = 96
# The interpreter runs programs one after another in Python; bigger tiles mean fewer of them.
INTERPRETER_TILE_ELEMENTS = 16384

_LINEAR = tl.constexpr(tables.LINEAR)
_CELLS_CLAMPED = tl.constexpr(tables.CELLS_CLAMPED)
_CELLS_ABS = tl.constexpr(tables.CELLS_ABS)
_CELLS_SIGNED = tl.constexpr(tables.CELLS_SIGNED)
_CELLS_SIGNED_ZERO = tl.constexpr(tables.CELLS_SIGNED_ZERO)
# The cell tables' layout (lowbit_optim.step.kernels.top_bits).
_CELL_FLOOR = tl.constexpr(2.0**top_bits.FLOOR_BINADE)
_CELL_SHIFT = tl.constexpr(top_bits.MANTISSA_BITS - top_bits.INDEX_BITS)
_CELL_FIRST = tl.constexpr((127 + top_bits.FLOOR_BINADE) << top_bits.INDEX_BITS)
_CELL_POSITION_SHIFT = tl.constexpr(top_bits.INDEX_BITS + 9)
_CELL_POSITIVE_START = tl.constexpr(top_bits.SIGNED_POSITIVE_START - _CELL_FIRST)
_BFLOAT16_DROPPED_BITS = tl.constexpr(math_spec.BFLOAT16_DROPPED_BITS)
_BFLOAT16_KEPT_MASK = tl.constexpr(math_spec.BFLOAT16_KEPT_MASK)
# Added with the lowest kept bit before truncating, it rounds to nearest even.
_BFLOAT16_ROUND_HALF = tl.constexpr((1 << (math_spec.BFLOAT16_DROPPED_BITS - 1)) - 1)
# One 32-bit hash gives two elements their noise: its low and its high 16 bits.
_NOISE_MASK = tl.constexpr((1 << math_spec.BFLOAT16_DROPPED_BITS) - 1)
_ALIGNMENT_ELEMENTS = tl.constexpr(layouts.ALIGNMENT_ELEMENTS)
# The layout table's columns (lowbit_optim.step.kernels.layout).
_PARAM = tl.constexpr(layouts.PARAM)
_GRAD = tl.constexpr(layouts.GRAD)
_EXP_AVG_CODES = tl.constexpr(layouts.EXP_AVG_CODES)
_EXP_AVG_SCALES = tl.constexpr(layouts.EXP_AVG_SCALES)
_EXP_AVG_SQ_CODES = tl.constexpr(layouts.EXP_AVG_SQ_CODES)
_EXP_AVG_SQ_SCALES = tl.constexpr(layouts.EXP_AVG_SQ_SCALES)
_MAX_CODES = tl.constexpr(layouts.MAX_CODES)
_MAX_SCALES = tl.constexpr(layouts.MAX_SCALES)
_NUMEL = tl.constexpr(layouts.NUMEL)
_FIRST_PROGRAM = tl.constexpr(layouts.FIRST_PROGRAM)
_WEIGHT_CORRECTION = tl.constexpr(layouts.WEIGHT_CORRECTION)
# Below this a block scale's reciprocal could overflow float32; such blocks are scaled by 2**64.
_TINY_SCALE = tl.constexpr(2.0**-125)
_TINY_FACTOR = tl.constexpr(2.0**64)


# --- device functions ---------------------------------------------------------------------
# Only builtins and functions of this module (and of master_weight_split, imported with it):
# triton.language's own @jit helpers (tl.max, tl.zeros, tl.randint) are interpreter functions
# only if TRITON_INTERPRET was set when Triton was first imported, while these follow the
# setting when this module is imported.
@triton.jit
def _is_finite(x):
    return tl.abs(x) < float("inf")  # False for NaN too: one comparison


@triton.jit
def _row_max(x):
    # tl.max's own combine function: the interpreter recognises it and reduces with numpy.
    return tl.reduce(x, 1, tl.standard._elementwise_max)


@triton.jit
def _random_bits32(seed, index):
    """32 uniform random bits per index: the murmur3 finaliser of a seeded counter.

    ``index`` is int64 and both of its halves enter the hash, so indices 2**32 apart in a
    launch (groups can be that large) do not share their noise."""
    high = (index >> 32).to(tl.uint32)
    x = index.to(tl.uint32) * 0x9E3779B1 + (seed.to(tl.uint32) ^ (high * 0x85EBCA77))
    x ^= x >> 16
    x *= 0x85EBCA6B
    x ^= x >> 13
    x *= 0xC2B2AE35
    x ^= x >> 16
    return x


@triton.jit
def _random_bits16(seed, index):
    """16 uniform random bits per index (the high half of ``_random_bits32``)."""
    return (_random_bits32(seed, index) >> 16).to(tl.int32)


@triton.jit
def _lookup(values, index, SIZE: tl.constexpr):
    """``values[index]`` for a 3-D ``index`` and a 1-D ``values`` of ``SIZE`` entries held in
    registers (``tl.gather`` works on equal ranks; the reshapes keep the element order)."""
    flat = tl.reshape(index, [index.shape[0] * index.shape[1] * index.shape[2]])
    return tl.reshape(tl.gather(values, flat, 0), [index.shape[0], index.shape[1], index.shape[2]])


@triton.jit
def _divide(numerator, denominator, INTERPRETED: tl.constexpr):
    """``div.approx.ftz.f32`` (``MUFU.RCP`` and a multiply; <= 2 ulp for denominators in
    [2**-126, 2**126], subnormal numerators and results flushed to 0). Triton's own
    ``fdiv(approx=True)`` keeps subnormal support, which costs four more instructions. The
    interpreter has no inline PTX: there it divides exactly (numpy)."""
    if INTERPRETED:
        return numerator / denominator
    else:
        return tl.inline_asm_elementwise("div.approx.ftz.f32 $0, $1, $2;", "=r,r,r",
                                         [numerator, denominator], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _decode(codes, table, BITS: tl.constexpr, CODEC: tl.constexpr):
    if CODEC == _LINEAR:
        # k / 2**bits + 1 / 2**bits in one FMA: exactly (k + 1) / 2**bits, the table's value.
        return tl.fma(codes.to(tl.float32), 1.0 / (1 << BITS), 1.0 / (1 << BITS))
    else:
        return _lookup(table, codes, 1 << BITS)


@triton.jit
def _load_moment(codes_ptr, scales_ptr, table, rows, cols, row_mask,
                 BLOCK_SIZE: tl.constexpr, BITS: tl.constexpr, CODEC: tl.constexpr):
    """Decode ``ROWS`` blocks: float32 (low half, high half), each ``(ROWS, BLOCK_SIZE // 2)``."""
    mask = row_mask[:, None]
    scale = tl.load(scales_ptr + rows, mask=row_mask, other=0.0)[:, None]
    if BITS == 8:
        index = rows[:, None] * BLOCK_SIZE + cols[None, :]
        low = tl.load(codes_ptr + index, mask=mask, other=0).to(tl.int32)
        high = tl.load(codes_ptr + index + BLOCK_SIZE // 2, mask=mask, other=0).to(tl.int32)
    else:
        packed = tl.load(codes_ptr + rows[:, None] * (BLOCK_SIZE // 2) + cols[None, :], mask=mask,
                         other=0).to(tl.int32)
        low = packed & 0x0F
        high = packed >> 4
    # Both halves in one tensor: one gather (one staging of the table) for both.
    values = _decode(tl.join(low, high), table, BITS, CODEC) * scale[:, :, None]
    return tl.split(values)


@triton.jit
def _load_cell(table_ptr, index, INTERPRETED: tl.constexpr):
    """``table_ptr[index]`` (int32) for a table read by scattered indices: ``ld.global.nc``
    (the read-only data path, cached in L1). As a ``tl.load`` the compiler gives the scattered
    addresses a layout of their own and moves every operand into it and back through shared
    memory (measured: 22 spills and +13 SASS instructions per element). The interpreter has
    no inline PTX."""
    if INTERPRETED:
        return tl.load(table_ptr + index)
    else:
        base = table_ptr.to(tl.int64, bitcast=True)
        return tl.inline_asm_elementwise(
            "{ .reg .u64 address; mad.wide.s32 address, $1, 4, $2; ld.global.nc.b32 $0, [address]; }",
            "=r,r,l", [index, base], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _encode_cells(normalized, cells_ptr, CODEC: tl.constexpr, INTERPRETED: tl.constexpr):
    """``codec.encode(normalized)`` of a table format, exactly, from its cell table
    (``top_bits``, where the argument is): the magnitude clamped to [floor, 1] (max and min
    drop NaN: it lands on the floor, the code of 0), its top bits index a cell, and the
    magnitude's position in the cell compared with the cell's edge picks one of the cell's two
    codes. 9 SASS instructions per value (10 signed, 11 with a signed zero). Only the low
    byte of the result is the code."""
    if CODEC == _CELLS_CLAMPED:
        magnitude = normalized  # negative values take the floor's code, as they encode as 0
    else:
        magnitude = tl.abs(normalized)
    magnitude = tl.minimum(tl.maximum(magnitude, _CELL_FLOOR), 1.0)
    bits = magnitude.to(tl.int32, bitcast=True)
    if CODEC == _CELLS_SIGNED or CODEC == _CELLS_SIGNED_ZERO:
        if CODEC == _CELLS_SIGNED_ZERO:
            # -0.0 has a code of its own and NaN must take +0.0's: min(x, inf) turns NaN into
            # inf and keeps every other sign.
            normalized = tl.minimum(normalized, float("inf"))
        # x's sign on the clamped magnitude: the sign bit becomes the cell index's bit 15,
        # which puts the negative half of the table 2**15 cells below the positive one.
        bits_with_sign = bits | (normalized.to(tl.int32, bitcast=True) & -0x80000000)
        cell = (bits_with_sign >> _CELL_SHIFT) + _CELL_POSITIVE_START
    else:
        cell = (bits >> _CELL_SHIFT) - _CELL_FIRST
    word = _load_cell(cells_ptr, cell, INTERPRETED)
    # The sign, exponent and index bits shifted out: the position in the cell, above the
    # word's two code bytes, so one unsigned comparison tests position > edge.
    position = (bits << _CELL_POSITION_SHIFT).to(tl.uint32, bitcast=True)
    return tl.where(position > word.to(tl.uint32, bitcast=True), word >> 8, word)


@triton.jit
def _encode(values, reciprocal, factor, encoder_ptr, BITS: tl.constexpr, CODEC: tl.constexpr,
            INTERPRETED: tl.constexpr):
    """Nearest code of ``values / scale`` given per-row ``reciprocal = 1 / (scale * factor)``;
    ``encoder_ptr``: the format's encoder table (``tables.device_tables``)."""
    # Values beyond +-1 (inf, or 1 + 1 ulp from the reciprocal) take the code of +-1, and NaN,
    # which arises only as inf * 0 (an overflowed moment in a block whose finite values are
    # all 0), the code of 0, as the reference's normalisation gives them: the linear encoder's
    # clamp and the cell tables' clamp do that by themselves.
    if CODEC == _LINEAR:
        # Midpoints (k + 1.5) / 2**bits: the count below x is ceil(x * 2**bits - 1.5), clamped;
        # one FMA with the per-row 2**bits / scale rounds once where x * 2**bits - 1.5 would
        # round twice (the bound covers both).
        levels: tl.constexpr = 1 << BITS
        code = tl.math.ceil(tl.fma(values * factor, reciprocal * levels, -1.5))
        code = tl.minimum(tl.maximum(code, 0.0), levels - 1.0).to(tl.int32)
    else:
        code = _encode_cells((values * factor) * reciprocal, encoder_ptr, CODEC, INTERPRETED)
    return code


@triton.jit
def _store_moment(low, high, codes_ptr, scales_ptr, encoder_ptr, rows, cols, row_mask,
                  BLOCK_SIZE: tl.constexpr, BITS: tl.constexpr, CODEC: tl.constexpr,
                  INTERPRETED: tl.constexpr):
    """Requantize ``ROWS`` blocks given as (low half, high half); write codes and scales."""
    low_abs = tl.where(_is_finite(low), tl.abs(low), 0.0)
    high_abs = tl.where(_is_finite(high), tl.abs(high), 0.0)
    scale = tl.maximum(_row_max(low_abs), _row_max(high_abs))
    tl.store(scales_ptr + rows, scale, mask=row_mask)
    tiny = scale < _TINY_SCALE
    factor = tl.where(tiny, _TINY_FACTOR, 1.0)
    # One (approximate, <= 2 ulp) division per block; 0 for an all-zero block, whose values
    # then encode as 0.
    reciprocal = tl.where(scale > 0, 1.0 / tl.where(scale > 0, scale * factor, 1.0), 0.0)
    both = tl.join(low, high)
    code = _encode(both, reciprocal[:, None, None], factor[:, None, None], encoder_ptr, BITS, CODEC,
                   INTERPRETED)
    low_code, high_code = tl.split(code)
    mask = row_mask[:, None]
    if BITS == 8:
        index = rows[:, None] * BLOCK_SIZE + cols[None, :]
        tl.store(codes_ptr + index, low_code.to(tl.uint8), mask=mask)
        tl.store(codes_ptr + index + BLOCK_SIZE // 2, high_code.to(tl.uint8), mask=mask)
    else:
        index = rows[:, None] * (BLOCK_SIZE // 2) + cols[None, :]
        # Only the cell encoder's low byte is its code: masked, both nibbles pack in one LOP3.
        tl.store(codes_ptr + index, ((low_code & 0x0F) | ((high_code << 4) & 0xF0)).to(tl.uint8), mask=mask)


@triton.jit
def _to_param_dtype(values, noise, DTYPE: tl.constexpr, STOCHASTIC_ROUND: tl.constexpr,
                    INTERPRETED: tl.constexpr):
    """float32 -> the parameter's dtype; bfloat16 optionally by stochastic rounding.

    ``INTERPRETED`` rounds to nearest even with integer operations: the interpreter's
    float32 -> bfloat16 cast truncates; the result is then exact in
    bfloat16, so the final cast cannot round again.
    """
    if DTYPE == tl.bfloat16:
        if STOCHASTIC_ROUND or INTERPRETED:
            bits = values.to(tl.int32, bitcast=True)
            kept_lowest = (bits >> _BFLOAT16_DROPPED_BITS) & 1
            rounded = (bits + (_BFLOAT16_ROUND_HALF + kept_lowest)) & _BFLOAT16_KEPT_MASK
            rounded = tl.where(values == values, rounded, bits | 0x400000)  # NaN stays (quiet) NaN
            if STOCHASTIC_ROUND:
                # math.round_to_bfloat16_stochastic: 16 random bits below the mantissa.
                rounded = tl.where(_is_finite(values), (bits + noise) & _BFLOAT16_KEPT_MASK, rounded)
            values = rounded.to(tl.float32, bitcast=True)
    return values.to(DTYPE)


@triton.jit
def _load_param(param_ptr, correction_ptr, index, mask, MASTER_WEIGHT_BITS: tl.constexpr):
    """The parameter as float32: its master weight where it keeps a correction."""
    if MASTER_WEIGHT_BITS:
        param = tl.load(param_ptr + index, mask=mask, other=0.0)
        correction = tl.load(correction_ptr + index, mask=mask, other=0)
        return master_weight_split.read_master(param, correction, MASTER_WEIGHT_BITS)
    else:
        return tl.load(param_ptr + index, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _update_half(param_ptr, grad_ptr, correction_ptr, half, moments, hyper, AMSGRAD: tl.constexpr,
                 MAXIMIZE: tl.constexpr, L2_DECAY: tl.constexpr, STOCHASTIC_ROUND: tl.constexpr,
                 MASTER_WEIGHT_BITS: tl.constexpr, INTERPRETED: tl.constexpr):
    """``math.adamw_update`` on one half-tile; stores the parameter, returns the moments.
    ``half``: the half-tile's ``(index, mask, noise)``; ``moments``: its ``(exp_avg,
    exp_avg_sq, max_exp_avg_sq)``; ``hyper``: the step's scalars, the same for both halves
    (the kernel's ``step_size`` to ``max_ratio``, in that order).
    ``MASTER_WEIGHT_BITS`` (24 or 32; 0 for none): the update reads and writes the master
    weight of a bfloat16 or float16 parameter and its correction at ``correction_ptr``, as the
    compiled step does (``quantized.quantized_adamw_step``).
    ``L2_DECAY`` (torch.optim.Adam): ``decay`` is the weight decay, added to the gradient as
    ``decay * param``, and the parameter is not scaled. One scalar serves both meanings: a
    separate one cost the 8-bit float32 variant two spills under the register cap (sm_90)."""
    index, mask, noise = half
    exp_avg, exp_avg_sq, max_exp_avg_sq = moments
    step_size, decay, one_minus_beta1, beta2, one_minus_beta2, inv_bias_correction2_sqrt, eps, max_ratio = (
        hyper)
    grad = tl.load(grad_ptr + index, mask=mask, other=0.0).to(tl.float32)
    if MAXIMIZE:
        grad = -grad
    # A non-finite gradient makes the new values NaN or inf; the selects below put back the
    # old ones, so the gradient itself needs no cleaning.
    finite = _is_finite(grad)
    if L2_DECAY:
        param = _load_param(param_ptr, correction_ptr, index, mask, MASTER_WEIGHT_BITS)
        grad = grad + decay * param
    new_exp_avg = exp_avg + one_minus_beta1 * (grad - exp_avg)
    # torch addcmul order, ((1 - beta2) * g) * g: g * g first overflows float32 sooner.
    new_exp_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * grad * grad
    second_moment = new_exp_avg_sq
    new_max = max_exp_avg_sq
    if AMSGRAD:
        new_max = tl.maximum(max_exp_avg_sq, new_exp_avg_sq, propagate_nan=tl.PropagateNan.ALL)
        second_moment = new_max
        new_max = tl.where(finite, new_max, max_exp_avg_sq)
    # Approximate sqrt and division, and two explicit FMAs: the bound is in the module docstring.
    denom = tl.fma(tl.sqrt(second_moment), inv_bias_correction2_sqrt, eps)
    # Loaded where it is needed: under the register cap, loading it with the gradient cost
    # 8-bit float32 a spill on sm_90.
    if not L2_DECAY:
        param = _load_param(param_ptr, correction_ptr, index, mask, MASTER_WEIGHT_BITS)
    decayed = param if L2_DECAY else param * decay
    # Clamped at Adam's own bound, as math.parameter_update clamps (NaN kept as torch's
    # clamp keeps it).
    # (The enum is spelled out in each call: a local holding it becomes a tensor when compiled.)
    ratio = _divide(new_exp_avg, denom, INTERPRETED)
    ratio = tl.maximum(ratio, -max_ratio, propagate_nan=tl.PropagateNan.ALL)
    ratio = tl.minimum(ratio, max_ratio, propagate_nan=tl.PropagateNan.ALL)
    new_param = tl.fma(-step_size, ratio, decayed)
    new_param = tl.where(finite, new_param, param)
    if MASTER_WEIGHT_BITS:
        new_param, new_correction = master_weight_split.split_master(new_param, param_ptr.dtype.element_ty,
                                                                     MASTER_WEIGHT_BITS)
        tl.store(correction_ptr + index, new_correction, mask=mask)
    else:
        new_param = _to_param_dtype(new_param, noise, param_ptr.dtype.element_ty,
                                    STOCHASTIC_ROUND, INTERPRETED)
    tl.store(param_ptr + index, new_param, mask=mask)
    return (tl.where(finite, new_exp_avg, exp_avg), tl.where(finite, new_exp_avg_sq, exp_avg_sq),
            new_max)


@triton.jit
def _offset(layout_row, column: tl.constexpr, ALIGNED: tl.constexpr, RELOAD: tl.constexpr = False):
    """A tensor's offset from its list's base; ``RELOAD`` reads it again (a volatile load,
    which the compiler keeps) instead of holding the first read in registers."""
    offset = tl.load(layout_row + column, volatile=RELOAD)
    if ALIGNED:
        # Every tensor of an aligned launch starts a multiple of 16 elements from its list's
        # base (checked on the host), so the loads below vectorise.
        offset = tl.multiple_of(offset, _ALIGNMENT_ELEMENTS)
    return offset


@triton.jit(do_not_specialize=["seed"])
def _adamw_lowbit_kernel(
    param_base, grad_base, exp_avg_codes_base, exp_avg_scales_base, exp_avg_sq_codes_base,
    exp_avg_sq_scales_base, max_codes_base, max_scales_base, weight_correction_base, layout_ptr,
    program_param_ptr,
    exp_avg_table_ptr, exp_avg_encoder_ptr, exp_avg_sq_table_ptr, exp_avg_sq_encoder_ptr,
    step_size, decay, one_minus_beta1, beta2, one_minus_beta2, inv_bias_correction2_sqrt, eps, max_ratio,
    seed, BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, LAYOUT_COLUMNS: tl.constexpr,
    EXP_AVG_BITS: tl.constexpr, EXP_AVG_CODEC: tl.constexpr,
    EXP_AVG_SQ_BITS: tl.constexpr, EXP_AVG_SQ_CODEC: tl.constexpr,
    AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, L2_DECAY: tl.constexpr, STOCHASTIC_ROUND: tl.constexpr,
    MASTER_WEIGHT_BITS: tl.constexpr, INTERPRETED: tl.constexpr, ALIGNED: tl.constexpr,
):
    pid = tl.program_id(0)
    param_index = tl.load(program_param_ptr + pid)
    layout_row = layout_ptr + param_index * LAYOUT_COLUMNS
    numel = tl.load(layout_row + _NUMEL)
    if ALIGNED:
        numel = tl.multiple_of(numel, _ALIGNMENT_ELEMENTS)  # the host sends only such sizes
    first_program = tl.load(layout_row + _FIRST_PROGRAM)
    # Offsets within one parameter's tensors fit in 32 bits (the host checks numel < 2**31);
    # the tensor bases from the layout stay 64-bit, as a group can exceed 2**31 elements.
    numel32 = numel.to(tl.int32)
    rows = (pid - first_program.to(tl.int32)) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < (numel32 + BLOCK_SIZE - 1) // BLOCK_SIZE
    cols = tl.arange(0, BLOCK_SIZE // 2)
    low_index = rows[:, None] * BLOCK_SIZE + cols[None, :]
    high_index = low_index + BLOCK_SIZE // 2
    noise_low = low_index
    noise_high = low_index
    if STOCHASTIC_ROUND:
        # One 32-bit hash per (low, high) element pair: 16 random bits for each.
        tile_start = pid.to(tl.int64) * (ROWS * BLOCK_SIZE)
        pair_index = tile_start + tl.arange(0, ROWS)[:, None] * BLOCK_SIZE + cols[None, :]
        noise = _random_bits32(seed, pair_index)
        noise_low = (noise & _NOISE_MASK).to(tl.int32)
        noise_high = (noise >> _BFLOAT16_DROPPED_BITS).to(tl.int32)

    param_ptr = param_base + _offset(layout_row, _PARAM, ALIGNED)
    grad_ptr = grad_base + _offset(layout_row, _GRAD, ALIGNED)
    correction_ptr = weight_correction_base  # None without master weights
    if MASTER_WEIGHT_BITS:
        correction_ptr = weight_correction_base + _offset(layout_row, _WEIGHT_CORRECTION, ALIGNED)
    exp_avg_codes = exp_avg_codes_base + _offset(layout_row, _EXP_AVG_CODES, ALIGNED)
    exp_avg_scales = exp_avg_scales_base + _offset(layout_row, _EXP_AVG_SCALES, ALIGNED)
    exp_avg_sq_codes = exp_avg_sq_codes_base + _offset(layout_row, _EXP_AVG_SQ_CODES, ALIGNED)
    exp_avg_sq_scales = exp_avg_sq_scales_base + _offset(layout_row, _EXP_AVG_SQ_SCALES, ALIGNED)

    # The maps' tables, once per program, held in registers (gathers read them from shared
    # memory); the linear map needs none.
    exp_avg_table = tl.load(exp_avg_table_ptr + tl.arange(0, 1 << EXP_AVG_BITS))
    exp_avg_sq_table = tl.load(exp_avg_sq_table_ptr + tl.arange(0, 1 << EXP_AVG_SQ_BITS))

    m_low, m_high = _load_moment(exp_avg_codes, exp_avg_scales, exp_avg_table, rows, cols, row_mask,
                                 BLOCK_SIZE, EXP_AVG_BITS, EXP_AVG_CODEC)
    v_low, v_high = _load_moment(exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_table, rows, cols,
                                 row_mask, BLOCK_SIZE, EXP_AVG_SQ_BITS, EXP_AVG_SQ_CODEC)
    max_low = v_low
    max_high = v_high
    if AMSGRAD:
        max_codes = max_codes_base + _offset(layout_row, _MAX_CODES, ALIGNED)
        max_scales = max_scales_base + _offset(layout_row, _MAX_SCALES, ALIGNED)
        max_low, max_high = _load_moment(max_codes, max_scales, exp_avg_sq_table, rows, cols, row_mask,
                                         BLOCK_SIZE, EXP_AVG_SQ_BITS, EXP_AVG_SQ_CODEC)

    hyper = (step_size, decay, one_minus_beta1, beta2, one_minus_beta2, inv_bias_correction2_sqrt, eps,
             max_ratio)
    low = (low_index, row_mask[:, None] & (low_index < numel32), noise_low)
    high = (high_index, row_mask[:, None] & (high_index < numel32), noise_high)
    m_low, v_low, max_low = _update_half(param_ptr, grad_ptr, correction_ptr, low, (m_low, v_low, max_low),
                                         hyper, AMSGRAD, MAXIMIZE, L2_DECAY, STOCHASTIC_ROUND,
                                         MASTER_WEIGHT_BITS, INTERPRETED)
    m_high, v_high, max_high = _update_half(param_ptr, grad_ptr, correction_ptr, high,
                                            (m_high, v_high, max_high), hyper, AMSGRAD, MAXIMIZE, L2_DECAY,
                                            STOCHASTIC_ROUND, MASTER_WEIGHT_BITS, INTERPRETED)

    # The codes' and scales' addresses again, for the stores: held from the loads, they were
    # spilled under the register cap while the cell encoders' lookups are in flight (sm_90).
    exp_avg_codes = exp_avg_codes_base + _offset(layout_row, _EXP_AVG_CODES, ALIGNED, True)
    exp_avg_scales = exp_avg_scales_base + _offset(layout_row, _EXP_AVG_SCALES, ALIGNED, True)
    exp_avg_sq_codes = exp_avg_sq_codes_base + _offset(layout_row, _EXP_AVG_SQ_CODES, ALIGNED, True)
    exp_avg_sq_scales = exp_avg_sq_scales_base + _offset(layout_row, _EXP_AVG_SQ_SCALES, ALIGNED, True)
    _store_moment(m_low, m_high, exp_avg_codes, exp_avg_scales, exp_avg_encoder_ptr, rows, cols, row_mask,
                  BLOCK_SIZE, EXP_AVG_BITS, EXP_AVG_CODEC, INTERPRETED)
    _store_moment(v_low, v_high, exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_encoder_ptr, rows, cols,
                  row_mask, BLOCK_SIZE, EXP_AVG_SQ_BITS, EXP_AVG_SQ_CODEC, INTERPRETED)
    if AMSGRAD:
        _store_moment(max_low, max_high, max_codes, max_scales, exp_avg_sq_encoder_ptr, rows, cols,
                      row_mask, BLOCK_SIZE, EXP_AVG_SQ_BITS, EXP_AVG_SQ_CODEC, INTERPRETED)


# --- host side ----------------------------------------------------------------------------
# Decided when the kernel was defined: Triton reads TRITON_INTERPRET in its @jit decorator.
_INTERPRETED = type(_adamw_lowbit_kernel).__name__ == "InterpretedFunction"


def is_interpreted() -> bool:
    """Whether the kernel was built for the Triton interpreter (``TRITON_INTERPRET=1`` when
    this module was imported): the only way it runs on CPU tensors."""
    return _INTERPRETED


def host_scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 step: float, *, decoupled_weight_decay: bool = True) -> dict[str, float | bool]:
    """The kernel's scalar arguments, formed in float64 as ``adamw_update`` forms them from
    its 0-d tensors (Triton rounds each to float32, as torch rounds a 0-d double operand).
    Decoupled (AdamW) weight decay scales the parameter by ``decay``; with L2 (Adam) weight
    decay, ``decay`` is the weight decay, added to the gradient times the parameter, and
    ``l2`` tells the kernel which (its ``L2_DECAY``)."""
    l2 = not decoupled_weight_decay and weight_decay != 0
    return dict(
        step_size=lr / (1 - beta1**step),
        decay=weight_decay if l2 else 1 - lr * weight_decay,
        l2=l2,
        one_minus_beta1=1 - beta1,
        beta2=beta2,
        one_minus_beta2=1 - beta2,
        inv_bias_correction2_sqrt=1 / math.sqrt(1 - beta2**step),
        eps=eps,
        max_ratio=_adam_ratio_bound(beta1, beta2, step),
    )


def _adam_ratio_bound(beta1: float, beta2: float, step: float) -> float:
    """``math.adam_ratio_bound`` in Python floats (tests/test_triton.py compares them):
    the 0-d tensor operations would run inside the compiled op's call."""
    if beta2 <= 0:
        return math.inf
    gamma = beta1**2 / beta2
    geometric = step if gamma == 1 else (1 - gamma**step) / (1 - gamma)
    return (1 - beta1) * math.sqrt(geometric / (1 - beta2)) * math.sqrt(1 - beta2**step)


def check_launch_lists(params: list[torch.Tensor], grads: list[torch.Tensor], block_size: int,
                       weight_corrections: list[torch.Tensor] | None = None) -> None:
    """What every launch needs of its parameters, gradients and weight corrections, refused
    with the reason."""
    if block_size & (block_size - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two block_size (got {block_size}): "
                         "tl.arange spans half a block")
    device = params[0].device
    if device.type == "cpu" and not is_interpreted():
        raise RuntimeError(
            "the Triton kernel runs on CPU tensors only under the Triton interpreter: set "
            "TRITON_INTERPRET=1 before lowbit_optim.step.kernels is imported, or use a CUDA device"
        )
    for name, tensors in (("params", params), ("grads", grads)):
        if any(t.device != device or t.dtype != tensors[0].dtype or not t.is_contiguous() for t in tensors):
            raise ValueError(f"{name} must be contiguous tensors of one dtype on {device}")
    if any(p.numel() >= 2**31 for p in params):
        raise ValueError("a parameter of 2**31 elements or more: the kernel indexes within a tensor in int32")
    if weight_corrections is not None:
        master_weight_bits(params, weight_corrections)


def master_weight_bits(params: list[torch.Tensor], weight_corrections: list[torch.Tensor] | None) -> int:
    """The kernel's ``MASTER_WEIGHT_BITS`` for these parameters and corrections (0: none),
    with what master weights need of them refused with the reason."""
    if weight_corrections is None:
        return 0
    if len(weight_corrections) != len(params):
        raise ValueError("weight_corrections must have one entry per parameter")
    dtype = weight_corrections[0].dtype
    if dtype not in (torch.int8, torch.int16) or params[0].dtype not in master_weights.CORRECTED_DTYPES:
        raise ValueError(f"master weights need bfloat16 or float16 parameters and int8 or int16 "
                         f"corrections (got {params[0].dtype} and {dtype})")
    for param, correction in zip(params, weight_corrections):
        if (correction.dtype != dtype or correction.device != param.device or not correction.is_contiguous()
                or correction.numel() != param.numel()):
            raise ValueError(f"weight_corrections must be contiguous {dtype} tensors with their parameters' "
                             f"sizes on {param.device}")
    return 24 if dtype == torch.int8 else 32


def rows_per_program(device: torch.device, block_size: int) -> int:
    tile = INTERPRETER_TILE_ELEMENTS if device.type == "cpu" else GPU_TILE_ELEMENTS
    return max(1, tile // block_size)


def tensor_lists_of(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq,
                    weight_corrections=None) -> list[list[torch.Tensor]]:
    """The kernel's eight tensor lists (without amsgrad the max lists repeat exp_avg_sq's, which
    the kernel then never reads), and the weight corrections as a ninth where there are any.
    The layout and the kernel address every tensor by its data pointer as a flat array, so
    contiguous tensors of any shape serve as they are."""
    moments = [exp_avg, exp_avg_sq, exp_avg_sq if max_exp_avg_sq is None else max_exp_avg_sq]
    lists = [list(params), list(grads)] + [[pair[i] for pair in moment] for moment in moments for i in (0, 1)]
    return lists if weight_corrections is None else lists + [list(weight_corrections)]


def launch(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avg: list[tuple],
           exp_avg_sq: list[tuple], max_exp_avg_sq: list[tuple] | None, scalars: dict[str, float | bool],
           *, exp_avg_format: QuantFormat, exp_avg_sq_format: QuantFormat, block_size: int,
           maximize: bool, stochastic_round: bool, seed: int,
           weight_corrections: list[torch.Tensor] | None = None) -> None:
    """Update params and moments in place: one launch for the parameters whose tensors are
    aligned (``layout.split_aligned``), one for the rest, where there are any.

    ``params``/``grads`` are contiguous tensors of one dtype each; each moment is a list of
    ``(codes, scales)`` pairs laid out as in ``QuantizedState``; ``scalars`` comes from
    ``host_scalars``. ``weight_corrections``: bfloat16 or float16 parameters' master weight
    corrections (``master_weights``; contiguous, all int8 or all int16), updated in place with
    them.
    Works everything out on every call, with layouts cached by address (``layout.get_layout``);
    the optimizer's steps go through ``kernels.plan.KindPlan``, which works it out once.
    """
    if not params:
        return
    check_launch_lists(params, grads, block_size, weight_corrections)
    device = params[0].device
    rows = rows_per_program(device, block_size)
    tensor_lists, _, _ = layouts.split_tails(
        tensor_lists_of(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, weight_corrections), block_size)
    tables = device_tables(exp_avg_format, device) + device_tables(exp_avg_sq_format, device)
    address = layouts.addresses_of(tensor_lists)
    options = kernel_options(exp_avg_format, exp_avg_sq_format, block_size=block_size, rows=rows,
                             amsgrad=max_exp_avg_sq is not None, maximize=maximize,
                             stochastic_round=stochastic_round and params[0].dtype == torch.bfloat16,
                             master_weight_bits=master_weight_bits(params, weight_corrections),
                             interpreted=device.type == "cpu")
    for aligned, indices in layouts.split_aligned(tensor_lists, address):
        lists = [[tensors[i] for i in indices] for tensors in tensor_lists]
        numels = [tensor_lists[0][i].numel() for i in indices]
        layout = layouts.get_layout(lists, numels, block_size, rows, device, aligned=aligned,
                                    address=address[:, indices])
        _launch_one([tensors[0] for tensors in lists], layout, tables, scalars, seed, options)


def device_guard(device: torch.device):
    """Launch on the parameters' device (and so on its current stream), whichever is current."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def kernel_options(exp_avg_format: QuantFormat, exp_avg_sq_format: QuantFormat, *, block_size: int,
                   rows: int, amsgrad: bool, maximize: bool, stochastic_round: bool,
                   interpreted: bool, master_weight_bits: int = 0) -> dict:
    """The kernel's compile-time options for one kind (``ALIGNED`` and the register cap are
    per launch: ``_launch_one`` adds them). ``master_weight_bits``: 24 or 32 for parameters
    with weight corrections, 0 for none."""
    if stochastic_round and master_weight_bits:
        raise ValueError("stochastic rounding and master weights exclude each other: the master "
                         "weight keeps what rounding loses")
    return dict(
        BLOCK_SIZE=block_size, ROWS=rows,
        LAYOUT_COLUMNS=layouts.layout_columns(layouts.LIST_COUNT + bool(master_weight_bits)),
        EXP_AVG_BITS=exp_avg_format.bits, EXP_AVG_CODEC=codec_kind(exp_avg_format),
        EXP_AVG_SQ_BITS=exp_avg_sq_format.bits, EXP_AVG_SQ_CODEC=codec_kind(exp_avg_sq_format),
        AMSGRAD=amsgrad, MAXIMIZE=maximize, STOCHASTIC_ROUND=stochastic_round,
        MASTER_WEIGHT_BITS=master_weight_bits, INTERPRETED=interpreted, num_warps=4, enable_fp_fusion=False,
    )


def _launch_one(bases: list[torch.Tensor], layout: layouts.Layout, tables: tuple, scalars: dict, seed: int,
                options: dict) -> None:
    """One launch: ``bases`` are the lists' first tensors (``tensor_lists_of``), which ``layout``
    is relative to; ``options`` from ``kernel_options``."""
    # Without master weights the corrections' pointer is None: a constexpr, no argument at all.
    weight_correction_base = bases[layouts.LIST_COUNT] if options["MASTER_WEIGHT_BITS"] else None
    with device_guard(bases[0].device):
        _adamw_lowbit_kernel[(layout.num_programs,)](
            *bases[:layouts.LIST_COUNT], weight_correction_base, layout.table, layout.program_param, *tables,
            scalars["step_size"], scalars["decay"], scalars["one_minus_beta1"], scalars["beta2"],
            scalars["one_minus_beta2"], scalars["inv_bias_correction2_sqrt"], scalars["eps"],
            scalars["max_ratio"], seed,
            L2_DECAY=scalars["l2"], ALIGNED=layout.aligned,
            maxnreg=MAX_REGISTERS if layout.aligned and not options["AMSGRAD"] else None, **options,
        )
