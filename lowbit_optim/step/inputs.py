"""Checking the functional step's lists before anything changes (``check_step_inputs``): one
gradient and one state per parameter, no parameter, state or moment given twice, no missing
gradient, and every state fitting its parameter under the update rule (its keys; each
moment's kind, shape, dtype and device; the step count; a master weight correction).

A mismatch would otherwise step a prefix of the lists, update a parameter twice with one step
count, or fail inside a kernel after step counts moved. ``ValueError`` names the position in
the lists. ``functional.step_params`` runs it whenever it plans a step, never when it reuses a
kept plan: ``plan.GroupPlan.matches`` holds only for the same parameters, gradient facts and
state objects the plan was checked with, so the cached step costs nothing more.
"""

import math

import torch

from lowbit_optim.state.factored import FactoredState
from lowbit_optim.state.quantized import QuantizedState
from lowbit_optim.state.sharding import local
from lowbit_optim.step.master_weights import (
    CORRECTED_DTYPES,
    CORRECTION_KEY,
    MASTER_WEIGHT_BITS,
    correction_dtype,
)
from lowbit_optim.step.math import compute_dtype

CORRECTION_DTYPES = tuple(correction_dtype(bits) for bits in MASTER_WEIGHT_BITS)
FLOAT_MOMENT_DTYPES = (torch.float32, torch.float64)


def check_step_inputs(rule, params: list, grads: list, states: list, moment_keys: tuple[str, ...]) -> None:
    """Refuse lists ``rule``'s functional entry point cannot step as given (module docstring);
    ``moment_keys``: the moments each state must have (``rule.moment_keys``)."""
    who = rule.name
    if not len(params) == len(grads) == len(states):
        raise ValueError(
            f"{who}: params, grads and states must have the same length, got {len(params)}, {len(grads)} "
            f"and {len(states)} (one gradient and one state per parameter, in the parameters' order)")
    _refuse_repeated(who, "parameter", params, "it would be updated twice with one step count")
    _refuse_repeated(who, "state", states, "its parameters would share one step count and moments")
    for position, (param, grad) in enumerate(zip(params, grads)):
        if not isinstance(param, torch.Tensor):
            raise ValueError(f"{who}: the parameter at position {position} is a {type(param).__name__}, "
                             "not a tensor")
        if not isinstance(grad, torch.Tensor):
            raise ValueError(
                f"{who}: the gradient at position {position} (parameter of shape {tuple(param.shape)}) is "
                f"{'None' if grad is None else 'a ' + type(grad).__name__}, not a tensor: pass only the "
                "parameters that have a gradient (as torch.optim's functional API needs)")
    owners: dict[int, str] = {}
    for position, (param, state) in enumerate(zip(params, states)):
        _check_state(rule, f"{who}: the state at position {position} (parameter of shape "
                           f"{tuple(param.shape)})", param, state, moment_keys, owners)


def _refuse_repeated(who: str, what: str, items: list, why: str) -> None:
    if len({*map(id, items)}) == len(items):
        return
    first: dict[int, int] = {}
    for position, item in enumerate(items):
        earlier = first.setdefault(id(item), position)
        if earlier != position:
            raise ValueError(f"{who}: the {what} at position {position} is the one at position {earlier}: "
                             f"each may be given only once ({why})")


