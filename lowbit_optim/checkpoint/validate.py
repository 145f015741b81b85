"""Checking an optimizer state dict before anything is loaded: every group and every state
entry against the optimizer it is meant for, raising ``ValueError`` that names the parameter
(``validate_state_dict``), and the map from saved parameter ids to the optimizer's
parameters that loading and conversion share (``slots``)."""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lowbit_optim.state.factored import FactoredState, factor_shape
from lowbit_optim.state.quantized import QuantizedState
from lowbit_optim.state.sharding import local
from lowbit_optim.step.master_weights import CORRECTION_KEY, check_loaded_correction

# Group options only this package has; a state dict without them was saved by another optimizer.
LOWBIT_GROUP_KEYS = ("block_size", "min_quant_size", "bf16_stochastic_round", "master_weight_bits")
# The moment kinds that are not plain tensors: blockwise codes, and factored statistics.
STORED_MOMENTS = (QuantizedState, FactoredState)
# torch.optim.AdamW's implementation choices, with the values our exported state dicts give
# them. (``decoupled_weight_decay``, what makes Adam AdamW, is a group option of ours too.)
TORCH_ADAMW_GROUP_OPTIONS = {
    "foreach": None, "capturable": False, "differentiable": False, "fused": None,
}


@dataclass
class _Slot:
    """Where a saved parameter id lands: the parameter it maps to, and its saved group."""

    param: torch.Tensor
    group: dict
    label: str


def slots_of(optimizer, state_dict) -> dict:
    """Saved parameter id -> ``_Slot``, checking that the groups line up."""
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= state_dict.keys():
        raise ValueError("an optimizer state dict needs the keys 'state' and 'param_groups'")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer "
            f"{len(optimizer.param_groups)}"
        )
    slots = {}
    for group_index, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"parameter group {group_index} of the loaded state dict has "
                f"{len(saved['params'])} parameters, this optimizer's has {len(group['params'])}"
            )
        names = saved.get("param_names") or group.get("param_names")
        for position, (saved_id, param) in enumerate(zip(saved["params"], group["params"])):
            name = f" {names[position]!r}" if names else ""
            label = (
                f"parameter {saved_id}{name} (group {group_index}, position {position}, "
                f"shape {tuple(param.shape)})"
            )
            slots[saved_id] = _Slot(param, saved, label)
    return slots


def slot_for(slots: dict, saved_id) -> _Slot:
    if saved_id not in slots:
        raise ValueError(f"loaded state dict has state for parameter id {saved_id!r}, which no group lists")
    return slots[saved_id]


def is_torch_adamw_state_dict(state_dict) -> bool:
    """Whether ``state_dict`` comes from ``torch.optim.AdamW``, torchao's low-bit optimizers
    (or another optimizer without our group options) rather than from a ``LowBitAdamW``."""
    groups = state_dict.get("param_groups", []) if isinstance(state_dict, Mapping) else []
    return bool(groups) and all(not any(k in g for k in LOWBIT_GROUP_KEYS) for g in groups)


def validate_state_dict(optimizer, state_dict, slots: dict | None = None) -> None:
    """Raise ``ValueError`` naming the parameter if ``state_dict`` does not fit ``optimizer``.

    Checks group and parameter counts, each group's hyperparameters, and every state entry:
    ``step`` a finite count; the moments present (``max_exp_avg_sq`` exactly when amsgrad is
    on), shaped like the parameter, quantized exactly when the parameter has at least
    ``min_quant_size`` elements, in this optimizer's formats and the group's block size,
    with codes and scales of the right dtype and shape and finite, non-negative scales (a
    factored moment: float32 row and column statistics of the right lengths, finite and
    non-negative). Nothing is modified. ``slots``: ``slots_of(optimizer, state_dict)`` if already built.
    """
    slots = slots or slots_of(optimizer, state_dict)
    for index, saved in enumerate(state_dict["param_groups"]):
        try:
            optimizer._check_group({**optimizer.defaults, **saved})
        except (ValueError, TypeError) as error:
            raise ValueError(f"parameter group {index} of the loaded state dict: {error}") from None
    for saved_id, entry in state_dict["state"].items():
        slot = slot_for(slots, saved_id)
        if not isinstance(entry, Mapping):
            raise ValueError(f"{slot.label}: its state is a {type(entry).__name__}, not a dict")
        _check_step(slot, entry.get("step"))
        group = {**optimizer.defaults, **slot.group}
        keys = optimizer.moment_keys(group)
        missing = [key for key in keys if key not in entry]
        if missing:
            raise ValueError(f"{slot.label}: state has no {', '.join(missing)}")
        for key, value in entry.items():
            if key in keys or key in ("step", CORRECTION_KEY) or not isinstance(value, torch.Tensor):
                continue
            if key in optimizer.all_moment_keys():  # amsgrad's maximum without amsgrad
                raise ValueError(f"{slot.label}: state has {key} but its group has amsgrad=False")
            raise ValueError(
                f"{slot.label}: state has {key}, which {type(optimizer).__name__} does not keep (its "
                f"moments: {', '.join(keys)}): a state dict of another update rule")
        for key in keys:
            _check_moment(optimizer, slot, group, key, entry[key])
        check_loaded_correction(slot.label, slot.param, group["master_weight_bits"],
                                entry.get(CORRECTION_KEY))


