"""Storage options written into a param group mid-training (lowbit_optim.optim.group_options):
at the next ``step()`` each is applied (amsgrad, master_weight_bits) or refused, naming the
group, the option, the old and new values and the fix, before anything changes, on every
backend; after an applied edit the state dict saves and reloads into an optimizer built with
the new options."""

import copy

import pytest
import torch
from helpers import assert_same_state

from lowbit_optim import AdamW4bit, AdamW8bit, AdamWFactored4bit, Lion8bit, master_weights_state_dict
from lowbit_optim.step.master_weights import CORRECTION_KEY


def make(optimizer_class, backend, *, dtype=torch.float32, seed=0, **options):
    """A quantized weight (64 x 64) and a float-state bias, and their optimizer."""
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(64, 64).to(dtype) * 0.1),
              torch.nn.Parameter(torch.randn(64).to(dtype) * 0.1)]
    options = {"min_quant_size": 1024, **options}
    return params, optimizer_class(params, lr=1e-3, backend=backend, **options)


def step_with(params, optimizer, seed):
    generator = torch.Generator().manual_seed(seed)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator).to(torch.bfloat16).to(param.dtype)
    optimizer.step()


def trained(optimizer_class, backend, **options):
    params, optimizer = make(optimizer_class, backend, **options)
    for seed in range(2):
        step_with(params, optimizer, seed)
    return params, optimizer


def assert_refused_unchanged(params, optimizer, match):
    before_params = [p.detach().clone() for p in params]
    before = copy.deepcopy(optimizer.state_dict())
    with pytest.raises(ValueError, match=match):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before_params))
    assert_same_state({**optimizer.state_dict(), "param_groups": []}, {**before, "param_groups": []})


def assert_reloads(params, optimizer, optimizer_class, backend, **options):
    """The state dict loads into an optimizer built with ``options`` and both step alike."""
    twin_params, twin = make(optimizer_class, backend, **options)
    for twin_param, param in zip(twin_params, params):
        twin_param.data.copy_(param)
    twin.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    step_with(params, optimizer, 7)
    step_with(twin_params, twin, 7)
    assert_same_state(twin.state_dict(), optimizer.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(params, twin_params))


def test_block_size_set_to_an_invalid_value_mid_training_is_refused_before_any_change(backend):
    params, optimizer = trained(AdamW8bit, backend)
    optimizer.param_groups[0]["block_size"] = 100
    assert_refused_unchanged(params, optimizer, "block_size.*100")


def test_block_size_changed_mid_training_is_refused_naming_group_option_and_values(backend):
    params, optimizer = trained(AdamW4bit, backend)
    optimizer.param_groups[0]["block_size"] = 64
    assert_refused_unchanged(
        params, optimizer, r"param group 0's block_size was changed to 64.*block_size=128.*Set block_size")
    optimizer.param_groups[0]["block_size"] = 128  # set back: steps again
    step_with(params, optimizer, 3)


def test_block_size_changed_before_the_first_step_is_applied(backend):
    params, optimizer = make(AdamW8bit, backend)
    optimizer.param_groups[0]["block_size"] = 64
    step_with(params, optimizer, 0)
    assert optimizer.state[params[0]]["exp_avg"].block_size == 64


def test_min_quant_size_raised_mid_training_is_refused_before_any_change(backend):
    params, optimizer = trained(AdamW8bit, backend)
    optimizer.param_groups[0]["min_quant_size"] = 10**9
    assert_refused_unchanged(params, optimizer,
                             r"param group 0's min_quant_size was changed to 1000000000.*min_quant_size=1024")


def test_min_quant_size_change_that_no_state_feels_is_accepted(backend):
    params, optimizer = trained(AdamW8bit, backend)
    optimizer.param_groups[0]["min_quant_size"] = 2048  # the weight (4096) stays quantized, the bias float
    step_with(params, optimizer, 3)
    assert_reloads(params, optimizer, AdamW8bit, backend, min_quant_size=2048)


def test_amsgrad_turned_on_mid_training_starts_the_maximum_from_the_second_moment(backend):
    params, optimizer = trained(AdamW8bit, backend)
    # The reference: an amsgrad optimizer loading the same state with the maximum set to the
    # second moment, through load_state_dict.
    saved = copy.deepcopy(optimizer.state_dict())
    for entry in saved["state"].values():
        entry["max_exp_avg_sq"] = copy.deepcopy(entry["exp_avg_sq"])
    saved["param_groups"][0]["amsgrad"] = True
    reference_params, reference = make(AdamW8bit, backend, amsgrad=True, seed=1)
    for reference_param, param in zip(reference_params, params):
        reference_param.data.copy_(param)
    reference.load_state_dict(saved)
    optimizer.param_groups[0]["amsgrad"] = True
    for seed in range(3, 5):
        step_with(params, optimizer, seed)
        step_with(reference_params, reference, seed)
    assert_same_state(optimizer.state_dict(), reference.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(params, reference_params))
    assert_reloads(params, optimizer, AdamW8bit, backend, amsgrad=True)


