"""AdamW8bit / AdamW4bit: drop-in behaviour, accuracy against torch.optim.AdamW, errors."""

import pytest
import torch
from conftest import relative_rmse
from helpers import STEPS, regression_problem, train

from lowbit_optim import AdamW4bit, AdamW8bit, AdamWFactored4bit, AdamWFp8, FactoredState, QuantizedState
from lowbit_optim.step.math import round_to_bfloat16_stochastic

OPTIMIZERS = [AdamW8bit, AdamW4bit, AdamWFp8]


# Relative error of the parameter change after 20 steps (weight decay 1.0, so decay matters)
# against torch.optim.AdamW on the regression problem. Measured: 8-bit 0.024, 4-bit 0.33, float8
# 0.0395 (torchao's AdamWFp8: 0.0395 too; e4m3fn keeps 3 mantissa bits, a relative step of up
# to 1/8 where the 8-bit map's top decade has 0.9/64 of the block's largest). The
# 8-bit bound (0.04) is tight enough that a 10% wrong LR scale (what a wrong bias correction
# does) or a doubled weight decay fails it (0.059 and 0.064, checked below). 4-bit noise is
# larger than such mistakes (its zero-free linear second-moment map over-estimates small v,
# which shrinks early steps), so its bound only guards against gross errors; the same
# ``adamw_update`` is checked to float rounding by the fp32-state test below.
WEIGHT_DECAY = 1.0
# AdamWFactored4bit (measured 0.37) shares the 4-bit bound; its step is checked against a
# float64 reference in tests/test_factored.py.
CHANGE_ERROR_BOUND = {AdamW8bit: 0.04, AdamW4bit: 0.45, AdamWFp8: 0.05, AdamWFactored4bit: 0.45}


@pytest.mark.parametrize("backend", ["eager", "compile"])
@pytest.mark.parametrize("cls", [*OPTIMIZERS, AdamWFactored4bit], ids=lambda c: c.__name__)
def test_quantized_state_follows_torch_adamw(cls, backend):
    initial, weight, _, optimizer = train(
        lambda p, **kw: cls(p, backend=backend, **kw), STEPS, weight_decay=WEIGHT_DECAY)
    _, expected_weight, _, _ = train(torch.optim.AdamW, STEPS, weight_decay=WEIGHT_DECAY)
    assert isinstance(optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"], QuantizedState)
    error = relative_rmse(weight - initial, expected_weight - initial)
    assert error < CHANGE_ERROR_BOUND[cls]


def test_8bit_bound_is_tight_enough_to_catch_wrong_math():
    initial, expected, _, _ = train(torch.optim.AdamW, STEPS, weight_decay=WEIGHT_DECAY)
    _, scaled_lr, _, _ = train(torch.optim.AdamW, STEPS, lr=1.1e-2, weight_decay=WEIGHT_DECAY)
    _, double_decay, _, _ = train(torch.optim.AdamW, STEPS, weight_decay=2 * WEIGHT_DECAY)
    for wrong in (scaled_lr, double_decay):
        assert relative_rmse(wrong - initial, expected - initial) > CHANGE_ERROR_BOUND[AdamW8bit]


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_small_tensors_match_torch_adamw_to_rounding(cls, amsgrad):
    params = [torch.nn.Parameter(torch.randn(40, 30)), torch.nn.Parameter(torch.randn(7))]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = cls([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0, "lr": 3e-3}],
               amsgrad=amsgrad, lr=1e-2)
    torch_adamw = torch.optim.AdamW(
        [{"params": reference[:1]}, {"params": reference[1:], "weight_decay": 0.0, "lr": 3e-3}],
        amsgrad=amsgrad, lr=1e-2, foreach=False)
    for _ in range(50):
        grads = [torch.randn_like(p) for p in params]
        for group, grad in zip((params, reference), (grads, grads)):
            for p, g in zip(group, grad):
                p.grad = g.clone()
        ours.step()
        torch_adamw.step()
    for p, r in zip(params, reference):
        # float32 state, same operation order; the LR is a float32 tensor (torch: a double),
        # which changes the step by ~1 float32 ulp relative.
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    state = ours.state[params[0]]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if amsgrad else set())


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_amsgrad_on_quantized_state(cls):
    initial, weight, _, optimizer = train(
        lambda p, **kw: cls(p, amsgrad=True, backend="eager", **kw), STEPS, weight_decay=WEIGHT_DECAY)
    _, expected, _, _ = train(
        lambda p, **kw: torch.optim.AdamW(p, amsgrad=True, **kw), STEPS, weight_decay=WEIGHT_DECAY)
    assert isinstance(optimizer.state[optimizer.param_groups[0]["params"][0]]["max_exp_avg_sq"],
                      QuantizedState)
    assert relative_rmse(weight - initial, expected - initial) < CHANGE_ERROR_BOUND[cls]


