"""Optimizer checkpoints: checking a state dict before it is loaded, and converting between
``torch.optim.AdamW`` state dicts and ours.

``LowBitAdamW.load_state_dict`` runs ``prepare_load`` before ``torch.optim.Optimizer``'s own
loading and ``PreparedLoad.finish`` after it. That wrapper exists for three reasons:

* a state dict that does not fit is refused, naming the parameter, before anything changes
  (``validate_state_dict``);
* ``Optimizer.load_state_dict`` casts every floating-point state tensor to its parameter's
  dtype. Quantized moments only relabel their dtype under that cast (``state._to_copy``), but
  the float32 moments of small parameters would be rounded to bfloat16 for bfloat16
  parameters, so they are held back from the cast and put back as float32;
* a ``torch.optim.AdamW`` state dict is recognised (its groups have no ``block_size``) and its
  moments are quantized on the way in (``from_torch_adamw``).

``to_torch_adamw`` goes the other way. See ``docs/checkpoints.md``.
"""

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lowbit_optim.checkpoint.torchao import quantized_from_torchao
from lowbit_optim.state.factored import FactoredState, factor_shape
from lowbit_optim.state.quantized import QuantizedState
from lowbit_optim.state.sharding import (
    factored_from_float,
    is_dtensor,
    local,
    quantized_from_float,
    wrap_like,
)
from lowbit_optim.step.master_weights import (
    CORRECTION_KEY,
    check_loaded_correction,
    needs_correction,
    read_master,
    zeros_correction,
)
from lowbit_optim.step.math import compute_dtype

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


def _slots(optimizer, state_dict) -> dict:
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


def _slot_for(slots: dict, saved_id) -> _Slot:
    if saved_id not in slots:
        raise ValueError(f"loaded state dict has state for parameter id {saved_id!r}, which no group lists")
    return slots[saved_id]


def is_torch_adamw_state_dict(state_dict) -> bool:
    """Whether ``state_dict`` comes from ``torch.optim.AdamW``, torchao's low-bit optimizers
    (or another optimizer without our group options) rather than from a ``LowBitAdamW``."""
    groups = state_dict.get("param_groups", []) if isinstance(state_dict, Mapping) else []
    return bool(groups) and all(not any(k in g for k in LOWBIT_GROUP_KEYS) for g in groups)


# --- validation ---------------------------------------------------------------------------
def validate_state_dict(optimizer, state_dict, slots: dict | None = None) -> None:
    """Raise ``ValueError`` naming the parameter if ``state_dict`` does not fit ``optimizer``.

    Checks group and parameter counts, each group's hyperparameters, and every state entry:
    ``step`` a finite count; the moments present (``max_exp_avg_sq`` exactly when amsgrad is
    on), shaped like the parameter, quantized exactly when the parameter has at least
    ``min_quant_size`` elements, in this optimizer's formats and the group's block size,
    with codes and scales of the right dtype and shape and finite, non-negative scales (a
    factored moment: float32 row and column statistics of the right lengths, finite and
    non-negative). Nothing is modified. ``slots``: ``_slots(optimizer, state_dict)`` if already built.
    """
    slots = slots or _slots(optimizer, state_dict)
    for index, saved in enumerate(state_dict["param_groups"]):
        try:
            optimizer._check_group({**optimizer.defaults, **saved})
        except (ValueError, TypeError) as error:
            raise ValueError(f"parameter group {index} of the loaded state dict: {error}") from None
    for saved_id, entry in state_dict["state"].items():
        slot = _slot_for(slots, saved_id)
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
            if key in optimizer.rule.all_moment_keys:  # amsgrad's maximum without amsgrad
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


