"""One ``step()`` is all or nothing: a step that is refused leaves parameters, moments and step
counts as they were, on every backend, so bias corrections and schedules never run ahead of
the updates actually made."""

import copy

import pytest
import torch
from helpers import assert_same_state

from lowbit_optim import AdamW8bit, AdEMAMix4bit, Lion8bit


def trained(optimizer_class, backend, *, dtype=torch.float32, steps=2, **options):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 64).to(dtype) * 0.1),
              torch.nn.Parameter(torch.randn(64).to(dtype) * 0.1)]
    optimizer = optimizer_class(params, lr=1e-3, backend=backend, min_quant_size=1024, **options)
    for seed in range(steps):
        generator = torch.Generator().manual_seed(seed)
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)
        optimizer.step()
    return params, optimizer


def step_counts(optimizer) -> list[float]:
    return [float(state["step"]) for state in optimizer.state.values()]


@pytest.mark.parametrize("optimizer_class", [AdamW8bit, Lion8bit, AdEMAMix4bit], ids=lambda c: c.__name__)
def test_maximize_set_to_a_truthy_string_mid_training_is_refused_before_any_change(optimizer_class, backend):
    # The constructor refuses maximize="yes"; written into a group later it is refused alike at
    # the next step, by every backend, before the step counts move.
    params, optimizer = trained(optimizer_class, backend)
    optimizer.param_groups[0]["maximize"] = "yes"
    before_params = [p.detach().clone() for p in params]
    before = copy.deepcopy(optimizer.state_dict())
    with pytest.raises(ValueError, match="Invalid maximize: 'yes'"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before_params))
    assert_same_state({**optimizer.state_dict(), "param_groups": []}, {**before, "param_groups": []})
    assert step_counts(optimizer) == [2.0, 2.0]
    optimizer.param_groups[0]["maximize"] = True
    optimizer.step()
    assert step_counts(optimizer) == [3.0, 3.0]


def test_model_float_with_master_weights_counts_each_step_once(backend):
    # A bfloat16 model with master weights cast to float32 mid-training: the next step drops
    # the corrections and updates every parameter, counting one step, never two.
    params, optimizer = trained(AdamW8bit, backend, dtype=torch.bfloat16, master_weight_bits=24)
    for param in params:
        param.data = param.data.float()
        param.grad = torch.ones_like(param)
    optimizer.step()
    assert step_counts(optimizer) == [3.0, 3.0]
    assert all("master_weight_correction" not in state for state in optimizer.state.values())
