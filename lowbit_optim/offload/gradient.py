"""``HostGradient``: what ``CPUOffloadOptimizer(offload_gradients=True)`` leaves as a device
parameter's ``.grad`` once the gradient has gone to the host.

With the device gradient simply freed, ``torch.nn.utils.clip_grad_norm_(model.parameters())``
(what a training loop, or Hugging Face ``Trainer`` through accelerate, calls) saw no gradient,
returned 0.0 and clipped nothing, silently. The placeholder has the parameter's shape, dtype
and device and no storage; it answers the few operations clipping uses by doing them on the
host gradient (after waiting for its copy), so that call measures and clips what the host
optimizer will step with, exactly as ``optimizer.clip_grad_norm_`` does. Anything else
raises, naming the ways to reach the host gradient, instead of computing with a gradient that
is not there.

Operations answered (``torch.nn.utils.get_total_norm`` / ``clip_grads_with_norm_`` fall back
to one call per tensor for a tensor subclass): ``linalg_vector_norm`` (the result is moved to
the device, as a device gradient's norm would be there), ``mul_`` by a tensor or number, and
``zero_`` (``module.zero_grad(set_to_none=False)``).
"""

import torch

aten = torch.ops.aten


class HostGradient(torch.Tensor):
    """A storage-less stand-in for ``param.grad``; ``host_gradient()`` returns the landed host
    gradient it speaks for."""

    @staticmethod
    def __new__(cls, param: torch.Tensor, host_gradient):
        return torch.Tensor._make_wrapper_subclass(
            cls, param.shape, strides=param.stride(), dtype=param.dtype, device=param.device)

    def __init__(self, param: torch.Tensor, host_gradient):
        self.host_gradient = host_gradient

    def __repr__(self):
        return (f"HostGradient(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}: "
                "held on the host by CPUOffloadOptimizer(offload_gradients=True))")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is None:
            raise RuntimeError(
                f"{func} on a gradient that CPUOffloadOptimizer(offload_gradients=True) moved to "
                "the host: only norms and in-place scaling (torch.nn.utils.clip_grad_norm_) "
                "work on it. Clip with optimizer.clip_grad_norm_(max_norm), read the gradient "
                "as optimizer.host_param(param).grad, or build the optimizer with "
                "offload_gradients=False to keep gradients on the device")
        return handler(*args, **kwargs)


def _norm(grad, *args, **kwargs):
    return aten.linalg_vector_norm.default(grad.host_gradient(), *args, **kwargs).to(grad.device)


def _mul_(grad, other):
    if isinstance(other, torch.Tensor):
        other = other.to(grad.host_gradient().device)
    grad.host_gradient().mul_(other)
    return grad


def _zero_(grad):
    grad.host_gradient().zero_()
    return grad


_HANDLERS = {
    aten.linalg_vector_norm.default: _norm,
    aten.mul_.Tensor: _mul_,
    aten.mul_.Scalar: _mul_,
    aten.zero_.default: _zero_,
}
