"""The AdamW rule (and torch.optim.Adam's, with ``decoupled_weight_decay=False``): two
moments, ``exp_avg`` (signed) and ``exp_avg_sq``, plus ``max_exp_avg_sq`` with amsgrad.

Its math is ``step.math``'s (``adam_update_values``; ``adamw_update`` with the shared policies
is the specification), its Triton piece ``adamw_kernel_update`` (below) and its C++ functor
``csrc/rules/adamw.h``. Two things of the param group are rule data, as variants of the rule
(``AdamWRule.for_step``): the weight decay's kind (decoupled, or torch.optim.Adam's L2 term)
and the ratio clamp at Adam's own bound (``math.adam_ratio_bound``), which quantized moments
need and float moments, exact arithmetic like ``torch.optim.AdamW``'s, do not take. A
factored second moment (``AdamWFactored4bit``) steps with the variant ``AdamWFactoredRule``
(``AdamWRule.for_factored``), whose ``update`` reads that moment instead of updating it.
``adamw`` is its functional entry point, in ``torch.optim.adamw.adamw``'s shape.
"""

import math
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: without it the rule has no kernel piece
    triton = None

from lowbit_optim.step.functional import StepCache, step_params
from lowbit_optim.step.hyperparams import StepOptions, check_hyperparameters
from lowbit_optim.step.math import (
    _step_constants_op,
    adam_ratio_bound,
    adam_update_values,
    bias_corrections,
    first_moment_update,
    l2_decayed_gradient,
    parameter_update,
)
from lowbit_optim.step.rules.base import MomentSpec, UpdateRule

if triton is not None:
    from lowbit_optim.step.math import approx_divide


class AdamWKernelConstants(NamedTuple):
    """``adamw_kernel_update``'s per-step constants, Python floats formed in float64 as
    ``adamw_update`` forms them from its 0-d tensors (Triton rounds each to float32, as torch
    rounds a 0-d double operand). Decoupled (AdamW) weight decay scales the parameter by
    ``decay``; with L2 (Adam) weight decay ``decay`` is the weight decay, added to the gradient
    times the parameter (the kernel's ``UPDATE_VARIANT`` says which: ``ADAMW_L2_DECAY``)."""

    step_size: float
    decay: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    inv_bias_correction2_sqrt: float
    eps: float
    max_ratio: float


# ``adamw_kernel_update``'s variant for torch.optim.Adam's L2 weight decay (0: decoupled).
ADAMW_L2_DECAY = 1


def adamw_kernel_variant(decoupled_weight_decay: bool, weight_decay: float) -> int:
    """``adamw_kernel_update``'s variant: ``ADAMW_L2_DECAY`` for torch.optim.Adam's weight decay
    where it adds something (a zero decay steps as AdamW's), else 0."""
    return ADAMW_L2_DECAY if not decoupled_weight_decay and weight_decay != 0 else 0


def adamw_kernel_constants(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                           step: float, *, l2_decay: bool = False,
                           max_ratio: float | None = None) -> AdamWKernelConstants:
    """The constants of one step count (``l2_decay``: torch.optim.Adam's weight decay, the
    kernel variant ``ADAMW_L2_DECAY``; ``max_ratio``: ``adam_ratio_bound`` at ``step`` where the
    caller has it, ``rules.adamw.AdamWConstants.max_ratio``, else computed here from the numbers
    as 0-d tensors of the step's dtypes)."""
    if max_ratio is None:
        max_ratio = float(adam_ratio_bound(torch.tensor(beta1, dtype=torch.float64),
                                           torch.tensor(beta2, dtype=torch.float64),
                                           torch.tensor(step, dtype=torch.float32)))
    return AdamWKernelConstants(
        step_size=lr / (1 - beta1**step),
        decay=weight_decay if l2_decay else 1 - lr * weight_decay,
        one_minus_beta1=1 - beta1,
        beta2=beta2,
        one_minus_beta2=1 - beta2,
        inv_bias_correction2_sqrt=1 / math.sqrt(1 - beta2**step),
        eps=eps,
        max_ratio=max_ratio,
    )


