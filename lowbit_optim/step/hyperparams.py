"""Hyperparameter checks and the 0-d CPU tensors a compiled step reads them from.

Why tensors: ``torch.compile`` bakes a Python float into the graph and recompiles when it
changes (shared seeds: a cosine schedule recompiled every step). A 0-d CPU tensor is a graph
input instead, and device kernels receive a CPU scalar as an argument, so changing it costs
neither a recompile nor a host-to-device copy. Why owned by the optimizer, on CPU and
refreshed in place: no per-step allocation, and whatever the user does to the group
(a scheduler, ``group["lr"] = 0.0005`` timm style, ``group["lr"].fill_(x)``, OneCycleLR
rewriting ``betas``) is read into the same tensors at the next step, while the group keeps
exactly what the user wrote.
"""

import math
import numbers
from typing import NamedTuple

import torch

# float64, as torch.optim.AdamW computes with Python floats: the bias corrections
# 1 - beta**step and lr / bias_correction1 are formed in float64, and a float LR reaches the
# step unrounded.
HYPER_DTYPE = torch.float64


def as_float(name: str, value) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element, got shape {tuple(value.shape)}")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"Invalid {name}: {value!r} (a number or a 1-element tensor is needed)")
    return float(value)


def check_learning_rate(lr) -> None:
    lr = as_float("lr", lr)
    if not 0.0 <= lr < math.inf:
        raise ValueError(f"Invalid learning rate: {lr}")


def check_nonnegative(name: str, value, wording: str | None = None) -> float:
    """``value`` as a float, or ``ValueError`` in torch.optim's words ("Invalid eps value")
    unless it is finite and >= 0."""
    number = as_float(name, value)
    if not 0.0 <= number < math.inf:
        raise ValueError(f"Invalid {wording or name} value: {number}")
    return number


def check_betas(betas, names: tuple[str, ...]) -> None:
    """``betas``: a tuple or list of ``len(names)`` values, each in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != len(names):
        raise ValueError(f"Invalid betas: {betas!r} (a {len(names)}-tuple ({', '.join(names)}) is needed)")
    for index, beta in enumerate(betas):
        beta = as_float(names[index], beta)
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {index}: {beta}")


def check_hyperparameters(lr, betas, eps, weight_decay) -> None:
    """Raise ``ValueError`` with torch.optim's wording for a value AdamW cannot use."""
    check_learning_rate(lr)
    check_nonnegative("eps", eps, "epsilon")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r} (a pair (beta1, beta2) is needed)")
    check_betas(betas, ("beta1", "beta2"))
    check_nonnegative("weight_decay", weight_decay)


class GroupScalars:
    """The 0-d CPU tensors one param group's step reads, owned by the optimizer and refreshed
    in place from the group at every step: one attribute per name of the update rule's
    ``scalar_names`` (``step.rules``; AdamW's ``lr``, ``beta1``, ``beta2``, ``eps``,
    ``weight_decay``).

    ``param_groups`` keep what the user wrote: a float LR stays a float (what schedulers,
    loggers and ``json.dumps`` see), a tensor LR stays the user's tensor. Only these copies,
    never the group's values, reach the compiled step, so a new LR or new betas change the
    tensors' contents, never the graph's inputs: no recompile, no allocation.
    """

    def __init__(self, rule):
        self.rule = rule
        self.last_values = None  # what the tensors hold, when it came from plain numbers
        for name in rule.scalar_names:
            setattr(self, name, torch.zeros((), dtype=HYPER_DTYPE))

    def refresh(self, hyperparameters: dict) -> None:
        """Validate a group's current values (raising before anything changes) and copy them
        in. Plain numbers equal to the last ones are already checked and held: skipped, which
        spares ~10 us per call to a step that runs per parameter (gradient release). A
        tensor value is read every time: changed in place, it compares equal to itself."""
        values = tuple(hyperparameters.values())
        plain = not any(map(_holds_tensor, values))
        if plain and values == self.last_values:
            return
        self.rule.check_hyperparameters(hyperparameters)
        for name, value in self.rule.scalar_values(hyperparameters).items():
            tensor = getattr(self, name)
            if isinstance(value, torch.Tensor):
                tensor.copy_(value.detach().reshape(()))  # no host sync for a CPU tensor
            else:
                tensor.fill_(value)
        self.last_values = values if plain else None


def _holds_tensor(value) -> bool:
    if isinstance(value, (tuple, list)):
        return any(map(_holds_tensor, value))
    return isinstance(value, torch.Tensor)


class StepOptions(NamedTuple):
    """A param group's flags for one step, as they travel from the optimizer to every
    implementation: ``maximize``, ``stochastic_round`` (bf16 parameters), the Triton kernel's
    noise ``rounding_stream`` (``chunks.GROUP_STREAM_BITS``) and, for the Adam rules,
    ``decoupled_weight_decay`` (``False``: ``torch.optim.Adam``'s L2 decay)."""

    maximize: bool
    stochastic_round: bool
    rounding_stream: int | None = None
    decoupled_weight_decay: bool = True
