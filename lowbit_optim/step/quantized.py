"""The step of a parameter with quantized moments: ``quantized_adamw_step`` decodes a
range of blocks, applies ``math.adamw_update`` and encodes them again, in place; compiled
once per state kind and flags (``COMPILED_STEPS``) or run eagerly, over the parameter's blocks in
bounded chunks (``run_quantized_step``).
"""

import functools
from typing import NamedTuple

import torch

from lowbit_optim.formats.catalog import QuantFormat
from lowbit_optim.step.chunks import (
    CompiledVariants,
    ParamStep,
    TailScratch,
    call_step,
    correction_dtype_of,
    for_each_block_chunk,
    leading_dims,
)
from lowbit_optim.step.master_weights import read_master, write_master
from lowbit_optim.step.math import (
    StepScalars,
    _step_constants_op,
    adam_ratio_bound,
    adamw_update,
    bias_corrections,
    compute_dtype,
    write_param,
)


class StoredMoment(NamedTuple):
    """The tensors a quantized moment is stored in (``QuantizedState.codes``/``.scales``), or
    a view of some of its blocks: what the compiled step reads and overwrites."""

    codes: torch.Tensor
    scales: torch.Tensor


def quantized_adamw_step(param, grad, exp_avg: StoredMoment, exp_avg_sq: StoredMoment,
                         max_exp_avg_sq: StoredMoment | None, scalars: StepScalars, *,
                         exp_avg_format: QuantFormat, exp_avg_sq_format: QuantFormat,
                         maximize: bool, stochastic_round: bool,
                         decoupled_weight_decay: bool = True, weight_correction: torch.Tensor | None = None):
    """``math.adamw_update`` on blocks: dequantize -> update -> requantize, in place.

    ``param`` and ``grad`` are ``(num_blocks, block_size)`` views; the moments are the stored
    tensors of their ``QuantizedState`` (the same rows), ``max_exp_avg_sq`` ``None`` unless
    amsgrad is on. ``weight_correction``: the blocks of a bfloat16 or float16 parameter's master weight
    correction (``master_weights``), whose master weight is read and written instead of the
    parameter, or ``None``. Only tensors are taken, so ``torch.compile`` traces it once per
    state kind, parameter dtype and correction dtype, whatever the parameter's shape.
    """
    # Each ``split`` slice of the blocks (the low and high halves for 4-bit, whose codes share
    # bytes; the whole block for 8-bit) is decoded, updated and encoded on its own and only
    # the packed bytes combine them: Inductor then computes both nibbles of a byte in the loop
    # that writes it instead of materialising unpacked codes and whole-block float buffers.
    # float64 parameters are updated in float64 (their moments are quantized all the same).
    dtype = compute_dtype(param)
    lr, beta1, beta2, eps, weight_decay, step = scalars
    amsgrad = max_exp_avg_sq is not None
    exp_avg_parts = exp_avg_format.decode_parts(*exp_avg)
    exp_avg_sq_parts = exp_avg_sq_format.decode_parts(*exp_avg_sq)
    max_parts = exp_avg_sq_format.decode_parts(*max_exp_avg_sq) if amsgrad else None
    param_parts = exp_avg_format.split(param)
    grad_parts = exp_avg_format.split(grad)
    weight_correction_parts = None if weight_correction is None else exp_avg_format.split(weight_correction)

    # On CPU, once per call (see _step_constants_op). Elsewhere inline, as before: the op's
    # 0-d results are CPU tensors made inside the graph, and whether Inductor passes those to
    # a GPU kernel as it passes 0-d CPU graph inputs was not checked (no GPU at hand).
    # The ratio is clamped at Adam's own bound: quantized moments are not exact ones.
    if param.device.type == "cpu":
        *corrections, max_ratio = _step_constants_op(beta1, beta2, step)
    else:
        corrections = bias_corrections(beta1, beta2, step)
        max_ratio = adam_ratio_bound(beta1, beta2, step)
    new_params, new_exp_avgs, new_exp_avg_sqs, new_maxes = [], [], [], []
    for index, param_part in enumerate(param_parts):
        if weight_correction_parts is not None:
            param_part = read_master(param_part, weight_correction_parts[index])
        new_param, new_exp_avg, new_exp_avg_sq, new_max = adamw_update(
            param_part.to(dtype), grad_parts[index].to(dtype), exp_avg_parts[index].to(dtype),
            exp_avg_sq_parts[index].to(dtype), max_parts[index].to(dtype) if amsgrad else None,
            lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
            maximize=maximize, corrections=corrections, decoupled_weight_decay=decoupled_weight_decay,
            max_ratio=max_ratio,
        )
        new_params.append(new_param)
        new_exp_avgs.append(new_exp_avg)
        new_exp_avg_sqs.append(new_exp_avg_sq)
        new_maxes.append(new_max)

    updates = [(exp_avg, exp_avg_format, new_exp_avgs), (exp_avg_sq, exp_avg_sq_format, new_exp_avg_sqs),
               (max_exp_avg_sq, exp_avg_sq_format, new_maxes)]
    store_blocks([update for update in updates if update[0] is not None], param_parts, new_params,
                 weight_correction_parts, stochastic_round=stochastic_round)


