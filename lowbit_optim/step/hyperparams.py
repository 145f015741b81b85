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

import torch

# float64, as torch.optim.AdamW computes with Python floats: the bias corrections
# 1 - beta**step and lr / bias_correction1 are formed in float64, and a float LR reaches the
# step unrounded.
HYPER_DTYPE = torch.float64


def _as_float(name: str, value) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element, got shape {tuple(value.shape)}")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"Invalid {name}: {value!r} (a number or a 1-element tensor is needed)")
    return float(value)


def check_hyperparameters(lr, betas, eps, weight_decay) -> None:
    """Raise ``ValueError`` with torch.optim's wording for a value AdamW cannot use."""
    lr = _as_float("lr", lr)
    if not 0.0 <= lr < math.inf:
        raise ValueError(f"Invalid learning rate: {lr}")
    eps = _as_float("eps", eps)
    if not 0.0 <= eps < math.inf:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r} (a pair (beta1, beta2) is needed)")
    for index, beta in enumerate(betas):
        beta = _as_float(f"beta{index + 1}", beta)
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {index}: {beta}")
    weight_decay = _as_float("weight_decay", weight_decay)
    if not 0.0 <= weight_decay < math.inf:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


class GroupScalars:
    """The 0-d CPU tensors one param group's step reads, owned by the optimizer and refreshed
    in place from the group at every step.

    ``param_groups`` keep what the user wrote: a float LR stays a float (what schedulers,
    loggers and ``json.dumps`` see), a tensor LR stays the user's tensor. Only these copies,
    never the group's values, reach the compiled step, so a new LR or new betas change the
    tensors' contents, never the graph's inputs: no recompile, no allocation.
    """

    def __init__(self):
        self.lr = torch.zeros((), dtype=HYPER_DTYPE)
        self.beta1 = torch.zeros((), dtype=HYPER_DTYPE)
        self.beta2 = torch.zeros((), dtype=HYPER_DTYPE)
        self.eps = torch.zeros((), dtype=HYPER_DTYPE)
        self.weight_decay = torch.zeros((), dtype=HYPER_DTYPE)

    def refresh(self, group: dict) -> None:
        """Validate the group's current values (raising before anything changes) and copy them in."""
        check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        for tensor, value in (
            (self.lr, group["lr"]),
            (self.beta1, group["betas"][0]),
            (self.beta2, group["betas"][1]),
            (self.eps, group["eps"]),
            (self.weight_decay, group["weight_decay"]),
        ):
            if isinstance(value, torch.Tensor):
                tensor.copy_(value.detach().reshape(()))  # no host sync for a CPU tensor
            else:
                tensor.fill_(value)
