"""Muon's orthogonalisation and learning-rate scale, written once: the low-bit Muon step
(``step.muon_plan``) and the plain-PyTorch reference (``lowbit_optim.reference.muon``) both
call these, and both equal ``torch.optim.Muon``'s ``_zeropower_via_newtonschulz`` and
``_adjust_lr`` op for op (tests/test_muon.py checks the trajectories bit for bit).

Muon: Jordan et al., https://kellerjordan.github.io/posts/muon/; the "match_rms_adamw" LR
scale: "Muon is Scalable for LLM Training", arXiv 2502.16982.
"""

import math

import torch

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
    raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
