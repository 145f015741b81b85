"""Master weights for bfloat16 and float16 parameters: the parameter plus an integer correction.

With ``master_weight_bits`` set, each bfloat16 or float16 parameter keeps a correction in its
optimizer state (``CORRECTION_KEY``: int8 for 24 bits, int16 for 32) so that parameter and
correction together hold a float32 master weight, and the step updates that master weight
instead of the rounded parameter: updates smaller than half an ulp of the parameter (7 or 10
stored mantissa bits) then accumulate instead of vanishing. Each dtype has its own encoding,
chosen by the parameter's dtype.

**bfloat16: a bit split.** ``m`` is the float32 master weight's bits as an int32; the
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

**float16: a scaled residual.** A float16 value is not the upper half of a float32, so the
parameter is ``p = m.to(torch.float16)`` (round to nearest even, as every backend's cast
rounds) and the correction counts the residual ``m - p`` in units of ``u``. With ``E`` the
exponent of ``p`` (its exponent field minus 15; -14 for zero and subnormals, which share the
smallest normal binade's spacing), ``u = 2**(E - 24)`` for 32 bits and ``2**(E - 17)`` for 24:

* the correction is ``round_half_even((m - p) / u)``: the subtraction is exact (``p`` is within
  half a float16 ulp of ``m``) and so is the division by a power of two; the master weight
  read back is ``p + correction * u``, also exact;
* where that master weight is a float16 midpoint (a correction of half an ulp, ``±2**13`` or
  ``±64``), ``m``'s own rounding may have gone to the other neighbour: the pair is then split
  again from the master weight it holds, so that the parameter is always the master weight
  rounded to nearest even and reading and splitting a pair gives it back unchanged (a step
  that keeps the master weight, a NaN gradient's, keeps the parameter);
* ``|m - p| <= 2**(E - 11)`` (half a float16 ulp; ``2**(E - 12)`` when ``m`` rounded up into
  ``p``'s binade from the one below), so ``|correction| <= 2**13`` (int16) or ``64`` (int8);
* 32 bits: every float32 ``m`` with ``|m| >= 2**-15`` (and 0) is a multiple of ``u`` (float32
  spacing in ``p``'s binade is ``2**(E - 23)``, one binade below ``2**(E - 24)``), so the master
  weight is ``m`` bit for bit. Below ``2**-15`` it is ``m`` rounded to a multiple of ``2**-38``;
* 24 bits: the master weight is ``m`` rounded to a multiple of ``2**(E - 17)``, 18 significant
  bits (float16's 11 and the int8's 7), within ``2**(E - 18)`` of ``m``: a relative ``2**-18``
  of ``p``'s binade, ``2**-17`` of ``|m|`` at most;
* ``|m|`` past float16's range (65520 and above; with 24 bits from 65519.875, which the
  master weight rounds to 65520) makes ``p`` infinite and the correction 0, as torch's own
  AdamW overflows a float16 parameter; a NaN makes ``p`` one quiet NaN and the correction 0.

float32 and float64 parameters are left as they are, with no correction.
"""

import torch

from lowbit_optim.state import sharding

MASTER_WEIGHT_BITS = (24, 32)
# The optimizer state key of a bfloat16 or float16 parameter's correction.
CORRECTION_KEY = "master_weight_correction"
# The parameter dtypes that keep a correction (float32 and float64 are their own masters).
CORRECTED_DTYPES = (torch.bfloat16, torch.float16)
# The corrections' dtypes: int8 for 24 bits, int16 for 32.
CORRECTION_DTYPES = (torch.int8, torch.int16)

# --- bfloat16 -------------------------------------------------------------------------------
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

