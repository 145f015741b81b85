"""Misuse of the functional entry points (``lowbit_optim.functional``) and of ``new_state``:
each call either steps as the optimizer class does or is refused with a message naming the
cause before any parameter, moment or step count changes, alike on every backend."""

import copy

import pytest
import torch
from helpers import assert_same_state

from lowbit_optim import (
    AdamW4bit,
    AdamW8bit,
    AdamWFactored4bit,
    AdEMAMix4bit,
    AdEMAMix8bit,
    Lion4bit,
    Lion8bit,
)
from lowbit_optim.functional import StepCache, adamw, ademamix, lion
from lowbit_optim.step import functional

SHAPES = [(64, 80), (30,)]  # quantized moments, float moments
MIN_QUANT_SIZE = 512
BACKENDS = ["cpu", "compile", "eager", "triton"]

RULES = {
    "adamw": (AdamW8bit, adamw, dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)),
    "lion": (Lion8bit, lion, dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)),
    "ademamix": (AdEMAMix4bit, ademamix, dict(lr=1e-2, beta1=0.9, beta2=0.999, beta3=0.9999, alpha=5.0,
                                              eps=1e-8, weight_decay=0.1, t_alpha=4, t_beta3=4)),
}
# A class of another rule, whose states each rule refuses, and what the refusal says.
OTHER_RULE = {"adamw": (Lion8bit, r"has no exp_avg_sq"),
              "lion": (AdamW8bit, r"has exp_avg_sq, which lion does not keep"),
              "ademamix": (AdamW8bit, r"has no exp_avg_slow")}


@pytest.fixture
def backend_of(request):
    """The backend named, with the Triton interpreter on for ``"triton"``."""
    def setup(name):
        if name == "triton":
            request.getfixturevalue("interpreter")
        return name
    return setup


@pytest.fixture(params=BACKENDS)
def backend(request, backend_of):
    return backend_of(request.param)


@pytest.fixture(params=list(RULES))
def rule(request):
    return request.param


def make_case(rule_name, seed=0):
    cls, function, hyper = RULES[rule_name]
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(shape, generator=generator) for shape in SHAPES]
    grads = [torch.randn(shape, generator=generator) for shape in SHAPES]
    states = [cls.new_state(p, min_quant_size=MIN_QUANT_SIZE) for p in params]
    return cls, function, hyper, params, grads, states


def assert_refused_unchanged(call, params, states, message):
    """``call()`` raises ValueError matching ``message`` and leaves ``params`` and every state
    value (codes, scales, float moments, step counts) bit for bit as they were."""
    before_params, before_states = copy.deepcopy((params, states))
    with pytest.raises(ValueError, match=message):
        call()
    for param, kept in zip(params, before_params):
        assert torch.equal(param, kept)
    assert_same_state({"state": dict(enumerate(states)), "param_groups": []},
                      {"state": dict(enumerate(before_states)), "param_groups": []})


def test_fewer_grads_than_params_is_refused_before_any_change(rule, backend):
    _, function, hyper, params, grads, states = make_case(rule)
    assert_refused_unchanged(lambda: function(params, grads[:1], states, **hyper, backend=backend),
                             params, states, r"must have the same length, got 2, 1 and 2")


def test_fewer_states_than_params_is_refused_before_any_change(rule, backend):
    _, function, hyper, params, grads, states = make_case(rule)
    assert_refused_unchanged(lambda: function(params, grads, states[:1], **hyper, backend=backend),
                             params, states, r"must have the same length, got 2, 2 and 1")


def test_a_parameter_given_twice_is_refused_before_any_change(rule, backend):
    cls, function, hyper, params, grads, states = make_case(rule)
    twice = [params[0], params[0]]
    states = [states[0], cls.new_state(params[0], min_quant_size=MIN_QUANT_SIZE)]
    assert_refused_unchanged(lambda: function(twice, [grads[0], grads[0]], states, **hyper, backend=backend),
                             params, states, r"the parameter at position 1 is the one at position 0")


