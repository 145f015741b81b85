"""Adam8bit / Adam4bit: torch.optim.Adam's L2 weight decay with our state formats."""

import pytest
import torch
from conftest import HAS_CUDA, relative_rmse, slow_except
from helpers import STEPS, train

from lowbit_optim import Adam4bit, Adam8bit, AdamFp8, AdamW8bit, QuantizedState
from lowbit_optim.checkpoint import to_torch_adamw

# Weight decay 1.0 makes L2 and decoupled decay differ by more than quantization noise: the
# parameter change of 20 steps is measured against torch.optim.Adam (the bounds) and must be
# at least twice as far from torch.optim.AdamW's (measured 0.90 for both formats).
WEIGHT_DECAY = 1.0
BOUND = {Adam8bit: 0.04, Adam4bit: 0.45, AdamFp8: 0.05}  # as test_optimizer's bounds against AdamW


# Compiled, each class's L2-decay step is a graph of its own: those in the slow tier.
@pytest.mark.parametrize("backend", slow_except(["eager", "compile"], "eager"))
@pytest.mark.parametrize("cls", [Adam8bit, Adam4bit, AdamFp8], ids=lambda c: c.__name__)
def test_adam_classes_follow_torch_adam(cls, backend):
    initial, weight, _, optimizer = train(lambda p, **kw: cls(p, backend=backend, **kw), STEPS,
                                          weight_decay=WEIGHT_DECAY)
    _, adam, _, _ = train(torch.optim.Adam, STEPS, weight_decay=WEIGHT_DECAY)
    _, adamw, _, _ = train(torch.optim.AdamW, STEPS, weight_decay=WEIGHT_DECAY)
    assert isinstance(optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"], QuantizedState)
    from_adam = relative_rmse(weight - initial, adam - initial)
    assert from_adam < BOUND[cls]
    assert relative_rmse(weight - initial, adamw - initial) > 2 * from_adam, "not AdamW's decay"


# Its own compiled float-state graph: slow tier (tests/test_tiny_gradients.py checks Adam's float
# state against torch's in the fast tier).
@pytest.mark.slow
def test_adam_float_state_matches_torch_adam_to_rounding():
    _, weight, bias, _ = train(lambda p, **kw: Adam8bit(p, min_quant_size=10**9, **kw), STEPS,
                               weight_decay=WEIGHT_DECAY)
    _, expected_weight, expected_bias, _ = train(torch.optim.Adam, STEPS, weight_decay=WEIGHT_DECAY)
    torch.testing.assert_close(weight, expected_weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bias, expected_bias, rtol=1e-5, atol=1e-6)


def test_adam_defaults_are_torchaos():
    optimizer = Adam8bit([torch.nn.Parameter(torch.randn(3))])
    group = optimizer.param_groups[0]
    assert group["weight_decay"] == 0.0 and group["decoupled_weight_decay"] is False
    assert AdamW8bit([torch.nn.Parameter(torch.randn(3))]).param_groups[0]["decoupled_weight_decay"]


@pytest.mark.parametrize("cls", [Adam8bit, Adam4bit, AdamFp8], ids=lambda c: c.__name__)
def test_adam_checkpoints_go_to_and_from_torch_adam(cls):
    weight = torch.nn.Parameter(torch.randn(50, 90))
    reference = torch.optim.Adam([weight], lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        weight.grad = torch.randn_like(weight)
        reference.step()
    ours = cls([weight])
    ours.load_state_dict(reference.state_dict())
    group = ours.param_groups[0]
    assert group["weight_decay"] == 0.1 and group["decoupled_weight_decay"] is False
    assert ours.state[weight]["step"].item() == 3
    back = torch.optim.Adam([weight])
    back.load_state_dict(to_torch_adamw(ours.state_dict()))
    assert back.param_groups[0]["decoupled_weight_decay"] is False
    with pytest.raises(ValueError, match=r"L2 weight decay \(Adam\); AdamW8bit uses decoupled"):
        AdamW8bit([weight]).load_state_dict(reference.state_dict())


def test_checkpoint_saved_before_the_group_option_loads():
    """State dicts from before the Adam classes have no ``decoupled_weight_decay`` in their
    groups: they load with this optimizer's value."""
    param = torch.nn.Parameter(torch.randn(5000))
    optimizer = AdamW8bit([param])
    param.grad = torch.randn_like(param)
    optimizer.step()
    saved = optimizer.state_dict()
    for group in saved["param_groups"]:
        del group["decoupled_weight_decay"]
    resumed = AdamW8bit([param])
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["decoupled_weight_decay"] is True
    resumed.step()


@pytest.mark.skipif(HAS_CUDA, reason="interpreter test: runs in CPU CI")
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("cls", [Adam8bit, AdamFp8], ids=lambda c: c.__name__)
def test_adam_on_the_triton_kernel_matches_eager(cls):
    """The kernel's L2 variant (TRITON_INTERPRET=1) against the eager step."""
    torch.manual_seed(0)
    start = torch.randn(64, 80)
    grads = [torch.randn(64, 80) for _ in range(3)]
    results = {}
    for backend in ("triton", "eager"):
        param = torch.nn.Parameter(start.clone())
        optimizer = cls([param], lr=1e-2, weight_decay=0.5, min_quant_size=0, backend=backend)
        for grad in grads:
            param.grad = grad.clone()
            optimizer.step()
        results[backend] = param.detach()
    # The kernel's documented bound (tests/test_triton.py): within float rounding of the step.
    torch.testing.assert_close(results["triton"], results["eager"], rtol=1e-5, atol=1e-6)