# --- float16 --------------------------------------------------------------------------------
# float16's stored mantissa bits: its exponent field starts at bit 10.
FLOAT16_MANTISSA_BITS = 10
# float16's exponent field, 5 bits, once shifted down.
FLOAT16_EXPONENT_FIELD = 0x1F
# The exponent field of the smallest normal binade: zero and subnormals (field 0) are spaced
# like it (2**-24 apart), so they take its unit.
FLOAT16_MIN_NORMAL_FIELD = 1
# float32's stored mantissa bits: a power of two's exponent field starts at bit 23.
FLOAT32_MANTISSA_BITS = 23
# The float32 exponent field of the correction's unit is float16's field plus this: the unit
# is 2**(E - 24) (int16) or 2**(E - 17) (int8) with E = field - 15, and float32's bias is 127.
# Both stay normal float32 numbers for every field (2**-38 to 2**-1).
FLOAT16_UNIT_FIELD_OFFSET = {torch.int16: 127 - 15 - 24, torch.int8: 127 - 15 - 17}
# One quiet NaN replaces every NaN, so that every backend's cast writes the same parameter bits.
CANONICAL_FLOAT16_NAN_BITS = 0x7E00
# An int8 correction's unit over an int16 one's, as a shift (2**(E - 17) over 2**(E - 24)).
FLOAT16_24_TO_32_BITS = FLOAT16_UNIT_FIELD_OFFSET[torch.int8] - FLOAT16_UNIT_FIELD_OFFSET[torch.int16]


def correction_dtype(bits: int) -> torch.dtype:
    """The correction's dtype for ``master_weight_bits``: int8 for 24, int16 for 32."""
    return torch.int8 if bits == 24 else torch.int16


def needs_correction(param: torch.Tensor, bits: int | None) -> bool:
    """Whether ``param`` keeps a correction: a bfloat16 or float16 parameter with ``bits`` set."""
    return bits is not None and param.dtype in CORRECTED_DTYPES


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


def zeros_correction(param: torch.Tensor, bits: int):
    """An all-zero correction for ``param`` (a DTensor's like its shard): the master weight
    starts as the parameter itself."""
    dtype = correction_dtype(bits)
    return sharding._like(param, lambda shard: torch.zeros(shard.shape, dtype=dtype, device=shard.device))


def read_master(param: torch.Tensor, correction: torch.Tensor) -> torch.Tensor:
    """The float32 master weight of bfloat16 or float16 ``param`` and its correction (int8 or
    int16)."""
    if param.dtype == torch.float16:
        return _read_float16_master(param, correction)
    upper = param.view(torch.int16).to(torch.int32) * (1 << BFLOAT16_SHIFT)
    remainder = correction.to(torch.int32)
    if correction.dtype == torch.int8:
        remainder = remainder * (1 << MASTER_24_DROPPED_BITS)
    return (upper + remainder).view(torch.float32)


