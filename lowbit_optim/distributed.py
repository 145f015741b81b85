"""FSDP2 (DTensor parameters) and DDP: the DTensor helpers the optimizer needs.

Under ``torch.distributed.fsdp.fully_shard`` every parameter is a ``DTensor`` whose local
tensor is this rank's shard. The optimizer keeps each moment as a ``DTensor`` too, with the
parameter's mesh and placements, whose local tensor is a ``QuantizedState`` of the local
shard: its blocks are cut from the shard, so every rank quantizes and steps only what it
holds, with no communication. Whether a moment is quantized is decided by the parameter's
global size, so the sharding policy never changes which states are float32 (the trap in
torchao #4912 and bitsandbytes #2080, where a shard below the size threshold silently got
float32 state).

DDP needs nothing here: its parameters are plain tensors, replicated on every rank.
Distributed checkpoints: resharding a quantized moment is ``lowbit_optim.quantized_slice``;
full state dicts gathered from shards are re-quantized on load by ``lowbit_optim.checkpoint``.
"""

import torch
from torch.distributed.tensor import DTensor

from lowbit_optim.quant.formats import QuantFormat
from lowbit_optim.state import QuantizedState


def rank() -> int:
    """This process's rank in the default process group (0 without one): ranks step different
    shards, so their stochastic-rounding noise must differ too."""
    distributed = torch.distributed
    return distributed.get_rank() if distributed.is_available() and distributed.is_initialized() else 0


def is_dtensor(tensor) -> bool:
    return isinstance(tensor, DTensor)


def local(tensor):
    """This rank's shard of a ``DTensor``; anything else (plain tensors, ``None``) as it is.

    The step runs under ``no_grad``, where ``to_local`` returns the shard itself, so in-place
    updates of the result update the parameter or state.
    """
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def wrap_like(local_tensor: torch.Tensor, param: DTensor) -> DTensor:
    """``local_tensor`` (a shard shaped like ``param``'s) as a DTensor laid out like ``param``.

    The global shape and stride are passed explicitly: for uneven shards ``from_local`` could
    not infer them, and a ``QuantizedState`` cannot take part in the check that would.
    """
    return DTensor.from_local(
        local_tensor, param.device_mesh, param.placements, run_check=False,
        shape=param.shape, stride=param.stride(),
    )


def zeros_state(param: torch.Tensor, fmt: QuantFormat, block_size: int):
    """An all-zero quantized moment for ``param``: blocks over the local shard of a DTensor."""
    shard = local(param)
    state = QuantizedState.zeros(shard.shape, fmt, block_size, device=shard.device, dtype=shard.dtype)
    return wrap_like(state, param) if is_dtensor(param) else state