if triton is not None:
    _ADAMW_L2_DECAY = tl.constexpr(ADAMW_L2_DECAY)

    @triton.jit
    def adamw_kernel_update(param, grad, moments, constants, VARIANT: tl.constexpr,
                            INTERPRETED: tl.constexpr):
        """``math.adamw_update`` on float32 values: ``(new_param, (exp_avg, exp_avg_sq[, max_exp_avg_sq]))``
        from ``moments`` in that order (three: amsgrad); ``constants``: ``AdamWKernelConstants``.
        The moments are computed operation for operation as the reference computes them (the
        kernel compiles with multiply-add contraction off), so their block scales match bit for
        bit. The parameter's bound: ``sqrt`` is ``sqrt.approx.f32`` (relative error <= 2**-22;
        a subnormal ``v'`` may flush to 0, which moves ``denom`` by less than 2**-63 / sqrt(1 -
        beta2**t)), ``1 / sqrt(1 - beta2**t)`` is formed on the host and ``+ eps`` is one FMA,
        and ``m' / denom`` is ``approx_divide`` (<= 2 ulp for ``denom`` in [2**-126, 2**126],
        which holds for ``eps >= 2**-126``: ``denom <= sqrt(FLT_MAX) / sqrt(1 - beta2**t)``; a
        subnormal ``m'`` flushes to 0, an error below 2**-126 / eps in the quotient). The
        quotient ``q`` is then within ``2**-20`` relative of the reference's, and ``p' =
        fma(-step, q, p * decay)``, so ``|p'_kernel - p'_reference| <= 2**-20 |lr / (1 -
        beta1**t) * q| + 1 ulp`` of the parameter dtype. Under the interpreter (numpy: every
        operation IEEE, the division exact) only the host reciprocal and the FMAs differ:
        ``2**-22`` relative.
        ``VARIANT == ADAMW_L2_DECAY`` (torch.optim.Adam): ``decay`` is the weight decay, added
        to the gradient as ``decay * param``, and the parameter is not scaled. One constant
        serves both meanings: a separate one cost the 8-bit float32 kernel two spills under
        its register cap (sm_90)."""
        (step_size, decay, one_minus_beta1, beta2, one_minus_beta2, inv_bias_correction2_sqrt, eps,
         max_ratio) = constants
        exp_avg = moments[0]
        exp_avg_sq = moments[1]
        if VARIANT == _ADAMW_L2_DECAY:
            grad = grad + decay * param
        new_exp_avg = exp_avg + one_minus_beta1 * (grad - exp_avg)
        # torch addcmul order, ((1 - beta2) * g) * g: g * g first overflows float32 sooner.
        new_exp_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * grad * grad
        second_moment = new_exp_avg_sq
        new_max = new_exp_avg_sq
        if len(moments) == 3:
            # (The enum is spelled out in each call: a local holding it becomes a tensor when
            # compiled.)
            new_max = tl.maximum(moments[2], new_exp_avg_sq, propagate_nan=tl.PropagateNan.ALL)
            second_moment = new_max
        # Approximate sqrt and division, and two explicit FMAs: the bound is in the docstring.
        denom = tl.fma(tl.sqrt(second_moment), inv_bias_correction2_sqrt, eps)
        decayed = param if VARIANT == _ADAMW_L2_DECAY else param * decay
        # Clamped at Adam's own bound, as parameter_update clamps (NaN kept as torch's clamp
        # keeps it).
        ratio = approx_divide(new_exp_avg, denom, INTERPRETED)
        ratio = tl.maximum(ratio, -max_ratio, propagate_nan=tl.PropagateNan.ALL)
        ratio = tl.minimum(ratio, max_ratio, propagate_nan=tl.PropagateNan.ALL)
        new_param = tl.fma(-step_size, ratio, decayed)
        if len(moments) == 3:
            return new_param, (new_exp_avg, new_exp_avg_sq, new_max)
        else:
            return new_param, (new_exp_avg, new_exp_avg_sq)
else:
    adamw_kernel_update = None


class AdamWConstants(NamedTuple):
    """What ``AdamWRule.update`` and the kernels read at one step count, 0-d CPU tensors. The C++
    functors (``csrc/rules/adamw.h``, ``adamw_factored.h``) read these fields in this order
    (``cpu_kernel.check_functor_constants``)."""

    lr: torch.Tensor
    beta1: torch.Tensor
    beta2: torch.Tensor
    eps: torch.Tensor
    weight_decay: torch.Tensor
    step: torch.Tensor
    decoupled: torch.Tensor  # float64 1 (decoupled weight decay) or 0 (L2): the functor's switch
    # ``math.adam_ratio_bound`` at ``step``, computed here once per step count for the kernels
    # (the C++ functor, the Triton piece through ``kernel_constants``), so the bound is written
    # once; ``update`` forms its own inside the compiled graph.
    max_ratio: torch.Tensor


