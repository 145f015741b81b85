"""``QuantizedState``: an optimizer moment stored as blockwise codes plus per-block scales.

The subclass only stores and converts; the AdamW math never runs through it (the step works
on its ``codes`` and ``scales`` directly, see ``lowbit_optim.step.rule_step``). It looks like a
tensor of the parameter's shape and dtype so that ``torch.optim.Optimizer`` machinery
(``state_dict``, ``load_state_dict``'s dtype/device cast, ``torch.save``) handles it.

Supported aten ops, and what each means here (the first five rows are
``lowbit_optim.state.stored_tensor``'s, shared with ``FactoredState``):

=====================  ==================================================================
``detach``, ``alias``   same codes and scales (shared storage)
``clone``               copies of codes and scales
``_to_copy``            moves codes and scales to another device; a dtype cast only relabels
                        the logical dtype (``Optimizer.load_state_dict`` casts every state
                        tensor to the parameter dtype: the codes and scales must survive it)
``is_pinned``           asked by DCP's save planner
``constant_pad_nd``,    run on the dequantized values (DTensor ``full_tensor()`` of a
``all_gather_into_      sharded moment gathers its float values)
tensor``
``copy_``               float -> state quantizes; state -> float dequantizes; state ->
                        state copies codes and scales (re-quantizing if the formats differ)
``zeros_like``,         a fresh all-zero state of the same format and block size
``empty_like``
``view``, ``reshape``,  relabel the logical shape (the blocks are over the flat tensor)
``_unsafe_view``
``equal``               compares format, shape, codes and scales
``slice``               a contiguous range (DCP resharding): whole blocks are a view, any
                        other range a ``lowbit_optim.state.quantized_slice.QuantizedSlice``
=====================  ==================================================================
"""

import torch

from lowbit_optim.formats.catalog import QuantFormat, check_block_size, get_format
from lowbit_optim.state.quantized_slice import QuantizedSlice
from lowbit_optim.state.stored_tensor import SHARED_HANDLERS, StoredTensor, infer_shape

aten = torch.ops.aten


class QuantizedState(StoredTensor):
    # The name torch.save writes for this class, and torch.load(weights_only=True) checks:
    # the package that exports it rather than this file, so that checkpoints do not depend on
    # where in the package the class is defined (tests/test_saved_checkpoints.py).
    __module__ = "lowbit_optim.state"

    codes: torch.Tensor
    scales: torch.Tensor
    format_name: str

    @staticmethod
    def __new__(cls, codes, scales, format_name, shape, dtype=torch.float32):
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=codes.device, requires_grad=False
        )

    def __init__(self, codes, scales, format_name, shape, dtype=torch.float32):
        self.codes = codes
        self.scales = scales
        self.format_name = format_name

    # --- construction -------------------------------------------------------------------
    @classmethod
    def zeros(cls, shape, fmt: QuantFormat, block_size: int, *, device=None, dtype=torch.float32):
        shape = torch.Size(shape)
        check_block_size(block_size)
        num_blocks = fmt.num_blocks(shape.numel(), block_size)
        zero_code = int(fmt.table.abs().argmin())
        # One block is packed and broadcast into the codes: packing all of them at once built
        # an unpacked byte per element (twice the 4-bit state) on the host, the first step's
        # largest temporary.
        zero_block = fmt.pack(torch.full((1, block_size), zero_code, dtype=torch.uint8))
        codes = torch.empty((num_blocks, zero_block.shape[-1]), dtype=torch.uint8, device=device)
        codes.copy_(zero_block.expand_as(codes))
        scales = torch.zeros(num_blocks, dtype=torch.float32, device=device)
        return cls(codes, scales, fmt.name, shape, dtype)

    @classmethod
    def from_float(cls, tensor: torch.Tensor, fmt: QuantFormat, block_size: int):
        state = cls.zeros(tensor.shape, fmt, block_size, device=tensor.device, dtype=tensor.dtype)
        state.quantize_(tensor)
        return state

    # --- properties ---------------------------------------------------------------------
    @property
    def format(self) -> QuantFormat:
        return get_format(self.format_name)

    @property
    def block_size(self) -> int:
        return self.codes.shape[-1] * self.format.codes_per_byte

    @property
    def num_blocks(self) -> int:
        return self.codes.shape[0]

    # --- conversion ---------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        values = self.format.dequantize_blocks(self.codes, self.scales).view(-1)
        values = values[: self.numel()].view(self.shape)
        return values.to(dtype or self.dtype)

    def quantize_(self, tensor: torch.Tensor) -> "QuantizedState":
        """Store ``tensor`` (same number of elements) into these codes and scales."""

        if tensor.numel() != self.numel():
            raise ValueError(
                f"cannot quantize a tensor of {tensor.numel()} elements into a state of "
                f"shape {tuple(self.shape)}"
            )
        flat = tensor.detach().reshape(-1).float().to(self.codes.device)
        padding = self.num_blocks * self.block_size - flat.numel()
        blocks = torch.nn.functional.pad(flat, (0, padding)).view(self.num_blocks, self.block_size)
        codes, scales = self.format.quantize_blocks(blocks)
        self.codes.copy_(codes)
        self.scales.copy_(scales)
        return self

    def _rebuild(self, inner, shape, dtype):
        return QuantizedState(inner["codes"], inner["scales"], self.format_name, shape, dtype)

    # --- torch.compile / serialization ----------------------------------------------------
    def __tensor_flatten__(self):
        return ["codes", "scales"], (self.format_name, tuple(self.shape), self.dtype)

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, ctx, outer_size, outer_stride):
        format_name, shape, dtype = ctx
        return cls(inner_tensors["codes"], inner_tensors["scales"], format_name, shape, dtype)

    def _stable_hash_for_caching(self) -> str:
        # Part of AOTAutograd's cache key: graphs for different formats or block sizes must
        # never be served for one another.
        return f"QuantizedState/{self.format_name}/{self.block_size}/{tuple(self.shape)}/{self.dtype}"

    def __reduce_ex__(self, protocol):
        # Saved as (codes, scales, format name, shape, dtype): plain tensors and builtins, so
        # torch.load(weights_only=True) accepts it once the class is a safe global.
        return (
            QuantizedState,
            (self.codes, self.scales, self.format_name, tuple(self.shape), self.dtype),
        )

    def __repr__(self):
        return (
            f"QuantizedState(format={self.format_name}, shape={tuple(self.shape)}, "
            f"dtype={self.dtype}, block_size={self.block_size}, device={self.device})"
        )

    _what_it_is = "a lowbit_optim optimizer moment stored as codes and scales"