def _check_step(slot: _Slot, step) -> None:
    if isinstance(step, torch.Tensor):
        ok = step.numel() == 1 and not step.is_complex() and step.dtype != torch.bool
        value = float(step) if ok else None
    else:
        ok = isinstance(step, (int, float)) and not isinstance(step, bool)
        value = float(step) if ok else None
    if not ok or not (0 <= value < float("inf")):
        raise ValueError(f"{slot.label}: 'step' must be a finite count >= 0, got {step!r}")


def _check_moment(optimizer, slot: _Slot, group: dict, key: str, value) -> None:
    where = f"{slot.label}: {key}"
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where} is a {type(value).__name__}, not a tensor")
    if tuple(value.shape) != tuple(slot.param.shape):
        raise ValueError(f"{where} has shape {tuple(value.shape)}, not the parameter's")
    shard = local(value)
    if optimizer.is_factored(slot.param, group, key):
        _check_factored(where, slot, shard)
        return
    if isinstance(shard, FactoredState):
        raise ValueError(
            f"{where} is a FactoredState; {type(optimizer).__name__} does not factor it (convert "
            "through lowbit_optim.checkpoint.to_torch_adamw to switch optimizers)"
        )
    if not optimizer.is_quantized(slot.param, group):
        if isinstance(shard, QuantizedState) or not shard.is_floating_point():
            got = "a QuantizedState" if isinstance(shard, QuantizedState) else f"a {shard.dtype} tensor"
            raise ValueError(
                f"{where} must be a float tensor (the parameter has fewer than min_quant_size="
                f"{group['min_quant_size']} elements), got {got}"
            )
        return
    fmt, block_size = optimizer.moment_format(key), group["block_size"]
    if not isinstance(shard, QuantizedState):
        raise ValueError(
            f"{where} must be a QuantizedState ({fmt.name}, block_size={block_size}), got a "
            f"plain {shard.dtype} tensor"
        )
    if shard.format_name != fmt.name:
        raise ValueError(
            f"{where} is stored as {shard.format_name}; {type(optimizer).__name__} uses {fmt.name} "
            "(convert through lowbit_optim.checkpoint.to_torch_adamw to switch formats)"
        )
    num_blocks = fmt.num_blocks(shard.numel(), block_size)
    codes_shape = (num_blocks, block_size // fmt.codes_per_byte)
    codes, scales = shard.codes, shard.scales
    if codes.dtype != torch.uint8 or tuple(codes.shape) != codes_shape:
        raise ValueError(
            f"{where}: codes are {codes.dtype} {tuple(codes.shape)}, expected torch.uint8 "
            f"{codes_shape} for block_size={block_size}"
        )
    if scales.dtype != torch.float32 or tuple(scales.shape) != (num_blocks,):
        raise ValueError(
            f"{where}: scales are {scales.dtype} {tuple(scales.shape)}, expected torch.float32 "
            f"({num_blocks},)"
        )
    if codes.device != scales.device:
        raise ValueError(f"{where}: codes on {codes.device} but scales on {scales.device}")
    if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
        raise ValueError(f"{where}: scales must be finite and >= 0")


def _check_factored(where: str, slot: _Slot, state) -> None:
    if not isinstance(state, FactoredState):
        got = f"a QuantizedState ({state.format_name})" if isinstance(state, QuantizedState) else (
            f"a plain {state.dtype} tensor")
        raise ValueError(
            f"{where} must be a FactoredState (row and column statistics), got {got} (convert "
            "through lowbit_optim.checkpoint.to_torch_adamw to switch optimizers)"
        )
    rows, columns = factor_shape(state.shape)  # this rank's rows of an FSDP2 shard
    for name, vector, length in (("row", state.row, rows), ("col", state.col, columns)):
        if vector.dtype != torch.float32 or tuple(vector.shape) != (length,):
            raise ValueError(
                f"{where}: {name} is {vector.dtype} {tuple(vector.shape)}, expected torch.float32 "
                f"({length},)"
            )
        if not bool((torch.isfinite(vector) & (vector >= 0)).all()):
            raise ValueError(f"{where}: {name} must be finite and >= 0")
    if state.row.device != state.col.device:
        raise ValueError(f"{where}: row on {state.row.device} but col on {state.col.device}")
