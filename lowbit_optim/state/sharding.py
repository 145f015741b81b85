"""FSDP2 (DTensor parameters) and DDP: the DTensor helpers the optimizer needs.

Under ``torch.distributed.fsdp.fully_shard`` every parameter is a ``DTensor`` whose local
tensor is this rank's shard. The optimizer keeps each moment as a ``DTensor`` too, with the
parameter's mesh and placements, whose local tensor is a ``QuantizedState`` of the local
shard: its blocks are cut from the shard, so every rank quantizes and steps only what it
holds, with no communication. Whether a moment is quantized is decided by the parameter's
global size, so the sharding policy never changes which states are float32 (the trap in
torchao #4912 and bitsandbytes #2080, where a shard below the size threshold silently got
float32 state).

A factored second moment (``AdamWFactored4bit``) is a ``FactoredState`` of the local shard
too. FSDP2 shards dimension 0, so each rank holds whole rows of the ``(rows, last dim)``
matrix the moment is factored over: the row statistics are local, but each column statistic
is a mean over every row, so the column sums of a step are added across the ranks that hold
the other rows (``sum_across_shards``, one all-reduce per step for all of a group's factored
parameters). Every rank then holds the same column statistics as an unsharded run would.

DDP needs nothing here: its parameters are plain tensors, replicated on every rank.
Distributed checkpoints: resharding a quantized moment is ``lowbit_optim.state.quantized_slice``,
a factored one slices whole rows (``FactoredState``'s ``slice``); full state dicts gathered
from shards are re-quantized (or re-factored) on load by ``lowbit_optim.checkpoint``.
"""

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from lowbit_optim.formats.catalog import QuantFormat
from lowbit_optim.state.factored import FactoredState, factor_shape
from lowbit_optim.state.quantized import QuantizedState


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


def _like(param: torch.Tensor, make: Callable[[torch.Tensor], torch.Tensor]):
    """``make(shard)`` for this rank's shard of ``param``, laid out like ``param``."""
    state = make(local(param))
    return wrap_like(state, param) if is_dtensor(param) else state


def zeros_state(param: torch.Tensor, fmt: QuantFormat, block_size: int):
    """An all-zero quantized moment for ``param``: blocks over the local shard of a DTensor."""
    return _like(param, lambda shard: QuantizedState.zeros(
        shard.shape, fmt, block_size, device=shard.device, dtype=shard.dtype))


def zeros_factored_state(param: torch.Tensor):
    """An all-zero factored moment for ``param``: the local shard's rows, every column."""
    return _like(param, lambda shard: FactoredState.zeros(shard.shape, device=shard.device,
                                                          dtype=shard.dtype))


def check_rows_sharded(param: torch.Tensor, owner: str) -> None:
    """Refuse a DTensor ``param`` split other than by whole rows (``Shard(0)``, what FSDP2
    uses, or replicated along a mesh dimension): a factored moment keeps every column of the
    rows it holds."""
    if not is_dtensor(param):
        return
    for placement in param.placements:
        if not (type(placement) is Replicate or (type(placement) is Shard and placement.dim == 0)):
            raise ValueError(
                f"{owner} factors the second moment of a DTensor parameter only when it is "
                f"sharded along dim 0 (FSDP2's Shard(0)) or replicated; got placements "
                f"{tuple(param.placements)} for a parameter of shape {tuple(param.shape)}"
            )


def shard_groups(param: torch.Tensor) -> tuple:
    """The process groups of the mesh dimensions along which ``param`` is sharded (empty for
    a plain tensor): their other ranks hold ``param``'s other rows."""
    if not is_dtensor(param):
        return ()
    mesh = param.device_mesh
    return tuple(mesh.get_group(dim) for dim, placement in enumerate(param.placements)
                 if placement.is_shard())


def sum_across_shards(tensor: torch.Tensor, groups: tuple) -> torch.Tensor:
    """``tensor`` summed in place over the ranks of each of ``groups`` (``shard_groups``)."""
    for group in groups:
        torch.distributed.all_reduce(tensor, group=group)
    return tensor


def quantized_from_float(values: torch.Tensor, fmt: QuantFormat, block_size: int, dtype: torch.dtype):
    """A float moment (a DTensor of the shards' values, or a plain tensor) quantized in
    ``fmt`` and laid out the same way: blocks over each rank's shard."""
    return _like(values, lambda shard: QuantizedState.zeros(
        shard.shape, fmt, block_size, device=shard.device, dtype=dtype).quantize_(shard))


def factored_from_float(values: torch.Tensor, dtype: torch.dtype):
    """A float moment (a DTensor of the shards' values, or a plain tensor) factored into a
    ``FactoredState`` laid out the same way: row means of this rank's rows, column means over
    every rank's (collective: every rank of the mesh calls it, as it loads the same state dict)."""
    groups = shard_groups(values)
    rows = factor_shape(values.shape).rows
    return _like(values, lambda shard: FactoredState.zeros(
        shard.shape, device=shard.device, dtype=dtype).factor_(
        shard, all_rows=rows, sum_columns=lambda sums: sum_across_shards(sums, groups)))