# --- loading --------------------------------------------------------------------------------
@dataclass
class PreparedLoad:
    """A checked state dict ready for ``Optimizer.load_state_dict``, minus what its dtype cast
    would damage: float32 moments (and ``step``), put back by ``finish``. ``held`` maps a
    saved parameter id to its state's key order and the held-back values."""

    state_dict: dict
    slots: dict
    held: dict

    def finish(self, optimizer) -> None:
        bits_of = {id(p): g["master_weight_bits"] for g in optimizer.param_groups for p in g["params"]}
        for saved_id, (order, values) in self.held.items():
            param = self.slots[saved_id].param
            state = dict(optimizer.state[param])
            for key, value in values.items():
                if key == "step":
                    # Our steps read it as a 0-d CPU float32 tensor whatever the device.
                    state[key] = torch.as_tensor(value).to(device="cpu", dtype=torch.float32)
                elif key == CORRECTION_KEY:  # an integer tensor, kept as saved
                    state[key] = value.to(device=param.device)
                else:
                    state[key] = value.to(device=param.device, dtype=compute_dtype(param))
            bits = bits_of[id(param)]
            if needs_correction(param, bits) and CORRECTION_KEY not in state:
                # Saved without master weights: the master weight starts as the parameter.
                state[CORRECTION_KEY] = zeros_correction(param, bits)
                order = [*order, CORRECTION_KEY]
            optimizer.state[param] = {key: state[key] for key in order}


def prepare_load(optimizer, state_dict) -> PreparedLoad:
    """Convert (a full state dict gathered from FSDP2 shards, a ``torch.optim.AdamW`` one)
    and check ``state_dict`` for ``optimizer``; raises ``ValueError`` without touching
    anything if it does not fit."""
    slots = _slots(optimizer, state_dict)
    state_dict = _store_float_moments(optimizer, state_dict, slots)
    state_dict = _adopt_older_formats(optimizer, state_dict, slots)
    if is_torch_adamw_state_dict(state_dict):
        state_dict = from_torch_adamw(optimizer, state_dict, slots)
        # Mapped again: the converted groups now carry this optimizer's block sizes.
        slots = _slots(optimizer, state_dict)
    state_dict = _with_current_group_options(optimizer, state_dict)
    # The optimizer keeps a copy: its step updates moments in place and replaces ``step``, so
    # state shared with the caller's dict would leave that dict half trained, an
    # inconsistent checkpoint. One copy of the state, at load time only; made after the
    # conversions, which leave no foreign (torchao) tensor that could not be copied.
    state_dict = {**state_dict, "state": copy.deepcopy(dict(state_dict["state"]))}
    validate_state_dict(optimizer, state_dict, slots)
    state, held = {}, {}
    for saved_id, entry in state_dict["state"].items():
        # Held back from torch's cast to the parameter's dtype too: the integer correction.
        keep = {k: v for k, v in entry.items()
                if k not in ("step", CORRECTION_KEY) and not _is_plain_moment(optimizer, k, v)}
        held[saved_id] = (list(entry), {k: v for k, v in entry.items() if k not in keep})
        state[saved_id] = keep
    return PreparedLoad({**state_dict, "state": state}, slots, held)


def _is_plain_moment(optimizer, key, value) -> bool:
    return key in optimizer.rule.all_moment_keys and not isinstance(local(value), STORED_MOMENTS)


