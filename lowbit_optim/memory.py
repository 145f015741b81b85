"""Measuring what optimizer state costs."""

import torch

from lowbit_optim.state import QuantizedState


def tensor_state_bytes(value) -> int:
    """Bytes a state value holds: a quantized state's codes and scales, a tensor's data."""
    if isinstance(value, QuantizedState):
        return value.state_nbytes()
    local = getattr(value, "_local_tensor", None)  # DTensor: this rank's shard
    if local is not None:
        return tensor_state_bytes(local)
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