def store_blocks(moments: list[tuple], param_parts, new_params, correction_parts, *,
                 stochastic_round: bool) -> None:
    """The end of a quantized step, in place: each ``(stored moment, format, new values per
    slice)`` of ``moments`` encoded into its codes and scales, and each slice's new parameter
    written (through its master weight correction, ``correction_parts``, if it keeps one)."""
    for target, fmt, values in moments:
        codes, scales = fmt.encode_parts(values)
        target.codes.copy_(codes)
        target.scales.copy_(scales)
    # Written slice by slice: a torch.cat here made Inductor materialise its inputs.
    for index, (param_part, new_param) in enumerate(zip(param_parts, new_params)):
        if correction_parts is not None:
            write_master(param_part, correction_parts[index], new_param)
        else:
            write_param(param_part, new_param, stochastic_round=stochastic_round)


# One compiled step per state kind, flags, amsgrad and correction dtype (``chunks.CompiledVariants``).
COMPILED_STEPS = CompiledVariants(quantized_adamw_step, "quantized_adamw_step")


def compiled_graph_count(exp_avg_format, exp_avg_sq_format) -> int:
    """How many graphs Dynamo holds for one state kind's step, over all its variants (0 before
    its first call)."""
    return COMPILED_STEPS.graph_count(exp_avg_format, exp_avg_sq_format)


def run_quantized_step(backend: str, entry: ParamStep, scalars: StepScalars, scratch: TailScratch,
                       *, maximize: bool, stochastic_round: bool,
                       decoupled_weight_decay: bool = True) -> None:
    """Update one parameter and its quantized moments in place with ``"compile"`` or
    ``"eager"``."""
    param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, _, weight_correction = entry
    if backend == "compile":
        step = COMPILED_STEPS.get((exp_avg.format, exp_avg_sq.format, maximize, stochastic_round,
                                   decoupled_weight_decay, max_exp_avg_sq is not None,
                                   correction_dtype_of(weight_correction)))
    else:
        step = quantized_adamw_step
    step = functools.partial(
        step, exp_avg_format=exp_avg.format, exp_avg_sq_format=exp_avg_sq.format,
        maximize=maximize, stochastic_round=stochastic_round,
        decoupled_weight_decay=decoupled_weight_decay,
    )

    moments = [exp_avg, exp_avg_sq] + ([max_exp_avg_sq] if max_exp_avg_sq is not None else [])

    def update(param_blocks, grad_blocks, block_rows: slice, first_element: int, correction_blocks) -> None:
        stored = [StoredMoment(m.codes[block_rows], m.scales[block_rows]) for m in moments]
        if max_exp_avg_sq is None:
            stored.append(None)
        options = {} if correction_blocks is None else {"weight_correction": correction_blocks}
        tensors = (param_blocks, grad_blocks, correction_blocks,
                   *(tensor for moment in stored if moment is not None for tensor in moment))
        call_step(step, backend == "compile", leading_dims(tensors), param_blocks, grad_blocks, *stored,
                  scalars, **options)

    for_each_block_chunk(param, grad, exp_avg.block_size, scratch, update,
                         weight_correction=weight_correction)
