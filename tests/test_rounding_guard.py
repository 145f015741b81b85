"""The rounding-loss guard: bf16 training at lr 1e-5 is flagged, a normal LR or fp32 weights
are not, and the estimate is the fraction of elements the last step really left unchanged."""

import warnings

import pytest
import torch
from helpers import seeded_mlp
from torch import nn

from lowbit_optim import AdamW4bit, AdamW8bit, AdamWFactored4bit, CPUOffloadOptimizer
from lowbit_optim.optim.rounding_guard import (
    RoundingLossWarning,
    lost_fraction,
    lost_updates,
    warn_on_lost_updates,
)
from lowbit_optim.step.master_weights import CORRECTION_KEY, read_master

STEPS = 5


def make_model(dtype) -> nn.Module:
    return seeded_mlp(64, 80, 70, dtype=dtype)


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


@pytest.mark.parametrize(("dtype", "bits", "lr", "flagged"), [
    (torch.bfloat16, 24, 1e-5, False),
    (torch.float16, 24, 1e-5, False),
    (torch.bfloat16, 24, 1e-9, True),
    (torch.bfloat16, 32, 1e-5, False),
    (torch.bfloat16, 32, 1e-11, True),
], ids=["bf16-mw24-lr1e-5", "fp16-mw24-lr1e-5", "bf16-mw24-lr1e-9", "bf16-mw32-lr1e-5", "bf16-mw32-lr1e-11"])
def test_master_weights_are_judged_by_what_the_master_weight_keeps(dtype, bits, lr, flagged):
    """With master weights an update is lost only when the master weight cannot hold it: the
    bf16 parameters flagged at lr 1e-5 above are fine with 24-bit master weights (16
    significant bits), which lose updates only far lower (1e-9), 32-bit ones lower still.
    The estimate is the fraction of master weights the last step left unchanged (to within
    the moments' 8-bit quantization, which matters for the few updates near the threshold)."""
    model = make_model(dtype)
    optimizer = AdamW8bit(model.parameters(), lr=lr, min_quant_size=1024, backend="eager",
                          master_weight_bits=bits)

    def masters():
        return [read_master(p, optimizer.state[p][CORRECTION_KEY]).clone() for p in model.parameters()]

    train(model, optimizer, steps=STEPS - 1)
    before = masters()
    train(model, optimizer, steps=1)
    names = [name for name, _ in model.named_parameters()]
    assert [item.name for item in lost_updates(optimizer, model=model)] == (names if flagged else [])
    for param, old, new in zip(model.parameters(), before, masters()):
        unchanged = float((new == old).float().mean())
        estimate = lost_fraction(param, optimizer.state[param], optimizer.param_groups[0])
        assert abs(estimate - unchanged) <= 0.01, (tuple(param.shape), unchanged, estimate)


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