def test_maximize_ascends():
    initial, weight, _, _ = train(lambda p, **kw: AdamW4bit(p, maximize=True, backend="eager", **kw), 30)
    _, descended, _, _ = train(lambda p, **kw: AdamW4bit(p, backend="eager", **kw), 30)
    inputs, targets, _ = regression_problem()
    def loss(w):
        return torch.nn.functional.mse_loss(inputs @ w.T, targets)

    assert loss(weight) > loss(initial) > loss(descended)


@pytest.mark.parametrize("cls", [*OPTIMIZERS, AdamWFactored4bit], ids=lambda c: c.__name__)
def test_eager_and_compiled_agree_step_by_step(cls):
    weights = [torch.randn(96, 130) for _ in range(2)]  # 12480 elements: whole blocks and a tail
    params = [torch.nn.Parameter(weights[0].clone()) for _ in range(2)]
    optimizers = [cls([params[0]], backend="eager"), cls([params[1]], backend="compile")]
    for _ in range(5):
        grad = torch.randn(96, 130)
        for p, opt in zip(params, optimizers):
            p.grad = grad.clone()
            opt.step()
        # Inductor fuses multiply-adds differently, so values differ by float rounding, and a
        # moment sitting on a rounding tie may take the neighbouring code.
        assert relative_rmse(params[1], params[0]) < 1e-5
        states = [opt.state[p] for opt, p in zip(optimizers, params)]
        for key in ("exp_avg", "exp_avg_sq"):
            if isinstance(states[0][key], FactoredState):
                # Inductor sums the statistics in another order: float rounding.
                for name in ("row", "col"):
                    torch.testing.assert_close(getattr(states[1][key], name), getattr(states[0][key], name),
                                               rtol=1e-5, atol=0)
                continue
            differ = (states[0][key].codes != states[1][key].codes).float().mean()
            assert differ < 1e-3


@pytest.mark.slow
def test_bf16_params_compiled_matches_eager():
    initial = torch.randn(64, 100).bfloat16()
    params = [torch.nn.Parameter(initial.clone()) for _ in range(2)]
    optimizers = [AdamW4bit([params[0]], backend="eager"), AdamW4bit([params[1]], backend="compile")]
    for _ in range(3):
        grad = torch.randn(64, 100).bfloat16()
        for p, opt in zip(params, optimizers):
            p.grad = grad.clone()
            opt.step()
    assert params[1].dtype == torch.bfloat16
    # bf16 round-to-nearest of float32 values that agree to ~1e-7: at most a rare one-ulp flip.
    assert (params[0] != params[1]).float().mean() < 1e-3
    assert not torch.equal(params[1], initial)


def test_bf16_stochastic_rounding_is_unbiased():
    # Values strictly between two bfloat16 neighbours: round-to-nearest always loses the fraction.
    base = torch.tensor([1.0, -3.0, 1e-3, 250.0])
    ulp = base.bfloat16().float().abs() * 2.0**-7
    values = base + ulp * torch.tensor([0.1, 0.3, 0.75, 0.5])
    samples = round_to_bfloat16_stochastic(values.repeat(20_000, 1)).float()
    mean = samples.mean(dim=0)
    # Each sample is one of two neighbours ulp apart: the std of the mean is <= ulp/2/sqrt(n).
    assert ((mean - values).abs() < 4 * ulp / 2 / 20_000**0.5).all()
    assert (values.bfloat16().float() - values).abs().min() > 4 * ulp.min() / 2 / 20_000**0.5