def test_a_state_given_twice_is_refused_before_any_change(rule, backend):
    _, function, hyper, params, grads, states = make_case(rule)
    twins = [params[0], params[0].clone()]
    assert_refused_unchanged(
        lambda: function(twins, [grads[0], grads[0]], [states[0], states[0]], **hyper, backend=backend),
        twins, states, r"the state at position 1 is the one at position 0")


def test_a_moment_shared_by_two_states_is_refused_before_any_change(rule, backend):
    cls, function, hyper, params, grads, states = make_case(rule)
    twins = [params[0], params[0].clone()]
    shared = [states[0], {**cls.new_state(twins[1], min_quant_size=MIN_QUANT_SIZE),
                          "exp_avg": states[0]["exp_avg"]}]
    assert_refused_unchanged(
        lambda: function(twins, [grads[0], grads[0]], shared, **hyper, backend=backend),
        twins, shared, r"position 1 .*exp_avg is the same tensor as the state at position 0")


def test_a_none_gradient_is_refused_before_any_change(rule, backend):
    _, function, hyper, params, grads, states = make_case(rule)
    assert_refused_unchanged(lambda: function(params, [grads[0], None], states, **hyper, backend=backend),
                             params, states, r"the gradient at position 1 \(parameter of shape \(30,\)\) "
                                             r"is None")


def test_states_in_the_wrong_order_are_refused_before_any_change(rule, backend):
    _, function, hyper, params, grads, states = make_case(rule)
    swapped = states[::-1]
    assert_refused_unchanged(lambda: function(params, grads, swapped, **hyper, backend=backend),
                             params, states, r"position 0 \(parameter of shape \(64, 80\)\): exp_avg has "
                                             r"shape \(30,\), not its parameter's")


def test_states_of_another_rule_are_refused_before_any_change(rule, backend):
    _, function, hyper, params, grads, _ = make_case(rule)
    other, message = OTHER_RULE[rule]
    states = [other.new_state(p, min_quant_size=MIN_QUANT_SIZE) for p in params]
    assert_refused_unchanged(lambda: function(params, grads, states, **hyper, backend=backend),
                             params, states, rf"position 0 .*{message}")


def test_a_state_without_its_step_count_is_refused_before_any_change(rule, backend):
    _, function, hyper, params, grads, states = make_case(rule)
    del states[1]["step"]
    assert_refused_unchanged(lambda: function(params, grads, states, **hyper, backend=backend),
                             params, states, r"position 1 .* has no step")


def test_a_float_moment_of_another_dtype_is_refused_before_any_change(rule, backend):
    _, function, hyper, params, grads, states = make_case(rule)
    states[1]["exp_avg"] = states[1]["exp_avg"].bfloat16()
    assert_refused_unchanged(lambda: function(params, grads, states, **hyper, backend=backend),
                             params, states, r"position 1 .*exp_avg is torch.bfloat16; float moments are "
                                             r"torch.float32 or torch.float64")


def test_a_moment_on_another_device_is_refused_before_any_change(rule, backend):
    _, function, hyper, params, grads, states = make_case(rule)
    states[1]["exp_avg"] = states[1]["exp_avg"].to("meta")
    before = copy.deepcopy(params)
    with pytest.raises(ValueError, match=r"position 1 .*exp_avg is on meta, its parameter on cpu"):
        function(params, grads, states, **hyper, backend=backend)
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    assert float(states[0]["step"]) == float(states[1]["step"]) == 0.0


def test_a_none_gradient_after_a_kept_plan_is_refused_before_any_change(rule):
    """With a ``StepCache`` holding a plan, the comparison that reuses it meets the ``None``
    first: it must fall through to the checks, not fail on the missing gradient's dtype."""
    _, function, hyper, params, grads, states = make_case(rule)
    cache = StepCache()
    function(params, grads, states, **hyper, backend="cpu", cache=cache)
    assert_refused_unchanged(
        lambda: function(params, [grads[0], None], states, **hyper, backend="cpu", cache=cache),
        params, states, r"the gradient at position 1 .* is None")


