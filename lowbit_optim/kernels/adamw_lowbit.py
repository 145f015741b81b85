"""Fused low-bit AdamW in Triton: dequantize -> AdamW -> requantize, one pass over memory.

Per element, with ``m, v`` (and ``v_max`` under amsgrad) decoded from their codes,
``m = table_m[code_m] * scale_m`` and so on, and ``g`` the gradient (negated if maximize)::

    finite  = isfinite(g);            g = finite ? g : 0
    m'      = m + (1 - beta1) * (g - m)
    v'      = v * beta2 + ((1 - beta2) * g) * g
    v_max'  = max(v_max, v')                        (amsgrad; the denominator uses it)
    denom   = sqrt(v') / sqrt(1 - beta2**t) + eps
    p'      = p * (1 - lr * weight_decay) - lr / (1 - beta1**t) * (m' / denom)
    (p', m', v', v_max') = finite ? (p', m', v', v_max') : (p, m, v, v_max)

then each moment is requantized per block: ``scale = max |x|`` over the block's finite
values, ``code = nearest(x / scale)``. This is ``lowbit_optim.functional.quantized_adamw_step``
operation for operation (the oracle of tests/test_triton.py): scalar factors are formed on the
host in float64 and rounded to float32 as torch rounds a 0-d double tensor, divisions and
square roots are IEEE (``div_rn``, ``sqrt_rn``; Triton's plain ``/`` and ``sqrt`` are
approximate on NVIDIA GPUs) and multiply-add contraction is off (``enable_fp_fusion=False``),
so each operation rounds as eager torch's does.

Encoders (``lowbit_optim.quant.codecs``): 16-entry maps count the 15 midpoints a value
exceeds; the 8-bit dynamic-tree maps use the same exponent arithmetic as
``DynamicExponentCodec`` (decade from the logarithm, floor position in the decade, then the
lower- and upper-midpoint corrections, which also make the result independent of the
logarithm's last-ulp accuracy). Decoding is one load from the 256- or 16-entry table.

Layout: a program takes ``ROWS`` consecutive blocks of one parameter and works on the low and
high halves of each block, which is exactly the 4-bit packing (byte ``k`` holds element ``k``
in its low nibble and element ``k + block_size / 2`` in its high nibble). Which parameter a
program serves, and where that parameter's tensors are, comes from the multi-tensor layout
(``lowbit_optim.kernels.layout``): one launch covers every parameter of a kind.
"""

import math

import torch
import triton
import triton.language as tl

from lowbit_optim.kernels import layout as layouts
from lowbit_optim.quant.codecs import DynamicExponentCodec, SmallTableCodec
from lowbit_optim.quant.formats import QuantFormat

# Elements per program: 2048 with 4 warps is 16 elements per thread (four 16-byte loads of
# float32), which keeps the ~10 live float32 values per element in registers.
GPU_TILE_ELEMENTS = 2048
# The interpreter runs programs one after another in Python; bigger tiles mean fewer of them.
INTERPRETER_TILE_ELEMENTS = 16384

SMALL_TABLE, DYNAMIC_SIGNED, DYNAMIC_UNSIGNED = 0, 1, 2
# 16-entry maps: the 15 midpoints. 8-bit: per decade (8 slots each) the scale to [0.1, 1) and the
# lower midpoint, then the upper midpoint, the zero code, the largest rank, the exponent bits.
CONSTS_SIZE = 20
_LOG10_2 = tl.constexpr(0.30102999566398120)


# --- device functions ---------------------------------------------------------------------
# Only builtins and functions of this module: triton.language's own @jit helpers (tl.max,
# tl.zeros, tl.randint) are interpreter functions only if TRITON_INTERPRET was set when Triton
# was first imported, while these follow the setting when this module is imported.
@triton.jit
def _is_finite(x):
    return (x == x) & (tl.abs(x) != float("inf"))


@triton.jit
def _row_max(x):
    # tl.max's own combine function: the interpreter recognises it and reduces with numpy.
    return tl.reduce(x, 1, tl.standard._elementwise_max)


