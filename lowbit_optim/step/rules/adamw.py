"""The AdamW rule (and torch.optim.Adam's, with ``decoupled_weight_decay=False``): two
moments, ``exp_avg`` (signed) and ``exp_avg_sq``, plus ``max_exp_avg_sq`` with amsgrad.

Its math is ``step.math`` (``adamw_update``, the specification), and it has kernels of its
own, so its ``plan`` is ``dispatch.AdamWPlan`` (compiled and eager steps, the Triton kernels,
the C++ CPU kernel, the factored second moment) rather than the generic rule step.
``adamw`` is its functional entry point, in ``torch.optim.adamw.adamw``'s shape.
"""

import torch

from lowbit_optim.step.chunks import ParamStep
from lowbit_optim.step.dispatch import AdamWPlan
from lowbit_optim.step.functional import StepCache, step_params
from lowbit_optim.step.hyperparams import StepOptions, check_hyperparameters
from lowbit_optim.step.rule_step import RuleEntry
from lowbit_optim.step.rules.base import MomentSpec, UpdateRule


class AdamWRule(UpdateRule):
    name = "adamw"
    moments = (MomentSpec("exp_avg", signed=True), MomentSpec("exp_avg_sq", signed=False, factorable=True),
               MomentSpec("max_exp_avg_sq", signed=False, amsgrad_only=True))
    scalar_names = ("lr", "beta1", "beta2", "eps", "weight_decay")
    cpu_functor = "adamw"  # step/csrc/rules/adamw.h

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

    def plan(self, entries: list[RuleEntry], backend: str, params: list[torch.Tensor]) -> AdamWPlan:
        steps = []
        for entry in entries:
            exp_avg, exp_avg_sq, *maximum = entry.moments
            steps.append(ParamStep(entry.param, entry.grad, exp_avg, exp_avg_sq,
                                   maximum[0] if maximum else None, entry.step, entry.weight_correction))
        return AdamWPlan(steps, backend, params)


ADAMW = AdamWRule()


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
