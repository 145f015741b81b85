"""``ReleasedGradient``: what ``param.grad`` holds once gradient release has stepped the
parameter during backward and freed its gradient (``optim.release``).

A ``GradientPlaceholder`` (no storage) on which every operation raises, naming the reason:
clipping by global norm, ``GradScaler.unscale_`` and gradient-norm logging would otherwise
see no gradient and be silently wrong, and accumulating into it (a second backward before
``optimizer.step()``: gradient accumulation over micro-batches) is stopped at its first
gradient, before anything changes. Zeroing is allowed (``zero_grad(set_to_none=False)`` zeroes
gradients in place): there is nothing left to zero; and so is a cast (``model.to(dtype)``
casts the gradients with the parameters), which gives a placeholder of the new dtype.
"""

import torch
from torch.distributed.tensor import DTensor

from lowbit_optim.optim.reentrant_backward import in_reentrant_backward
from lowbit_optim.state.placeholder import GradientPlaceholder

aten = torch.ops.aten


def _to_copy(grad, *, dtype=None, device=None, **options):
    """A cast of the model after backward (``model.to(torch.bfloat16)`` casts gradients too):
    still released, in the new dtype (and on the new device)."""
    return torch.Tensor._make_wrapper_subclass(
        ReleasedGradient, grad.shape, strides=grad.stride(), dtype=dtype or grad.dtype,
        device=device or grad.device)


class ReleasedGradient(GradientPlaceholder):
    """A freed gradient's stand-in; every operation but zeroing and casting raises."""

    handlers = {
        aten.zero_.default: lambda grad: grad,
        aten._foreach_zero_.default: lambda grads: None,
        aten._to_copy.default: _to_copy,
    }

    def __repr__(self):
        return f"ReleasedGradient(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def refusal(cls) -> str:
        if in_reentrant_backward():
            return (
                "a released gradient, inside a reentrant activation checkpointing segment "
                "(torch.utils.checkpoint with use_reentrant=True): the segment runs a backward "
                "of its own and adds a part to the gradient of a parameter that "
                "lowbit_optim.release_gradients already stepped with the part computed outside "
                "the segment (a parameter used inside the segment and after it: autograd "
                "completes the outside part first, and nothing says that a segment will add to "
                "it). This backward's steps so far stand. Pass use_reentrant=False (one "
                "backward, each gradient complete when its hook runs), or remove the release "
                "handle to train as usual (docs/gradient_release.md)")
        return (
            "a released gradient: lowbit_optim.release_gradients stepped this parameter during "
            "backward and freed its gradient. Anything that needs the gradient after backward "
            "cannot work with release: clipping by global norm (clip_grad_norm_), GradScaler, "
            "reading or logging gradients, and gradient accumulation over micro-batches (a "
            "second backward before optimizer.step(); each backward is one optimizer step). "
            "Call optimizer.step() after every backward (it steps nothing, it ends the step), "
            "or remove the release handle to train as usual (docs/gradient_release.md)")


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