def _copy(dst, src, non_blocking=False):
    if isinstance(dst, QuantizedState) and isinstance(src, QuantizedState):
        same_layout = (dst.format_name, dst.block_size) == (src.format_name, src.block_size)
        if same_layout and dst.numel() == src.numel():
            dst.codes.copy_(src.codes)
            dst.scales.copy_(src.scales)
            return dst
        return dst.quantize_(src.dequantize(torch.float32))
    if isinstance(dst, QuantizedState):
        return dst.quantize_(src)
    return dst.copy_(src.dequantize(dst.dtype))


def _zeros_like(state, *, dtype=None, layout=None, device=None, pin_memory=None,
                memory_format=None):
    return QuantizedState.zeros(
        state.shape, state.format, state.block_size,
        device=device or state.device, dtype=dtype or state.dtype,
    )


def _view(state, shape):
    shape = infer_shape(shape, state.numel())
    if shape.numel() != state.numel():
        raise RuntimeError(f"shape {list(shape)} is invalid for a state of {state.numel()} elements")
    return state._relabel(shape=shape)


def _equal(a, b):
    if not (isinstance(a, QuantizedState) and isinstance(b, QuantizedState)):
        return False
    return (
        a.format_name == b.format_name
        and a.shape == b.shape
        and torch.equal(a.codes, b.codes)
        and torch.equal(a.scales, b.scales)
    )


def _slice(state, dim=0, start=None, end=None, step=1):
    """Elements ``[start, end)`` along ``dim``, a contiguous range of the flat tensor.

    ``torch.distributed.checkpoint`` narrows saved and target tensors this way when it
    reshards. A range on block boundaries is a view of whole blocks (reads and writes are
    exact); any other range is a ``QuantizedSlice`` (see ``lowbit_optim.state.quantized_slice``).
    """
    shape = list(state.shape)
    dim %= len(shape)
    if step != 1 or any(size != 1 for size in shape[:dim]):
        raise NotImplementedError(
            f"QuantizedState supports slices of contiguous ranges only (got dim={dim}, "
            f"step={step} on shape {tuple(shape)}); call .dequantize() first"
        )
    size = shape[dim]
    start, end = (0 if start is None else start), (size if end is None else end)
    start, end = (min(max(i + size if i < 0 else i, 0), size) for i in (start, end))
    end = max(start, end)
    inner = torch.Size(shape[dim + 1:]).numel()
    first, last = start * inner, end * inner
    shape[dim] = end - start
    block_size = state.block_size
    if first % block_size == 0 and (last % block_size == 0 or last == state.numel()):
        rows = slice(first // block_size, -(-last // block_size))
        return state._relabel(codes=state.codes[rows], scales=state.scales[rows], shape=torch.Size(shape))
    return QuantizedSlice(state, first, last, torch.Size(shape))


QuantizedState._handlers = {
    **SHARED_HANDLERS,
    aten.copy_.default: _copy,
    aten.zeros_like.default: _zeros_like,
    aten.empty_like.default: _zeros_like,
    aten.view.default: _view,
    aten.reshape.default: _view,
    aten._unsafe_view.default: _view,
    aten.equal.default: _equal,
    aten.slice.Tensor: _slice,
}

torch.serialization.add_safe_globals([QuantizedState])
