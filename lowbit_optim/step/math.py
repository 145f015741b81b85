"""The AdamW math, written once in float32 (float64 for float64 parameters): the pieces
every step implementation is built from.

``adamw_update`` is the specification: the compiled step, the eager step and the Triton
kernels compute exactly this, and tests use it as the oracle. It follows
``torch.optim.AdamW`` (decoupled weight decay, bias-corrected moments, ``eps`` added after
the square root) with one deliberate difference, the non-finite gradient policy: an element
whose gradient is NaN or ±inf keeps its parameter value and its moments for that step, so a
bad element never spreads to its quantization block, its tensor or other parameters.

Hyperparameters arrive as 0-d CPU tensors: ``lr``, betas, eps and weight decay float64
(``hyperparams.HYPER_DTYPE``: the bias corrections and the LR then match torch's float64
arithmetic), the step count float32. A compiled graph reads them as inputs, so new values
never recompile it, and a CPU scalar reaches a device kernel as an argument, so no per-step
host-to-device copy happens.

The AdamW rule's Triton piece, the same math per element, is ``rules.adamw.adamw_kernel_update``;
``approx_divide``, the division the rules' pieces share, is here (defined only where Triton is
installed).
"""

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: without it there is no kernel piece to define
    triton = None


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
    # masked_fill, not where with a Python number: no tensor is made from the number. In place
    # on the fresh product: the out-of-place form clones it, and the Triton op computes this
    # bound on the host inside a compiled caller's graph, where no clone is expected.
    return bound.masked_fill_(beta2 <= 0, torch.inf)


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
        safe_grad = l2_decayed_gradient(param, safe_grad, weight_decay)
    return finite, safe_grad


def l2_decayed_gradient(param, grad, weight_decay):
    # torch.optim.Adam's L2 weight decay: grad.add(param, alpha=weight_decay).
    return grad + weight_decay * param


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
    if corrections is None:
        corrections = bias_corrections(beta1, beta2, step)
    new_param, new_exp_avg, new_exp_avg_sq, new_max = adam_update_values(
        param, safe_grad, exp_avg, exp_avg_sq, max_exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, corrections=corrections, decoupled_weight_decay=decoupled_weight_decay,
        max_ratio=max_ratio)
    new_param = torch.where(finite, new_param, param)
    new_exp_avg = torch.where(finite, new_exp_avg, exp_avg)
    new_exp_avg_sq = torch.where(finite, new_exp_avg_sq, exp_avg_sq)
    if new_max is not None:
        new_max = torch.where(finite, new_max, max_exp_avg_sq)
    return new_param, new_exp_avg, new_exp_avg_sq, new_max


def adam_update_values(param, safe_grad, exp_avg, exp_avg_sq, max_exp_avg_sq, *, lr, beta1, beta2, eps,
                       weight_decay, corrections, decoupled_weight_decay: bool, max_ratio=None):
    """``adamw_update``'s arithmetic from a finite gradient (``safe_grad``, L2 term included):
    the new ``(param, exp_avg, exp_avg_sq, max_exp_avg_sq)`` with no element kept. What the
    AdamW rule's ``update`` is (``rules.adamw``)."""
    # Same operation order as torch.optim.AdamW (lerp, then mul + addcmul, then addcdiv).
    new_exp_avg = first_moment_update(exp_avg, safe_grad, beta1)
    new_exp_avg_sq = exp_avg_sq * beta2 + squared_gradient_term(safe_grad, beta2)
    second_moment = new_exp_avg_sq
    new_max = None
    if max_exp_avg_sq is not None:
        new_max = torch.maximum(max_exp_avg_sq, new_exp_avg_sq)
        second_moment = new_max
    new_param = parameter_update(param, new_exp_avg, second_moment, lr=lr, eps=eps,
                                 weight_decay=weight_decay, corrections=corrections,
                                 decoupled_weight_decay=decoupled_weight_decay, max_ratio=max_ratio)
    return new_param, new_exp_avg, new_exp_avg_sq, new_max


# bfloat16 is the high 16 bits of a float32: rounding to it works on the 16 bits below them.
BFLOAT16_DROPPED_BITS = 16
# Clears the dropped bits (two's complement: 0xFFFF0000 as an int32).
BFLOAT16_KEPT_MASK = -(1 << BFLOAT16_DROPPED_BITS)


def round_to_bfloat16_stochastic(values: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16, rounding up with probability equal to the dropped fraction.

    Adds 16 random bits below the bfloat16 mantissa and truncates, so E[result] equals the
    float32 value (unbiased, unlike round-to-nearest, which loses updates smaller than half a
    bfloat16 ulp). Written with integer ops so it compiles and matches the Triton kernel.
    """
    bits = values.view(torch.int32)
    noise = torch.randint_like(bits, 0, 1 << BFLOAT16_DROPPED_BITS)
    truncated = (bits + noise) & BFLOAT16_KEPT_MASK
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


if triton is not None:
    @triton.jit
    def approx_divide(numerator, denominator, INTERPRETED: tl.constexpr):
        """``div.approx.ftz.f32`` (``MUFU.RCP`` and a multiply; <= 2 ulp for denominators in
        [2**-126, 2**126], subnormal numerators and results flushed to 0), for the rules' Triton
        pieces. Triton's own ``fdiv(approx=True)`` keeps subnormal support, which costs four more
        instructions. The interpreter has no inline PTX: there it divides exactly (numpy)."""
        if INTERPRETED:
            return numerator / denominator
        else:
            return tl.inline_asm_elementwise("div.approx.ftz.f32 $0, $1, $2;", "=r,r,r",
                                             [numerator, denominator], dtype=tl.float32, is_pure=True, pack=1)
else:
    approx_divide = None
