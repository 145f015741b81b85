"""Measuring what optimizer state costs."""

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from lowbit_optim.state.factored import FactoredState
from lowbit_optim.state.quantized import QuantizedState


def tensor_state_bytes(value) -> int:
    """Bytes a state value holds: a quantized state's codes and scales, a factored one's
    row and column statistics, a tensor's data."""
    if isinstance(value, (QuantizedState, FactoredState)):
        return value.state_nbytes()
    local = getattr(value, "_local_tensor", None)  # DTensor: this rank's shard
    if local is not None:
        return tensor_state_bytes(local)
    if is_traceable_wrapper_subclass(value):
        # Another library's quantized state (e.g. torchao's): its nbytes is the logical fp32
        # size, so count its inner tensors instead (a lookup table it holds counts in full).
        inner_names, _ = value.__tensor_flatten__()
        return sum(tensor_state_bytes(getattr(value, name)) for name in inner_names)
    if isinstance(value, torch.Tensor):
        return value.nbytes
    return 0


def state_bytes(optimizer: torch.optim.Optimizer, *, include_step: bool = False) -> int:
    """Bytes of per-parameter optimizer state (the moments; the 4-byte ``step`` scalars only
    with ``include_step=True``). Works for any ``torch.optim.Optimizer``."""
    total = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if key == "step" and not include_step:
                continue
            total += tensor_state_bytes(value)
    return total

