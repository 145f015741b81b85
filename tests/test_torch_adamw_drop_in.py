"""What code written for ``torch.optim.AdamW`` does with an optimizer: its implementation
keywords, a parameter listed twice, and a state dict loaded, trained on, then saved or
loaded again."""

import copy

import pytest
import torch
from helpers import step_on_random_gradients
from torch import nn

from lowbit_optim import AdamW4bit, AdamW8bit, AdamWFactored4bit, QuantizedState

CLASSES = [AdamW8bit, AdamW4bit, AdamWFactored4bit]


# --- torch.optim.AdamW's keywords ---------------------------------------------------------------
@pytest.mark.parametrize("value", [None, True, False])
@pytest.mark.parametrize("keyword", ["fused", "foreach"])
def test_torch_adamw_keyword_fused_true_is_accepted(keyword, value):
    """``fused``/``foreach`` are implementation hints: accepted, kept in the groups as torch
    keeps them, and the step is the same whatever they say (it is always fused)."""
    torch.manual_seed(0)
    start, grad = torch.randn(64, 80), torch.randn(64, 80)
    hinted, plain = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    optimizer = AdamW8bit([hinted], min_quant_size=0, **{keyword: value})
    reference = AdamW8bit([plain], min_quant_size=0)
    assert optimizer.param_groups[0][keyword] is value
    hinted.grad, plain.grad = grad.clone(), grad.clone()
    optimizer.step()
    reference.step()
    assert torch.equal(hinted, plain)


def test_torch_adamw_keywords_have_torchs_defaults_in_the_groups():
    group = AdamW4bit([nn.Parameter(torch.zeros(3))]).param_groups[0]
    torch_group = torch.optim.AdamW([nn.Parameter(torch.zeros(3))]).param_groups[0]
    for key in ("foreach", "capturable", "differentiable", "fused"):
        assert group[key] == torch_group[key], key


@pytest.mark.parametrize("keyword, reason", [("capturable", "CUDA graph"),
                                             ("differentiable", "not differentiable")])
def test_torch_adamw_keyword_capturable_or_differentiable_true_is_refused(keyword, reason):
    param = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=f"Invalid {keyword}: True .*{reason}"):
        AdamW8bit([param], **{keyword: True})
    optimizer = AdamW8bit([param])
    with pytest.raises(ValueError, match=f"Invalid {keyword}"):
        optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))], keyword: True})
    assert len(optimizer.param_groups) == 1


def test_torch_adamw_keyword_fused_of_another_type_is_refused():
    with pytest.raises(ValueError, match="Invalid fused: 'yes'"):
        AdamW8bit([nn.Parameter(torch.zeros(3))], fused="yes")


def test_a_state_dict_saved_before_the_torch_keywords_loads():
    """Groups saved without ``fused``/``foreach``/``capturable``/``differentiable`` load, and
    the loaded groups have them with torch's defaults (``__setstate__``)."""
    param = nn.Parameter(torch.randn(8))
    optimizer = AdamW8bit([param])
    param.grad = torch.randn(8)
    optimizer.step()
    saved = optimizer.state_dict()
    for group in saved["param_groups"]:
        for key in ("foreach", "capturable", "differentiable", "fused"):
            del group[key]
    fresh = AdamW8bit([param], fused=True)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["capturable"] is False and "fused" in fresh.param_groups[0]
    param.grad = torch.randn(8)
    fresh.step()


# --- the same parameter twice -----------------------------------------------------------------
def test_same_parameter_twice_in_a_group_is_refused():
    """torch's AdamW warns and updates it twice per step with one step count; refused here,
    naming it, before the optimizer exists."""
    param = nn.Parameter(torch.randn(4, 5))
    with pytest.raises(ValueError, match=r"parameter \(shape \(4, 5\)\) at position 1 .* position 0"):
        AdamW8bit([param, param], lr=0.1, weight_decay=0)


def test_same_named_parameter_twice_in_a_group_is_refused_by_name():
    param = nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="parameter 'second' .* at position 1"):
        AdamW8bit([("first", param), ("second", param)])


def test_same_parameter_in_two_groups_is_refused_before_anything_changes():
    shared, other = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(3))
    optimizer = AdamW8bit([{"params": [shared]}])
    with pytest.raises(ValueError, match=r"position 1 of the new param group is already in param group 0"):
        optimizer.add_param_group({"params": [other, shared], "lr": 0.5})
    assert len(optimizer.param_groups) == 1 and optimizer.param_groups[0]["params"] == [shared]
    with pytest.raises(ValueError, match="already in param group 0"):
        AdamW8bit([{"params": [shared]}, {"params": [shared]}])


# --- load_state_dict and the caller's dict ------------------------------------------------------
def assert_identical(a, b, where="state dict") -> None:
    """Bit-identical nested state dicts (quantized moments by codes and scales)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{index}]")
    elif isinstance(a, QuantizedState):
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales), where
    elif isinstance(a, torch.Tensor):
        assert type(a) is type(b) and a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_load_state_dict_leaves_the_callers_state_dict_untouched(cls):
    """Training after ``load_state_dict(sd)`` moved the moments in ``sd`` but not its step, a
    half-trained checkpoint. Now ``sd`` stays bit-identical, and resuming from it again
    reproduces the resumed run bit for bit. Quantized, factored and float moments (a bias)."""
    torch.manual_seed(0)
    model = nn.Linear(96, 64)
    params = list(model.parameters())
    optimizer = cls(params, min_quant_size=1024, backend="eager")
    step_on_random_gradients(params, optimizer, 3, seed=1)
    saved = optimizer.state_dict()
    weights = [p.detach().clone() for p in params]
    snapshot = copy.deepcopy(saved)

    resumed = cls(params, min_quant_size=1024, backend="eager")
    resumed.load_state_dict(saved)
    step_on_random_gradients(params, resumed, 4, seed=2)
    assert_identical(saved, snapshot)
    first_run = [p.detach().clone() for p in params]

    for param, weight in zip(params, weights):
        param.data.copy_(weight)
    again = cls(params, min_quant_size=1024, backend="eager")
    again.load_state_dict(saved)
    step_on_random_gradients(params, again, 4, seed=2)
    for param, expected in zip(params, first_run):
        assert torch.equal(param, expected)
    assert_identical(again.state_dict(), resumed.state_dict())