# The functor's ``decoupled`` value of each weight decay's kind.
DECOUPLED = {True: torch.tensor(1.0, dtype=torch.float64), False: torch.tensor(0.0, dtype=torch.float64)}


class AdamWRule(UpdateRule):
    name = "adamw"
    moments = (MomentSpec("exp_avg", signed=True), MomentSpec("exp_avg_sq", signed=False, factorable=True),
               MomentSpec("max_exp_avg_sq", signed=False, amsgrad_only=True))
    scalar_names = ("lr", "beta1", "beta2", "eps", "weight_decay")
    kernel_update = adamw_kernel_update
    cpu_functor = "adamw"  # step/csrc/rules/adamw.h

    def __init__(self, decoupled_weight_decay: bool = True, bounded: bool = True):
        self.decoupled_weight_decay = decoupled_weight_decay
        self.bounded = bounded

    def variants(self) -> tuple[UpdateRule, ...]:
        return tuple(_VARIANTS.values())

    def for_decay(self, decoupled_weight_decay: bool, bounded: bool = True) -> "AdamWRule":
        return _VARIANTS[bool(decoupled_weight_decay), bounded]

    def for_step(self, options: StepOptions, *, exact_moments: bool) -> "AdamWRule":
        return self.for_decay(options.decoupled_weight_decay, bounded=not exact_moments)

    def for_factored(self, options: StepOptions) -> "AdamWFactoredRule":
        return _FACTORED_VARIANTS[bool(options.decoupled_weight_decay)]

    def check_hyperparameters(self, group: dict) -> None:
        check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])

    def scalar_values(self, group: dict) -> dict:
        beta1, beta2 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"])

    def keywords(self, group: dict) -> dict:
        beta1, beta2 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], amsgrad=group.get("amsgrad", False),
                    decoupled_weight_decay=group.get("decoupled_weight_decay", True))

    def step(self, params, grads, states, **keywords) -> None:
        adamw(params, grads, states, **keywords)

    def step_constants(self, scalars, step: torch.Tensor) -> AdamWConstants:
        return AdamWConstants(scalars.lr, scalars.beta1, scalars.beta2, scalars.eps, scalars.weight_decay,
                              step, DECOUPLED[self.decoupled_weight_decay],
                              adam_ratio_bound(scalars.beta1, scalars.beta2, step))

    def corrections_and_bound(self, param, constants: AdamWConstants):
        """The bias corrections and Adam's bound on the ratio (``None`` unbounded) at the
        step of ``constants``, for ``update`` on ``param``'s device."""
        _, beta1, beta2, _, _, step = constants[:6]
        if not self.bounded:
            return bias_corrections(beta1, beta2, step), None
        if param.device.type == "cpu":
            # Once per call, outside the loops (``math._step_constants_op``). Elsewhere inline:
            # the op's 0-d results are CPU tensors made inside the graph, and whether Inductor
            # passes those to a GPU kernel as it passes 0-d CPU graph inputs was not checked.
            *corrections, max_ratio = _step_constants_op(beta1, beta2, step)
            return corrections, max_ratio
        return bias_corrections(beta1, beta2, step), adam_ratio_bound(beta1, beta2, step)

    def update(self, param, grad, moments: tuple, constants: AdamWConstants):
        lr, beta1, beta2, eps, weight_decay, step = constants[:6]
        if not self.decoupled_weight_decay:
            grad = l2_decayed_gradient(param, grad, weight_decay)
        exp_avg, exp_avg_sq, *maximum = moments
        corrections, max_ratio = self.corrections_and_bound(param, constants)
        new_param, new_exp_avg, new_exp_avg_sq, new_max = adam_update_values(
            param, grad, exp_avg, exp_avg_sq, maximum[0] if maximum else None, lr=lr, beta1=beta1,
            beta2=beta2, eps=eps, weight_decay=weight_decay, corrections=corrections,
            decoupled_weight_decay=self.decoupled_weight_decay, max_ratio=max_ratio)
        return new_param, (new_exp_avg, new_exp_avg_sq) + ((new_max,) if maximum else ())

    def kernel_variant(self, scalars) -> int:
        return adamw_kernel_variant(self.decoupled_weight_decay, float(scalars.weight_decay))

    def kernel_constants(self, constants: AdamWConstants):
        lr, beta1, beta2, eps, weight_decay, step = (float(value) for value in constants[:6])
        return adamw_kernel_constants(
            lr, beta1, beta2, eps, weight_decay, step,
            l2_decay=bool(adamw_kernel_variant(self.decoupled_weight_decay, weight_decay)),
            max_ratio=float(constants.max_ratio))

    def __repr__(self) -> str:
        decay = "decoupled" if self.decoupled_weight_decay else "L2"
        return f"<update rule {self.name} ({decay} weight decay{', bounded' if self.bounded else ''})>"


