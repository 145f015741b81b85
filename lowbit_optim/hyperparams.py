"""Hyperparameter checks and the 0-d CPU tensors a compiled step reads them from.

Why tensors: ``torch.compile`` bakes a Python float into the graph and recompiles when it
changes (shared seeds: a cosine schedule recompiled every step). A 0-d CPU tensor is a graph
input instead, and device kernels receive a CPU scalar as an argument, so changing it costs
neither a recompile nor a host-to-device copy. Why on CPU and refreshed in place: no
per-step allocation, and ``group["lr"] = 0.0005`` (timm style) or OneCycleLR rewriting
``betas`` keep working: the new value is read into the same tensors at the next step.
"""

import math
import numbers

import torch

LR_DTYPE = torch.float32
# Betas, eps and weight decay are float64 so that the bias corrections 1 - beta**step are
# formed in float64, as torch.optim.AdamW forms them from Python floats.
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


def is_lr_tensor(value) -> bool:
    """Whether ``value`` can serve as a group's LR as it is: a 0-d float32 CPU tensor."""
    return (
        isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and value.dtype == LR_DTYPE
        and value.dim() == 0
    )


def new_lr_tensor(value) -> torch.Tensor:
    return torch.tensor(_as_float("lr", value), dtype=LR_DTYPE)


class GroupScalars:
    """The 0-d CPU tensors one param group's step reads: refreshed in place every step."""

    def __init__(self):
        self.lr: torch.Tensor | None = None
        self.beta1 = torch.zeros((), dtype=HYPER_DTYPE)
        self.beta2 = torch.zeros((), dtype=HYPER_DTYPE)
        self.eps = torch.zeros((), dtype=HYPER_DTYPE)
        self.weight_decay = torch.zeros((), dtype=HYPER_DTYPE)

    def refresh(self, group: dict) -> torch.Tensor:
        """Validate the group's current values, copy them in, and return its LR tensor.

        A float (or foreign tensor) put into ``group["lr"]`` is written into the group's own
        LR tensor, which is put back, so the compiled step always sees the same input.
        """
        check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        lr = group["lr"]
        if is_lr_tensor(lr):
            self.lr = lr
        else:
            if self.lr is None:
                self.lr = new_lr_tensor(lr)
            self.lr.fill_(_as_float("lr", lr))
            group["lr"] = self.lr
        self.beta1.fill_(_as_float("beta1", group["betas"][0]))
        self.beta2.fill_(_as_float("beta2", group["betas"][1]))
        self.eps.fill_(_as_float("eps", group["eps"]))
        self.weight_decay.fill_(_as_float("weight_decay", group["weight_decay"]))
        return self.lr
