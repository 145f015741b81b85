"""Loading an optimizer state dict: what ``load_state_dict`` does before and after
``torch.optim.Optimizer``'s own loading.

``LowBitAdamW.load_state_dict`` runs ``prepare_load`` before ``torch.optim.Optimizer``'s own
loading and ``PreparedLoad.finish`` after it. That wrapper exists for three reasons:

* a state dict that does not fit is refused, naming the parameter, before anything changes
  (``validate.validate_state_dict``);
* ``Optimizer.load_state_dict`` casts every floating-point state tensor to its parameter's
  dtype. Quantized moments only relabel their dtype under that cast (``state._to_copy``), but
  the float32 moments of small parameters would be rounded to bfloat16 for bfloat16
  parameters, so they are held back from the cast and put back as float32;
* a ``torch.optim.AdamW`` state dict is recognised (its groups have no ``block_size``) and its
  moments are quantized on the way in (``convert.from_torch_adamw``);
* a state dict gathered from FSDP2 shards holds float moments, stored again here, and one
  saved in an older format this one reads is relabelled;
* master weight corrections follow the loading optimizer's ``master_weight_bits``: widened
  from 24 to 32 bits, narrowed from 32 to 24, dropped (with a warning) without master weights.

See ``docs/checkpoints.md``.
"""

import copy
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lowbit_optim.checkpoint.convert import from_torch_adamw, stored_moment
from lowbit_optim.checkpoint.validate import (
    STORED_MOMENTS,
    is_torch_adamw_state_dict,
    slots_of,
    validate_state_dict,
)
from lowbit_optim.state.quantized import QuantizedState
from lowbit_optim.state.sharding import is_dtensor, local, wrap_like
from lowbit_optim.step.master_weights import (
    CORRECTED_DTYPES,
    CORRECTION_DTYPES,
    CORRECTION_KEY,
    convert_correction,
    correction_dtype,
    needs_correction,
    zeros_correction,
)
from lowbit_optim.step.math import compute_dtype


@dataclass
class PreparedLoad:
    """A checked state dict ready for ``Optimizer.load_state_dict``, minus what its dtype cast
    would damage: float32 moments (and ``step``), put back by ``finish``. ``held`` maps a
    saved parameter id to its state's key order and the held-back values."""

    state_dict: dict
    slots: dict
    held: dict
    # Corrections dropped because the loading optimizer keeps none (``master_weight_bits=None``).
    dropped_corrections: int = 0

    def finish(self, optimizer) -> None:
        if self.dropped_corrections:
            warnings.warn(
                f"{type(optimizer).__name__}.load_state_dict: the state dict holds master weight "
                f"corrections for {self.dropped_corrections} parameter(s), which this optimizer "
                "(master_weight_bits=None) does not keep: dropped, the parameters resume as they are. "
                "Build the optimizer with master_weight_bits=24 or 32 to keep them",
                stacklevel=3)
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
    slots = slots_of(optimizer, state_dict)
    state_dict = _store_float_moments(optimizer, state_dict, slots)
    state_dict = _adopt_older_formats(optimizer, state_dict, slots)
    if is_torch_adamw_state_dict(state_dict):
        state_dict = from_torch_adamw(optimizer, state_dict, slots)
        # Mapped again: the converted groups now carry this optimizer's block sizes.
        slots = slots_of(optimizer, state_dict)
    state_dict = _with_current_group_options(optimizer, state_dict)
    # Mapped again: the groups now carry this optimizer's master_weight_bits.
    slots = slots_of(optimizer, state_dict)
    state_dict, dropped = _fit_corrections(state_dict, slots)
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
    return PreparedLoad({**state_dict, "state": state}, slots, held, dropped)


def _is_plain_moment(optimizer, key, value) -> bool:
    return key in optimizer.all_moment_keys() and not isinstance(local(value), STORED_MOMENTS)


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
        return stored_moment(optimizer, slot.param, group, key, value)

    return _map_moments(state_dict, slots, optimizer.all_moment_keys(), convert)


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

    return _map_moments(state_dict, slots, optimizer.all_moment_keys(), convert)


def _fit_corrections(state_dict: dict, slots: dict) -> tuple[dict, int]:
    """``state_dict`` with each saved correction fitted to the loading optimizer's
    ``master_weight_bits`` (already in the groups), and how many were dropped: a 24-bit one
    widened to 32 bits exactly, a 32-bit one narrowed to 24 (``convert_correction``), one of a
    bfloat16 or float16 parameter whose group keeps none dropped. Anything else is left to be
    checked (``check_loaded_correction``). Nothing is modified."""
    state, dropped = {}, 0
    for saved_id, entry in state_dict["state"].items():
        slot = slots.get(saved_id)
        value = entry.get(CORRECTION_KEY) if isinstance(entry, Mapping) else None
        shard = local(value)
        if slot is None or not isinstance(shard, torch.Tensor) or shard.dtype not in CORRECTION_DTYPES:
            state[saved_id] = entry
            continue
        bits = slot.group["master_weight_bits"]
        entry = dict(entry)
        if needs_correction(slot.param, bits):
            if shard.dtype != correction_dtype(bits) and tuple(value.shape) == tuple(slot.param.shape):
                entry[CORRECTION_KEY] = convert_correction(value, slot.param.dtype, correction_dtype(bits))
        elif bits is None and slot.param.dtype in CORRECTED_DTYPES:
            del entry[CORRECTION_KEY]
            dropped += 1
        state[saved_id] = entry
    return {**state_dict, "state": state}, dropped


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
