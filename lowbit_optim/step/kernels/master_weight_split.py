"""The step kernel's master weights: ``lowbit_optim.step.master_weights`` (the reference, where
the encodings and their reasons are) as Triton device functions, called by
``step_kernel.lowbit_step_kernel``'s ``MASTER_WEIGHT_BITS`` variants (``read_master`` through
``param_access.load_param``).

``read_master`` forms the float32 master weight of a bfloat16 or float16 parameter and its
correction; ``split_master`` splits an updated one back. Each performs the reference's
operations: for bfloat16 the same integer operations on the bit patterns, for float16 the same
float32 operations, each of which is exact (a subtraction of two floats within half a float16
ulp, a scaling by a power of two) or a rounding the reference also does (to float16, nearest
even; to an integer, half to even). So the kernel's pair is bit for bit the reference's split
of the float32 value the kernel computed (tests/test_triton_master_weights.py).
"""

import torch
import triton
import triton.language as tl

from lowbit_optim.step import master_weights

# The encodings' constants (lowbit_optim.step.master_weights, where the reasons are).
_BFLOAT16_SHIFT = tl.constexpr(master_weights.BFLOAT16_SHIFT)
_BFLOAT16_ROUNDING = tl.constexpr(master_weights.BFLOAT16_ROUNDING)
_MASTER_24_DROPPED_BITS = tl.constexpr(master_weights.MASTER_24_DROPPED_BITS)
_MASTER_24_ROUNDING = tl.constexpr(master_weights.MASTER_24_ROUNDING)
_MASTER_24_KEPT_MASK = tl.constexpr(-(1 << master_weights.MASTER_24_DROPPED_BITS))
_CANONICAL_NAN_BITS = tl.constexpr(master_weights.CANONICAL_NAN_BITS)
_FLOAT16_MANTISSA_BITS = tl.constexpr(master_weights.FLOAT16_MANTISSA_BITS)
_FLOAT16_EXPONENT_FIELD = tl.constexpr(master_weights.FLOAT16_EXPONENT_FIELD)
_FLOAT16_MIN_NORMAL_FIELD = tl.constexpr(master_weights.FLOAT16_MIN_NORMAL_FIELD)
_FLOAT32_MANTISSA_BITS = tl.constexpr(master_weights.FLOAT32_MANTISSA_BITS)
_FLOAT16_UNIT_FIELD_OFFSET_24 = tl.constexpr(master_weights.FLOAT16_UNIT_FIELD_OFFSET[torch.int8])
_FLOAT16_UNIT_FIELD_OFFSET_32 = tl.constexpr(master_weights.FLOAT16_UNIT_FIELD_OFFSET[torch.int16])
_CANONICAL_FLOAT16_NAN_BITS = tl.constexpr(master_weights.CANONICAL_FLOAT16_NAN_BITS)
# A power of two's float32 exponent field is 127 plus its exponent: 2**-k's is 254 minus 2**k's.
_FLOAT32_RECIPROCAL_FIELD = tl.constexpr(2 * 127)
# x + 1.5 * 2**23 - 1.5 * 2**23 is x rounded to an integer, half to even, for |x| <= 2**22: the
# sum lies in [2**23, 2**24), where float32's spacing is 1 (torch's round() of the reference).
_ROUND_TO_INTEGER = tl.constexpr(1.5 * 2.0**23)


@triton.jit
def read_master(param, correction, MASTER_WEIGHT_BITS: tl.constexpr):
    """``master_weights.read_master``: the float32 master weight of a bfloat16 or float16
    parameter and its correction (int8 for 24 bits, int16 for 32), with the same operations."""
    if param.dtype == tl.float16:
        unit_field = _float16_unit_field(param.to(tl.int16, bitcast=True).to(tl.int32), MASTER_WEIGHT_BITS)
        unit = (unit_field << _FLOAT32_MANTISSA_BITS).to(tl.float32, bitcast=True)
        # Subtracted as its negation, as the reference does: a zero correction keeps -0.0.
        negated = -correction.to(tl.int32)
        return param.to(tl.float32) - negated.to(tl.float32) * unit
    else:
        upper = param.to(tl.int16, bitcast=True).to(tl.int32) << _BFLOAT16_SHIFT
        remainder = correction.to(tl.int32)
        if MASTER_WEIGHT_BITS == 24:
            remainder = remainder << _MASTER_24_DROPPED_BITS
        return (upper + remainder).to(tl.float32, bitcast=True)


