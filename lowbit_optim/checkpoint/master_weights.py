"""A model's float32 master weights, out of and into a bfloat16 or float16 model and its optimizer.

``master_weights_state_dict`` returns what a float32 copy of the model would hold: each
bfloat16 or float16 parameter that keeps a correction (``master_weight_bits``,
``step.master_weights``) as its master weight, the other floating-point parameters as float32
(float64 ones as they are), buffers unchanged. ``load_master_weights`` is its inverse: it
loads float32 weights into the model and sets the corrections, so that training resumes from
those exact weights (with 32 bits; for float16 from 2**-15 in magnitude up; within the 24-bit
rounding with 24). See docs/checkpoints.md.
"""

import torch

from lowbit_optim.state import sharding
from lowbit_optim.step.master_weights import CORRECTION_KEY, needs_correction, read_master, write_master


def _groups_by_param(optimizer) -> dict[int, dict]:
    return {id(param): group for group in optimizer.param_groups for param in group["params"]}


def _stepped_param(optimizer, param: torch.Tensor) -> torch.Tensor:
    """The tensor ``optimizer`` steps for the model's ``param``: ``CPUOffloadOptimizer`` steps
    (and keys its state by) a host copy."""
    host_param = getattr(optimizer, "host_param", None)
    if host_param is None:
        return param
    try:
        return host_param(param)
    except KeyError:  # frozen: no host copy
        return param


def _sync_master_weights(optimizer) -> None:
    """The corrections brought in line with their parameters as they are now, as the next step
    would (a model cast since: ``optim.master_weight_casts``)."""
    sync = getattr(getattr(optimizer, "host_optimizer", optimizer), "_sync_master_weights", None)
    if sync is not None:
        sync()


def _float32(value: torch.Tensor) -> torch.Tensor:
    return value.detach().clone() if value.dtype == torch.float64 else value.detach().to(torch.float32)


@torch.no_grad()
def master_weights_state_dict(model: torch.nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every floating-point parameter as float32 (float64 ones as
    they are) and every bfloat16 or float16 parameter that keeps a correction in ``optimizer``
    as its master weight: parameter + correction, exactly the float32 weight the step computes
    with ``master_weight_bits=32`` (float16: from 2**-15 in magnitude up). Loads into a
    float32 copy of the model with ``load_state_dict``. FSDP2 parameters give DTensors sharded
    like them. A model cast since the last step (``model.half()``, ``model.float()``) is first
    followed as the next step would (docs/usage.md, "Casting the model")."""
    _sync_master_weights(optimizer)
    result = model.state_dict()
    for name, param in model.named_parameters():
        if not param.is_floating_point() or name not in result:
            continue
        stepped = _stepped_param(optimizer, param)
        correction = optimizer.state.get(stepped, {}).get(CORRECTION_KEY)
        if correction is None:
            result[name] = _float32(param)
            continue
        master = read_master(sharding.local(stepped).detach(), sharding.local(correction))
        result[name] = sharding.wrap_like(master, stepped) if sharding.is_dtensor(stepped) else master
    return result


@torch.no_grad()
def load_master_weights(model: torch.nn.Module, optimizer, state_dict, *, strict: bool = True):
    """Load float32 (or float64) weights into ``model`` and, for each bfloat16 or float16
    parameter whose group has ``master_weight_bits``, set its correction in ``optimizer`` so
    that parameter + correction is the loaded weight (exactly with 32 bits, for float16 from
    2**-15 in magnitude up; rounded to 24 bits with 24). The
    parameter's optimizer state is created if it has none yet (zero moments, as a first step
    would create them). Returns ``model.load_state_dict``'s result (``strict`` as there)."""
    _sync_master_weights(optimizer)  # a cast since the last step: first followed
    result = model.load_state_dict(state_dict, strict=strict)
    groups = _groups_by_param(optimizer)
    for name, param in model.named_parameters():
        stepped = _stepped_param(optimizer, param)
        group = groups.get(id(stepped))
        if (name not in state_dict or group is None
                or not needs_correction(stepped, group["master_weight_bits"])):
            continue
        state = optimizer.state[stepped]
        if not state:
            getattr(optimizer, "host_optimizer", optimizer)._init_state(stepped, group, state)
        weights = sharding.local(state_dict[name])
        if sharding.is_dtensor(weights):
            weights = weights.to_local()
        local_param = sharding.local(stepped)
        write_master(local_param, sharding.local(state[CORRECTION_KEY]),
                     weights.to(device=local_param.device, dtype=torch.float32).reshape(local_param.shape))
        if stepped is not param:
            param.copy_(stepped)
    _sync_master_weights(optimizer)  # the corrections made here, remembered with their dtypes
    return result