def test_bf16_stochastic_rounding_in_the_optimizer():
    param = torch.nn.Parameter(torch.ones(8192, dtype=torch.bfloat16))
    optimizer = AdamW8bit([param], lr=1e-4, weight_decay=0.0, bf16_stochastic_round=True, backend="eager")
    for _ in range(20):
        param.grad = torch.ones_like(param)
        optimizer.step()
    # Each step moves every weight by ~1e-4 (Adam's normalised update), far below the bf16
    # ulp at 1.0 (2**-7): round-to-nearest would never move; stochastic rounding moves the
    # mean by the accumulated updates.
    assert abs(param.float().mean().item() - (1 - 20 * 1e-4)) < 5e-4


def test_param_groups_closure_and_lr_tensors():
    a, b = torch.nn.Parameter(torch.randn(5000)), torch.nn.Parameter(torch.randn(10))
    own_lr = torch.tensor(0.01)
    optimizer = AdamW8bit([{"params": [a], "lr": own_lr}, {"params": [b]}], lr=1e-3, backend="eager")
    lrs = [group["lr"] for group in optimizer.param_groups]
    assert lrs[0] is own_lr, "a tensor LR given by the user is kept, not copied"
    assert lrs[1] == 1e-3 and isinstance(lrs[1], float), "a float LR stays a float"
    c = torch.nn.Parameter(torch.randn(3))
    optimizer.add_param_group({"params": [c], "lr": 0.5})
    assert optimizer.param_groups[2]["lr"] == 0.5

    def closure():
        optimizer.zero_grad()
        loss = (a.sum() + b.sum() + c.sum()) ** 2
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert isinstance(loss, torch.Tensor) and a.grad is not None
    optimizer.zero_grad()
    assert a.grad is None


BAD_ARGUMENTS = [
    ({"lr": -1e-3}, "Invalid learning rate: -0.001"),
    ({"eps": -1.0}, "Invalid epsilon value: -1.0"),
    ({"betas": (1.0, 0.999)}, "Invalid beta parameter at index 0: 1.0"),
    ({"betas": (0.9, -0.1)}, "Invalid beta parameter at index 1: -0.1"),
    ({"weight_decay": -0.1}, "Invalid weight_decay value: -0.1"),
    ({"block_size": 100}, "Invalid block_size: 100"),
    ({"block_size": 8}, "Invalid block_size: 8"),
    ({"min_quant_size": -1}, "Invalid min_quant_size: -1"),
    ({"backend": "cuda-magic"}, "Invalid backend: 'cuda-magic'"),
    ({"lr": torch.ones(2)}, "Tensor lr must be 1-element"),
]


@pytest.mark.parametrize("kwargs, message", BAD_ARGUMENTS, ids=[m for _, m in BAD_ARGUMENTS])
def test_bad_hyperparameters_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        AdamW4bit([torch.nn.Parameter(torch.randn(3))], **kwargs)


def test_bad_value_set_during_training_raises_before_any_change():
    param = torch.nn.Parameter(torch.randn(5000))
    optimizer = AdamW4bit([param], backend="eager")
    param.grad = torch.randn(5000)
    optimizer.step()
    before = param.detach().clone()
    state_before = optimizer.state[param]["exp_avg"].clone()
    optimizer.param_groups[0]["lr"] = -0.5
    with pytest.raises(ValueError, match="Invalid learning rate: -0.5"):
        optimizer.step()
    assert torch.equal(param, before) and torch.equal(optimizer.state[param]["exp_avg"], state_before)
    assert optimizer.state[param]["step"].item() == 1


def test_sparse_gradients_and_complex_parameters_are_refused():
    with pytest.raises(ValueError, match="complex parameters"):
        AdamW8bit([torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))])
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    dense = torch.nn.Parameter(torch.randn(4))
    optimizer = AdamW8bit([dense, *embedding.parameters()], backend="eager")
    dense.grad = torch.ones(4)
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        optimizer.step()
    assert not optimizer.state, "nothing was updated before the error"
