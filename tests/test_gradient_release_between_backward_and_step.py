"""What a user may do between a released backward and ``optimizer.step()``: cast the model,
edit a param group. Either it works as without release, or it is refused before anything
changes."""

import pytest
import torch
from torch import nn

from lowbit_optim import AdamW8bit, Lion8bit, release_gradients
from lowbit_optim.optim.released_gradient import is_released


def released_model(cls=AdamW8bit, backend="cpu"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 4))
    optimizer = cls(model.parameters(), lr=1e-2, min_quant_size=64, backend=backend)
    release_gradients(optimizer)
    model(torch.randn(3, 8)).square().mean().backward()
    return model, optimizer


def test_model_cast_between_released_backward_and_step_keeps_the_placeholders():
    model, optimizer = released_model()
    model.to(torch.bfloat16)
    assert all(param.dtype == torch.bfloat16 for param in model.parameters())
    assert all(is_released(param.grad) and param.grad.dtype == torch.bfloat16 for param in model.parameters())
    optimizer.step()
    assert all(param.grad is None for param in model.parameters())


@pytest.mark.parametrize("backend", ["cpu", "eager"])
@pytest.mark.parametrize("cls", [AdamW8bit, Lion8bit], ids=lambda c: c.__name__)
def test_step_under_release_refuses_a_bad_learning_rate_before_any_change(cls, backend):
    """Ordinary ``step()`` refuses it with no gradient to step; so does ``step()`` under
    release, which has nothing left to step after backward."""
    model, optimizer = released_model(cls, backend)
    params = [param.detach().clone() for param in model.parameters()]
    steps = [state["step"].clone() for state in optimizer.state.values()]
    optimizer.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="Invalid learning rate: -1.0"):
        optimizer.step()
    assert all(map(torch.equal, params, model.parameters()))
    assert all(map(torch.equal, steps, (state["step"] for state in optimizer.state.values())))
    assert all(is_released(param.grad) for param in model.parameters())  # the step did not end
    optimizer.param_groups[0]["lr"] = 1e-2
    optimizer.step()
    assert all(param.grad is None for param in model.parameters())
