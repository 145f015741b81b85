"""``StoredTensor``: what ``QuantizedState`` and ``FactoredState`` share as tensor subclasses.

Both are wrapper subclasses that look like a tensor of the parameter's shape and dtype while
their values live in a few inner tensors (codes and scales; row and column statistics). The
aten ops that only move, copy or relabel those inner tensors, or only read the values, mean
the same for both, so they are written once here over the names ``__tensor_flatten__``
returns; each subclass adds its own ops (``copy_``, ``view``, ``slice``, ``zeros_like``,
``equal``) and says how to rebuild itself from new inner tensors (``_rebuild``).

Shared aten ops:

=====================  ==================================================================
``detach``, ``alias``   same inner tensors (shared storage)
``clone``               copies of the inner tensors
``_to_copy``            moves the inner tensors to another device; a dtype cast only
                        relabels the logical dtype (``Optimizer.load_state_dict`` casts
                        every state tensor to the parameter dtype: the stored values must
                        survive it)
``is_pinned``           every inner tensor pinned (asked by DCP's save planner)
``constant_pad_nd``,    run on the dequantized values (DTensor ``full_tensor()`` of a
``all_gather_into_      sharded moment pads uneven shards and gathers its float values;
tensor``, ``split``     ``distribute_tensor`` splits a whole moment into shards' values when
                        a one-process state dict is loaded under FSDP2, and the optimizer
                        stores each shard's values again)
=====================  ==================================================================
"""

import torch

aten = torch.ops.aten


class StoredTensor(torch.Tensor):
    """Base of the optimizer-state subclasses. A subclass implements ``__tensor_flatten__``,
    ``__tensor_unflatten__``, ``dequantize`` and ``_rebuild``, and sets ``_handlers`` (usually
    ``SHARED_HANDLERS`` plus its own) and ``_what_it_is`` (for the error an unsupported op
    raises)."""

    _handlers: dict = {}
    _what_it_is: str = ""

    def _rebuild(self, inner: dict[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype):
        """The same kind of state (same format) over ``inner`` with this logical shape and dtype."""
        raise NotImplementedError

    def inner_tensors(self) -> dict[str, torch.Tensor]:
        names, _ = self.__tensor_flatten__()
        return {name: getattr(self, name) for name in names}

    def _relabel(self, *, shape=None, dtype=None, **inner):
        """This state with some inner tensors, its shape or its dtype replaced."""
        return self._rebuild(
            {**self.inner_tensors(), **inner},
            self.shape if shape is None else torch.Size(shape),
            self.dtype if dtype is None else dtype,
        )

    def state_nbytes(self) -> int:
        """Bytes held by the inner tensors (what the state costs in memory)."""
        return sum(tensor.nbytes for tensor in self.inner_tensors().values())

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        handler = cls._handlers.get(func)
        if handler is None:
            # Most often met as the first step of torch.optim.AdamW (aten.lerp_) after it
            # loaded one of our state dicts: say how to convert.
            raise NotImplementedError(
                f"{cls.__name__} does not support {func}: it is {cls._what_it_is}. Call "
                ".dequantize() for its values; to use a lowbit_optim state dict with "
                "torch.optim.AdamW, convert it first with "
                "lowbit_optim.checkpoint.to_torch_adamw(state_dict)"
            )
        return handler(*args, **(kwargs or {}))


def infer_shape(shape, numel: int) -> torch.Size:
    """``shape`` with a ``-1`` (if any) replaced by what makes it hold ``numel`` elements."""
    shape = list(shape)
    if -1 in shape:
        known = -torch.Size(shape).numel()  # product of the other dimensions
        shape[shape.index(-1)] = numel // known if known else 0
    return torch.Size(shape)


def _detach(state):
    return state._relabel()


def _clone(state, memory_format=None):
    return state._relabel(**{name: tensor.clone() for name, tensor in state.inner_tensors().items()})


def _to_copy(state, *, dtype=None, device=None, layout=None, pin_memory=None,
             non_blocking=False, memory_format=None):
    # A dtype cast only relabels: Optimizer.load_state_dict casts every state tensor to its
    # parameter's dtype, and the stored values (codes, float32 statistics) must survive it.
    moved = {name: tensor.to(device=device, non_blocking=non_blocking)
             for name, tensor in state.inner_tensors().items()}
    return state._relabel(dtype=dtype, **moved)


def _is_pinned(state, device=None):
    return all(tensor.is_pinned() for tensor in state.inner_tensors().values())


def _on_values(func):
    """A handler for an op that only reads: it runs on the dequantized values and returns a
    plain tensor. DTensor's ``full_tensor()`` pads uneven shards and all-gathers them, so
    the full tensor of a sharded moment is its float values."""
    def handler(*args, **kwargs):
        return func(*[arg.dequantize() if isinstance(arg, StoredTensor) else arg for arg in args],
                    **kwargs)
    return handler


SHARED_HANDLERS = {
    aten.detach.default: _detach,
    aten.alias.default: _detach,
    aten.clone.default: _clone,
    aten._to_copy.default: _to_copy,
    aten.is_pinned.default: _is_pinned,
    aten.constant_pad_nd.default: _on_values(aten.constant_pad_nd.default),
    torch.ops._c10d_functional.all_gather_into_tensor.default: _on_values(
        torch.ops._c10d_functional.all_gather_into_tensor.default
    ),
    aten.split.Tensor: _on_values(aten.split.Tensor),
}
