"""Gradient release (``release_gradients``): the step fused into backward gives exactly the
parameters and state of ordinary stepping, frees each gradient as it goes, and tells the
user when something needs the gradients it freed. FSDP2 runs in
tests/test_distributed.py."""

import pytest
import torch
from helpers import graph_count
from torch import nn
from torch.optim import lr_scheduler

import lowbit_optim
from lowbit_optim import (
    Adam4bit,
    Adam8bit,
    AdamFp8,
    AdamW4bit,
    AdamW8bit,
    AdamWFactored4bit,
    AdamWFp8,
    CPUOffloadOptimizer,
    release_gradients,
)
from lowbit_optim.bench.profiling import allocation_peak_bytes
from lowbit_optim.optim.released_gradient import ReleasedGradient, is_released
from lowbit_optim.step import float_state

CLASSES = [AdamW8bit, AdamW4bit, AdamWFp8, AdamWFactored4bit, Adam8bit, Adam4bit, AdamFp8]
# The AdamW classes run their compiled step (the graphs other test files compile too); the
# Adam classes differ only in where weight decay goes, so eager keeps the compile cost down.
BACKEND = {AdamW8bit: "compile", AdamW4bit: "compile", AdamWFp8: "compile", AdamWFactored4bit: "compile"}
OPTIONS = dict(lr=1e-2, weight_decay=1e-2, min_quant_size=1024)
STEPS = 3


class Net(nn.Sequential):
    """Quantized weights with partial last blocks (80 x 64, 70 x 80), float-state biases, a
    small last layer, and a layer the loss never uses (its parameters get no gradient)."""

    def __init__(self):
        super().__init__(nn.Linear(64, 80), nn.Tanh(), nn.Linear(80, 70), nn.Linear(70, 3))
        self.unused = nn.Linear(4, 4)

    def forward(self, inputs):
        return self[3](self[2](self[1](self[0](inputs))))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def param_groups(model) -> list[dict]:
    """Two groups, the second with its own LR; the unused layer in the first."""
    return [
        {"params": [*model[0].parameters(), *model.unused.parameters()]},
        {"params": [*model[2].parameters(), *model[3].parameters()], "lr": 3e-3},
    ]


def loss_of(model, step: int) -> torch.Tensor:
    inputs = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
    return model(inputs).square().mean()


def new_run(cls, release: bool, **options):
    model = make_model()
    optimizer = cls(param_groups(model), **{**OPTIONS, "backend": BACKEND.get(cls, "eager"), **options})
    handle = release_gradients(optimizer) if release else None
    return model, optimizer, handle


def train(model, optimizer, steps: int = STEPS, first: int = 0, scheduler=None) -> None:
    for step in range(first, first + steps):
        loss_of(model, step).backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()


def stored_tensors(value) -> list[torch.Tensor]:
    """The tensors a state value is stored in (codes and scales, factors, or itself)."""
    if hasattr(value, "codes"):
        return [value.codes, value.scales]
    if hasattr(value, "row"):
        return [value.row, value.col]
    return [value]