def test_amsgrad_turned_on_after_a_kept_plan_is_refused_before_any_change(backend):
    """States made without amsgrad have no maximum: a kept plan made without it must not keep
    stepping them as if ``amsgrad=True`` had been honoured."""
    _, function, hyper, params, grads, states = make_case("adamw")
    cache = StepCache()
    function(params, grads, states, **hyper, backend=backend, cache=cache)
    assert_refused_unchanged(
        lambda: function(params, grads, states, **hyper, amsgrad=True, backend=backend, cache=cache),
        params, states, r"position 0 .* has no max_exp_avg_sq")


def test_amsgrad_with_a_factored_second_moment_is_refused_before_any_change(backend):
    params = [torch.randn(64, 80)]
    grads = [torch.randn(64, 80)]
    state = AdamWFactored4bit.new_state(params[0], min_quant_size=MIN_QUANT_SIZE)
    state["max_exp_avg_sq"] = AdamW4bit.new_state(params[0], amsgrad=True,
                                                  min_quant_size=MIN_QUANT_SIZE)["max_exp_avg_sq"]
    _, _, hyper, _, _, _ = make_case("adamw")
    assert_refused_unchanged(
        lambda: adamw(params, grads, [state], **hyper, amsgrad=True, backend=backend),
        params, [state], r"exp_avg_sq is factored, which keeps no amsgrad maximum")


@pytest.mark.parametrize("cls", [Lion8bit, Lion4bit, AdEMAMix8bit, AdEMAMix4bit, AdamWFactored4bit])
def test_new_state_with_amsgrad_is_refused_by_classes_without_amsgrad(cls):
    with pytest.raises(ValueError, match=rf"Invalid amsgrad: True \({cls.__name__} does not support amsgrad"):
        cls.new_state(torch.randn(64, 80), amsgrad=True)
    assert "max_exp_avg_sq" in AdamW8bit.new_state(torch.randn(64, 80), amsgrad=True)  # the control


# Lion's and AdEMAMix's compiled graphs cost ~15 s each on 2 cores: slow tier.
@pytest.mark.parametrize("rule, backend_name", [
    pytest.param(rule, backend, marks=[pytest.mark.slow] if backend == "compile" and rule != "adamw" else [])
    for rule in RULES for backend in BACKENDS])
def test_a_correct_call_steps_as_the_optimizer_does_bit_for_bit(rule, backend_name, backend_of):
    """The control of the refusals above: well-formed lists step exactly as the class does."""
    backend = backend_of(backend_name)
    cls, function, hyper, params, _, states = make_case(rule)
    group = {key: value for key, value in hyper.items() if not key.startswith("beta")}
    group["betas"] = tuple(value for key, value in hyper.items() if key.startswith("beta"))
    model_params = [torch.nn.Parameter(p.clone()) for p in params]
    optimizer = cls(model_params, **group, min_quant_size=MIN_QUANT_SIZE, backend=backend)
    cache = StepCache()
    for seed in range(2):
        grads = make_case(rule, seed=seed + 1)[4]
        function(params, grads, states, **hyper, backend=backend, cache=cache)
        for param, grad in zip(model_params, grads):
            param.grad = grad.clone()
        optimizer.step()
    for param, model_param in zip(params, model_params):
        assert torch.equal(param, model_param.detach())
    kept = {index: optimizer.state[param] for index, param in enumerate(model_params)}
    assert_same_state({"state": dict(enumerate(states)), "param_groups": []},
                      {"state": kept, "param_groups": []})


def test_a_kept_plan_steps_without_checking_the_lists_again(monkeypatch):
    """The checks run when a step is planned: an optimizer's steps (and a functional caller's
    with a ``StepCache``) reuse the plan and pay nothing per parameter for them."""
    calls = []
    original = functional.check_step_inputs
    monkeypatch.setattr(functional, "check_step_inputs", lambda *args: calls.append(1) or original(*args))
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    optimizer = AdamW8bit(params, min_quant_size=MIN_QUANT_SIZE)
    for _ in range(3):
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer.step()
    assert len(calls) == 1
