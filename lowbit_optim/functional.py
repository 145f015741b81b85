"""The functional API, in ``torch.optim``'s shape: one step of a list of parameters with their
gradients and states, hyperparameters keyword-only. Every optimizer class steps through
these same functions (``step.functional``); they are usable on their own, with states from
an optimizer class's ``new_state`` (docs/usage.md, "The functional API")."""

from lowbit_optim.step.functional import StepCache
from lowbit_optim.step.rules.adamw import adamw
from lowbit_optim.step.rules.ademamix import ademamix
from lowbit_optim.step.rules.lion import lion

__all__ = ["StepCache", "adamw", "ademamix", "lion"]