# Every variant, by (decoupled weight decay, bounded): each is its own singleton, so the
# compiled step is cached per variant.
_VARIANTS = {(decoupled, bounded): AdamWRule(decoupled, bounded)
             for decoupled in (True, False) for bounded in (True, False)}
ADAMW = _VARIANTS[True, True]


class AdamWFactoredRule(AdamWRule):
    """AdamW for a parameter whose second moment is factored (``AdamWFactored4bit``): ``update``
    takes ``(exp_avg, second_moment)``, the second moment being the factored layout's
    reconstruction ``row[i] * col[j] / mean(col)`` of each element (``step.factored``), read
    only, and returns the new parameter and first moment. AdamW's constants and pieces
    (``math.first_moment_update``, ``math.parameter_update``), always with the ratio clamp at
    Adam's own bound: a factored ``v`` can underestimate an element's own by up to
    ``min(rows, columns)`` times (docs/design.md, "The factored second moment"). Its C++ functor
    is ``csrc/rules/adamw_factored.h``, which ``cpu_kernel_factored`` runs; it has no Triton
    piece."""

    name = "adamw_factored"
    moments = (MomentSpec("exp_avg", signed=True), MomentSpec("exp_avg_sq", signed=False, factorable=True))
    kernel_update = None
    cpu_functor = None

    def __init__(self, decoupled_weight_decay: bool = True):
        super().__init__(decoupled_weight_decay, bounded=True)

    def variants(self) -> tuple[UpdateRule, ...]:
        return tuple(_FACTORED_VARIANTS.values())

    def for_step(self, options: StepOptions, *, exact_moments: bool) -> "AdamWFactoredRule":
        return self.for_factored(options)

    def update(self, param, grad, moments: tuple, constants: AdamWConstants):
        lr, beta1, _, eps, weight_decay = constants[:5]
        if not self.decoupled_weight_decay:
            grad = l2_decayed_gradient(param, grad, weight_decay)
        exp_avg, second_moment = moments
        corrections, max_ratio = self.corrections_and_bound(param, constants)
        new_exp_avg = first_moment_update(exp_avg, grad, beta1)
        new_param = parameter_update(param, new_exp_avg, second_moment, lr=lr, eps=eps,
                                     weight_decay=weight_decay, corrections=corrections,
                                     decoupled_weight_decay=self.decoupled_weight_decay, max_ratio=max_ratio)
        return new_param, (new_exp_avg,)

    def __repr__(self) -> str:
        decay = "decoupled" if self.decoupled_weight_decay else "L2"
        return f"<update rule {self.name} ({decay} weight decay)>"


# Its variants by decoupled weight decay, singletons like ``_VARIANTS``.
_FACTORED_VARIANTS = {decoupled: AdamWFactoredRule(decoupled) for decoupled in (True, False)}
ADAMW_FACTORED = _FACTORED_VARIANTS[True]


def adamw(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict], *, lr, beta1, beta2,
          eps, weight_decay, amsgrad: bool = False, decoupled_weight_decay: bool = True,
          maximize: bool = False,
          stochastic_round: bool = False, rounding_stream: int = 0, backend: str | None = None,
          cache: StepCache | None = None) -> None:
    """One AdamW step (``decoupled_weight_decay=False``: Adam's L2 decay) of ``params``, in place.

    ``states``: one dict per parameter (``step``, ``exp_avg``, ``exp_avg_sq``, with amsgrad
    ``max_exp_avg_sq``, quantized or float; from ``lowbit_optim.functional.new_state`` or an
    optimizer), advanced in place. ``lr``, the betas, ``eps`` and ``weight_decay``: numbers or
    1-element tensors, as in ``torch.optim.AdamW``. ``stochastic_round``: bf16 parameters are
    written by stochastic rounding (``rounding_stream`` separates the Triton kernel's noise of
    callers that step at once). ``backend``: ``"compile"``, ``"eager"``, ``"cpu"``, ``"triton"``
    or ``None`` (the fastest for the parameters' devices). ``cache``: a ``StepCache`` passed on
    every call keeps the planned step between calls (``step.functional``).
    """
    step_params(ADAMW, params, grads, states,
                dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad),
                options=StepOptions(maximize, stochastic_round, rounding_stream, decoupled_weight_decay),
                backend=backend, cache=cache)