def test_amsgrad_turned_off_mid_training_drops_the_maximum(backend):
    params, optimizer = trained(AdamW8bit, backend, amsgrad=True)
    optimizer.param_groups[0]["amsgrad"] = False
    step_with(params, optimizer, 3)
    assert all("max_exp_avg_sq" not in optimizer.state[p] for p in params)
    assert_reloads(params, optimizer, AdamW8bit, backend)


def test_amsgrad_turned_on_for_factored_adamw_mid_training_is_refused_before_any_change(backend):
    params, optimizer = trained(AdamWFactored4bit, backend)
    optimizer.param_groups[0]["amsgrad"] = True
    assert_refused_unchanged(params, optimizer, "Invalid amsgrad: True")


def test_block_size_changed_mid_training_of_lion_is_refused_before_any_change(backend):
    params, optimizer = trained(Lion8bit, backend)
    optimizer.param_groups[0]["block_size"] = 128
    assert_refused_unchanged(params, optimizer, "param group 0's block_size was changed to 128")


def test_master_weight_bits_set_mid_training_starts_corrections_at_zero(backend):
    params, optimizer = trained(AdamW8bit, backend, dtype=torch.bfloat16)
    # The reference: a 32-bit optimizer loading the state saved without master weights.
    reference_params, reference = make(AdamW8bit, backend, dtype=torch.bfloat16, seed=1,
                                       master_weight_bits=32)
    for reference_param, param in zip(reference_params, params):
        reference_param.data.copy_(param)
    reference.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    optimizer.param_groups[0]["master_weight_bits"] = 32
    for seed in range(3, 5):
        step_with(params, optimizer, seed)
        step_with(reference_params, reference, seed)
    assert all(optimizer.state[p][CORRECTION_KEY].dtype == torch.int16 for p in params)
    assert_same_state(optimizer.state_dict(), reference.state_dict())
    assert_reloads(params, optimizer, AdamW8bit, backend, dtype=torch.bfloat16, master_weight_bits=32)


@pytest.mark.parametrize(("old", "new"), [(24, 32), (32, 24), (32, None)])
def test_master_weight_bits_changed_mid_training_converts_the_corrections(backend, old, new):
    params, optimizer = trained(AdamW8bit, backend, dtype=torch.bfloat16, master_weight_bits=old)
    model = torch.nn.Module()
    model.weight, model.bias = params
    before = master_weights_state_dict(model, optimizer)
    optimizer.param_groups[0]["master_weight_bits"] = new
    optimizer.zero_grad()
    optimizer.step()  # no gradients: only the states follow the option
    after = master_weights_state_dict(model, optimizer)
    for name, master in before.items():
        if new == 32:
            assert torch.equal(after[name], master), name
        elif new == 24:
            assert ((after[name] - master).abs() <= 1.5 * 2.0**-15 * master.abs()).all(), name
        else:
            assert CORRECTION_KEY not in optimizer.state[getattr(model, name)]
    assert_reloads(params, optimizer, AdamW8bit, backend, dtype=torch.bfloat16, master_weight_bits=new)


def test_bf16_stochastic_round_set_with_master_weights_mid_training_is_refused_before_any_change(backend):
    params, optimizer = trained(AdamW8bit, backend, dtype=torch.bfloat16, master_weight_bits=32)
    optimizer.param_groups[0]["bf16_stochastic_round"] = True
    assert_refused_unchanged(params, optimizer, "master_weight_bits.*bf16_stochastic_round=True")


def test_a_refused_group_leaves_the_groups_before_it_unchanged(backend):
    params, optimizer = trained(AdamW8bit, backend, dtype=torch.bfloat16)
    extra = torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16))
    optimizer.add_param_group({"params": [extra], "block_size": 128})
    extra.grad = torch.randn(64, 64).to(torch.bfloat16)
    optimizer.step()
    optimizer.param_groups[0]["master_weight_bits"] = 32  # applied, but only with the step
    optimizer.param_groups[1]["block_size"] = 64  # refused
    for param in params:
        param.grad = torch.ones_like(param)
    extra.grad = torch.ones_like(extra)
    assert_refused_unchanged([*params, extra], optimizer, "param group 1's block_size")
    assert all(CORRECTION_KEY not in optimizer.state[p] for p in params)
