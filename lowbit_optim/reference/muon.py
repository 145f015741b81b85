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

Muon: Jordan et al., https://kellerjordan.github.io/posts/muon/; the "match_rms_adamw" LR
scale: "Muon is Scalable for LLM Training", arXiv 2502.16982.
"""

import math

import torch

from lowbit_optim.reference.momentum_codecs import FloatMomentum

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def zeropower_via_newtonschulz(update: torch.Tensor, ns_coefficients: tuple[float, float, float],
                               ns_steps: int, eps: float) -> torch.Tensor:
    """The quintic Newton-Schulz iteration in bf16 that pushes every singular value of
    ``update`` towards 1 (returned in bf16, ``update``'s shape)."""
    a, b, c = ns_coefficients
    ortho = update.bfloat16()
    # Iterate on the wide orientation: its Gram matrix is the smaller one.
    tall = update.size(0) > update.size(1)
    if tall:
        ortho = ortho.T
    # Frobenius norm >= spectral norm: afterwards every singular value is at most 1.
    ortho.div_(ortho.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if tall else ortho


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """The LR a ``rows x cols`` matrix steps with: "original" (and None) scales by
    sqrt(max(1, rows / cols)), "match_rms_adamw" by 0.2 sqrt(max(rows, cols))."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"Invalid adjust_lr_fn: {adjust_lr_fn!r} (one of {ADJUST_LR_FNS})")


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
