"""Converting between ``torch.optim.AdamW`` state dicts (and torchao's, and
``torch.optim.Muon``'s) and ours: ``from_torch_adamw`` quantizes their moments on the way in
(carrying torchao's codes over where the maps agree), ``to_torch_adamw`` and ``to_torch_muon``
dequantize ours on the way out, master weights included. See docs/checkpoints.md."""

import torch

from lowbit_optim.checkpoint.torchao import quantized_from_torchao
from lowbit_optim.checkpoint.validate import (
    LOWBIT_GROUP_KEYS,
    STORED_MOMENTS,
    TORCH_ADAMW_GROUP_OPTIONS,
    slot_for,
    slots_of,
)
from lowbit_optim.state.quantized import QuantizedState
from lowbit_optim.state.sharding import factored_from_float, is_dtensor, local, quantized_from_float
from lowbit_optim.step.master_weights import CORRECTION_KEY, read_master
from lowbit_optim.step.rules.adamw import ADAMW

# What makes a param group one ``torch.optim.AdamW`` steps: it reads these and two betas
# (its ``__setstate__`` fills in the rest).
TORCH_ADAMW_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
# Options only AdamW's groups have among the rules': a group holding one was saved by AdamW.
ADAMW_ONLY_OPTIONS = ("eps", "amsgrad")
# Group options that say which rule (and decay) a group of ours runs: the loading optimizer's.
OWN_RULE_OPTIONS = ("decoupled_weight_decay", "use_muon")


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
    slots = slots or slots_of(optimizer, state_dict)
    if any(optimizer.rule_of(group) is not ADAMW for group in optimizer.param_groups):
        _refuse_adamw_state(optimizer, state_dict, slots)
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
        group.update({k: own[k] for k in (*LOWBIT_GROUP_KEYS, *OWN_RULE_OPTIONS) if k in own})
        groups.append(group)
    group_of = {saved_id: groups[i] for i, g in enumerate(groups) for saved_id in g["params"]}

    state = {}
    for saved_id, entry in state_dict["state"].items():
        slot = slot_for(slots, saved_id)
        converted = dict(entry)
        if "step" in entry:
            converted["step"] = torch.as_tensor(entry["step"]).to(device="cpu", dtype=torch.float32)
        elif entry:  # torch.optim.Muon counts no steps (nor does Muon's math read them)
            converted["step"] = torch.tensor(0.0)
        group = group_of[saved_id]
        for key in optimizer.all_moment_keys():
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
                carried = stored_moment(optimizer, slot.param, group, key, _float_values(value))
            converted[key] = carried
        state[saved_id] = converted
    return {**state_dict, "state": state, "param_groups": groups}


def _refuse_adamw_state(optimizer, state_dict, slots: dict) -> None:
    """An AdamW state (its second moments, its ``eps`` or ``amsgrad``) does not become the
    state of a param group of another rule: Lion has no second moment, AdEMAMix a slow one the
    AdamW state lacks. A state dict of that rule without our group options (one whose
    moments have the rule's keys: ``torch.optim.Muon``'s) still converts."""
    name = type(optimizer).__name__
    rule_of = {saved_id: optimizer.rule_of(own) for saved, own in zip(state_dict["param_groups"],
                                                                    optimizer.param_groups)
               for saved_id in saved["params"]}
    for saved_id, entry in state_dict["state"].items():
        slot_for(slots, saved_id)  # a state no group lists is refused by name
        slot_rule = rule_of[saved_id]
        if slot_rule is ADAMW:
            continue
        rule, own = slot_rule.name, slot_rule.all_moment_keys
        adamw_moments = [key for key in ADAMW.all_moment_keys if key not in own]
        moments = [key for key in adamw_moments if key in entry]
        missing = [key for key in own if entry and key not in entry]
        if moments or missing:
            what = (f"has {', '.join(moments)}, which {name} does not keep" if moments
                    else f"has no {', '.join(missing)}, which {name} needs")
            raise ValueError(
                f"{slot_for(slots, saved_id).label}: the loaded state {what} ({rule} rule: "
                f"{', '.join(own)}): an AdamW state does not become its state")
    for index, (saved, own_group) in enumerate(zip(state_dict["param_groups"], optimizer.param_groups)):
        rule = optimizer.rule_of(own_group)
        options = [key for key in ADAMW_ONLY_OPTIONS if key in saved and key not in own_group]
        if options and rule is not ADAMW:
            raise ValueError(
                f"parameter group {index} of the loaded state dict has {', '.join(options)}: a "
                f"torch.optim.AdamW state dict, which does not become the state of {name} "
                f"({rule.name} rule)")


