"""``QuantizedSlice``: a range of a ``QuantizedState`` whose ends are not block boundaries.

``torch.distributed.checkpoint`` makes these when it loads with another sharding than it
saved (``QuantizedState``'s ``aten.slice`` handler returns one). Kept apart from
``QuantizedState`` because only resharding needs it; it reaches its state only through the
state's public methods (``dequantize``, ``codes``, ``scales``, ``format``), so this module
imports nothing of ours and ``state.quantized`` can import it without a cycle.
"""

import torch
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten

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
        # ``types`` holds the subclasses taking part in this call (QuantizedSlice and, when
        # one is an argument, QuantizedState): both dequantize to their float values.
        if func is aten.copy_.default and isinstance(args[0], QuantizedSlice):
            source = args[1]
            if type(source) in types:
                source = source.dequantize(torch.float32)
            args[0].write(source)
            return args[0]
        written = [schema_arg.alias_info is not None and schema_arg.alias_info.is_write
                   for schema_arg in func._schema.arguments]
        if any(isinstance(arg, QuantizedSlice) and is_written for arg, is_written in zip(args, written)):
            raise NotImplementedError(f"QuantizedSlice supports no in-place op but copy_ (got {func})")

        def values(arg):
            return arg.dequantize() if type(arg) in types else arg
        return func(*[values(arg) for arg in args], **{k: values(v) for k, v in kwargs.items()})