# --- conversion -----------------------------------------------------------------------------
def from_torch_adamw(optimizer, state_dict, slots: dict | None = None) -> dict:
    """A ``torch.optim.AdamW`` state dict as ``optimizer`` (a ``LowBitAdamW``) would save it.

    Also takes a state dict of torchao's ``AdamW8bit``/``AdamW4bit``/``AdamWFp8``/``Adam8bit``/
    ``Adam4bit``/``AdamFp8``:
    their quantized moments keep their codes and scales where our format has their map and
    layout (``foreign_moment``, ``_carried_moment``; see docs/checkpoints.md), and are read as
    float values and quantized in our formats otherwise. Options the saving optimizer did
    not have (torchao's groups have no ``maximize``) are filled in from this optimizer's
    groups by ``prepare_load``.
    Hyperparameters (lr, betas, eps, weight decay, amsgrad, maximize) come from
    ``state_dict``; ``block_size``, ``min_quant_size`` and ``bf16_stochastic_round`` from the
    optimizer's current groups. Moments of parameters with at least ``min_quant_size``
    elements are quantized in the optimizer's formats (a factored second moment,
    ``AdamWFactored4bit``, is factored from the full one: its row and column means); the
    others stay float32.
    ``optimizer.load_state_dict`` calls this itself when given a torch state dict.
    """
    slots = slots or _slots(optimizer, state_dict)
    groups = []
    for index, (saved, own) in enumerate(zip(state_dict["param_groups"], optimizer.param_groups)):
        # torch.optim.AdamW's groups say True; torchao's say nothing (their class decides).
        own_decoupled = own.get("decoupled_weight_decay", True)
        decoupled = saved.get("decoupled_weight_decay", own_decoupled)
        if decoupled != own_decoupled and saved.get("weight_decay", 0) != 0:
            kinds = {True: "decoupled weight decay (AdamW)", False: "L2 weight decay (Adam)"}
            raise ValueError(
                f"parameter group {index} of the loaded state dict uses {kinds[decoupled]}; "
                f"{type(optimizer).__name__} uses {kinds[own_decoupled]}"
            )
        group = {k: v for k, v in saved.items() if k not in TORCH_ADAMW_GROUP_OPTIONS}
        group.update({k: own[k] for k in (*LOWBIT_GROUP_KEYS, "decoupled_weight_decay") if k in own})
        groups.append(group)
    group_of = {saved_id: groups[i] for i, g in enumerate(groups) for saved_id in g["params"]}

    state = {}
    for saved_id, entry in state_dict["state"].items():
        slot = _slot_for(slots, saved_id)
        converted = dict(entry)
        if "step" in entry:
            converted["step"] = torch.as_tensor(entry["step"]).to(device="cpu", dtype=torch.float32)
        group = group_of[saved_id]
        for key in optimizer.rule.all_moment_keys:
            value = entry.get(key)
            if not isinstance(value, torch.Tensor):
                continue
            value = foreign_moment(value)
            if not optimizer.is_quantized(slot.param, group):
                converted[key] = _float_values(value)
                continue
            if value.shape != slot.param.shape:
                raise ValueError(
                    f"{slot.label}: {key} has shape {tuple(value.shape)}, not the parameter's"
                )
            carried = _carried_moment(optimizer, slot.param, group, key, value)
            if carried is None:
                carried = _stored_moment(optimizer, slot.param, group, key, _float_values(value))
            converted[key] = carried
        state[saved_id] = converted
    return {**state_dict, "state": state, "param_groups": groups}


def _stored_moment(optimizer, param, group: dict, key: str, values: torch.Tensor):
    """Float ``values`` of ``param``'s shape (plain, or a DTensor of this rank's shard) as
    ``optimizer`` keeps moment ``key``: factored, or quantized in its format and ``group``'s
    block size (for a DTensor, over this rank's shard; factoring one is a collective)."""
    if optimizer.is_factored(param, group, key):
        return factored_from_float(values, param.dtype)
    return quantized_from_float(values, optimizer.moment_format(key), group["block_size"], param.dtype)


def foreign_moment(value: torch.Tensor) -> torch.Tensor:
    """A moment stored by another library's quantized state in our terms; any other tensor as
    it is.

    torchao's ``OptimState8bit``/``OptimState4bit``/``OptimStateFp8`` (tested) become a
    ``QuantizedState`` with their codes and scales (``torchao_checkpoint.quantized_from_torchao``:
    their maps are ours). Another tensor subclass with its own ``dequantize()`` becomes its
    float32 values; such subclasses' other ops (``reshape`` of a torchao 4-bit state raised
    ``NotImplementedError ... aten.constant_pad_nd``) cannot be relied on.
    """
    carried = quantized_from_torchao(value)
    if carried is not None:
        return carried
    own_dequantize = getattr(type(value), "dequantize", torch.Tensor.dequantize)
    if isinstance(value, STORED_MOMENTS) or own_dequantize is torch.Tensor.dequantize:
        return value
    return value.dequantize().float()


def _float_values(value: torch.Tensor) -> torch.Tensor:
    return value.dequantize(torch.float32) if isinstance(value, STORED_MOMENTS) else value


