"""What ``param.grad`` holds once gradient release has stepped the parameter and freed its
gradient: a placeholder of the gradient's shape and dtype, with no storage, that raises a
clear error on any use.

Why not ``None``: ``torch.nn.utils.clip_grad_norm_`` skips parameters whose gradient is
``None`` and returns a norm of 0, so a user who clips after backward would be told nothing
while nothing was clipped. ``GradScaler.unscale_`` and gradient-norm logging would be just
as silently wrong. Every operation on the placeholder raises instead, naming the reason,
and so does accumulating into it: a second backward before ``optimizer.step()`` (gradient
accumulation over micro-batches) is stopped at its first gradient, before anything changes.
Zeroing is the one operation allowed (``zero_grad(set_to_none=False)`` zeroes gradients in
place): there is nothing left to zero.
"""

import torch
from torch.distributed.tensor import DTensor

_aten = torch.ops.aten

RELEASED_MESSAGE = (
    "this parameter's gradient was released: lowbit_optim.release_gradients stepped the "
    "parameter during backward and freed its gradient. Anything that needs the gradient "
    "after backward cannot work with release: clipping by global norm (clip_grad_norm_), "
    "GradScaler, reading or logging gradients, and gradient accumulation over micro-batches "
    "(a second backward before optimizer.step(); each backward is one optimizer step). Call "
    "optimizer.step() after every backward (it steps nothing, it ends the step), or remove "
    "the release handle to train as usual (docs/gradient_release.md)"
)


class ReleasedGradient(torch.Tensor):
    """A storage-less stand-in for a freed gradient; every operation but zeroing raises."""

    @staticmethod
    def __new__(cls, like: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), dtype=like.dtype, device=like.device)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is _aten.zero_.default:
            return args[0]
        if func is _aten._foreach_zero_.default:
            return None
        raise RuntimeError(f"{func.__name__} on a released gradient: {RELEASED_MESSAGE}")

    def __repr__(self):
        return f"ReleasedGradient(shape={tuple(self.shape)}, dtype={self.dtype})"


def released_gradient(param: torch.Tensor) -> torch.Tensor:
    """The placeholder to assign as ``param.grad``: a ``DTensor`` laid out like an FSDP2
    parameter (FSDP2 accumulates into ``grad._local_tensor``, which then raises)."""
    if isinstance(param, DTensor):
        return DTensor(ReleasedGradient(param.to_local()), param._spec, requires_grad=False)
    return ReleasedGradient(param)


def is_released(grad) -> bool:
    """Whether ``grad`` is a placeholder (or an FSDP2 ``DTensor`` of one)."""
    if isinstance(grad, DTensor):
        grad = grad._local_tensor
    return type(grad) is ReleasedGradient