@triton.jit
def _float16_unit_field(param_bits, MASTER_WEIGHT_BITS: tl.constexpr):
    """The float32 exponent field of a float16 parameter's correction unit, from the
    parameter's bits (``master_weights.float16_unit``)."""
    field = (param_bits >> _FLOAT16_MANTISSA_BITS) & _FLOAT16_EXPONENT_FIELD
    if MASTER_WEIGHT_BITS == 24:
        offset: tl.constexpr = _FLOAT16_UNIT_FIELD_OFFSET_24
    else:
        offset: tl.constexpr = _FLOAT16_UNIT_FIELD_OFFSET_32
    return tl.maximum(field, _FLOAT16_MIN_NORMAL_FIELD) + offset


@triton.jit
def split_master(master, DTYPE: tl.constexpr, MASTER_WEIGHT_BITS: tl.constexpr):
    """``master_weights.split_master``: float32 ``master`` -> (parameter of ``DTYPE``,
    correction: int8 for 24 bits, int16 for 32)."""
    # One return: Triton types every return of a function alike, static branches included.
    if DTYPE == tl.float16:
        param, steps = _split_float16_master(master, MASTER_WEIGHT_BITS)
    else:
        param, steps = _split_bfloat16_master(master, MASTER_WEIGHT_BITS)
    if MASTER_WEIGHT_BITS == 24:
        correction = steps.to(tl.int8)
    else:
        correction = steps.to(tl.int16)
    return param, correction


@triton.jit
def _split_bfloat16_master(master, MASTER_WEIGHT_BITS: tl.constexpr):
    """The bfloat16 parameter and the correction (int32), with the reference's integer
    operations: rounded half up in bit space (to a multiple of 2**8 first for 24 bits), every
    NaN replaced by one quiet NaN."""
    bits = tl.where(master == master, master.to(tl.int32, bitcast=True), _CANONICAL_NAN_BITS)
    if MASTER_WEIGHT_BITS == 24:
        bits = (bits + _MASTER_24_ROUNDING) & _MASTER_24_KEPT_MASK
    upper = (bits + _BFLOAT16_ROUNDING) >> _BFLOAT16_SHIFT
    remainder = bits - (upper << _BFLOAT16_SHIFT)
    if MASTER_WEIGHT_BITS == 24:
        remainder = remainder >> _MASTER_24_DROPPED_BITS
    return upper.to(tl.int16).to(tl.bfloat16, bitcast=True), remainder


@triton.jit
def _split_float16_master(master, MASTER_WEIGHT_BITS: tl.constexpr):
    """The float16 parameter and the correction (float32, integral), as the reference splits:
    the residual of the master weight, then the residual of the master weight that pair holds,
    so that at a float16 midpoint the parameter is the held weight's even neighbour and
    reading and splitting a pair gives it back."""
    param, steps = _float16_residual(master, MASTER_WEIGHT_BITS)
    held = read_master(param, steps.to(tl.int32), MASTER_WEIGHT_BITS)
    return _float16_residual(held, MASTER_WEIGHT_BITS)


@triton.jit
def _float16_residual(master, MASTER_WEIGHT_BITS: tl.constexpr):
    """``master`` rounded to float16 (nearest even, NaN to one quiet NaN) and its residual
    counted in the parameter's unit, rounded half to even (0 for a non-finite parameter). The
    subtraction and the scaling by a power of two are exact, so each value is the
    reference's."""
    param_bits = tl.where(master == master, master.to(tl.float16).to(tl.int16, bitcast=True),
                          _CANONICAL_FLOAT16_NAN_BITS)
    param = param_bits.to(tl.float16, bitcast=True)
    base = param.to(tl.float32)
    unit_field = _float16_unit_field(param_bits.to(tl.int32), MASTER_WEIGHT_BITS)
    # Dividing by the unit (a power of two) is multiplying by its reciprocal, another one.
    inverse_unit = ((-unit_field + _FLOAT32_RECIPROCAL_FIELD) << _FLOAT32_MANTISSA_BITS).to(
        tl.float32, bitcast=True)
    residual = (master - base) * inverse_unit
    finite = tl.abs(base) < float("inf")  # False for NaN too
    return param, tl.where(finite, (residual + _ROUND_TO_INTEGER) - _ROUND_TO_INTEGER, 0.0)