def stored_moment(optimizer, param, group: dict, key: str, values: torch.Tensor):
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
    ``QuantizedState`` with their codes and scales (``checkpoint.torchao.quantized_from_torchao``:
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
    _check_adamw_state_dict(state_dict)

    def torch_group(saved: dict) -> dict:
        group = {k: v for k, v in saved.items() if k not in LOWBIT_GROUP_KEYS}
        group.setdefault("decoupled_weight_decay", True)  # saved before it was a group option
        return {**group, **TORCH_ADAMW_GROUP_OPTIONS}

    return _dequantized_state_dict(state_dict, params, torch_group, keep_step=True)


def to_torch_muon(state_dict, *, params=None) -> dict:
    """A ``Muon8bit``/``Muon4bit`` state dict whose groups are all Muon groups as a plain
    ``torch.optim.Muon`` one: ``momentum_buffer`` dequantized to float32, the groups without
    our options (``use_muon``, ``maximize``, the storage options), and no ``step`` (torch's Muon
    keeps none). ``params`` and master weights as in ``to_torch_adamw``. A state dict with an
    AdamW group is refused (torch.optim.Muon steps 2-D Muon parameters only): convert the Muon
    part of a mixed optimizer by building it from the Muon groups alone."""
    for index, saved in enumerate(state_dict["param_groups"]):
        if not saved.get("use_muon", "momentum" in saved):
            raise ValueError(
                f"to_torch_muon: parameter group {index} is an AdamW group (its options: "
                f"{', '.join(k for k in saved if k != 'params')}): torch.optim.Muon keeps Muon groups only")

    def torch_group(saved: dict) -> dict:
        return {k: v for k, v in saved.items() if k not in (*LOWBIT_GROUP_KEYS, "use_muon", "maximize")}

    return _dequantized_state_dict(state_dict, params, torch_group, keep_step=False)


def _dequantized_state_dict(state_dict, params, torch_group, *, keep_step: bool) -> dict:
    """``state_dict`` with every moment as float32 values, each group as ``torch_group`` makes
    it (LRs as Python floats), and master weight corrections exported as ``to_torch_adamw``
    says."""
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
        group = torch_group(saved)
        for key in ("lr", "initial_lr"):
            if isinstance(group.get(key), torch.Tensor):
                group[key] = float(group[key])
        groups.append(group)
    state, master_weights = {}, {}
    for saved_id, entry in state_dict["state"].items():
        converted = {}
        for key, value in entry.items():
            if key == CORRECTION_KEY:
                param = local(param_of[saved_id]).detach()
                master_weights[saved_id] = read_master(param, local(value)).clone()
                continue
            if key == "step" and not keep_step:
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


def _check_adamw_state_dict(state_dict) -> None:
    """Refuse a state dict ``torch.optim.AdamW`` could load but not step: a Lion state (no
    ``eps``, no ``exp_avg_sq``: its step fails with ``KeyError: 'exp_avg_sq'``), an AdEMAMix
    one (three betas, a slow moment). A state dict records no class, so its groups' options
    and its moments' keys tell."""
    for index, saved in enumerate(state_dict["param_groups"]):
        missing = [key for key in TORCH_ADAMW_HYPERPARAMETERS if key not in saved]
        betas = saved.get("betas", ())
        if missing or len(betas) != 2:
            what = f"no {', '.join(missing)}" if missing else f"{len(betas)} betas"
            raise ValueError(
                f"to_torch_adamw: parameter group {index} has {what} (its options: "
                f"{', '.join(k for k in saved if k != 'params')}): not an AdamW or Adam state dict "
                "(Lion and AdEMAMix states have no torch.optim.AdamW equivalent)")
    group_of = {saved_id: saved for saved in state_dict["param_groups"] for saved_id in saved["params"]}
    allowed = ("step", CORRECTION_KEY, *ADAMW.all_moment_keys)
    for saved_id, entry in state_dict["state"].items():
        if not entry:
            continue
        needed = ("step", *ADAMW.moment_keys(group_of.get(saved_id, {})))
        missing = [key for key in needed if key not in entry]
        foreign = [str(key) for key in entry if key not in allowed]
        if missing or foreign:
            what = f"no {', '.join(missing)}" if missing else ", ".join(foreign)
            raise ValueError(
                f"to_torch_adamw: the state of parameter {saved_id} has {what} (it has "
                f"{', '.join(map(str, entry))}; torch.optim.AdamW keeps {', '.join(needed)}): not an "
                "AdamW or Adam state")


def _float32_copy(param: torch.Tensor) -> torch.Tensor:
    return local(param).detach().to(torch.float32, copy=True)
