"""Quantized moments inside the step kernel: decode ``ROWS`` blocks of codes to float32, and
requantize updated values (per block ``scale = max |x|`` over the block's finite values,
``code = nearest(x * (1 / scale))``) with their codes and scales written back.

A block's scale is its maximum, which is exact, so the scales are the reference's
(``lowbit_optim.step.rule_step``) bit for bit wherever the moments are. Two places trade
IEEE-exact forms for cheap ones (with AdamW's update the IEEE forms cost ~45 SASS instructions
per element, measured with benchmarks/kernel_stats.py), with these bounds (``RN`` is float32
round-to-nearest):

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
    (``cell_tables.cell_words``, which refuses a format with two edges in one cell or one below
    the floor), and the kernel forms the bits and compares them with integer operations
    only, so no rounding separates its code from the codec's. The numerical argument in full
    is in ``lowbit_optim/formats/cell_tables.py``; tests/test_triton_encoders.py runs this
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
"""

import triton
import triton.language as tl

from lowbit_optim.formats import cell_tables
from lowbit_optim.step.kernels import tables

_LINEAR = tl.constexpr(tables.LINEAR)
_CELLS_CLAMPED = tl.constexpr(tables.CELLS_CLAMPED)
_CELLS_ABS = tl.constexpr(tables.CELLS_ABS)
_CELLS_SIGNED = tl.constexpr(tables.CELLS_SIGNED)
_CELLS_SIGNED_ZERO = tl.constexpr(tables.CELLS_SIGNED_ZERO)
# The cell tables' layout (lowbit_optim.formats.cell_tables).
_CELL_FLOOR = tl.constexpr(2.0**cell_tables.FLOOR_BINADE)
_CELL_SHIFT = tl.constexpr(cell_tables.MANTISSA_BITS - cell_tables.INDEX_BITS)
_CELL_FIRST = tl.constexpr((127 + cell_tables.FLOOR_BINADE) << cell_tables.INDEX_BITS)
_CELL_POSITION_SHIFT = tl.constexpr(cell_tables.INDEX_BITS + 9)
_CELL_POSITIVE_START = tl.constexpr(cell_tables.SIGNED_POSITIVE_START - _CELL_FIRST)
# Below this a block scale's reciprocal could overflow float32; such blocks are scaled by 2**64.
_TINY_SCALE = tl.constexpr(2.0**-125)
_TINY_FACTOR = tl.constexpr(2.0**64)


# Only builtins and functions of the kernel package and the rules' modules: triton.language's
# own @jit helpers (tl.max, tl.zeros, tl.randint) are interpreter functions only if
# TRITON_INTERPRET was set when Triton was first imported, while these follow the setting when
# their module is imported.
@triton.jit
def is_finite(x):
    return tl.abs(x) < float("inf")  # False for NaN too: one comparison


@triton.jit
def _row_max(x):
    # tl.max's own combine function: the interpreter recognises it and reduces with numpy.
    return tl.reduce(x, 1, tl.standard._elementwise_max)


@triton.jit
def _lookup(values, index, SIZE: tl.constexpr):
    """``values[index]`` for a 3-D ``index`` and a 1-D ``values`` of ``SIZE`` entries held in
    registers (``tl.gather`` works on equal ranks; the reshapes keep the element order)."""
    flat = tl.reshape(index, [index.shape[0] * index.shape[1] * index.shape[2]])
    return tl.reshape(tl.gather(values, flat, 0), [index.shape[0], index.shape[1], index.shape[2]])


@triton.jit
def _decode(codes, table, BITS: tl.constexpr, CODEC: tl.constexpr):
    if CODEC == _LINEAR:
        # k / 2**bits + 1 / 2**bits in one FMA: exactly (k + 1) / 2**bits, the table's value.
        return tl.fma(codes.to(tl.float32), 1.0 / (1 << BITS), 1.0 / (1 << BITS))
    else:
        return _lookup(table, codes, 1 << BITS)


@triton.jit
def load_moment(codes_ptr, scales_ptr, table, rows, cols, row_mask,
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
    (``formats.cell_tables``, where the argument is): the magnitude clamped to [floor, 1] (max and min
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
def encode(values, reciprocal, factor, encoder_ptr, BITS: tl.constexpr, CODEC: tl.constexpr,
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
def store_moment(low, high, codes_ptr, scales_ptr, encoder_ptr, rows, cols, row_mask,
                 BLOCK_SIZE: tl.constexpr, BITS: tl.constexpr, CODEC: tl.constexpr,
                  INTERPRETED: tl.constexpr):
    """Requantize ``ROWS`` blocks given as (low half, high half); write codes and scales."""
    low_abs = tl.where(is_finite(low), tl.abs(low), 0.0)
    high_abs = tl.where(is_finite(high), tl.abs(high), 0.0)
    scale = tl.maximum(_row_max(low_abs), _row_max(high_abs))
    tl.store(scales_ptr + rows, scale, mask=row_mask)
    tiny = scale < _TINY_SCALE
    factor = tl.where(tiny, _TINY_FACTOR, 1.0)
    # One (approximate, <= 2 ulp) division per block; 0 for an all-zero block, whose values
    # then encode as 0.
    reciprocal = tl.where(scale > 0, 1.0 / tl.where(scale > 0, scale * factor, 1.0), 0.0)
    both = tl.join(low, high)
    code = encode(both, reciprocal[:, None, None], factor[:, None, None], encoder_ptr, BITS, CODEC,
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

