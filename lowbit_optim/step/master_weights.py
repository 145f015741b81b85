"""Master weights for bfloat16 parameters: the parameter plus an integer correction.

With ``master_weight_bits`` set, each bfloat16 parameter keeps a correction in its optimizer
state (``CORRECTION_KEY``) so that parameter and correction together hold a float32 master
weight, and the step updates that master weight instead of the rounded parameter: updates
smaller than half a bfloat16 ulp (7 mantissa bits) then accumulate instead of vanishing.

Everything works on bit patterns. ``m`` is the float32 master weight's bits as an int32; the
parameter is its upper 16 bits rounded half up in bit space, ``p = (m + 2**15) >> 16``, so
the remainder ``m - p * 2**16`` lies in ``[-2**15, 2**15 - 1]``:

* 32 bits: the correction is that remainder as an int16, and ``p * 2**16 + correction`` is
  ``m`` exactly;
* 24 bits: ``m`` is first rounded (half up) to a multiple of ``2**8``, a float with 15 stored
  mantissa bits; the remainder is then a multiple of ``2**8`` in ``[-2**15, 2**15 - 2**8]`` and
  the correction, remainder / 2**8, fits an int8 exactly. The master weight is within 128
  float32 ulps (a relative ``2**-16``) of the float32 value the step computed.

Round half up rather than torch's round-to-nearest-even: with ties to even a tie that rounds
down leaves a remainder of ``+2**15``, one past int16. The two differ only when ``m``'s low 16
bits are exactly ``0x8000``; the parameter is then one bfloat16 ulp above what
``master.to(torch.bfloat16)`` gives, and the master weight is exact either way.

float16 parameters are refused: a float16 value is not the upper half of a float32, so this
bit split does not apply (the residual ``m - float(p)`` is exact but needs another encoding).
float32 and float64 parameters are left as they are, with no correction.
"""

import torch

from lowbit_optim.state import sharding

MASTER_WEIGHT_BITS = (24, 32)
# The optimizer state key of a bfloat16 parameter's correction.
CORRECTION_KEY = "master_weight_correction"
# A bfloat16 value is the upper half of a float32's bits: the parameter is bits >> 16.
BFLOAT16_SHIFT = 16
# Added before the shift to round half up: half of the 2**16 the shift drops.
BFLOAT16_ROUNDING = 1 << (BFLOAT16_SHIFT - 1)
# The bits a 24-bit master weight drops (int8 correction = 32-bit remainder >> 8).
MASTER_24_DROPPED_BITS = 8
# Added before dropping them, to round the 24-bit master half up.
MASTER_24_ROUNDING = 1 << (MASTER_24_DROPPED_BITS - 1)
# One quiet NaN replaces every NaN pattern: some (0x7FFF8000 and above) would overflow int32
# when the rounding is added, and a NaN's payload carries no information here.
CANONICAL_NAN_BITS = 0x7FC00000


def correction_dtype(bits: int) -> torch.dtype:
    """The correction's dtype for ``master_weight_bits``: int8 for 24, int16 for 32."""
    return torch.int8 if bits == 24 else torch.int16


def needs_correction(param: torch.Tensor, bits: int | None) -> bool:
    """Whether ``param`` keeps a correction: a bfloat16 parameter with ``bits`` set."""
    return bits is not None and param.dtype == torch.bfloat16


def check_master_weight_options(bits, stochastic_round) -> None:
    """Refuse an invalid ``master_weight_bits`` or one combined with stochastic rounding."""
    # 24.0 == 24 and True == 1: only the ints themselves.
    valid = bits is None or (type(bits) is int and bits in MASTER_WEIGHT_BITS)
    if not valid:
        raise ValueError(f"Invalid master_weight_bits: {bits!r} (None, 24 or 32)")
    if bits is not None and stochastic_round:
        raise ValueError(
            f"Invalid master_weight_bits: {bits!r} with bf16_stochastic_round=True (the master "
            "weight already keeps what rounding loses; choose one of the two)"
        )


def check_master_weight_param(param: torch.Tensor, bits, owner: str) -> None:
    """Refuse a float16 parameter in a group with master weights (see the module docstring)."""
    if bits is not None and param.dtype == torch.float16:
        raise ValueError(
            f"{owner}: master_weight_bits={bits} supports bfloat16 parameters only (got a "
            f"float16 one of shape {tuple(param.shape)}); train in bfloat16, or keep float16 "
            "parameters without master weights"
        )


def zeros_correction(param: torch.Tensor, bits: int):
    """An all-zero correction for ``param`` (a DTensor's like its shard): the master weight
    starts as the parameter itself."""
    dtype = correction_dtype(bits)
    return sharding._like(param, lambda shard: torch.zeros(shard.shape, dtype=dtype, device=shard.device))


def read_master(param: torch.Tensor, correction: torch.Tensor) -> torch.Tensor:
    """The float32 master weight of bfloat16 ``param`` and its correction (int8 or int16)."""
    upper = param.view(torch.int16).to(torch.int32) * (1 << BFLOAT16_SHIFT)
    remainder = correction.to(torch.int32)
    if correction.dtype == torch.int8:
        remainder = remainder * (1 << MASTER_24_DROPPED_BITS)
    return (upper + remainder).view(torch.float32)


def split_master(master: torch.Tensor, correction_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``master`` -> (bfloat16 parameter, correction of ``correction_dtype``)."""
    bits = torch.where(torch.isnan(master), CANONICAL_NAN_BITS, master.view(torch.int32))
    if correction_dtype == torch.int8:
        bits = (bits + MASTER_24_ROUNDING) & -(1 << MASTER_24_DROPPED_BITS)
    upper = (bits + BFLOAT16_ROUNDING) >> BFLOAT16_SHIFT
    remainder = bits - upper * (1 << BFLOAT16_SHIFT)
    if correction_dtype == torch.int8:
        remainder = remainder >> MASTER_24_DROPPED_BITS
    return upper.to(torch.int16).view(torch.bfloat16), remainder.to(correction_dtype)


def write_master(param: torch.Tensor, correction: torch.Tensor, master: torch.Tensor) -> None:
    """Store float32 ``master`` into bfloat16 ``param`` and its ``correction``, in place."""
    rounded, remainder = split_master(master, correction.dtype)
    param.copy_(rounded)
    correction.copy_(remainder)


def check_loaded_correction(label: str, param: torch.Tensor, bits, value) -> None:
    """Refuse a saved correction that does not fit ``param`` under ``master_weight_bits``
    ``bits``. A missing one is accepted (a state dict saved without master weights): the
    master weight then starts as the parameter (``PreparedLoad.finish`` adds zeros)."""
    where = f"{label}: {CORRECTION_KEY}"
    if not needs_correction(param, bits):
        if value is not None:
            raise ValueError(
                f"{where} is present but the parameter keeps none ({param.dtype}, "
                f"master_weight_bits={bits!r}); drop it, or load the master weights with "
                "lowbit_optim.load_master_weights"
            )
        return
    if value is None:
        return
    expected = correction_dtype(bits)
    shard = sharding.local(value)
    if not isinstance(value, torch.Tensor) or shard.dtype != expected:
        got = shard.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{where} must be a {expected} tensor for master_weight_bits={bits}, got {got}")
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"{where} has shape {tuple(value.shape)}, not the parameter's")
