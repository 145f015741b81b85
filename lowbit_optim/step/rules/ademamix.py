"""The AdEMAMix rule (Pagliardini, Ablin and Grangier 2024, "The AdEMAMix Optimizer:
Better, Faster, Older"): Adam's two moments plus a slow EMA of the gradient,

    m1 <- beta1 * m1 + (1 - beta1) * g          (``exp_avg``, signed)
    m2 <- beta3_t * m2 + (1 - beta3_t) * g      (``exp_avg_slow``, signed, not bias-corrected)
    nu <- beta2 * nu + (1 - beta2) * g**2       (``exp_avg_sq``)
    p  <- p * (1 - lr * weight_decay) - lr * (m1 / bc1 + alpha_t * m2) / (sqrt(nu) / sqrt(bc2) + eps)

with ``bitsandbytes.optim.AdEMAMix``'s arguments and schedulers: ``alpha_t = min(t * alpha /
t_alpha, alpha)`` and ``beta3_t = min(exp(ln b1 ln b3 / ((1 - t/T) ln b3 + (t/T) ln b1)), b3)``
with ``T = t_beta3``; ``None`` turns a scheduler off (stored as 0 in the 0-d scalars).

Quantized moments are not exact ones, so, as for AdamW (``math.adam_ratio_bound``), each ratio
is clamped at a bound exact AdEMAMix never exceeds: ``m1 / denom`` at Adam's own bound, and
``m2 / denom`` at ``sqrt((1 - b2**t) / ((1 - b2) * b2**(t - 1)))``. The second holds for any
``beta3`` schedule: the weights of the EMA ``m2`` are non-negative and sum to at most 1, so
``|m2| <= max_k |g_k|``, and every ``g_k`` of the last ``t`` steps contributed at least
``(1 - b2) * b2**(t - 1) * g_k**2`` to ``nu``. It is loose for long runs (it grows like
``b2**(-t/2)``) and infinite once that underflows: a guard against a second moment stored far
below an element's own (a square that overflows float32), not a tuning knob.

``ademamix_kernel_update`` is the same math as the Triton step kernel's element-wise piece
(defined where Triton is installed): the moments operation for operation as
``AdEMAMixRule.update`` (so the kernel's block scales are the compiled step's bit for bit), the
parameter with the approximate square root and divisions of AdamW's piece
(``rules.adamw.adamw_kernel_update``, where the bound is) and two host reciprocals.
"""

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: without it the rule has no kernel piece
    triton = None

from lowbit_optim.step.functional import StepCache, step_params
from lowbit_optim.step.hyperparams import (
    HYPER_DTYPE,
    StepOptions,
    as_float,
    check_betas,
    check_learning_rate,
    check_nonnegative,
)
from lowbit_optim.step.math import adam_ratio_bound, bias_corrections, squared_gradient_term
from lowbit_optim.step.rules.base import MomentSpec, UpdateRule


class AdEMAMixConstants(NamedTuple):
    """What one step reads: the group's values with the schedules applied at its step count,
    the bias corrections and the two ratio bounds."""

    lr: torch.Tensor
    beta1: torch.Tensor
    beta2: torch.Tensor
    beta3: torch.Tensor
    alpha: torch.Tensor
    eps: torch.Tensor
    weight_decay: torch.Tensor
    bias_correction1: torch.Tensor
    bias_correction2_sqrt: torch.Tensor
    fast_bound: torch.Tensor
    slow_bound: torch.Tensor


class AdEMAMixKernelConstants(NamedTuple):
    """``ademamix_kernel_update``'s constants (Python floats), in the order it unpacks them."""

    lr: float
    decay: float  # 1 - lr * weight_decay
    beta1: float
    one_minus_beta1: float
    beta3: float  # scheduled
    one_minus_beta3: float
    beta2: float
    one_minus_beta2: float
    alpha: float  # scheduled
    inv_bias_correction1: float
    inv_bias_correction2_sqrt: float
    eps: float
    fast_bound: float
    slow_bound: float


def scheduled_alpha(alpha, t_alpha, step):
    """The paper's linear warm-up of ``alpha`` over ``t_alpha`` steps (``t_alpha = 0``: off)."""
    return torch.where(t_alpha > 0, torch.minimum(step * alpha / t_alpha, alpha), alpha)


