"""The Lion rule (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): one
signed moment ``exp_avg``; the parameter moves by ``lr`` times the sign of an interpolation of
the moment and the gradient, with decoupled weight decay:

    p     <- p * (1 - lr * weight_decay) - lr * sign(beta1 * m + (1 - beta1) * g)
    m     <- beta2 * m + (1 - beta2) * g

in the operation order of ``bitsandbytes.optim.Lion`` and lucidrains' ``lion-pytorch``
(decay, then the signed step, then the moment). Every move is exactly ``lr`` (or 0) per
element besides the decay, so no ratio bound is needed: a quantized moment changes only
which sign an element takes, never how far it moves.

``lion_kernel_update`` is the same math as the Triton step kernel's element-wise piece (defined
where Triton is installed), operation for operation as ``LionRule.update``, so the kernel's
parameters and block scales are the compiled step's bit for bit.
"""

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: without it the rule has no kernel piece
    triton = None

from lowbit_optim.step.functional import StepCache, step_params
from lowbit_optim.step.hyperparams import StepOptions, check_betas, check_learning_rate, check_nonnegative
from lowbit_optim.step.rules.base import MomentSpec, UpdateRule


class LionConstants(NamedTuple):
    lr: torch.Tensor
    beta1: torch.Tensor
    beta2: torch.Tensor
    weight_decay: torch.Tensor


class LionKernelConstants(NamedTuple):
    """``lion_kernel_update``'s constants (Python floats), in the order it unpacks them."""

    lr: float
    decay: float  # 1 - lr * weight_decay
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float


if triton is not None:
    @triton.jit
    def lion_kernel_update(param, grad, moments, constants, VARIANT: tl.constexpr, INTERPRETED: tl.constexpr):
        """``LionRule.update`` on float32 values, for the step kernel (``step.kernels.step_kernel``);
        ``constants``: ``LionKernelConstants``."""
        lr, decay, beta1, one_minus_beta1, beta2, one_minus_beta2 = constants
        (exp_avg,) = moments
        interpolated = exp_avg * beta1 + grad * one_minus_beta1
        direction = tl.where(interpolated > 0, 1.0, tl.where(interpolated < 0, -1.0, 0.0))
        new_param = param * decay - lr * direction
        return new_param, (exp_avg * beta2 + grad * one_minus_beta2,)
else:
    lion_kernel_update = None


class LionRule(UpdateRule):
    name = "lion"
    moments = (MomentSpec("exp_avg", signed=True),)
    scalar_names = LionConstants._fields
    kernel_update = lion_kernel_update
    cpu_functor = "lion"  # step/csrc/rules/lion.h

    def check_hyperparameters(self, group: dict) -> None:
        check_learning_rate(group["lr"])
        check_betas(group["betas"], ("beta1", "beta2"))
        check_nonnegative("weight_decay", group["weight_decay"])

    def scalar_values(self, group: dict) -> dict:
        beta1, beta2 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"])

    def keywords(self, group: dict) -> dict:
        beta1, beta2 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"])

    def step(self, params, grads, states, **keywords) -> None:
        lion(params, grads, states, **keywords)

    def step_constants(self, scalars, step: torch.Tensor) -> LionConstants:
        return LionConstants(*(getattr(scalars, name) for name in self.scalar_names))

    def update(self, param, grad, moments: tuple, constants: LionConstants):
        lr, beta1, beta2, weight_decay = constants
        (exp_avg,) = moments
        direction = (exp_avg * beta1 + grad * (1 - beta1)).sign()
        new_param = param * (1 - lr * weight_decay) - lr * direction
        return new_param, (exp_avg * beta2 + grad * (1 - beta2),)

    def kernel_constants(self, constants: LionConstants) -> LionKernelConstants:
        """``lion_kernel_update``'s constants, formed in float64 as ``update`` forms them from
        its 0-d tensors (the kernel rounds each to float32, as torch rounds a 0-d double
        operand; ``lr`` is float32 already)."""
        lr, beta1, beta2, weight_decay = (float(value) for value in constants)
        return LionKernelConstants(lr=lr, decay=1 - lr * weight_decay, beta1=beta1, one_minus_beta1=1 - beta1,
                                   beta2=beta2, one_minus_beta2=1 - beta2)


LION = LionRule()


def lion(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict], *, lr, beta1, beta2,
         weight_decay, maximize: bool = False, stochastic_round: bool = False, rounding_stream: int = 0,
         backend: str | None = None, cache: StepCache | None = None) -> None:
    """One Lion step of ``params``, in place; ``states``: one dict per parameter (``step``,
    ``exp_avg``). The options are ``rules.adamw.adamw``'s."""
    step_params(LION, params, grads, states,
                dict(lr=lr, betas=(beta1, beta2), weight_decay=weight_decay),
                options=StepOptions(maximize, stochastic_round, rounding_stream),
                backend=backend, cache=cache)