@triton.jit
def _random_bits16(seed, index):
    """16 uniform random bits per element: the murmur3 finaliser of a seeded counter."""
    x = index.to(tl.uint32) * 0x9E3779B1 + seed.to(tl.uint32)
    x ^= x >> 16
    x *= 0x85EBCA6B
    x ^= x >> 13
    x *= 0xC2B2AE35
    x ^= x >> 16
    return (x >> 16).to(tl.int32)


@triton.jit
def _load_moment(codes_ptr, scales_ptr, table_ptr, rows, cols, row_mask,
                 BLOCK_SIZE: tl.constexpr, BITS: tl.constexpr):
    """Decode ``ROWS`` blocks: float32 (low half, high half), each ``(ROWS, BLOCK_SIZE // 2)``."""
    mask = row_mask[:, None]
    scale = tl.load(scales_ptr + rows, mask=row_mask, other=0.0)[:, None]
    if BITS == 8:
        index = rows[:, None] * BLOCK_SIZE + cols[None, :]
        low = tl.load(codes_ptr + index, mask=mask, other=0)
        high = tl.load(codes_ptr + index + BLOCK_SIZE // 2, mask=mask, other=0)
    else:
        packed = tl.load(codes_ptr + rows[:, None] * (BLOCK_SIZE // 2) + cols[None, :], mask=mask, other=0)
        low = packed & 0x0F
        high = packed >> 4
    return (tl.load(table_ptr + low.to(tl.int32)) * scale,
            tl.load(table_ptr + high.to(tl.int32)) * scale)


@triton.jit
def _encode(values, scale, consts_ptr, CODEC: tl.constexpr):
    """Nearest code of ``values / scale`` (``scale`` broadcast per row), as int32."""
    safe_scale = tl.where(scale > 0, scale, 1.0)
    normalized = tl.where(scale > 0, tl.math.div_rn(values, safe_scale), 0.0)
    normalized = tl.where(normalized == normalized, normalized, 0.0)
    normalized = tl.minimum(tl.maximum(normalized, -1.0), 1.0)
    if CODEC == 0:
        code = tl.full(normalized.shape, 0, tl.int32)
        for i in tl.static_range(15):
            code += (normalized > tl.load(consts_ptr + i)).to(tl.int32)
    else:
        magnitude = tl.abs(normalized)
        exponent_bits = tl.load(consts_ptr + 19)
        # The floor of 1e-30 clamps to decade 0 as log10(0) = -inf does, without the -inf.
        decade = tl.floor(tl.log2(tl.maximum(magnitude, 1e-30)) * _LOG10_2) + exponent_bits
        decade = tl.minimum(tl.maximum(decade, 0.0), exponent_bits - 1.0).to(tl.int32)
        # Decade d holds 2**d codes (2**(d + 1) unsigned) after 2**d - 1 (2**(d + 1) - 2) smaller
        # ones: exact integer arithmetic saves two of the four table loads per element.
        if CODEC == 2:
            count = (2 << decade).to(tl.float32)
            first = count - 2.0
        else:
            count = (1 << decade).to(tl.float32)
            first = count - 1.0
        shift = tl.load(consts_ptr + decade)
        lower = tl.load(consts_ptr + 8 + decade)
        position = tl.floor(tl.math.div_rn((magnitude * shift - 0.1) * count, 0.9))
        rank = first + tl.minimum(tl.maximum(position, 0.0), count - 1.0)
        rank = tl.where(magnitude < lower, first - 1.0, rank)
        max_rank = tl.load(consts_ptr + 18)
        rank = tl.where(magnitude >= tl.load(consts_ptr + 16), max_rank, rank)
        zero_code = tl.load(consts_ptr + 17)
        if CODEC == 1:
            code_value = tl.where(normalized >= 0, zero_code + 1.0 + rank,
                                  zero_code - 1.0 - tl.minimum(rank, max_rank - 1.0))
        else:
            code_value = rank + (zero_code + 1.0)
        code = code_value.to(tl.int32)
    return code


@triton.jit
def _store_moment(low, high, codes_ptr, scales_ptr, consts_ptr, rows, cols, row_mask,
                  BLOCK_SIZE: tl.constexpr, BITS: tl.constexpr, CODEC: tl.constexpr):
    """Requantize ``ROWS`` blocks given as (low half, high half); write codes and scales."""
    low_abs = tl.where(_is_finite(low), tl.abs(low), 0.0)
    high_abs = tl.where(_is_finite(high), tl.abs(high), 0.0)
    scale = tl.maximum(_row_max(low_abs), _row_max(high_abs))
    tl.store(scales_ptr + rows, scale, mask=row_mask)
    low_code = _encode(low, scale[:, None], consts_ptr, CODEC)
    high_code = _encode(high, scale[:, None], consts_ptr, CODEC)
    mask = row_mask[:, None]
    if BITS == 8:
        index = rows[:, None] * BLOCK_SIZE + cols[None, :]
        tl.store(codes_ptr + index, low_code.to(tl.uint8), mask=mask)
        tl.store(codes_ptr + index + BLOCK_SIZE // 2, high_code.to(tl.uint8), mask=mask)
    else:
        index = rows[:, None] * (BLOCK_SIZE // 2) + cols[None, :]
        tl.store(codes_ptr + index, (low_code | (high_code << 4)).to(tl.uint8), mask=mask)


@triton.jit
def _to_param_dtype(values, noise_index, seed, DTYPE: tl.constexpr, STOCHASTIC_ROUND: tl.constexpr,
                    INTEGER_BF16_ROUNDING: tl.constexpr):
    """float32 -> the parameter's dtype; bfloat16 optionally by stochastic rounding.

    ``INTEGER_BF16_ROUNDING`` rounds to nearest even with integer operations, for the
    interpreter, whose float32 -> bfloat16 cast truncates; the result is then exact in
    bfloat16, so the final cast cannot round again.
    """
    if DTYPE == tl.bfloat16:
        if STOCHASTIC_ROUND or INTEGER_BF16_ROUNDING:
            bits = values.to(tl.int32, bitcast=True)
            rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
            rounded = tl.where(values == values, rounded, bits | 0x400000)  # NaN stays (quiet) NaN
            if STOCHASTIC_ROUND:
                # functional.round_to_bfloat16_stochastic: 16 random bits below the mantissa.
                noise = _random_bits16(seed, noise_index)
                rounded = tl.where(_is_finite(values), (bits + noise) & -65536, rounded)
            values = rounded.to(tl.float32, bitcast=True)
    return values.to(DTYPE)


@triton.jit
def _update_half(param_ptr, grad_ptr, index, mask, noise_index, exp_avg, exp_avg_sq, max_exp_avg_sq,
                 step_size, decay, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt,
                 eps, seed, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
                 STOCHASTIC_ROUND: tl.constexpr, INTEGER_BF16_ROUNDING: tl.constexpr):
    """``functional.adamw_update`` on one half-tile; stores the parameter, returns the moments."""
    param = tl.load(param_ptr + index, mask=mask, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + index, mask=mask, other=0.0).to(tl.float32)
    if MAXIMIZE:
        grad = -grad
    finite = _is_finite(grad)
    grad = tl.where(finite, grad, 0.0)
    new_exp_avg = exp_avg + one_minus_beta1 * (grad - exp_avg)
    # torch addcmul order, ((1 - beta2) * g) * g: g * g first overflows float32 sooner.
    new_exp_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * grad * grad
    second_moment = new_exp_avg_sq
    new_max = max_exp_avg_sq
    if AMSGRAD:
        new_max = tl.maximum(max_exp_avg_sq, new_exp_avg_sq, propagate_nan=tl.PropagateNan.ALL)
        second_moment = new_max
        new_max = tl.where(finite, new_max, max_exp_avg_sq)
    denom = tl.math.div_rn(tl.sqrt_rn(second_moment), bias_correction2_sqrt) + eps
    new_param = param * decay - step_size * tl.math.div_rn(new_exp_avg, denom)
    new_param = tl.where(finite, new_param, param)
    new_param = _to_param_dtype(new_param, noise_index, seed, param_ptr.dtype.element_ty,
                                STOCHASTIC_ROUND, INTEGER_BF16_ROUNDING)
    tl.store(param_ptr + index, new_param, mask=mask)
    return (tl.where(finite, new_exp_avg, exp_avg), tl.where(finite, new_exp_avg_sq, exp_avg_sq),
            new_max)


@triton.jit
def _offset(layout_row, column: tl.constexpr, ALIGNED: tl.constexpr):
    offset = tl.load(layout_row + column)
    if ALIGNED:
        # Every tensor starts a multiple of 16 elements from its list's base (checked on the
        # host), so the loads below vectorise although the offset comes from memory.
        offset = tl.multiple_of(offset, 16)
    return offset


@triton.jit(do_not_specialize=["seed"])
def _adamw_lowbit_kernel(
    param_base, grad_base, exp_avg_codes_base, exp_avg_scales_base, exp_avg_sq_codes_base,
    exp_avg_sq_scales_base, max_codes_base, max_scales_base, layout_ptr, program_param_ptr,
    exp_avg_table, exp_avg_consts, exp_avg_sq_table, exp_avg_sq_consts,
    step_size, decay, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, seed,
    BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, LAYOUT_COLUMNS: tl.constexpr,
    EXP_AVG_BITS: tl.constexpr, EXP_AVG_CODEC: tl.constexpr,
    EXP_AVG_SQ_BITS: tl.constexpr, EXP_AVG_SQ_CODEC: tl.constexpr,
    AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, STOCHASTIC_ROUND: tl.constexpr,
    INTEGER_BF16_ROUNDING: tl.constexpr, ALIGNED: tl.constexpr,
):
    pid = tl.program_id(0)
    param_index = tl.load(program_param_ptr + pid)
    layout_row = layout_ptr + param_index * LAYOUT_COLUMNS
    numel = tl.load(layout_row + 8)
    first_program = tl.load(layout_row + 9)
    rows = (pid - first_program) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < (numel + BLOCK_SIZE - 1) // BLOCK_SIZE
    cols = tl.arange(0, BLOCK_SIZE // 2)
    low_index = rows[:, None] * BLOCK_SIZE + cols[None, :]
    high_index = low_index + BLOCK_SIZE // 2
    tile_start = pid.to(tl.int64) * (ROWS * BLOCK_SIZE)
    tile_index = tile_start + tl.arange(0, ROWS)[:, None] * BLOCK_SIZE + cols[None, :]

    param_ptr = param_base + _offset(layout_row, 0, ALIGNED)
    grad_ptr = grad_base + _offset(layout_row, 1, ALIGNED)
    exp_avg_codes = exp_avg_codes_base + _offset(layout_row, 2, ALIGNED)
    exp_avg_scales = exp_avg_scales_base + _offset(layout_row, 3, ALIGNED)
    exp_avg_sq_codes = exp_avg_sq_codes_base + _offset(layout_row, 4, ALIGNED)
    exp_avg_sq_scales = exp_avg_sq_scales_base + _offset(layout_row, 5, ALIGNED)

    m_low, m_high = _load_moment(exp_avg_codes, exp_avg_scales, exp_avg_table, rows, cols, row_mask,
                                 BLOCK_SIZE, EXP_AVG_BITS)
    v_low, v_high = _load_moment(exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_table, rows, cols,
                                 row_mask, BLOCK_SIZE, EXP_AVG_SQ_BITS)
    max_low = v_low
    max_high = v_high
    if AMSGRAD:
        max_codes = max_codes_base + _offset(layout_row, 6, ALIGNED)
        max_scales = max_scales_base + _offset(layout_row, 7, ALIGNED)
        max_low, max_high = _load_moment(max_codes, max_scales, exp_avg_sq_table, rows, cols, row_mask,
                                         BLOCK_SIZE, EXP_AVG_SQ_BITS)

    m_low, v_low, max_low = _update_half(
        param_ptr, grad_ptr, low_index, row_mask[:, None] & (low_index < numel), tile_index,
        m_low, v_low, max_low, step_size, decay, one_minus_beta1, beta2, one_minus_beta2,
        bias_correction2_sqrt, eps, seed, AMSGRAD, MAXIMIZE, STOCHASTIC_ROUND, INTEGER_BF16_ROUNDING)
    m_high, v_high, max_high = _update_half(
        param_ptr, grad_ptr, high_index, row_mask[:, None] & (high_index < numel),
        tile_index + BLOCK_SIZE // 2, m_high, v_high, max_high, step_size, decay, one_minus_beta1,
        beta2, one_minus_beta2, bias_correction2_sqrt, eps, seed, AMSGRAD, MAXIMIZE, STOCHASTIC_ROUND,
        INTEGER_BF16_ROUNDING)

    _store_moment(m_low, m_high, exp_avg_codes, exp_avg_scales, exp_avg_consts, rows, cols, row_mask,
                  BLOCK_SIZE, EXP_AVG_BITS, EXP_AVG_CODEC)
    _store_moment(v_low, v_high, exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_consts, rows, cols,
                  row_mask, BLOCK_SIZE, EXP_AVG_SQ_BITS, EXP_AVG_SQ_CODEC)
    if AMSGRAD:
        _store_moment(max_low, max_high, max_codes, max_scales, exp_avg_sq_consts, rows, cols, row_mask,
                      BLOCK_SIZE, EXP_AVG_SQ_BITS, EXP_AVG_SQ_CODEC)


# --- host side ----------------------------------------------------------------------------
def codec_kind(fmt: QuantFormat) -> int:
    codec = fmt.codec
    if isinstance(codec, SmallTableCodec) and codec.table.numel() == 16:
        return SMALL_TABLE
    if isinstance(codec, DynamicExponentCodec) and codec.exponent_bits <= 8:
        # The kernel forms the per-decade code counts as powers of two (see _encode).
        extra = 0 if codec.signed else 1
        if codec._counts == [2 ** (d + extra) for d in range(codec.exponent_bits)]:
            return DYNAMIC_SIGNED if codec.signed else DYNAMIC_UNSIGNED
    raise ValueError(f"format {fmt.name!r} has no Triton encoder")


def codec_constants(fmt: QuantFormat) -> torch.Tensor:
    """The encoder's constants as the kernel reads them (float32, ``CONSTS_SIZE`` entries)."""
    codec = fmt.codec
    consts = [0.0] * CONSTS_SIZE
    if codec_kind(fmt) == SMALL_TABLE:
        consts[:15] = codec._midpoints
    else:
        top = codec.exponent_bits - 1
        for decade in range(codec.exponent_bits):
            consts[decade] = 10.0 ** (top - decade)
            consts[8 + decade] = codec._lower_midpoints[decade]
        consts[16:20] = [codec._upper_midpoint, codec._zero_code, codec._max_rank, codec.exponent_bits]
    return torch.tensor(consts, dtype=torch.float32)


_DEVICE_TABLES: dict = {}


def _device_tables(fmt: QuantFormat, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(decode table, encoder constants) on ``device``: copied there once per process."""
    key = (fmt.name, device)
    if key not in _DEVICE_TABLES:
        _DEVICE_TABLES[key] = (fmt.table.to(device), codec_constants(fmt).to(device))
    return _DEVICE_TABLES[key]


# Decided when the kernel was defined: Triton reads TRITON_INTERPRET in its @jit decorator.
_INTERPRETED = type(_adamw_lowbit_kernel).__name__ == "InterpretedFunction"


def is_interpreted() -> bool:
    """Whether the kernel was built for the Triton interpreter (``TRITON_INTERPRET=1`` when
    this module was imported): the only way it runs on CPU tensors."""
    return _INTERPRETED


def host_scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 step: float) -> dict[str, float]:
    """The kernel's scalar arguments, formed in float64 as ``adamw_update`` forms them from
    its 0-d tensors (Triton rounds each to float32, as torch rounds a 0-d double operand)."""
    return dict(
        step_size=lr / (1 - beta1**step),
        decay=1 - lr * weight_decay,
        one_minus_beta1=1 - beta1,
        beta2=beta2,
        one_minus_beta2=1 - beta2,
        bias_correction2_sqrt=math.sqrt(1 - beta2**step),
        eps=eps,
    )


def launch(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avg: list[tuple],
           exp_avg_sq: list[tuple], max_exp_avg_sq: list[tuple] | None, scalars: dict[str, float],
           *, exp_avg_format: QuantFormat, exp_avg_sq_format: QuantFormat, block_size: int,
           maximize: bool, stochastic_round: bool, seed: int) -> None:
    """One launch for every parameter given; updates params and moments in place.

    ``params``/``grads`` are contiguous tensors of one dtype each; each moment is a list of
    ``(codes, scales)`` pairs laid out as in ``QuantizedState``; ``scalars`` comes from
    ``host_scalars``.
    """
    if not params:
        return
    device = params[0].device
    if device.type == "cpu" and not is_interpreted():
        raise RuntimeError(
            "the Triton kernel runs on CPU tensors only under the Triton interpreter: set "
            "TRITON_INTERPRET=1 before lowbit_optim.kernels is imported, or use a CUDA device"
        )
    for name, tensors in (("params", params), ("grads", grads)):
        if any(t.device != device or t.dtype != tensors[0].dtype or not t.is_contiguous() for t in tensors):
            raise ValueError(f"{name} must be contiguous tensors of one dtype on {device}")
    amsgrad = max_exp_avg_sq is not None
    tile = INTERPRETER_TILE_ELEMENTS if device.type == "cpu" else GPU_TILE_ELEMENTS
    rows = max(1, tile // block_size)
    moments = [exp_avg, exp_avg_sq, max_exp_avg_sq if amsgrad else exp_avg_sq]
    tensor_lists = [params, grads] + [[pair[i] for pair in moment] for moment in moments for i in (0, 1)]
    layout = layouts.get_layout(tensor_lists, [p.numel() for p in params], block_size, rows, device)
    exp_avg_table, exp_avg_consts = _device_tables(exp_avg_format, device)
    exp_avg_sq_table, exp_avg_sq_consts = _device_tables(exp_avg_sq_format, device)
    bases = [tensors[0] for tensors in tensor_lists]
    _adamw_lowbit_kernel[(layout.num_programs,)](
        *bases, layout.table, layout.program_param,
        exp_avg_table, exp_avg_consts, exp_avg_sq_table, exp_avg_sq_consts,
        scalars["step_size"], scalars["decay"], scalars["one_minus_beta1"], scalars["beta2"],
        scalars["one_minus_beta2"], scalars["bias_correction2_sqrt"], scalars["eps"], seed,
        BLOCK_SIZE=block_size, ROWS=rows, LAYOUT_COLUMNS=layouts.LAYOUT_COLUMNS,
        EXP_AVG_BITS=exp_avg_format.bits, EXP_AVG_CODEC=codec_kind(exp_avg_format),
        EXP_AVG_SQ_BITS=exp_avg_sq_format.bits, EXP_AVG_SQ_CODEC=codec_kind(exp_avg_sq_format),
        AMSGRAD=amsgrad, MAXIMIZE=maximize,
        STOCHASTIC_ROUND=stochastic_round and params[0].dtype == torch.bfloat16,
        INTEGER_BF16_ROUNDING=device.type == "cpu", ALIGNED=layout.aligned,
        num_warps=4, enable_fp_fusion=False,
    )
