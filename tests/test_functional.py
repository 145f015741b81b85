"""The functional entry points (``lowbit_optim.functional``): the path every optimizer class
steps through, usable on its own in ``torch.optim``'s functional shape."""

import copy

import pytest
import torch
from torch.optim.adamw import adamw as torch_adamw

from lowbit_optim import AdamW8bit, AdEMAMix4bit, Lion8bit
from lowbit_optim.functional import StepCache, adamw, ademamix, lion
from lowbit_optim.step import plan as step_plan

SHAPES = [(64, 80), (777,), (30,)]  # quantized, quantized with a partial block, float moments
MIN_QUANT_SIZE = 512

CASES = [
    pytest.param(AdamW8bit, adamw, dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1), id="adamw"),
    pytest.param(Lion8bit, lion, dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1), id="lion"),
    pytest.param(AdEMAMix4bit, ademamix, dict(lr=1e-2, betas=(0.9, 0.999, 0.9999), alpha=5.0, eps=1e-8,
                                              weight_decay=0.1, t_alpha=4, t_beta3=4), id="ademamix"),
]


def keywords_of(group: dict) -> dict:
    """A param group's hyperparameters as the functions take them (betas one by one)."""
    keywords = {key: value for key, value in group.items() if key != "betas"}
    keywords.update(zip(("beta1", "beta2", "beta3"), group["betas"]))
    return keywords


def make_params(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def make_grads(step):
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


@pytest.mark.parametrize("cls, function, group", CASES)
def test_function_steps_as_the_optimizer_does_bit_for_bit(cls, function, group):
    """The optimizer is its rule's function and a param group: the same parameters and states,
    bit for bit, over steps with a changing LR, for every rule (the default CPU backend)."""
    params = make_params()
    states = [cls.new_state(p, min_quant_size=MIN_QUANT_SIZE) for p in params]
    model_params = [torch.nn.Parameter(p.clone()) for p in params]
    optimizer = cls(model_params, **group, min_quant_size=MIN_QUANT_SIZE)
    cache = StepCache()
    for step in range(4):
        grads = make_grads(step)
        lr = group["lr"] * (1 - step / 8)
        function(params, grads, states, **keywords_of({**group, "lr": lr}), cache=cache)
        for param, grad in zip(model_params, grads):
            param.grad = grad.clone()
        optimizer.param_groups[0]["lr"] = lr
        optimizer.step()
    for param, model_param, state in zip(params, model_params, states):
        assert torch.equal(param, model_param.detach())
        for key, value in optimizer.state[model_param].items():
            assert torch.equal(torch.as_tensor(state[key]), torch.as_tensor(value)), key


def test_hyperparameters_are_keyword_only():
    params = make_params()
    states = [AdamW8bit.new_state(p) for p in params]
    with pytest.raises(TypeError):
        adamw(params, make_grads(0), states, 1e-3, 0.9, 0.999, 1e-8, 0.0)


def test_small_parameters_follow_torch_functional_adamw():
    """Float moments (below ``min_quant_size``) follow ``torch.optim.adamw.adamw`` to float32
    rounding: the same formula, the bias corrections ordered differently (1e-6 relative)."""
    params = make_params()[2:]
    states = [AdamW8bit.new_state(p) for p in params]
    reference = [p.clone() for p in params]
    exp_avgs, exp_avg_sqs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    steps = [torch.tensor(0.0) for _ in params]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    for step in range(5):
        grads = make_grads(step)[2:]
        adamw(params, grads, states, **hyper)
        torch_adamw(reference, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=False,
                                amsgrad=False, maximize=False, **hyper)
    for param, expected in zip(params, reference):
        torch.testing.assert_close(param, expected, rtol=1e-6, atol=1e-7)


def test_cache_keeps_the_plan_and_none_plans_each_call(monkeypatch):
    """With a ``StepCache``, one plan serves every call while nothing changes, and a new
    gradient list at new addresses is no change; without one, every call plans."""
    built = []
    original = step_plan.GroupPlan.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(step_plan.GroupPlan, "__init__", counting)
    params = make_params()
    states = [AdamW8bit.new_state(p, min_quant_size=MIN_QUANT_SIZE) for p in params]
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    cache = StepCache()
    for step in range(3):
        adamw(params, make_grads(step), states, **hyper, cache=cache)
    assert len(built) == 1
    adamw(params[:2], make_grads(3)[:2], states[:2], **hyper, cache=cache)  # other parameters: planned
    assert len(built) == 2
    for step in range(2):
        adamw(params, make_grads(step), states, **hyper)
    assert len(built) == 4


@pytest.mark.parametrize("bad, error, message", [
    (dict(lr=-1.0), ValueError, "Invalid learning rate: -1.0"),
    (dict(beta2=1.0), ValueError, "Invalid beta parameter at index 1"),
    (dict(grad_shape=(7,)), RuntimeError, "does not match its parameter"),
    (dict(grad_dtype=torch.float64), RuntimeError, "must match its parameter's dtype"),
])
def test_bad_input_is_refused_before_anything_changes(bad, error, message):
    params = make_params()
    states = [AdamW8bit.new_state(p, min_quant_size=MIN_QUANT_SIZE) for p in params]
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    cache = StepCache()
    adamw(params, make_grads(0), states, **hyper, cache=cache)  # a plan in place
    before = copy.deepcopy((params, states))
    grads = make_grads(1)
    if "grad_shape" in bad:
        grads[1] = torch.randn(bad.pop("grad_shape"))
    if "grad_dtype" in bad:
        grads[1] = grads[1].to(bad.pop("grad_dtype"))
    with pytest.raises(error, match=message):
        adamw(params, grads, states, **{**hyper, **bad}, cache=cache)
    for param, kept in zip(params, before[0]):
        assert torch.equal(param, kept)
    for state, kept in zip(states, before[1]):
        assert float(state["step"]) == float(kept["step"]) == 1.0
        assert torch.equal(torch.as_tensor(state["exp_avg"]), torch.as_tensor(kept["exp_avg"]))


def test_new_state_takes_the_class_options():
    weight = torch.randn(64, 128)
    state = AdamW8bit.new_state(weight, amsgrad=True, block_size=64)
    assert set(state) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert state["exp_avg"].block_size == 64 and state["exp_avg"].format is AdamW8bit.exp_avg_format
    assert set(Lion8bit.new_state(weight)) == {"step", "exp_avg"}
    assert type(AdamW8bit.new_state(torch.randn(30))["exp_avg"]) is torch.Tensor  # small: float32
    with pytest.raises(ValueError, match="block_size"):
        AdamW8bit.new_state(weight, block_size=100)


def test_a_refused_group_leaves_no_gradient_held_by_the_groups_before_it():
    """The optimizer checks every group before stepping any; when a later group's gradient is
    refused, the earlier groups' caches drop the gradient lists they had accepted (they
    would otherwise keep those gradients' memory alive until the next step)."""
    first, second = torch.nn.Parameter(torch.randn(64, 80)), torch.nn.Parameter(torch.randn(64, 80))
    optimizer = AdamW8bit([{"params": [first]}, {"params": [second]}], min_quant_size=MIN_QUANT_SIZE)
    for param in (first, second):
        param.grad = torch.randn_like(param)
    optimizer.step()
    first.grad = torch.randn_like(first)
    second.grad.data = torch.ones(7)  # refused: another shape
    with pytest.raises(RuntimeError, match="does not match its parameter"):
        optimizer.step()
    assert all(cache.checked_grads is None for cache in optimizer._caches)
    assert float(optimizer.state[first]["step"]) == 1.0
