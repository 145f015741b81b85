"""The fused low-bit step in Triton, for any update rule: decode -> the rule's math -> encode,
one pass over memory.

Per element, with the rule's moments ``m_0 .. m_{k-1}`` (one to three) decoded from their
codes (``m_i = table_i[code_i] * scale_i``, ``moment_codes.load_moment``) and ``g`` the gradient
(negated if maximize)::

    finite       = isfinite(g)
    p', m_i'     = UPDATE(p, g, (m_0, ...), constants)     (the rule's @triton.jit piece)
    (p', m_i')   = finite ? (p', m_i') : (p, m_i)

then each moment is requantized per block (``moment_codes.store_moment``) and the parameter
written back in its dtype (``param_access``). ``UPDATE`` is the rule's element-wise math, a
``tl.constexpr`` argument: ``rules.adamw.adamw_kernel_update`` (AdamW and Adam),
``rules.lion.lion_kernel_update``, ``rules.ademamix.ademamix_kernel_update``. It receives the
float32 parameter, the gradient (possibly non-finite: the selects above put the old values
back), the rule's moments as a tuple, its per-step ``constants`` (a tuple of floats formed on
the host, passed as runtime scalars so a schedule never recompiles) and its compile-time
``UPDATE_VARIANT``, and returns the new parameter and moments. What every rule shares is the
kernel's, not the rule's: maximize, the non-finite gradient policy, master weights (the
``MASTER_WEIGHT_BITS`` variants: ``p`` is the float32 master weight read from the bfloat16 or
float16 parameter and its correction, and ``p'`` is split back into both, exactly as
``lowbit_optim.step.master_weights`` reads and splits) and bfloat16 stochastic rounding. The
oracle is the compiled step (``step.rule_step.quantized_rule_step``; tests/test_triton.py,
tests/test_triton_rules.py). Multiply-add contraction is off (``enable_fp_fusion=False``), so a
rule piece that writes its moments operation for operation as its specification gets the
reference's block scales bit for bit; the bounds of the encoders are in ``moment_codes``, each
rule's own in its piece's docstring.

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

import triton
import triton.language as tl

from lowbit_optim.step.kernels import layout as layouts
from lowbit_optim.step.kernels import master_weight_split
from lowbit_optim.step.kernels.moment_codes import is_finite, load_moment, store_moment
from lowbit_optim.step.kernels.param_access import (
    NOISE_MASK,
    NOISE_SHIFT,
    load_param,
    random_bits32,
    to_param_dtype,
)

_ALIGNMENT_ELEMENTS = tl.constexpr(layouts.ALIGNMENT_ELEMENTS)
# The layout table's columns (lowbit_optim.step.kernels.layout): the rule's moments' codes and
# scales in its order, in the three column pairs.
_PARAM = tl.constexpr(layouts.PARAM)
_GRAD = tl.constexpr(layouts.GRAD)
_MOMENT0_CODES = tl.constexpr(layouts.MOMENT_CODES[0])
_MOMENT0_SCALES = tl.constexpr(layouts.MOMENT_SCALES[0])
_MOMENT1_CODES = tl.constexpr(layouts.MOMENT_CODES[1])
_MOMENT1_SCALES = tl.constexpr(layouts.MOMENT_SCALES[1])
_MOMENT2_CODES = tl.constexpr(layouts.MOMENT_CODES[2])
_MOMENT2_SCALES = tl.constexpr(layouts.MOMENT_SCALES[2])
_NUMEL = tl.constexpr(layouts.NUMEL)
_FIRST_PROGRAM = tl.constexpr(layouts.FIRST_PROGRAM)
_WEIGHT_CORRECTION = tl.constexpr(layouts.WEIGHT_CORRECTION)


@triton.jit
def _kept_where(finite, new_moments, moments):
    """Each new moment where the gradient is finite, the old one elsewhere."""
    if len(moments) == 1:
        return (tl.where(finite, new_moments[0], moments[0]),)
    elif len(moments) == 2:
        return (tl.where(finite, new_moments[0], moments[0]), tl.where(finite, new_moments[1], moments[1]))
    else:
        return (tl.where(finite, new_moments[0], moments[0]), tl.where(finite, new_moments[1], moments[1]),
                tl.where(finite, new_moments[2], moments[2]))


@triton.jit
def _update_half(param_ptr, grad_ptr, correction_ptr, half, moments, constants, UPDATE: tl.constexpr,
                 UPDATE_VARIANT: tl.constexpr, MAXIMIZE: tl.constexpr, STOCHASTIC_ROUND: tl.constexpr,
                 MASTER_WEIGHT_BITS: tl.constexpr, INTERPRETED: tl.constexpr):
    """The rule's ``UPDATE`` on one half-tile with the shared policies; stores the parameter,
    returns the moments. ``half``: the half-tile's ``(index, mask, noise)``; ``moments``: its
    decoded moments in the rule's order; ``constants``: the step's, the same for both halves.
    ``MASTER_WEIGHT_BITS`` (24 or 32; 0 for none): the update reads and writes the master
    weight of a bfloat16 or float16 parameter and its correction at ``correction_ptr``, as the
    compiled step does."""
    index, mask, noise = half
    grad = tl.load(grad_ptr + index, mask=mask, other=0.0).to(tl.float32)
    if MAXIMIZE:
        grad = -grad
    # A non-finite gradient makes the new values NaN or inf; the selects below put back the
    # old ones, so the gradient itself needs no cleaning.
    finite = is_finite(grad)
    param = load_param(param_ptr, correction_ptr, index, mask, MASTER_WEIGHT_BITS)
    new_param, new_moments = UPDATE(param, grad, moments, constants, UPDATE_VARIANT, INTERPRETED)
    new_param = tl.where(finite, new_param, param)
    if MASTER_WEIGHT_BITS:
        new_param, new_correction = master_weight_split.split_master(new_param, param_ptr.dtype.element_ty,
                                                                     MASTER_WEIGHT_BITS)
        tl.store(correction_ptr + index, new_correction, mask=mask)
    else:
        new_param = to_param_dtype(new_param, noise, param_ptr.dtype.element_ty, STOCHASTIC_ROUND,
                                   INTERPRETED)
    tl.store(param_ptr + index, new_param, mask=mask)
    return _kept_where(finite, new_moments, moments)


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


@triton.jit
def _load_table(table_ptr, BITS: tl.constexpr):
    """A map's decode table, once per program, held in registers (gathers read it from shared
    memory); the linear map's is never read."""
    return tl.load(table_ptr + tl.arange(0, 1 << BITS))


