"""The rounding-loss guard: bf16 training at lr 1e-5 is flagged, a normal LR or fp32 weights
are not, and the estimate is the fraction of elements the last step really left unchanged."""

import warnings

import pytest
import torch
from torch import nn

from lowbit_optim import AdamW4bit, AdamW8bit, AdamWFactored4bit, CPUOffloadOptimizer
from lowbit_optim.optim.rounding_guard import (
    RoundingLossWarning,
    lost_fraction,
    lost_updates,
    warn_on_lost_updates,
)

STEPS = 5


def make_model(dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 80), nn.Tanh(), nn.Linear(80, 70)).to(dtype)


def train(model, optimizer, steps: int = STEPS) -> list[torch.Tensor]:
    """Train; returns the parameters as they were before the last step."""
    dtype = next(model.parameters()).dtype
    for step in range(steps):
        before = [param.detach().clone() for param in model.parameters()]
        inputs = torch.randn(8, 64, generator=torch.Generator().manual_seed(step)).to(dtype)
        model(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return before


@pytest.mark.parametrize("cls", [AdamW8bit, AdamW4bit, AdamWFactored4bit], ids=lambda c: c.__name__)
@pytest.mark.parametrize(("dtype", "lr", "flagged"), [
    (torch.bfloat16, 1e-5, True),
    (torch.bfloat16, 1e-3, False),
    (torch.float32, 1e-5, False),
], ids=["bf16-lr1e-5", "bf16-lr1e-3", "fp32-lr1e-5"])
def test_bf16_at_a_tiny_lr_is_flagged_and_nothing_else(cls, dtype, lr, flagged):
    model = make_model(dtype)
    optimizer = cls(model.parameters(), lr=lr, min_quant_size=1024, backend="eager")
    before = train(model, optimizer)
    found = lost_updates(optimizer, model=model)
    names = [name for name, _ in model.named_parameters()]
    assert [item.name for item in found] == (names if flagged else [])
    # The estimate is what happened: the fraction of elements the last step left unchanged
    # (every element had a non-zero update here), but for elements whose update is within
    # the moments' requantization error of half an ulp: the estimate reads the stored
    # moments, the step used them before they were rounded to their codes. Measured: at most
    # 1e-5 apart with 8-bit moments, 0.038 with 4-bit ones (16 codes per block).
    tolerance = 0.01 if cls is AdamW8bit else 0.05
    for param, old in zip(model.parameters(), before):
        unchanged = float((param == old).float().mean())
        estimate = lost_fraction(param, optimizer.state[param], optimizer.param_groups[0])
        assert abs(estimate - unchanged) <= tolerance, (tuple(param.shape), unchanged, estimate)


def test_warning_names_the_stalled_parameters_every_n_steps():
    model = make_model(torch.bfloat16)
    optimizer = AdamW8bit(model.parameters(), lr=1e-5, min_quant_size=1024, backend="eager")
    handle = warn_on_lost_updates(optimizer, every=2, model=model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, optimizer, steps=3)
    lost = [warning for warning in caught if issubclass(warning.category, RoundingLossWarning)]
    assert len(lost) == 1  # after step 2 only
    assert "0.weight [80, 64] torch.bfloat16" in str(lost[0].message)
    handle.remove()
    assert not optimizer._optimizer_step_post_hooks  # nothing left on the step


def test_offloaded_optimizer_is_checked_on_the_host():
    model = make_model(torch.bfloat16)
    optimizer = CPUOffloadOptimizer(model.parameters(), AdamW8bit, lr=1e-5, min_quant_size=1024)
    train(model, optimizer)
    assert [item.name for item in lost_updates(optimizer, model=model)] == [
        name for name, _ in model.named_parameters()]


def test_bad_arguments_are_refused():
    optimizer = AdamW8bit(make_model(torch.float32).parameters())
    with pytest.raises(ValueError, match="Invalid threshold: 1.5"):
        lost_updates(optimizer, threshold=1.5)
    with pytest.raises(ValueError, match="Invalid every: 0"):
        warn_on_lost_updates(optimizer, every=0)
