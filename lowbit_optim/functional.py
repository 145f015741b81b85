"""The AdamW math, written once in float32, and the per-parameter steps built on it.

``adamw_update`` is the specification: the compiled step, the eager step and the Triton
kernels compute exactly this, and tests use it as the oracle. It follows
``torch.optim.AdamW`` (decoupled weight decay, bias-corrected moments, ``eps`` added after
the square root) with one deliberate difference, the non-finite gradient policy: an element
whose gradient is NaN or ±inf keeps its parameter value and its moments for that step, so a
bad element never spreads to its quantization block, its tensor or other parameters.

Hyperparameters arrive as 0-d CPU tensors (``lr``, ``step`` float32; betas, eps and weight
decay float64 so the bias corrections match torch's float64 arithmetic): a compiled graph
reads them as inputs, so new values never recompile, and a CPU scalar reaches a device
kernel as an argument, so no per-step host-to-device copy happens.
"""

from typing import NamedTuple

import torch

from lowbit_optim.quant.formats import QuantFormat


class StepScalars(NamedTuple):
    """A step's hyperparameters and step count, 0-d CPU tensors (``hyperparams.GroupScalars``
    holds the group's; ``step`` is the parameter's own count). Graph inputs of the compiled
    step, so new values never recompile it."""

    lr: torch.Tensor
    beta1: torch.Tensor
    beta2: torch.Tensor
    eps: torch.Tensor
    weight_decay: torch.Tensor
    step: torch.Tensor


class StoredMoment(NamedTuple):
    """The tensors a quantized moment is stored in (``QuantizedState.codes``/``.scales``), or
    a view of some of its blocks: what the compiled step reads and overwrites."""

    codes: torch.Tensor
    scales: torch.Tensor


def compute_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype a parameter's update is computed in, and its float moments kept in: float64
    for float64 parameters (so they are not rounded to float32 every step, as torch keeps
    them), float32 for every other float dtype."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def bias_corrections(beta1, beta2, step):
    """``(1 - beta1**step, sqrt(1 - beta2**step))``, from 0-d tensors (float64 betas)."""
    return 1 - beta1**step, (1 - beta2**step).sqrt()


def adam_ratio_bound(beta1, beta2, step):
    """Adam's bound on ``|exp_avg / denom|`` in ``parameter_update`` at ``step``.

    Cauchy-Schwarz on ``m_t = (1 - b1) sum_k b1**k g_{t-k}`` and ``v_t = (1 - b2) sum_k
    b2**k g_{t-k}**2`` gives ``|m_t| <= (1 - b1) sqrt(sum_{k<t} (b1**2 / b2)**k)
    sqrt(v_t / (1 - b2))``; ``exp_avg / denom`` is ``m_t / (sqrt(v_t) / sqrt(1 - b2**t))``
    at most. Infinite for ``beta2 = 0`` (then ``v`` holds only the last gradient).
    """
    gamma = beta1**2 / beta2
    geometric = torch.where(gamma == 1, step.to(gamma.dtype), (1 - gamma**step) / (1 - gamma))
    bound = (1 - beta1) * (geometric / (1 - beta2)).sqrt() * (1 - beta2**step).sqrt()
    # masked_fill, not where with a Python number: no tensor is made from the number.
    return bound.masked_fill(beta2 <= 0, torch.inf)


