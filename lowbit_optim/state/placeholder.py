"""``GradientPlaceholder``: a storage-less tensor of a gradient's shape, dtype and device that
stands in ``param.grad`` for a gradient the device no longer holds.

Why not ``None``: ``torch.nn.utils.clip_grad_norm_`` skips parameters whose gradient is
``None`` and returns a norm of 0, so a user who clips would be told nothing while nothing was
clipped. A placeholder is seen by every such caller; each subclass says what it answers
(``handlers``: the few aten operations it can do something right with) and why the rest are
refused (``refusal``), raised as a ``RuntimeError`` naming the operation. Subclasses:
``offload.gradient.HostGradient`` (the gradient went to the host: norms and scaling act on
it there) and ``optim.released_gradient.ReleasedGradient`` (the gradient was stepped and freed).
"""

import torch


class GradientPlaceholder(torch.Tensor):
    """Shape, strides, dtype and device of ``like``; no storage; operations by ``handlers``."""

    handlers: dict = {}  # aten overload -> function(*args, **kwargs)

    @staticmethod
    def __new__(cls, like: torch.Tensor, *args):
        return torch.Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), dtype=like.dtype, device=like.device)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def refusal(cls) -> str:
        """Why operations other than ``handlers`` cannot be answered, and what to do."""
        raise NotImplementedError

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        handler = cls.handlers.get(func)
        if handler is None:
            raise RuntimeError(f"{func} on {cls.refusal()}")
        return handler(*args, **(kwargs or {}))
