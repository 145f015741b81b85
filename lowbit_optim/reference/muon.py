"""Muon with its momentum stored through a codec: the plain-PyTorch reference.

With ``FloatMomentum`` (the default) every step is ``torch.optim.Muon``'s, op for op, so the
trajectory equals it bit for bit on CPU (tests/test_muon_reference.py):

    B_t = lerp(B_{t-1}, g_t, 1 - momentum)             (B_t = momentum B_{t-1} + (1 - momentum) g_t)
    U_t = lerp(g_t, B_t, momentum) if nesterov else B_t
    O_t = NewtonSchulz(U_t)                            (bf16, ns_steps quintic iterations)
    p   = p (1 - lr weight_decay) - adjusted_lr O_t

With a quantizing codec the buffer is decoded, updated and encoded again each step (what a
low-bit Muon's fused momentum pass does). The Nesterov mix and Newton-Schulz take the float32
momentum before it is encoded: a fused kernel has it in registers then.

Newton-Schulz and the LR scale are the package's own (``lowbit_optim.step.newton_schulz``).
"""

import torch

from lowbit_optim.reference.momentum_codecs import FloatMomentum
from lowbit_optim.step.newton_schulz import (
    ADJUST_LR_FNS,
    NS_COEFFICIENTS,
    adjusted_lr,
    zeropower_via_newtonschulz,
)


@torch.no_grad()
def muon_step(param: torch.Tensor, grad: torch.Tensor, momentum_state, codec, *, lr: float,
              weight_decay: float, momentum: float, nesterov: bool,
              ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float,
              adjust_lr_fn: str | None):
    """One Muon step of one 2-D ``param`` in place; returns the new momentum state."""
    buffer = codec.decode(momentum_state)
    buffer.lerp_(grad, 1 - momentum)
    update = grad.lerp(buffer, momentum) if nesterov else buffer
    update = zeropower_via_newtonschulz(update, ns_coefficients, ns_steps, eps)
    step_lr = adjusted_lr(lr, adjust_lr_fn, param.shape)
    param.mul_(1 - lr * weight_decay)
    param.add_(update, alpha=-step_lr)
    return codec.encode(buffer, momentum_state)


class ReferenceMuon(torch.optim.Optimizer):
    """``torch.optim.Muon``'s arguments and defaults, its state key ``momentum_buffer`` (here
    the codec's state), and a ``codec`` that stores the momentum."""

    def __init__(self, params, lr: float = 1e-3, *, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None,
                 codec=None):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= momentum:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"Invalid adjust_lr_fn: {adjust_lr_fn!r} (one of {ADJUST_LR_FNS})")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for param in group["params"]:
                if param.ndim != 2:
                    raise ValueError(f"Muon steps 2-D parameters only, got one of shape "
                                     f"{tuple(param.shape)}")
        self.codec = codec if codec is not None else FloatMomentum()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            hyper = {key: group[key] for key in ("lr", "weight_decay", "momentum", "nesterov",
                                                 "ns_coefficients", "ns_steps", "eps", "adjust_lr_fn")}
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = self.codec.init(param)
                state["momentum_buffer"] = muon_step(param, param.grad, state["momentum_buffer"],
                                                     self.codec, **hyper)
        return loss

    def state_bytes(self) -> int:
        """The momentum states' bytes, every part counted (``codec.state_bytes``)."""
        return sum(self.codec.state_bytes(state["momentum_buffer"]) for state in self.state.values())
