"""FSDP2 (DTensor parameters), DDP and distributed-checkpoint support.

Under ``torch.distributed.fsdp.fully_shard`` every parameter is a ``DTensor`` whose local
tensor is this rank's shard. The optimizer keeps each moment as a ``DTensor`` too, with the
parameter's mesh and placements, whose local tensor is a ``QuantizedState`` of the local
shard: its blocks are cut from the shard, so every rank quantizes and steps only what it
holds, with no communication. Whether a moment is quantized is decided by the parameter's
global size, so the sharding policy never changes which states are float32 (the trap in
torchao #4912 and bitsandbytes #2080, where a shard below the size threshold silently got
float32 state).

DDP needs nothing here: its parameters are plain tensors, replicated on every rank.
"""

import torch
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from lowbit_optim.quant.formats import QuantFormat
from lowbit_optim.state import QuantizedState

aten = torch.ops.aten


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


# --- resharding -----------------------------------------------------------------------------
# Pending writes into blocks that a reshard fills piece by piece, keyed by the codes tensor
# they belong to (shared by every view of one state): float32 values of the whole state and
# which elements have been written. See ``QuantizedSlice``.
_PENDING = WeakIdKeyDictionary()


class QuantizedSlice(torch.Tensor):
    """Elements ``[first, last)`` of a ``QuantizedState`` whose ends are not block boundaries.

    ``torch.distributed.checkpoint`` makes these when it loads with another sharding than it
    saved: a saved shard is narrowed to the part a rank needs (a read), and the rank's state
    is narrowed to the part one saved shard fills (a write). A read dequantizes. A write
    stores the values and quantizes every block once all of its elements have arrived, so
    each block of the new sharding is quantized exactly once, from the dequantized values of
    the old one: resharding costs one re-quantization (its error is the format's rounding
    error, measured in tests/test_distributed.py), and loading with the sharding that saved
    never comes here (whole shards copy their codes and scales bit for bit).
    """

    @staticmethod
    def __new__(cls, state, first, last, shape):
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=state.dtype, device=state.device, requires_grad=False
        )

    def __init__(self, state, first, last, shape):
        self.state, self.first, self.last = state, first, last

    def dequantize(self, dtype=None) -> torch.Tensor:
        values = self.state.dequantize(torch.float32).reshape(-1)[self.first:self.last]
        return values.view(self.shape).to(dtype or self.dtype)

    def write(self, values: torch.Tensor) -> None:
        state = self.state
        pending = _PENDING.get(state.codes)
        if pending is None:
            pending = (state.dequantize(torch.float32).reshape(-1).clone(),
                       torch.zeros(state.numel(), dtype=torch.bool, device=state.device))
            _PENDING[state.codes] = pending
        flat, written = pending
        flat[self.first:self.last] = values.reshape(-1).to(flat)
        written[self.first:self.last] = True

        block_size, num_blocks = state.block_size, state.num_blocks
        padding = num_blocks * block_size - state.numel()
        done = torch.nn.functional.pad(written, (0, padding), value=True).view(num_blocks, block_size)
        first_block, end_block = self.first // block_size, -(-self.last // block_size)
        complete = done[first_block:end_block].all(dim=1).nonzero().flatten() + first_block
        if complete.numel():
            blocks = torch.nn.functional.pad(flat, (0, padding)).view(num_blocks, block_size)
            codes, scales = state.format.quantize_blocks(blocks[complete])
            state.codes[complete] = codes
            state.scales[complete] = scales
        # Once no block is half written, every block's codes are current: drop the buffer (a
        # later write starts a fresh one from the codes).
        if not (done.any(dim=1) & ~done.all(dim=1)).any():
            del _PENDING[state.codes]

    def __repr__(self):
        return f"QuantizedSlice(elements {self.first}:{self.last} of {self.state!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return args[0]
        if func is aten.copy_.default and isinstance(args[0], QuantizedSlice):
            source = args[1]
            if isinstance(source, (QuantizedSlice, QuantizedState)):
                source = source.dequantize(torch.float32)
            args[0].write(source)
            return args[0]
        written = [schema_arg.alias_info is not None and schema_arg.alias_info.is_write
                   for schema_arg in func._schema.arguments]
        if any(isinstance(arg, QuantizedSlice) and is_written for arg, is_written in zip(args, written)):
            raise NotImplementedError(f"QuantizedSlice supports no in-place op but copy_ (got {func})")

        def values(arg):
            return arg.dequantize() if isinstance(arg, (QuantizedSlice, QuantizedState)) else arg
        return func(*[values(arg) for arg in args], **{k: values(v) for k, v in kwargs.items()})


# --- loading full state dicts ---------------------------------------------------------------
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def quantize_sharded_float_moments(optimizer, state_dict: dict) -> dict:
    """``state_dict`` with each float DTensor moment of a quantized parameter re-quantized.

    ``get_optimizer_state_dict(..., full_state_dict=True)`` gathers sharded moments as their
    float values (``full_tensor()`` of a quantized shard dequantizes), and
    ``set_optimizer_state_dict`` shards them back as float DTensors; this turns them into
    quantized shards again, in ``optimizer``'s formats and the group's block size, before
    ``load_state_dict`` checks them. Loaded with the sharding that saved them this is exact
    (each shard re-quantizes the values it dequantized); otherwise it costs one rounding.
    Anything else is passed through, for ``load_state_dict`` to check. Nothing is modified.
    """
    saved_groups = state_dict.get("param_groups", []) if isinstance(state_dict, dict) else []
    params = {
        saved_id: (param, {**optimizer.defaults, **saved})
        for saved, own in zip(saved_groups, optimizer.param_groups)
        for saved_id, param in zip(saved.get("params", []), own["params"])
    }
    state = {}
    for saved_id, entry in state_dict.get("state", {}).items():
        param, group = params.get(saved_id, (None, None))
        if param is None or not isinstance(entry, dict):
            state[saved_id] = entry
            continue
        entry = dict(entry)
        quantized = 0 < param.numel() and param.numel() >= group["min_quant_size"]
        for key in MOMENT_KEYS:
            value = entry.get(key)
            if quantized and is_dtensor(value) and not isinstance(local(value), QuantizedState):
                fmt = optimizer.exp_avg_format if key == "exp_avg" else optimizer.exp_avg_sq_format
                shard = local(value)
                moment = QuantizedState.zeros(shard.shape, fmt, group["block_size"],
                                              device=shard.device, dtype=param.dtype)
                entry[key] = wrap_like(moment.quantize_(shard), value)
        state[saved_id] = entry
    return {**state_dict, "state": state}
