"""Updates lost to rounding: which parameters are silently not training.

A bf16 parameter holds 8 significant bits: an update smaller than half the spacing between
its value and the next representable one (half an ulp) rounds back to the value it had.
At lr 1e-5, AdamW8bit moved a bf16 parameter by 1.5e-5 on average against 2.0e-4 for fp32
parameters, only 6% of its elements changing at all; nothing in the loss says so at first.

``lost_updates(optimizer)`` estimates, per parameter, the fraction of elements whose last
update was lost this way, from what the optimizer holds after a step: the update is
recomputed from the stored moments, step count and hyperparameters with the step's own
formula (``step.math.parameter_update``), and compared with half an ulp of the stored
weight. Nothing runs unless it is called: the step is untouched (no cost when unused), and
a call costs one dequantization of each parameter's moments, one parameter at a time.
``warn_on_lost_updates`` calls it from a step post-hook every ``every`` steps and warns.

With master weights (``master_weight_bits``) the weight that has to move is the master weight
(parameter + correction), so an update is lost when writing the master weight plus the update
back into parameter and correction leaves the master weight as it was: 24-bit master weights
hold 16 significant bits (bf16) or 18 (float16), 32-bit ones a float32's 24, so the same check
tells whether the master weights are fine enough for the learning rate.

Elements whose update is exactly 0 (zero gradient and moment) are not counted: nothing was
lost there. Under FSDP2 each rank reports on its own shards. ``AdamWFactored4bit``'s ratio
bound is not applied: the estimate is of the unclamped update, which only clamps large ones.
"""

import math
import warnings
from dataclasses import dataclass

import torch

from lowbit_optim.state import FactoredState, QuantizedState, sharding
from lowbit_optim.step.master_weights import CORRECTION_KEY, read_master, split_master
from lowbit_optim.step.math import compute_dtype, parameter_update


class RoundingLossWarning(UserWarning):
    """Most of a parameter's updates are smaller than half an ulp of its stored value."""


@dataclass(frozen=True)
class LostUpdates:
    """One parameter whose updates are being lost to rounding."""

    name: str  # from ``model.named_parameters()`` if a model was given, else "group G, parameter I"
    shape: tuple[int, ...]
    dtype: torch.dtype
    lost_fraction: float  # of the elements whose update is not 0


def _stepping_optimizer(optimizer):
    """The optimizer that holds the state (``CPUOffloadOptimizer``'s host optimizer) and a
    map from its parameters to the ones the user sees."""
    host = getattr(optimizer, "host_optimizer", None)
    if host is None:
        return optimizer, {}
    return host, {item.host_param: device for device, item in optimizer._offloaded.items()}


def _dequantized(moment, dtype) -> torch.Tensor:
    moment = sharding.local(moment)
    if isinstance(moment, (QuantizedState, FactoredState)):
        return moment.dequantize(dtype)
    return moment.to(dtype)


def lost_fraction(param: torch.Tensor, state: dict, group: dict) -> float | None:
    """The fraction of ``param``'s elements whose last update (recomputed from ``state``) is
    smaller than half an ulp of the stored value; ``None`` before the first step."""
    if not state or float(state["step"]) == 0:
        return None
    stored = sharding.local(param).detach()
    correction = state.get(CORRECTION_KEY)
    if correction is not None:
        correction = sharding.local(correction)
        master = read_master(stored, correction)
    # Against a float32 master weight the update is computed in float64: in float32 an update
    # below half its ulp would already round to exactly 0 and go uncounted.
    dtype = compute_dtype(stored) if correction is None else torch.float64
    value = stored.to(dtype) if correction is None else master.to(dtype)
    second = state["max_exp_avg_sq"] if group["amsgrad"] else state["exp_avg_sq"]
    exp_avg = _dequantized(state["exp_avg"], dtype)
    if group["maximize"]:
        exp_avg = -exp_avg
    step = float(state["step"])
    beta1, beta2 = (float(beta) for beta in group["betas"])
    corrections = (1 - beta1**step, math.sqrt(1 - beta2**step))
    updated = parameter_update(
        value, exp_avg, _dequantized(second, dtype), lr=float(group["lr"]), eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]), corrections=corrections,
        decoupled_weight_decay=group.get("decoupled_weight_decay", True),
    )
    update = (updated - value).abs()
    moving = update > 0
    if correction is None:
        magnitude = stored.abs()
        ulp = torch.nextafter(magnitude, torch.full_like(magnitude, math.inf)) - magnitude
        lost = update < ulp.to(dtype) / 2
    else:
        lost = read_master(*split_master(updated.float(), stored.dtype, correction.dtype)) == master
    count = int(moving.sum())
    return int((moving & lost).sum()) / count if count else 0.0


def lost_updates(optimizer, *, threshold: float = 0.5,
                 model: torch.nn.Module | None = None) -> list[LostUpdates]:
    """The parameters more than ``threshold`` of whose elements' last updates were lost to
    rounding (see the module docstring). ``optimizer``: any of lowbit_optim's, or a
    ``CPUOffloadOptimizer``; ``model``: to name the parameters."""
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"Invalid threshold: {threshold!r} (a fraction in [0, 1) is needed)")
    stepping, shown = _stepping_optimizer(optimizer)
    names = {param: name for name, param in model.named_parameters()} if model is not None else {}
    found = []
    with torch.no_grad():
        for group_index, group in enumerate(stepping.param_groups):
            for index, param in enumerate(group["params"]):
                fraction = lost_fraction(param, stepping.state.get(param, {}), group)
                if fraction is not None and fraction > threshold:
                    user_param = shown.get(param, param)
                    name = names.get(user_param, f"group {group_index}, parameter {index}")
                    found.append(LostUpdates(name, tuple(param.shape), param.dtype, fraction))
    return found


def warn_on_lost_updates(optimizer, *, every: int = 100, threshold: float = 0.5,
                         model: torch.nn.Module | None = None):
    """Check ``lost_updates`` after every ``every``-th ``optimizer.step()`` and warn
    (``RoundingLossWarning``) naming the parameters found. Returns the hook's handle
    (``remove()`` stops it)."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"Invalid every: {every!r} (an int >= 1 is needed)")
    lost_updates(optimizer, threshold=threshold, model=model)  # bad arguments fail here, not in a step
    steps = 0

    def check(optimizer, args, kwargs):
        nonlocal steps
        steps += 1
        if steps % every:
            return
        found = lost_updates(optimizer, threshold=threshold, model=model)
        if found:
            listed = "; ".join(f"{item.name} {list(item.shape)} {item.dtype}: {item.lost_fraction:.0%}"
                               for item in found)
            warnings.warn(RoundingLossWarning(
                f"updates lost to rounding (smaller than half an ulp of the stored weight) for "
                f"more than {threshold:.0%} of the elements of {len(found)} parameter(s): {listed}. "
                "Training is stalling there: raise the learning rate, use "
                "bf16_stochastic_round=True, or keep those parameters in float32"), stacklevel=2)

    return optimizer.register_step_post_hook(check)
