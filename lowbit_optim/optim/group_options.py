"""Storage options set into a param group after its state was made: applied or refused.

``block_size``, ``min_quant_size``, ``amsgrad`` and ``master_weight_bits`` say how a group's
state is stored, and a user can write any of them into ``param_groups`` mid-training as
they can the LR. ``step()`` checks them before anything changes: an optimizer keeps each
group's options as its state was last checked against them (``snapshot``, one tuple
compared per group and step), and only when they differ looks at the states:

* ``block_size``, ``min_quant_size``: refused (``check_layouts``) when a state was made
  otherwise (blocks of another size; quantized, factored or float moments where the new
  value would make others): re-quantizing moments would cost a rounding nobody asked
  for. A change that no state feels (no quantized moment yet, no parameter whose size
  crosses the new ``min_quant_size``) is accepted;
* ``amsgrad`` on: ``max_exp_avg_sq`` starts as a copy of the current ``exp_avg_sq`` (the
  maximum over the steps from now on; torch's AdamW, which makes it only with a new state,
  raises ``KeyError``); off: it is dropped (``amsgrad_changes``);
* ``master_weight_bits``: the corrections follow (``master_weight_casts``).
"""

import torch

from lowbit_optim.state import sharding
from lowbit_optim.state.factored import FactoredState
from lowbit_optim.state.quantized import QuantizedState

STORAGE_OPTIONS = ("block_size", "min_quant_size", "amsgrad", "master_weight_bits")
# The moment amsgrad's maximum starts from when amsgrad is turned on mid-training.
AMSGRAD_STARTS_FROM = {"max_exp_avg_sq": "exp_avg_sq"}


def snapshot(group: dict) -> tuple:
    """``group``'s storage options, as compared from one step to the next."""
    return tuple(map(group.get, STORAGE_OPTIONS))


def _kind(value) -> str:
    shard = sharding.local(value)
    if isinstance(shard, FactoredState):
        return "factored"
    return "quantized" if isinstance(shard, QuantizedState) else "float"


def check_layouts(optimizer, index: int, group: dict, previous: tuple | None) -> None:
    """Refuse ``group``'s ``block_size`` or ``min_quant_size`` if a state of one of its
    parameters was made otherwise (``previous``: the group's options when last checked)."""
    before = dict(zip(STORAGE_OPTIONS, previous)) if previous is not None else {}
    for position, param in enumerate(group["params"]):
        state = optimizer.state.get(param)
        if not state:
            continue
        for key in optimizer.moment_keys(group):
            if key not in state:
                continue
            kind = _kind(state[key])
            if optimizer.is_factored(param, group, key):
                expected = "factored"
            else:
                expected = "quantized" if optimizer.is_quantized(param, group) else "float"
            if kind != expected:
                _refuse(optimizer, index, position, param, "min_quant_size", old=before.get("min_quant_size"),
                        new=group["min_quant_size"], kept=f"{kind} moments")
            block_size = sharding.local(state[key]).block_size if kind == "quantized" else None
            if block_size is not None and block_size != group["block_size"]:
                _refuse(optimizer, index, position, param, "block_size", old=block_size,
                        new=group["block_size"], kept=f"blocks of {block_size}")


def _refuse(optimizer, index: int, position: int, param: torch.Tensor, option: str, *, old, new, kept: str):
    name = type(optimizer).__name__
    was = f"{option}={old!r}" if old is not None else f"another {option}"
    raise ValueError(
        f"{name}: param group {index}'s {option} was changed to {new!r}, but its state was made "
        f"with {was}: the parameter at position {position} (shape {tuple(param.shape)}) keeps "
        f"{kept}, which cannot change mid-training. Set {option} back"
        f"{f' to {old!r}' if old is not None else ''}, or move the state to a new {name} built with "
        f"{option}={new!r} (for the AdamW and Adam classes: "
        "new.load_state_dict(lowbit_optim.checkpoint.to_torch_adamw(optimizer.state_dict())), "
        "one rounding of the moments)"
    )


def amsgrad_changes(optimizer, group: dict) -> list:
    """What turning ``group``'s amsgrad on or off takes, as calls that do it (nothing is
    modified here): the maximum started from the moment it tracks, or dropped."""
    keys = optimizer.moment_keys(group)
    actions = []
    for param in group["params"]:
        state = optimizer.state.get(param)
        if not state:
            continue
        for key, source in AMSGRAD_STARTS_FROM.items():
            if key in keys and key not in state and source in state:
                actions.append(lambda s=state, k=key, v=state[source]: s.__setitem__(k, _copy(v)))
            elif key not in keys and key in state:
                actions.append(lambda s=state, k=key: s.pop(k))
    return actions


def _copy(value):
    """A copy of a moment (a DTensor's shard by shard), stored as it is."""
    def copy(shard):
        if isinstance(shard, QuantizedState):
            return QuantizedState(shard.codes.clone(), shard.scales.clone(), shard.format_name, shard.shape,
                                  shard.dtype)
        return shard.clone()

    return sharding._like(value, copy)
