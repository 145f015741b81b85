"""The parameter inside the step kernel: read as float32 (its master weight where it keeps a
correction), written back in its dtype (bfloat16 optionally by stochastic rounding, or split
into parameter and correction: ``master_weight_split``), and the noise stochastic rounding
draws."""

import triton
import triton.language as tl

from lowbit_optim.step import math as math_spec
from lowbit_optim.step.kernels import master_weight_split
from lowbit_optim.step.kernels.moment_codes import is_finite

_BFLOAT16_DROPPED_BITS = tl.constexpr(math_spec.BFLOAT16_DROPPED_BITS)
_BFLOAT16_KEPT_MASK = tl.constexpr(math_spec.BFLOAT16_KEPT_MASK)
# Added with the lowest kept bit before truncating, it rounds to nearest even.
_BFLOAT16_ROUND_HALF = tl.constexpr((1 << (math_spec.BFLOAT16_DROPPED_BITS - 1)) - 1)
# One 32-bit hash gives two elements their noise: its low and its high 16 bits.
NOISE_MASK = tl.constexpr((1 << math_spec.BFLOAT16_DROPPED_BITS) - 1)
NOISE_SHIFT = tl.constexpr(math_spec.BFLOAT16_DROPPED_BITS)


@triton.jit
def random_bits32(seed, index):
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
def random_bits16(seed, index):
    """16 uniform random bits per index (the high half of ``random_bits32``)."""
    return (random_bits32(seed, index) >> 16).to(tl.int32)


@triton.jit
def to_param_dtype(values, noise, DTYPE: tl.constexpr, STOCHASTIC_ROUND: tl.constexpr,
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
                rounded = tl.where(is_finite(values), (bits + noise) & _BFLOAT16_KEPT_MASK, rounded)
            values = rounded.to(tl.float32, bitcast=True)
    return values.to(DTYPE)


@triton.jit
def load_param(param_ptr, correction_ptr, index, mask, MASTER_WEIGHT_BITS: tl.constexpr):
    """The parameter as float32: its master weight where it keeps a correction."""
    if MASTER_WEIGHT_BITS:
        param = tl.load(param_ptr + index, mask=mask, other=0.0)
        correction = tl.load(correction_ptr + index, mask=mask, other=0)
        return master_weight_split.read_master(param, correction, MASTER_WEIGHT_BITS)
    else:
        return tl.load(param_ptr + index, mask=mask, other=0.0).to(tl.float32)