def split_master(master: torch.Tensor, param_dtype: torch.dtype,
                 correction_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``master`` -> (parameter of ``param_dtype``, correction of ``correction_dtype``)."""
    if param_dtype == torch.float16:
        return _split_float16_master(master, correction_dtype)
    bits = torch.where(torch.isnan(master), CANONICAL_NAN_BITS, master.view(torch.int32))
    if correction_dtype == torch.int8:
        bits = (bits + MASTER_24_ROUNDING) & -(1 << MASTER_24_DROPPED_BITS)
    upper = (bits + BFLOAT16_ROUNDING) >> BFLOAT16_SHIFT
    remainder = bits - upper * (1 << BFLOAT16_SHIFT)
    if correction_dtype == torch.int8:
        remainder = remainder >> MASTER_24_DROPPED_BITS
    return upper.to(torch.int16).view(torch.bfloat16), remainder.to(correction_dtype)


def write_master(param: torch.Tensor, correction: torch.Tensor, master: torch.Tensor) -> None:
    """Store float32 ``master`` into ``param`` and its ``correction``, in place."""
    rounded, remainder = split_master(master, param.dtype, correction.dtype)
    param.copy_(rounded)
    correction.copy_(remainder)


def float16_unit(param_bits: torch.Tensor, correction_dtype: torch.dtype) -> torch.Tensor:
    """The float32 unit of a float16 parameter's correction, from the parameter's bits (int16):
    ``2**(E - 24)`` for an int16 correction, ``2**(E - 17)`` for an int8 one, built as bits."""
    field = (param_bits.to(torch.int32) >> FLOAT16_MANTISSA_BITS) & FLOAT16_EXPONENT_FIELD
    unit_field = field.clamp(min=FLOAT16_MIN_NORMAL_FIELD) + FLOAT16_UNIT_FIELD_OFFSET[correction_dtype]
    return (unit_field << FLOAT32_MANTISSA_BITS).view(torch.float32)


def _read_float16_master(param: torch.Tensor, correction: torch.Tensor) -> torch.Tensor:
    unit = float16_unit(param.view(torch.int16), correction.dtype)
    # The residual is subtracted as its negation (negated as an integer, so a zero stays +0.0):
    # x - 0.0 is x for every x, where x + 0.0 would turn a -0.0 parameter into +0.0.
    negated = -correction.to(torch.int32)
    return param.to(torch.float32) - negated.to(torch.float32) * unit


def _split_float16_master(master: torch.Tensor, correction_dtype: torch.dtype):
    # First the master weight the correction can hold (``master`` itself for an int16 one
    # from 2**-15 up), then that held weight's own split, which is exact: the parameter is the
    # held weight rounded to nearest even. Where the held weight is a float16 midpoint,
    # ``master``'s own rounding may have gone to the other neighbour, and reading and splitting
    # the pair again would move the parameter by an ulp (a step with a NaN gradient, which
    # keeps the master weight, must keep the parameter too).
    held = _read_float16_master(*_float16_residual(master, correction_dtype))
    return _float16_residual(held, correction_dtype)


def _float16_residual(master: torch.Tensor, correction_dtype: torch.dtype):
    """``master`` rounded to float16 (nearest even, every NaN one quiet NaN) and its residual
    in units, rounded to nearest even."""
    rounded = master.to(torch.float16).view(torch.int16)
    param_bits = torch.where(torch.isnan(master), CANONICAL_FLOAT16_NAN_BITS, rounded)
    param = param_bits.view(torch.float16)
    base = param.to(torch.float32)
    residual = (master - base) / float16_unit(param_bits, correction_dtype)
    # Past float16's range the parameter is infinite and, like a NaN one, keeps no correction.
    # A finite one's residual is at most half a float16 ulp: within the correction's range.
    steps = torch.where(torch.isfinite(base), residual.round(), 0.0)
    return param, steps.to(correction_dtype)


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


def convert_correction(correction: torch.Tensor, param_dtype: torch.dtype,
                       dtype: torch.dtype) -> torch.Tensor:
    """``correction`` of a ``param_dtype`` parameter as a ``dtype`` (int8 or int16) one for the
    same parameter, which keeps its value (a DTensor's shard by shard).

    24 -> 32 bits is exact: the int8 correction's unit is 2**8 (bfloat16) or 2**7 (float16)
    of the int16's. 32 -> 24 bits rounds the master weight to the nearest 24-bit one that keeps
    the parameter: half up (bfloat16) or to nearest even (float16), as the splits round. A
    bfloat16 remainder from ``2**15 - 2**7`` up, which rounds up to the next parameter, keeps
    the largest int8 correction instead (127), 1.5 * 2**8 float32 ulps from it at most.
    """
    def convert(shard: torch.Tensor) -> torch.Tensor:
        if shard.dtype == dtype:
            return shard.clone()
        scale_bits = MASTER_24_DROPPED_BITS if param_dtype == torch.bfloat16 else FLOAT16_24_TO_32_BITS
        wide = shard.to(torch.int32)
        if dtype == torch.int16:
            return (wide << scale_bits).to(torch.int16)
        if param_dtype == torch.bfloat16:
            narrow = (wide + MASTER_24_ROUNDING) >> scale_bits
        else:
            narrow = (wide.to(torch.float32) / (1 << scale_bits)).round().to(torch.int32)
        return narrow.clamp(max=torch.iinfo(torch.int8).max).to(torch.int8)

    return sharding._like(correction, convert)