def assert_same_training(expected, actual) -> None:
    """Same parameters and the same optimizer state dict, bit for bit, in the same order."""
    (model_a, optimizer_a), (model_b, optimizer_b) = expected, actual
    for (name, a), (_, b) in zip(model_a.state_dict().items(), model_b.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    saved_a, saved_b = optimizer_a.state_dict(), optimizer_b.state_dict()
    assert saved_a["param_groups"] == saved_b["param_groups"]
    assert list(saved_a["state"]) == list(saved_b["state"])
    for index, state in saved_a["state"].items():
        assert list(state) == list(saved_b["state"][index])
        for key, value in state.items():
            other = saved_b["state"][index][key]
            assert type(value) is type(other), (index, key)
            for a, b in zip(stored_tensors(value), stored_tensors(other), strict=True):
                assert torch.equal(a, b), (index, key)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_released_training_matches_ordinary_bit_for_bit(cls):
    runs = []
    for release in (False, True):
        model, optimizer, _ = new_run(cls, release)
        train(model, optimizer)
        runs.append((model, optimizer))
    assert_same_training(*runs)
    model, optimizer = runs[1]
    assert all(param not in optimizer.state for param in model.unused.parameters())
    assert all(float(state["step"]) == STEPS for state in optimizer.state.values())


def test_amsgrad_and_maximize_released_match_ordinary():
    runs = []
    for release in (False, True):
        model, optimizer, _ = new_run(Adam8bit, release, amsgrad=True, maximize=True)
        train(model, optimizer)
        runs.append((model, optimizer))
    assert_same_training(*runs)


def test_lr_scheduler_drives_released_steps_without_recompiles():
    runs = []
    for release in (False, True):
        model, optimizer, _ = new_run(AdamW4bit, release)
        scheduler = lr_scheduler.CosineAnnealingLR(optimizer, T_max=6)
        train(model, optimizer, 1, scheduler=scheduler)
        graphs = graph_count(optimizer)
        train(model, optimizer, 5, first=1, scheduler=scheduler)
        assert graph_count(optimizer) == graphs
        runs.append((model, optimizer))
    assert_same_training(*runs)


def test_backward_steps_and_step_does_not_step_again():
    model, optimizer, _ = new_run(AdamW8bit, True)
    before = [param.detach().clone() for param in model[0].parameters()]
    loss_of(model, 0).backward()
    after_backward = [param.detach().clone() for param in model[0].parameters()]
    assert not any(map(torch.equal, before, after_backward))
    assert all(is_released(param.grad) for param in model[0].parameters())
    optimizer.step()
    assert all(map(torch.equal, after_backward, model[0].parameters()))
    assert all(param.grad is None for param in model.parameters())
    assert all(float(state["step"]) == 1 for state in optimizer.state.values())


def test_tutorial_loop_of_backward_and_zero_grad_without_step():
    """PyTorch's tutorial never calls ``step()``: ``zero_grad()`` ends each released step."""
    ordinary = new_run(AdamW8bit, False)[:2]
    train(*ordinary)
    model, optimizer, _ = new_run(AdamW8bit, True)
    for step in range(STEPS):
        loss_of(model, step).backward()
        optimizer.zero_grad()
    assert_same_training(ordinary, (model, optimizer))


def test_gradient_assigned_by_hand_is_stepped_by_step():
    runs = []
    for release in (False, True):
        model, optimizer, _ = new_run(AdamW8bit, release)
        for param in model.parameters():
            param.grad = torch.full_like(param, 0.25)
        optimizer.step()
        runs.append((model, optimizer))
    assert_same_training(*runs)


def test_param_group_added_after_release_is_stepped_by_step():
    runs = []
    for release in (False, True):
        model, optimizer, _ = new_run(AdamW8bit, release)
        extra = nn.Parameter(torch.ones(3, 5))
        optimizer.add_param_group({"params": [extra], "lr": 0.1})
        for step in range(2):
            (loss_of(model, step) + extra.square().sum()).backward()
            optimizer.step()
            optimizer.zero_grad()
        runs.append((model, optimizer))
    assert_same_training(*runs)
    assert float(runs[1][1].state[runs[1][1].param_groups[2]["params"][0]]["step"]) == 2


def test_zero_grad_without_set_to_none_and_closure_loops():
    runs = []
    for release in (False, True):
        model, optimizer, _ = new_run(AdamW4bit, release)
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=False)

            def closure(model=model, step=step):
                loss = loss_of(model, step)
                loss.backward()
                return loss

            optimizer.step(closure)
        runs.append((model, optimizer))
    assert_same_training(*runs)


def test_remove_restores_ordinary_stepping():
    ordinary = new_run(AdamW4bit, False)[:2]
    train(*ordinary, steps=4)
    model, optimizer, handle = new_run(AdamW4bit, True)
    train(model, optimizer, steps=2)
    loss_of(model, 2).backward()  # released: the third step
    handle.remove()
    assert all(param.grad is None for param in model.parameters())  # placeholders dropped
    train(model, optimizer, steps=1, first=3)  # ordinary
    assert all(type(param.grad) is not ReleasedGradient for param in model.parameters())
    assert_same_training(ordinary, (model, optimizer))
    with release_gradients(optimizer):  # and it can be turned on again
        loss_of(model, 4).backward()
    assert optimizer._gradient_release is None


def test_clip_grad_norm_after_backward_is_told():
    model, optimizer, _ = new_run(AdamW8bit, True)
    loss_of(model, 0).backward()
    with pytest.raises(RuntimeError, match="released gradient.*clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def test_grad_scaler_is_told():
    model, optimizer, _ = new_run(AdamW8bit, True)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_of(model, 0)).backward()
    with pytest.raises(RuntimeError, match="released gradient.*GradScaler"):
        scaler.step(optimizer)