def scheduled_beta3(beta1, beta3, t_beta3, step):
    """The paper's warm-up of ``beta3`` from ``beta1`` over ``t_beta3`` steps, increasing so
    that the slow EMA's half-life grows linearly (``t_beta3 = 0``: off)."""
    fraction = step / t_beta3
    log1, log3 = beta1.log(), beta3.log()
    warming = (log1 * log3 / ((1 - fraction) * log3 + fraction * log1)).exp()
    return torch.where(t_beta3 > 0, torch.minimum(warming, beta3), beta3)


def slow_ratio_bound(beta2, step):
    """The bound on ``|m2 / denom|`` of the module docstring (infinite for ``beta2 = 0``)."""
    bound = ((1 - beta2**step) / ((1 - beta2) * beta2 ** (step - 1))).sqrt()
    return bound.masked_fill(beta2 <= 0, torch.inf)


def _check_schedule_length(name: str, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"Invalid {name}: {value!r} (None or an int > 0 is needed)")


if triton is not None:
    from lowbit_optim.step.math import approx_divide

    @triton.jit
    def _clamp(ratio, bound):
        # NaN kept, as torch's clamp keeps it. (The enum is spelled out in each call: a local
        # holding it becomes a tensor when compiled.)
        ratio = tl.maximum(ratio, -bound, propagate_nan=tl.PropagateNan.ALL)
        return tl.minimum(ratio, bound, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def ademamix_kernel_update(param, grad, moments, constants, VARIANT: tl.constexpr,
                               INTERPRETED: tl.constexpr):
        """``AdEMAMixRule.update`` on float32 values, for the step kernel
        (``step.kernels.step_kernel``); ``constants``: ``AdEMAMixKernelConstants``."""
        (lr, decay, beta1, one_minus_beta1, beta3, one_minus_beta3, beta2, one_minus_beta2, alpha,
         inv_bias_correction1, inv_bias_correction2_sqrt, eps, fast_bound, slow_bound) = constants
        exp_avg, exp_avg_slow, exp_avg_sq = moments
        new_exp_avg = exp_avg * beta1 + grad * one_minus_beta1
        new_exp_avg_slow = exp_avg_slow * beta3 + grad * one_minus_beta3
        # squared_gradient_term's order, ((1 - beta2) * g) * g.
        new_exp_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * grad * grad
        denom = tl.fma(tl.sqrt(new_exp_avg_sq), inv_bias_correction2_sqrt, eps)
        fast = _clamp(approx_divide(new_exp_avg, denom, INTERPRETED), fast_bound) * inv_bias_correction1
        slow = _clamp(approx_divide(new_exp_avg_slow, denom, INTERPRETED), slow_bound)
        new_param = param * decay - lr * (fast + alpha * slow)
        return new_param, (new_exp_avg, new_exp_avg_slow, new_exp_avg_sq)
else:
    ademamix_kernel_update = None


class AdEMAMixRule(UpdateRule):
    name = "ademamix"
    moments = (MomentSpec("exp_avg", signed=True), MomentSpec("exp_avg_slow", signed=True),
               MomentSpec("exp_avg_sq", signed=False))
    scalar_names = ("lr", "beta1", "beta2", "beta3", "alpha", "eps", "weight_decay", "t_alpha", "t_beta3")
    kernel_update = ademamix_kernel_update
    cpu_functor = "ademamix"  # step/csrc/rules/ademamix.h

    def check_hyperparameters(self, group: dict) -> None:
        check_learning_rate(group["lr"])
        check_betas(group["betas"], ("beta1", "beta2", "beta3"))
        check_nonnegative("alpha", group["alpha"])
        check_nonnegative("eps", group["eps"], "epsilon")
        check_nonnegative("weight_decay", group["weight_decay"])
        _check_schedule_length("t_alpha", group["t_alpha"])
        _check_schedule_length("t_beta3", group["t_beta3"])
        beta1, _, beta3 = (as_float("beta", beta) for beta in group["betas"])
        if group["t_beta3"] is not None and (beta1 == 0 or beta3 == 0):
            raise ValueError(
                f"Invalid betas: {tuple(group['betas'])!r} with t_beta3={group['t_beta3']!r} (the beta3 "
                "warm-up interpolates between log(beta1) and log(beta3): both must be > 0)")

    def scalar_values(self, group: dict) -> dict:
        beta1, beta2, beta3 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, beta3=beta3, alpha=group["alpha"],
                    eps=group["eps"], weight_decay=group["weight_decay"],
                    t_alpha=group["t_alpha"] or 0, t_beta3=group["t_beta3"] or 0)

    def keywords(self, group: dict) -> dict:
        beta1, beta2, beta3 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, beta3=beta3, alpha=group["alpha"],
                    eps=group["eps"], weight_decay=group["weight_decay"], t_alpha=group["t_alpha"],
                    t_beta3=group["t_beta3"])

    def step(self, params, grads, states, **keywords) -> None:
        ademamix(params, grads, states, **keywords)

    def step_constants(self, scalars, step: torch.Tensor) -> AdEMAMixConstants:
        step = step.to(HYPER_DTYPE)
        bias_correction1, bias_correction2_sqrt = bias_corrections(scalars.beta1, scalars.beta2, step)
        return AdEMAMixConstants(
            lr=scalars.lr, beta1=scalars.beta1, beta2=scalars.beta2,
            beta3=scheduled_beta3(scalars.beta1, scalars.beta3, scalars.t_beta3, step),
            alpha=scheduled_alpha(scalars.alpha, scalars.t_alpha, step),
            eps=scalars.eps, weight_decay=scalars.weight_decay,
            bias_correction1=bias_correction1, bias_correction2_sqrt=bias_correction2_sqrt,
            fast_bound=adam_ratio_bound(scalars.beta1, scalars.beta2, step),
            slow_bound=slow_ratio_bound(scalars.beta2, step))

    def update(self, param, grad, moments: tuple, constants: AdEMAMixConstants):
        c = constants
        exp_avg, exp_avg_slow, exp_avg_sq = moments
        new_exp_avg = exp_avg * c.beta1 + grad * (1 - c.beta1)
        new_exp_avg_slow = exp_avg_slow * c.beta3 + grad * (1 - c.beta3)
        new_exp_avg_sq = exp_avg_sq * c.beta2 + squared_gradient_term(grad, c.beta2)
        denom = new_exp_avg_sq.sqrt() / c.bias_correction2_sqrt + c.eps
        fast = (new_exp_avg / denom).clamp(-c.fast_bound, c.fast_bound) / c.bias_correction1
        slow = (new_exp_avg_slow / denom).clamp(-c.slow_bound, c.slow_bound)
        new_param = param * (1 - c.lr * c.weight_decay) - c.lr * (fast + c.alpha * slow)
        return new_param, (new_exp_avg, new_exp_avg_slow, new_exp_avg_sq)

    def kernel_constants(self, constants: AdEMAMixConstants) -> AdEMAMixKernelConstants:
        """``ademamix_kernel_update``'s constants, formed in float64 from ``step_constants``'
        0-d tensors as ``update`` forms them (the kernel rounds each to float32, as torch
        rounds a 0-d double operand), with the two bias corrections as reciprocals."""
        c = AdEMAMixConstants(*(float(value) for value in constants))
        return AdEMAMixKernelConstants(
            lr=c.lr, decay=1 - c.lr * c.weight_decay, beta1=c.beta1, one_minus_beta1=1 - c.beta1,
            beta3=c.beta3, one_minus_beta3=1 - c.beta3, beta2=c.beta2, one_minus_beta2=1 - c.beta2,
            alpha=c.alpha, inv_bias_correction1=1 / c.bias_correction1,
            inv_bias_correction2_sqrt=1 / c.bias_correction2_sqrt, eps=c.eps, fast_bound=c.fast_bound,
            slow_bound=c.slow_bound)


ADEMAMIX = AdEMAMixRule()


def ademamix(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict], *, lr, beta1, beta2,
             beta3, alpha, eps, weight_decay, t_alpha: int | None = None, t_beta3: int | None = None,
             maximize: bool = False, stochastic_round: bool = False, rounding_stream: int = 0,
             backend: str | None = None, cache: StepCache | None = None) -> None:
    """One AdEMAMix step of ``params``, in place; ``states``: one dict per parameter (``step``,
    ``exp_avg``, ``exp_avg_slow``, ``exp_avg_sq``). The options are ``rules.adamw.adamw``'s."""
    step_params(ADEMAMIX, params, grads, states,
                dict(lr=lr, betas=(beta1, beta2, beta3), alpha=alpha, eps=eps, weight_decay=weight_decay,
                     t_alpha=t_alpha, t_beta3=t_beta3),
                options=StepOptions(maximize, stochastic_round, rounding_stream),
                backend=backend, cache=cache)