@triton.jit(do_not_specialize=["seed"])
def lowbit_step_kernel(
    param_base, grad_base, moment0_codes_base, moment0_scales_base, moment1_codes_base, moment1_scales_base,
    moment2_codes_base, moment2_scales_base, weight_correction_base, layout_ptr, program_param_ptr,
    moment0_table_ptr, moment0_encoder_ptr, moment1_table_ptr, moment1_encoder_ptr, moment2_table_ptr,
    moment2_encoder_ptr, constants, seed,
    UPDATE: tl.constexpr, UPDATE_VARIANT: tl.constexpr, MOMENT_COUNT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, LAYOUT_COLUMNS: tl.constexpr,
    MOMENT0_BITS: tl.constexpr, MOMENT0_CODEC: tl.constexpr, MOMENT1_BITS: tl.constexpr,
    MOMENT1_CODEC: tl.constexpr, MOMENT2_BITS: tl.constexpr, MOMENT2_CODEC: tl.constexpr,
    MAXIMIZE: tl.constexpr, STOCHASTIC_ROUND: tl.constexpr, MASTER_WEIGHT_BITS: tl.constexpr,
    INTERPRETED: tl.constexpr, ALIGNED: tl.constexpr,
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
        noise = random_bits32(seed, pair_index)
        noise_low = (noise & NOISE_MASK).to(tl.int32)
        noise_high = (noise >> NOISE_SHIFT).to(tl.int32)

    param_ptr = param_base + _offset(layout_row, _PARAM, ALIGNED)
    grad_ptr = grad_base + _offset(layout_row, _GRAD, ALIGNED)
    correction_ptr = weight_correction_base  # None without master weights
    if MASTER_WEIGHT_BITS:
        correction_ptr = weight_correction_base + _offset(layout_row, _WEIGHT_CORRECTION, ALIGNED)

    # Decode the rule's moments, each (low half, high half) of the tile.
    moment0_codes = moment0_codes_base + _offset(layout_row, _MOMENT0_CODES, ALIGNED)
    moment0_scales = moment0_scales_base + _offset(layout_row, _MOMENT0_SCALES, ALIGNED)
    if MOMENT_COUNT >= 2:
        moment1_codes = moment1_codes_base + _offset(layout_row, _MOMENT1_CODES, ALIGNED)
        moment1_scales = moment1_scales_base + _offset(layout_row, _MOMENT1_SCALES, ALIGNED)
    table0 = _load_table(moment0_table_ptr, MOMENT0_BITS)
    if MOMENT_COUNT >= 2:
        table1 = _load_table(moment1_table_ptr, MOMENT1_BITS)
    m0_low, m0_high = load_moment(moment0_codes, moment0_scales, table0, rows, cols, row_mask, BLOCK_SIZE,
                                  MOMENT0_BITS, MOMENT0_CODEC)
    low = (m0_low,)
    high = (m0_high,)
    if MOMENT_COUNT >= 2:
        m1_low, m1_high = load_moment(moment1_codes, moment1_scales, table1, rows, cols, row_mask, BLOCK_SIZE,
                                      MOMENT1_BITS, MOMENT1_CODEC)
        low = (m0_low, m1_low)
        high = (m0_high, m1_high)
    if MOMENT_COUNT == 3:
        moment2_codes = moment2_codes_base + _offset(layout_row, _MOMENT2_CODES, ALIGNED)
        moment2_scales = moment2_scales_base + _offset(layout_row, _MOMENT2_SCALES, ALIGNED)
        table2 = _load_table(moment2_table_ptr, MOMENT2_BITS)
        m2_low, m2_high = load_moment(moment2_codes, moment2_scales, table2, rows, cols, row_mask, BLOCK_SIZE,
                                      MOMENT2_BITS, MOMENT2_CODEC)
        low = (m0_low, m1_low, m2_low)
        high = (m0_high, m1_high, m2_high)

    low_half = (low_index, row_mask[:, None] & (low_index < numel32), noise_low)
    high_half = (high_index, row_mask[:, None] & (high_index < numel32), noise_high)
    low = _update_half(param_ptr, grad_ptr, correction_ptr, low_half, low, constants, UPDATE,
                       UPDATE_VARIANT, MAXIMIZE, STOCHASTIC_ROUND, MASTER_WEIGHT_BITS, INTERPRETED)
    high = _update_half(param_ptr, grad_ptr, correction_ptr, high_half, high, constants, UPDATE,
                        UPDATE_VARIANT, MAXIMIZE, STOCHASTIC_ROUND, MASTER_WEIGHT_BITS, INTERPRETED)

    # The codes' and scales' addresses again, for the stores: held from the loads, they were
    # spilled under the register cap while the cell encoders' lookups are in flight (sm_90).
    moment0_codes = moment0_codes_base + _offset(layout_row, _MOMENT0_CODES, ALIGNED, True)
    moment0_scales = moment0_scales_base + _offset(layout_row, _MOMENT0_SCALES, ALIGNED, True)
    if MOMENT_COUNT >= 2:
        moment1_codes = moment1_codes_base + _offset(layout_row, _MOMENT1_CODES, ALIGNED, True)
        moment1_scales = moment1_scales_base + _offset(layout_row, _MOMENT1_SCALES, ALIGNED, True)
    store_moment(low[0], high[0], moment0_codes, moment0_scales, moment0_encoder_ptr, rows, cols, row_mask,
                 BLOCK_SIZE, MOMENT0_BITS, MOMENT0_CODEC, INTERPRETED)
    if MOMENT_COUNT >= 2:
        store_moment(low[1], high[1], moment1_codes, moment1_scales, moment1_encoder_ptr, rows, cols,
                     row_mask, BLOCK_SIZE, MOMENT1_BITS, MOMENT1_CODEC, INTERPRETED)
    if MOMENT_COUNT == 3:
        store_moment(low[2], high[2], moment2_codes, moment2_scales, moment2_encoder_ptr, rows, cols,
                     row_mask, BLOCK_SIZE, MOMENT2_BITS, MOMENT2_CODEC, INTERPRETED)