def test_gradient_accumulation_is_told_before_anything_changes():
    model, optimizer, _ = new_run(AdamW8bit, True)
    loss_of(model, 0).backward()
    params = [param.detach().clone() for param in model.parameters()]
    state = {key: value.clone() for key, value in optimizer.state[model[3].weight].items()}
    with pytest.raises(RuntimeError, match="gradient accumulation"):
        loss_of(model, 1).backward()
    assert all(map(torch.equal, params, model.parameters()))
    assert all(torch.equal(value, optimizer.state[model[3].weight][key]) for key, value in state.items())


def test_refusals():
    model = make_model()
    with pytest.raises(TypeError, match="AdamW"):
        release_gradients(torch.optim.AdamW(model.parameters()))
    optimizer = AdamW8bit(model.parameters())
    release_gradients(optimizer)
    with pytest.raises(RuntimeError, match="already active"):
        release_gradients(optimizer)
    offload = CPUOffloadOptimizer(make_model().parameters(), torch.optim.AdamW)
    with pytest.raises(TypeError, match="host optimizer"):
        release_gradients(offload)


@pytest.mark.parametrize("offload_gradients", [False, True], ids=["device_gradients", "offload_gradients"])
def test_offload_released_matches_offload_ordinary(offload_gradients):
    runs = []
    for release in (False, True):
        model = make_model()
        optimizer = CPUOffloadOptimizer(param_groups(model), AdamW4bit, offload_gradients=offload_gradients,
                                        **OPTIONS)
        if release:
            release_gradients(optimizer)
        train(model, optimizer)
        runs.append((model, optimizer))
    assert_same_training(*runs)
    model, optimizer = runs[1]
    loss_of(model, STEPS).backward()
    with pytest.raises(RuntimeError, match="released gradient"):
        optimizer.clip_grad_norm_(1.0)


def test_peak_memory_of_a_step_drops_by_the_gradients():
    """Eight equal layers: ordinary stepping holds all eight gradients at the step, release
    at most the one being stepped, so the peak drops by the gradients' size less one of them
    (one gradient must exist for its parameter to be stepped) and less what backward itself
    holds when the first hooks run (measured: 28 KiB, under one batch-sized buffer per
    layer). The step's own temporaries are the same either way: one parameter's."""
    inputs = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    peaks = []
    for release in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(8)])
        optimizer = AdamW4bit(model.parameters(), backend="eager")
        if release:
            release_gradients(optimizer)

        def training_step(model=model, optimizer=optimizer):
            model(inputs).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        training_step()  # states created
        peaks.append(allocation_peak_bytes(training_step))
    gradient_bytes = [param.numel() * param.element_size() for param in model.parameters()]
    backward_buffers = len(model) * inputs.numel() * inputs.element_size()
    assert peaks[0] - peaks[1] >= sum(gradient_bytes) - max(gradient_bytes) - backward_buffers, peaks


def test_public_name():
    assert lowbit_optim.release_gradients is release_gradients


def test_small_parameters_are_stepped_together_at_the_end_of_backward(monkeypatch):
    """Norms and biases (float moments) would cost ~40 operations each one by one; their
    gradients are small, so they wait for the end of backward and take one flat step per
    group, as in ``step()``. Quantized parameters step in their own hook."""
    model = nn.Sequential(*[nn.LayerNorm(64) for _ in range(20)], nn.Linear(64, 80))
    optimizer = AdamW8bit(model.parameters(), min_quant_size=1024, backend="eager")
    release_gradients(optimizer)
    flat_steps, flat_step = [], float_state.FloatStateStep.step

    def counted(self, grads, update, **options):
        flat_steps.append(len(grads))
        return flat_step(self, grads, update, **options)

    monkeypatch.setattr(float_state.FloatStateStep, "step", counted)
    for _ in range(2):
        model(torch.randn(4, 64)).square().mean().backward()
        assert all(is_released(param.grad) for param in model.parameters())
        optimizer.step()
    # 40 norm parameters and the Linear's bias: one flat step per backward.
    assert flat_steps == [41, 41]


def test_hooks_go_with_the_optimizer():
    import gc

    model, optimizer, handle = new_run(AdamW8bit, True)
    del optimizer, handle
    gc.collect()
    loss_of(model, 0).backward()  # no optimizer: ordinary gradients, nothing stepped
    assert all(type(param.grad) is torch.Tensor for param in model[0].parameters())
    assert all(not param._post_accumulate_grad_hooks for param in model.parameters())
