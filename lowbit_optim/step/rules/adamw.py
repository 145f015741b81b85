"""The AdamW rule (and torch.optim.Adam's, with ``decoupled_weight_decay=False``): two
moments, ``exp_avg`` (signed) and ``exp_avg_sq``, plus ``max_exp_avg_sq`` with amsgrad.

Its math is ``step.math`` (``adamw_update``, the specification), and it has kernels of its
own, so its ``plan`` is ``dispatch.AdamWPlan`` (compiled and eager steps, the Triton kernels,
the C++ CPU kernel, the factored second moment) rather than the generic rule step.
"""

import torch

from lowbit_optim.step.chunks import ParamStep
from lowbit_optim.step.dispatch import AdamWPlan
from lowbit_optim.step.hyperparams import check_hyperparameters
from lowbit_optim.step.rule_step import RuleEntry
from lowbit_optim.step.rules.base import MomentSpec, UpdateRule


class AdamWRule(UpdateRule):
    name = "adamw"
    moments = (MomentSpec("exp_avg", signed=True), MomentSpec("exp_avg_sq", signed=False),
               MomentSpec("max_exp_avg_sq", signed=False, amsgrad_only=True))
    scalar_names = ("lr", "beta1", "beta2", "eps", "weight_decay")
    cpu_functor = "adamw"  # step/csrc/rules/adamw.h

    def check_hyperparameters(self, group: dict) -> None:
        check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])

    def scalar_values(self, group: dict) -> dict:
        beta1, beta2 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"])

    def plan(self, entries: list[RuleEntry], backend: str, params: list[torch.Tensor]) -> AdamWPlan:
        steps = []
        for entry in entries:
            exp_avg, exp_avg_sq, *maximum = entry.moments
            steps.append(ParamStep(entry.param, entry.grad, exp_avg, exp_avg_sq,
                                   maximum[0] if maximum else None, entry.step, entry.weight_correction))
        return AdamWPlan(steps, backend, params)


ADAMW = AdamWRule()
