"""The Lion rule (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): one
signed moment ``exp_avg``; the parameter moves by ``lr`` times the sign of an interpolation of
the moment and the gradient, with decoupled weight decay:

    p     <- p * (1 - lr * weight_decay) - lr * sign(beta1 * m + (1 - beta1) * g)
    m     <- beta2 * m + (1 - beta2) * g

in the operation order of ``bitsandbytes.optim.Lion`` and lucidrains' ``lion-pytorch``
(decay, then the signed step, then the moment). Every move is exactly ``lr`` (or 0) per
element besides the decay, so no ratio bound is needed: a quantized moment changes only
which sign an element takes, never how far it moves.
"""

from typing import NamedTuple

import torch

from lowbit_optim.step.functional import StepCache, step_params
from lowbit_optim.step.hyperparams import StepOptions, check_betas, check_learning_rate, check_nonnegative
from lowbit_optim.step.rules.base import MomentSpec, UpdateRule


class LionConstants(NamedTuple):
    lr: torch.Tensor
    beta1: torch.Tensor
    beta2: torch.Tensor
    weight_decay: torch.Tensor


class LionRule(UpdateRule):
    name = "lion"
    moments = (MomentSpec("exp_avg", signed=True),)
    scalar_names = LionConstants._fields
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