def _carried_moment(optimizer, param, group: dict, key: str, value):
    """``value``, a ``QuantizedState`` from another optimizer, as ``optimizer`` keeps moment
    ``key`` of ``param`` without touching its codes: where its format is ours (or one ours
    reads as its own, ``QuantFormat.reads_codes_of``) in ``group``'s block size. ``None``
    otherwise: the moment is then quantized again from its values."""
    fmt = optimizer.moment_format(key)
    if (not isinstance(value, QuantizedState) or is_dtensor(param)
            or optimizer.is_factored(param, group, key)
            or value.format_name not in (fmt.name, *fmt.reads_codes_of)
            or value.block_size != group["block_size"]):
        return None
    return QuantizedState(value.codes, value.scales, fmt.name, param.shape, param.dtype)


def to_torch_adamw(state_dict, *, params=None) -> dict:
    """A ``LowBitAdamW`` state dict as a plain ``torch.optim.AdamW`` one.

    Quantized moments are dequantized to float32 tensors of the parameter's shape (a factored
    second moment becomes the outer product it stands for, ``FactoredState.dequantize``), float32
    moments and ``step`` are copied, LRs become Python floats, and the groups get
    ``torch.optim.AdamW``'s options in place of ours. The result loads into
    ``torch.optim.AdamW`` (which casts moments to the parameter dtype) or, to switch formats,
    into another ``LowBitAdamW``. An ``Adam8bit``/``Adam4bit`` state dict keeps
    ``decoupled_weight_decay=False`` and loads into ``torch.optim.Adam``. Pass
    ``optimizer.state_dict()``; nothing is modified.

    Master weight corrections (``master_weight_bits``) are no ``torch.optim.AdamW`` state: a
    state dict holding them needs ``params``, the optimizer's parameters in the order of its
    groups (``[p for g in optimizer.param_groups for p in g["params"]]``), and the result
    gets ``"master_weights"``: parameter id -> float32 master weight for every parameter, in
    group order (float32 copies of those without a correction), to copy into a float32 model
    (``master_weights_state_dict`` gives the same by parameter name).
    """
    ids = [saved_id for saved in state_dict["param_groups"] for saved_id in saved["params"]]
    has_corrections = any(CORRECTION_KEY in entry for entry in state_dict["state"].values())
    params = None if params is None else list(params)
    if has_corrections and (params is None or len(params) != len(ids)):
        raise ValueError(
            f"this state dict holds master weight corrections ({CORRECTION_KEY}): pass params="
            f"the optimizer's {len(ids)} parameters in group order, so that the master weights "
            "are exported with it"
        )
    param_of = dict(zip(ids, params)) if has_corrections else {}
    groups = []
    for saved in state_dict["param_groups"]:
        group = {k: v for k, v in saved.items() if k not in LOWBIT_GROUP_KEYS}
        group.setdefault("decoupled_weight_decay", True)  # saved before it was a group option
        for key in ("lr", "initial_lr"):
            if isinstance(group.get(key), torch.Tensor):
                group[key] = float(group[key])
        group.update(TORCH_ADAMW_GROUP_OPTIONS)
        groups.append(group)
    state, master_weights = {}, {}
    for saved_id, entry in state_dict["state"].items():
        converted = {}
        for key, value in entry.items():
            if key == CORRECTION_KEY:
                param = local(param_of[saved_id]).detach()
                master_weights[saved_id] = read_master(param, local(value)).clone()
                continue
            if isinstance(value, STORED_MOMENTS):
                value = value.dequantize(torch.float32)
            elif isinstance(value, torch.Tensor):
                value = value.detach().to(torch.float32, copy=True)
            converted[key] = value
        state[saved_id] = converted
    if has_corrections:
        # Every parameter, in group order: those without a correction as float32 copies.
        master_weights = {saved_id: master_weights.get(saved_id, _float32_copy(param_of[saved_id]))
                          for saved_id in ids}
        return {"state": state, "param_groups": groups, "master_weights": master_weights}
    return {"state": state, "param_groups": groups}


