"""The functional step: ``step_params`` steps a list of parameters with their gradients and
states under an update rule, and each rule module builds its public keyword-only entry point
on it (``rules.adamw.adamw``, ``rules.lion.lion``, ``rules.ademamix.ademamix``, torch's shape
``adamw(params, grads, states, *, lr, beta1, ...)``). Every optimizer class steps through
those entry points, so there is one path from a param group to the implementations.

A step is planned (``plan.GroupPlan``: kinds sorted, launches laid out, step counts and
small moments gathered) and the plan is worth keeping between steps; a ``StepCache`` passed
on every call keeps it, with the 0-d CPU tensors the hyperparameters are copied into (so a
schedule changes values, never graphs). Without one, each call plans afresh. The plan is
reused only while everything it was built from is unchanged (``GroupPlan.matches``, and the
moments amsgrad asks for); when anything changed, the lists are checked (``inputs``: their
lengths, repeats, missing gradients, states that do not fit) and the gradients one by one,
and refused, naming the position or parameter, before any parameter or state changes.
"""

from itertools import compress, repeat
from operator import attrgetter, is_not

import torch

from lowbit_optim.step.chunks import TailScratch
from lowbit_optim.step.dispatch import resolve_backend
from lowbit_optim.step.hyperparams import GroupScalars, StepOptions
from lowbit_optim.step.inputs import check_step_inputs
from lowbit_optim.step.plan import GroupPlan

_GRAD = attrgetter("grad")
_FACTS = attrgetter("dtype", "shape")
_GRAD_FACTS = attrgetter("dtype", "shape", "is_sparse")


class StepCache:
    """What ``step_params`` keeps between calls for one list of parameters: the plan, the
    hyperparameters' 0-d CPU tensors and the scratch buffers of partial blocks. Opaque: pass
    the same one on every call for the same parameters (an optimizer keeps one per param
    group); it is checked, never trusted."""

    def __init__(self, scratch: TailScratch | None = None):
        self.plan: GroupPlan | None = None
        self.scalars: GroupScalars | None = None
        self.requested_backend = None
        self.scratch = TailScratch() if scratch is None else scratch
        # The gradient list ``holds`` last accepted: a caller that checked first (an optimizer,
        # all its groups before stepping any) spares the step the same comparisons.
        self.checked_grads: list | None = None

    def holds(self, rule, params: list[torch.Tensor], grads: list[torch.Tensor], states: list,
              backend: str | None) -> bool:
        """Whether the kept plan steps ``params`` with ``grads`` and ``states`` as they are now
        (``GroupPlan.matches``: every gradient fits, nothing the plan depends on changed)."""
        plan = self.plan
        try:
            held = (plan is not None and plan.rule is rule and self.requested_backend == backend
                    and plan.matches(params, grads, states, plan.backend) and plan.steps_unchanged())
        except (AttributeError, TypeError):  # a None or non-tensor entry: not what was planned
            held = False
        self.checked_grads = grads if held else None
        return held


def with_gradients(params: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The parameters that have a gradient, and their gradients, in order (C-level passes:
    no Python loop per parameter)."""
    grads = [*map(_GRAD, params)]
    has_grad = [*map(is_not, grads, repeat(None))]
    if all(has_grad):
        return params, grads
    return [*compress(params, has_grad)], [*compress(grads, has_grad)]


def check_gradients(params: list[torch.Tensor], grads: list[torch.Tensor], who: str) -> None:
    """Refuse a gradient that cannot step its parameter (sparse, another shape or dtype),
    naming it; ``who`` names the caller in the message. A fast comparison first: the loop
    that finds the culprit runs only when something does not fit."""
    if [*map(_GRAD_FACTS, grads)] == [(*facts, False) for facts in map(_FACTS, params)]:
        return
    for param, grad in zip(params, grads):
        if grad.is_sparse:
            raise RuntimeError(f"{who} does not support sparse gradients (parameter of shape "
                               f"{tuple(param.shape)})")
        if grad.shape != param.shape:
            raise RuntimeError(f"gradient of shape {tuple(grad.shape)} does not match its parameter "
                               f"of shape {tuple(param.shape)}")
        if grad.dtype != param.dtype:
            # torch refuses such an assignment (p.grad = g) with "the gradient must match the
            # tensor's grad_dtype" and its AdamW fails on one set through .data: refused here
            # before anything changes, in the same words.
            raise RuntimeError(f"{who}: a gradient with dtype {grad.dtype} for a parameter of dtype "
                               f"{param.dtype} (shape {tuple(param.shape)}): the gradient must match "
                               "its parameter's dtype")


def step_params(rule, params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
                hyperparameters: dict, *, options: StepOptions, backend: str | None = None,
                cache: StepCache | None = None) -> None:
    """One step of ``params`` under ``rule`` (``step.rules``), in place.

    ``grads``: one per parameter, of its dtype and shape; ``states``: one dict per parameter
    with its ``step`` count and the rule's moments (created by ``new_state`` or an
    optimizer), advanced in place; ``hyperparameters``: a param group's values, checked by
    the rule before anything changes; ``backend``: as ``resolve_backend`` takes it (``None``:
    the fastest for the parameters' devices); ``cache``: see ``StepCache``.
    """
    cache = StepCache() if cache is None else cache
    if cache.scalars is None or cache.scalars.rule is not rule:
        cache.scalars = GroupScalars(rule)
    cache.scalars.refresh(hyperparameters)  # raises for a bad value before anything changes
    plan = cache.plan
    moment_keys = rule.moment_keys(hyperparameters)
    if (grads is not cache.checked_grads and not cache.holds(rule, params, grads, states, backend)
            or plan.moment_keys != moment_keys):
        check_step_inputs(rule, params, grads, states, moment_keys)
        check_gradients(params, grads, rule.name)
        cache.requested_backend = backend
        resolved = resolve_backend(backend, [param.device for param in params])
        plan = cache.plan = GroupPlan(params, grads, states, resolved, rule, moment_keys)
    cache.checked_grads = None
    plan.step(grads, cache.scalars, options, cache.scratch)
