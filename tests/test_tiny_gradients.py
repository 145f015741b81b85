"""Gradients so small that ``eps`` dominates Adam's denominator: where ``eps`` is added (after
the bias correction of the second moment's square root, as torch adds it) decides the step.
At gradients of order 1 a misplaced ``eps`` moves a step by ~1e-7 relative, below the other
tests' rounding tolerances; here it moves it ~30x."""

import pytest
import torch

from lowbit_optim import Adam8bit, AdamW8bit

STEPS = 3
# Every moment in float: the rule's own arithmetic, which follows torch's to float32 rounding.
FLOAT_STATE = dict(min_quant_size=10**9)


@pytest.mark.parametrize("cls, reference", [(AdamW8bit, torch.optim.AdamW), (Adam8bit, torch.optim.Adam)],
                         ids=["AdamW", "Adam"])
def test_float_state_follows_torch_where_eps_dominates_the_denominator(cls, reference):
    generator = torch.Generator().manual_seed(0)
    initial = torch.randn(300, generator=generator)
    # Magnitudes from 1e-12 to 1e-6: |g| / sqrt(1 - beta2) below and above eps = 1e-8.
    grads = [torch.randn(300, generator=generator) * 10 ** (-12 + 6 * torch.rand(300, generator=generator))
             for _ in range(STEPS)]
    ours, theirs = torch.nn.Parameter(initial.clone()), torch.nn.Parameter(initial.clone())
    optimizers = [cls([ours], lr=1e-3, weight_decay=0.1, **FLOAT_STATE),
                  reference([theirs], lr=1e-3, weight_decay=0.1, foreach=False)]
    for grad in grads:
        for param, optimizer in zip((ours, theirs), optimizers):
            param.grad = grad.clone()
            optimizer.step()
    torch.testing.assert_close(ours - initial, theirs - initial, rtol=1e-4, atol=0)