def _float32_copy(param: torch.Tensor) -> torch.Tensor:
    return local(param).detach().to(torch.float32, copy=True)


def _map_moments(state_dict: dict, slots: dict, keys: tuple[str, ...], convert) -> dict:
    """``state_dict`` with ``convert(slot, key, moment)`` applied to every moment (``keys``) of
    a known parameter (``None``: the moment stays as it is). Nothing is modified."""
    state = {}
    for saved_id, entry in state_dict["state"].items():
        slot = slots.get(saved_id)
        if slot is None or not isinstance(entry, Mapping):
            state[saved_id] = entry
            continue
        entry = dict(entry)
        for key in keys:
            if key in entry:
                converted = convert(slot, key, entry[key])
                if converted is not None:
                    entry[key] = converted
        state[saved_id] = entry
    return {**state_dict, "state": state}


def _store_float_moments(optimizer, state_dict: dict, slots: dict) -> dict:
    """``state_dict`` with each float moment of a quantized parameter stored again: quantized
    in ``optimizer``'s formats and the group's block size, or factored (for a DTensor, a
    collective, as every rank loads).

    ``get_optimizer_state_dict(..., full_state_dict=True)`` gathers sharded moments as their
    float values (``full_tensor()`` of a quantized shard dequantizes).
    ``set_optimizer_state_dict`` shards them back as float DTensors, or, into an unsharded
    model, hands them over whole; this turns them into stored moments again before they are
    checked. Loaded with the blocks that saved them this is exact (each block re-quantizes the
    values it dequantized, but see docs/distributed.md for negative-maximum blocks); otherwise
    it costs one rounding. A ``torch.optim.AdamW`` state dict is left to ``from_torch_adamw``
    (whose groups hold no block size). Anything else is passed through, to be checked.
    """
    if is_torch_adamw_state_dict(state_dict):
        return state_dict

    def convert(slot, key, value):
        group = {**optimizer.defaults, **slot.group}
        shard = local(value)
        is_float = (isinstance(shard, torch.Tensor) and not isinstance(shard, STORED_MOMENTS)
                    and shard.is_floating_point())
        if not is_float or value.shape != slot.param.shape or not optimizer.is_quantized(slot.param, group):
            return None
        return _stored_moment(optimizer, slot.param, group, key, value)

    return _map_moments(state_dict, slots, optimizer.rule.all_moment_keys, convert)


def _adopt_older_formats(optimizer, state_dict: dict, slots: dict) -> dict:
    """``state_dict`` with each moment saved in an older format that this optimizer's format
    reads as its own (``QuantFormat.reads_codes_of``: the 8-bit second moment before it became zero-free)
    relabelled, codes and scales untouched: its codes mean the same values except code 0,
    which now decodes to half the map's smallest value instead of 0."""
    def convert(slot, key, value):
        shard, fmt = local(value), optimizer.moment_format(key)
        if not isinstance(shard, QuantizedState) or shard.format_name not in fmt.reads_codes_of:
            return None
        adopted = QuantizedState(shard.codes, shard.scales, fmt.name, shard.shape, shard.dtype)
        return wrap_like(adopted, value) if is_dtensor(value) else adopted

    return _map_moments(state_dict, slots, optimizer.rule.all_moment_keys, convert)


def _with_current_group_options(optimizer, state_dict: dict) -> dict:
    """``state_dict`` with every group option it predates (``decoupled_weight_decay`` in
    checkpoints saved before the Adam classes) set to this optimizer's current value, since
    ``Optimizer.load_state_dict`` replaces the groups by the saved ones. ``master_weight_bits``
    is always the optimizer's own: it says which state the parameters keep, so a checkpoint
    saved without master weights can resume with them (the corrections start at zero) and
    one whose corrections do not fit is refused (``check_loaded_correction``)."""
    groups = []
    for saved, own in zip(state_dict["param_groups"], optimizer.param_groups):
        missing = {k: v for k, v in own.items() if k not in saved and k not in ("params", "param_names")}
        groups.append({**saved, **missing, "master_weight_bits": own["master_weight_bits"]})
    return {**state_dict, "param_groups": groups}