@torch.library.custom_op("lowbit_optim::step_constants", mutates_args=())
def _step_constants_op(beta1: torch.Tensor, beta2: torch.Tensor,
                       step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(*bias_corrections, adam_ratio_bound)`` as an operator Inductor cannot see into.

    Inductor inlines 0-d computations into every loop that uses them, and its C++ is built
    with ``-fmath-errno``, so the compiler cannot hoist ``std::pow`` out of the loop: the two
    float64 powers then ran once per 16 elements in every pass (measured: a pow and a sqrt
    in a loop over 10.5M float32 values, 31 ms against 17 ms at 1 thread). Computed once
    here, the loops read two numbers.
    """
    values = (*bias_corrections(beta1, beta2, step), adam_ratio_bound(beta1, beta2, step))
    return tuple(value.clone() for value in values)


@_step_constants_op.register_fake
def _(beta1, beta2, step):
    shape = torch.broadcast_shapes(beta1.shape, beta2.shape, step.shape)
    dtype = torch.promote_types(beta1.dtype, step.dtype)
    return tuple(beta1.new_empty(shape, dtype=dtype) for _ in range(3))


def effective_gradient(param, grad, *, weight_decay, maximize: bool, decoupled_weight_decay: bool):
    """``(finite, gradient)``: which elements have a finite gradient, and the gradient the
    moments see (negated to maximize, non-finite elements 0, plus ``weight_decay * param``
    for ``torch.optim.Adam``'s L2 decay)."""
    grad = -grad if maximize else grad
    finite = torch.isfinite(grad)
    # Not nan_to_num: Inductor's CPU code tests NaN element by element in a scalar loop for
    # it; the same zeros come from the finite mask (masked_fill, unlike where with a Python
    # number, makes no tensor from the number in eager mode: tests/test_schedules.py).
    safe_grad = grad.masked_fill(~finite, 0.0)
    if not decoupled_weight_decay:
        safe_grad = safe_grad + weight_decay * param  # torch.optim.Adam: grad.add(param, alpha=wd)
    return finite, safe_grad


def first_moment_update(exp_avg, safe_grad, beta1):
    # torch.optim.AdamW's lerp, so that float32 state tracks it to within rounding.
    return exp_avg + (1 - beta1) * (safe_grad - exp_avg)


def squared_gradient_term(safe_grad, beta2):
    # ((1 - beta2) * grad) * grad, the order of torch's addcmul: grad * grad first would
    # overflow float32 from |grad| > 1.8e19 instead of ~5.8e20 (tests/test_robustness.py).
    return (1 - beta2) * safe_grad * safe_grad


def parameter_update(param, exp_avg, second_moment, *, lr, eps, weight_decay, corrections,
                     decoupled_weight_decay: bool, max_ratio=None):
    """The new parameter from the updated moments: torch.optim.AdamW's addcdiv.

    ``max_ratio``, if given, clamps ``exp_avg / denom`` elementwise to ``[-max_ratio,
    max_ratio]``: ``adam_ratio_bound``, which exact Adam never exceeds, for moments that are
    quantized or factored. A quantized second moment can stand for far less than an
    element's own (a square that overflows float32 is stored at its block's scale; a factored
    one underestimates by up to ``min(rows, columns)`` times), and the clamp keeps every
    update within what Adam itself could do (docs/design.md, "Non-finite values")."""
    bias_correction1, bias_correction2_sqrt = corrections
    step_size = lr / bias_correction1
    denom = second_moment.sqrt() / bias_correction2_sqrt + eps
    decayed = param * (1 - lr * weight_decay) if decoupled_weight_decay else param
    ratio = exp_avg / denom
    if max_ratio is not None:
        ratio = ratio.clamp(-max_ratio, max_ratio)
    return decayed - step_size * ratio


def adamw_update(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, *, lr, beta1, beta2, eps,
                 weight_decay, step, maximize: bool, corrections=None,
                 decoupled_weight_decay: bool = True, max_ratio=None):
    """One AdamW step on float32 (or float64) values.

    Returns the new ``(param, exp_avg, exp_avg_sq, max_exp_avg_sq)``.

    ``max_exp_avg_sq`` is ``None`` unless amsgrad is on. ``corrections``, if given, is
    ``bias_corrections(beta1, beta2, step)`` computed beforehand. With
    ``decoupled_weight_decay=False`` it is ``torch.optim.Adam``'s step instead: the weight
    decay is added to the gradient (L2) rather than applied to the parameter. ``max_ratio``:
    see ``parameter_update``. Pure: inputs are not modified.
    """
    finite, safe_grad = effective_gradient(param, grad, weight_decay=weight_decay, maximize=maximize,
                                           decoupled_weight_decay=decoupled_weight_decay)
    # Same operation order as torch.optim.AdamW (lerp, then mul + addcmul, then addcdiv).
    new_exp_avg = first_moment_update(exp_avg, safe_grad, beta1)
    new_exp_avg_sq = exp_avg_sq * beta2 + squared_gradient_term(safe_grad, beta2)
    second_moment = new_exp_avg_sq
    new_max = None
    if max_exp_avg_sq is not None:
        new_max = torch.maximum(max_exp_avg_sq, new_exp_avg_sq)
        second_moment = new_max

    if corrections is None:
        corrections = bias_corrections(beta1, beta2, step)
    new_param = parameter_update(param, new_exp_avg, second_moment, lr=lr, eps=eps,
                                 weight_decay=weight_decay, corrections=corrections,
                                 decoupled_weight_decay=decoupled_weight_decay, max_ratio=max_ratio)

    new_param = torch.where(finite, new_param, param)
    new_exp_avg = torch.where(finite, new_exp_avg, exp_avg)
    new_exp_avg_sq = torch.where(finite, new_exp_avg_sq, exp_avg_sq)
    if new_max is not None:
        new_max = torch.where(finite, new_max, max_exp_avg_sq)
    return new_param, new_exp_avg, new_exp_avg_sq, new_max


def round_to_bfloat16_stochastic(values: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16, rounding up with probability equal to the dropped fraction.

    Adds 16 random bits below the bfloat16 mantissa and truncates, so E[result] equals the
    float32 value (unbiased, unlike round-to-nearest, which loses updates smaller than half a
    bfloat16 ulp). Written with integer ops so it compiles and matches the Triton kernel.
    """
    bits = values.view(torch.int32)
    noise = torch.randint_like(bits, 0, 1 << 16)
    truncated = (bits + noise) & -65536
    rounded = truncated.view(torch.float32)
    # Rounding up can carry a finite value past the largest bfloat16 into inf; keep inf/NaN
    # inputs as they are and leave finite values finite.
    return torch.where(torch.isfinite(values), rounded, values).to(torch.bfloat16)


def write_param(param: torch.Tensor, values: torch.Tensor, *, stochastic_round: bool) -> None:
    """Store float32 ``values`` into ``param`` (any float dtype), in place."""
    if stochastic_round and param.dtype == torch.bfloat16:
        param.copy_(round_to_bfloat16_stochastic(values))
    else:
        param.copy_(values)


class _Flat:
    """A list of tensors as one flat tensor, to compute on and write back.

    Tensors that already are consecutive views of one 1-D tensor (the float moments of small
    parameters, which ``step_plan`` lays out so) are used in place, as is a single contiguous
    tensor (a large parameter stepped alone is not copied); others are gathered into a
    buffer, with a view of it shaped like each tensor made once.
    """

    def __init__(self, tensors: list[torch.Tensor]):
        self.views = None
        if len(tensors) == 1 and tensors[0].is_contiguous():
            self.flat = tensors[0].view(-1)
            return
        self.flat = consecutive_views(tensors)
        if self.flat is None:
            sizes = [t.numel() for t in tensors]
            self.flat = torch.empty(sum(sizes), dtype=tensors[0].dtype, device=tensors[0].device)
            self.views = [piece.view(t.shape) for piece, t in zip(self.flat.split(sizes), tensors)]

    def gather(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if self.views is not None:
            torch._foreach_copy_(self.views, tensors)
        return self.flat

    def scatter(self, tensors: list[torch.Tensor], values: torch.Tensor) -> None:
        self.flat.copy_(values)
        if self.views is not None:
            torch._foreach_copy_(tensors, self.views)


def consecutive_views(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D tensor that ``tensors`` are contiguous, consecutive views of, in order, or None."""
    base = tensors[0]._base
    if base is None or base.dim() != 1 or not base.is_contiguous():
        return None
    offset = start = tensors[0].storage_offset()
    for tensor in tensors:
        if tensor._base is not base or not tensor.is_contiguous() or tensor.storage_offset() != offset:
            return None
        offset += tensor.numel()
    return base[start - base.storage_offset():offset - base.storage_offset()]


class FloatStateStep:
    """The step for parameters with float moments (below ``min_quant_size``), in place,
    set up once for a fixed list of them (``backends.AdamWPlan`` keeps it between steps).

    Parameters of one device and dtype with the same step count are computed as one flat
    tensor, so the number of kernels does not grow with their number (issue 17: one by one,
    each norm or bias cost ~40 ops, ~25 launches on a GPU), with no Python work per parameter
    (a ``cat``, a ``split`` and a ``view`` per tensor cost ~2.5 ms per step for 160 norms on
    CPU, issue 17 item 3): parameters and gradients are gathered with one
    ``torch._foreach_copy_`` each into buffers kept here and the parameters written back with
    one; moments laid out as consecutive views of one tensor (``step_plan`` does that) are
    updated in place, others gathered and written back the same way (``_Flat``).
    ``max_exp_avg_sqs`` is ``None`` unless amsgrad is on. The moments are ``compute_dtype``
    (float32; float64 for float64 parameters).
    """

    def __init__(self, params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs):
        self.params = list(params)
        self.moments = [list(exp_avgs), list(exp_avg_sqs)]
        if max_exp_avg_sqs is not None:
            self.moments.append(list(max_exp_avg_sqs))
        self.param_flat = _Flat(self.params)
        self.moment_flats = [_Flat(moments) for moments in self.moments]
        # Gradients are new tensors at every step: only a buffer for them is kept.
        self.grad_buffer = None if len(self.params) == 1 else _Flat(self.params)

    def step(self, grads, *, lr, beta1, beta2, eps, weight_decay, step, maximize: bool,
             stochastic_round: bool, decoupled_weight_decay: bool = True) -> None:
        dtype = compute_dtype(self.params[0])
        grad = grads[0].reshape(-1) if self.grad_buffer is None else self.grad_buffer.gather(grads)
        moments = [flat.gather(tensors) for flat, tensors in zip(self.moment_flats, self.moments)]
        new_param, *new_moments = adamw_update(
            self.param_flat.gather(self.params).to(dtype), grad.to(dtype), moments[0], moments[1],
            moments[2] if len(moments) == 3 else None,
            lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
            maximize=maximize, decoupled_weight_decay=decoupled_weight_decay,
        )
        for flat, tensors, values in zip(self.moment_flats, self.moments, new_moments):
            flat.scatter(tensors, values)
        if stochastic_round and self.params[0].dtype == torch.bfloat16:
            new_param = round_to_bfloat16_stochastic(new_param)
        self.param_flat.scatter(self.params, new_param)


def quantized_adamw_step(param, grad, exp_avg: StoredMoment, exp_avg_sq: StoredMoment,
                         max_exp_avg_sq: StoredMoment | None, scalars: StepScalars, *,
                         exp_avg_format: QuantFormat, exp_avg_sq_format: QuantFormat,
                         maximize: bool, stochastic_round: bool,
                         decoupled_weight_decay: bool = True):
    """``single_param_adam`` on blocks: dequantize -> ``adamw_update`` -> requantize, in place.

    ``param`` and ``grad`` are ``(num_blocks, block_size)`` views; the moments are the stored
    tensors of their ``QuantizedState`` (the same rows), ``max_exp_avg_sq`` ``None`` unless
    amsgrad is on. Only tensors are taken, so ``torch.compile`` traces it once per state kind
    and parameter dtype, whatever the parameter's shape.
    """
    # Each ``split`` slice of the blocks (the low and high halves for 4-bit, whose codes share
    # bytes; the whole block for 8-bit) is decoded, updated and encoded on its own and only
    # the packed bytes combine them: Inductor then computes both nibbles of a byte in the loop
    # that writes it instead of materialising unpacked codes and whole-block float buffers.
    # float64 parameters are updated in float64 (their moments are quantized all the same).
    dtype = compute_dtype(param)
    lr, beta1, beta2, eps, weight_decay, step = scalars
    stored = [exp_avg, exp_avg_sq, max_exp_avg_sq]
    exp_avg = exp_avg_format.decode_parts(*stored[0])
    exp_avg_sq = exp_avg_sq_format.decode_parts(*stored[1])
    max_exp_avg_sq = [None] * len(exp_avg)
    if stored[2] is not None:
        max_exp_avg_sq = exp_avg_sq_format.decode_parts(*stored[2])
    param_parts = exp_avg_format.split(param)
    grad_parts = exp_avg_format.split(grad)

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
        new_param, new_exp_avg, new_exp_avg_sq, new_max = adamw_update(
            param_part.to(dtype), grad_parts[index].to(dtype), exp_avg[index].to(dtype),
            exp_avg_sq[index].to(dtype),
            None if stored[2] is None else max_exp_avg_sq[index].to(dtype),
            lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
            maximize=maximize, corrections=corrections, decoupled_weight_decay=decoupled_weight_decay,
            max_ratio=max_ratio,
        )
        new_params.append(new_param)
        new_exp_avgs.append(new_exp_avg)
        new_exp_avg_sqs.append(new_exp_avg_sq)
        new_maxes.append(new_max)

    updates = [(exp_avg_format, new_exp_avgs), (exp_avg_sq_format, new_exp_avg_sqs),
               (exp_avg_sq_format, new_maxes)]
    for target, (fmt, values) in zip(stored, updates):
        if target is not None:
            codes, scales = fmt.encode_parts(values)
            target.codes.copy_(codes)
            target.scales.copy_(scales)
    # Written slice by slice: a torch.cat here made Inductor materialise its inputs.
    for param_part, new_param in zip(param_parts, new_params):
        write_param(param_part, new_param, stochastic_round=stochastic_round)