def _check_state(rule, where: str, param: torch.Tensor, state, moment_keys: tuple[str, ...],
                 owners: dict[int, str]) -> None:
    if not isinstance(state, dict):
        raise ValueError(f"{where} is a {type(state).__name__}, not a dict")
    missing = [key for key in ("step", *moment_keys) if key not in state]
    if missing:
        present = ", ".join(map(str, state)) or "nothing"
        raise ValueError(f"{where} has no {', '.join(missing)} (it has {present}; {rule.name} needs step, "
                         f"{', '.join(moment_keys)}): make states with the optimizer class's new_state, in "
                         "the parameters' order")
    known = ("step", CORRECTION_KEY, *rule.all_moment_keys)
    foreign = [str(key) for key in state if key not in known]
    if foreign:
        raise ValueError(f"{where} has {', '.join(foreign)}, which {rule.name} does not keep (its moments: "
                         f"{', '.join(rule.all_moment_keys)}): a state of another update rule")
    _check_step(where, state["step"])
    first = local(state[moment_keys[0]])
    for key in moment_keys:
        moment = state[key]
        label = f"{where}: {key}"
        if not isinstance(moment, torch.Tensor):
            raise ValueError(f"{label} is a {type(moment).__name__}, not a tensor")
        owner = owners.setdefault(id(moment), label)
        if owner != label:
            raise ValueError(f"{label} is the same tensor as {owner.removeprefix(rule.name + ': ')}")
        if moment.shape != param.shape:
            raise ValueError(f"{label} has shape {tuple(moment.shape)}, not its parameter's: are the "
                             "states in the parameters' order?")
        if moment.device != param.device:
            raise ValueError(f"{label} is on {moment.device}, its parameter on {param.device}")
        _check_kind(rule, label, param, key, local(moment), first=first, moment_keys=moment_keys)
    correction = state.get(CORRECTION_KEY)
    if correction is not None:
        _check_correction(f"{where}: {CORRECTION_KEY}", param, correction)


def _check_step(where: str, step) -> None:
    ok = (isinstance(step, torch.Tensor) and step.dim() == 0 and not step.is_complex()
          and step.dtype != torch.bool)
    if not ok or not (0 <= float(step) < math.inf):
        raise ValueError(f"{where}: 'step' must be a 0-d tensor holding a finite count >= 0, got {step!r}")


def _check_kind(rule, label: str, param: torch.Tensor, key: str, moment, *, first, moment_keys) -> None:
    """A state's moments are all float tensors, or all quantized in one block size (AdamW's
    second moment may instead be factored, without amsgrad): the step sorts a parameter by its
    first moment and steps all of them the same way."""
    if isinstance(moment, FactoredState):
        if not rule.moment(key).factorable or not isinstance(first, QuantizedState):
            raise ValueError(f"{label} is factored, which {rule.name} steps only for a factorable second "
                             "moment next to a quantized first one")
        if any(rule.moment(other).amsgrad_only for other in moment_keys):
            raise ValueError(f"{label} is factored, which keeps no amsgrad maximum: amsgrad=True is not "
                             "supported with a factored second moment (AdamWFactored4bit)")
    elif isinstance(first, QuantizedState):
        if not isinstance(moment, QuantizedState):
            raise ValueError(f"{label} is a plain {moment.dtype} tensor next to a quantized "
                             f"{moment_keys[0]}: a state's moments are all quantized or all float")
        if moment.block_size != first.block_size:
            raise ValueError(f"{label} has blocks of {moment.block_size}, its {moment_keys[0]} blocks of "
                             f"{first.block_size}")
    elif isinstance(moment, QuantizedState):
        raise ValueError(f"{label} is quantized next to a plain {moment_keys[0]}: a state's moments are "
                         "all quantized or all float")
    elif moment.dtype not in FLOAT_MOMENT_DTYPES:
        # The step computes in float32 or float64 (``math.compute_dtype``) and reads either: a
        # state made for float32 parameters still steps them after ``model.double()``.
        raise ValueError(f"{label} is {moment.dtype}; float moments are torch.float32 or torch.float64 "
                         f"(new_state makes {compute_dtype(param)} ones for a {param.dtype} parameter)")


def _check_correction(label: str, param: torch.Tensor, correction) -> None:
    if param.dtype not in CORRECTED_DTYPES:
        raise ValueError(f"{label} is present but its parameter is {param.dtype}: only bfloat16 and "
                         "float16 parameters keep one")
    if not isinstance(correction, torch.Tensor) or local(correction).dtype not in CORRECTION_DTYPES:
        got = local(correction).dtype if isinstance(correction, torch.Tensor) else type(correction).__name__
        raise ValueError(f"{label} must be a torch.int8 (24-bit) or torch.int16 (32-bit) tensor, got {got}")
    if correction.shape != param.shape or correction.device != param.device:
        raise ValueError(f"{label} is {tuple(correction.shape)} on {correction.device}, its parameter "
                         f"{tuple(param.shape)} on {param.device}")
