"""Helpers shared by several test modules (test modules never import each other)."""

import socket

import torch
from torch.optim import lr_scheduler

from lowbit_optim import AdamWFactored4bit, FactoredState, QuantizedState
from lowbit_optim.step import factored, quantized

# The regression problem's length: the bounds against torch.optim.AdamW and Adam in
# tests/test_optimizer.py and tests/test_adam.py were measured at it.
STEPS = 20


def regression_problem(rows=64, cols=128, seed=0):
    """A least-squares problem (convex: quantization noise does not get amplified by chaos)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(256, cols, generator=generator)
    targets = inputs @ torch.randn(cols, rows, generator=generator) * 0.1
    weight = torch.randn(rows, cols, generator=generator) * 0.05
    return inputs, targets, weight


def train(optimizer_factory, steps, *, weight_decay=0.1, lr=1e-2, backend_kwargs=None):
    inputs, targets, initial = regression_problem()
    weight = torch.nn.Parameter(initial.clone())
    bias = torch.nn.Parameter(torch.zeros(initial.shape[0]))
    optimizer = optimizer_factory([weight, bias], lr=lr, weight_decay=weight_decay, **(backend_kwargs or {}))
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(inputs @ weight.T + bias, targets)
        loss.backward()
        optimizer.step()
    return initial, weight.detach(), bias.detach(), optimizer


def assert_same_state(actual: dict, expected: dict) -> None:
    """Two optimizer state dicts hold bit-identical state and equal hyperparameters."""
    assert actual["state"].keys() == expected["state"].keys()
    for saved_id, entry in expected["state"].items():
        other = actual["state"][saved_id]
        assert other.keys() == entry.keys(), f"parameter {saved_id}"
        for key, value in entry.items():
            where = f"parameter {saved_id} {key}"
            if isinstance(value, FactoredState):
                assert isinstance(other[key], FactoredState), where
                assert (other[key].shape, other[key].dtype) == (value.shape, value.dtype), where
                assert torch.equal(other[key].row, value.row), where
                assert torch.equal(other[key].col, value.col), where
            elif isinstance(value, QuantizedState):
                assert isinstance(other[key], QuantizedState), where
                assert (other[key].format_name, other[key].shape, other[key].dtype) == (
                    value.format_name, value.shape, value.dtype), where
                assert torch.equal(other[key].codes, value.codes), where
                assert torch.equal(other[key].scales, value.scales), where
            else:
                assert other[key].dtype == value.dtype, where
                assert torch.equal(other[key], value), where
    assert len(actual["param_groups"]) == len(expected["param_groups"])
    for group, other in zip(expected["param_groups"], actual["param_groups"]):
        assert {k: float(v) if k == "lr" else v for k, v in group.items()} == {
            k: float(v) if k == "lr" else v for k, v in other.items()}


# Steps of tests/test_schedules.py's runs: the schedules below reach their ends within it.
SCHEDULE_STEPS = 30

# One of each torch LR scheduler kind, built on an optimizer.
SCHEDULES = {
    "LinearLR": lambda opt: lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=SCHEDULE_STEPS),
    "CosineAnnealingLR": lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=SCHEDULE_STEPS),
    "CosineAnnealingWarmRestarts": lambda opt: lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=7),
    "OneCycleLR": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=SCHEDULE_STEPS + 1),
    "LambdaLR": lambda opt: lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step)),
    "SequentialLR": lambda opt: lr_scheduler.SequentialLR(
        opt,
        [lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=5),
         lr_scheduler.ExponentialLR(opt, gamma=0.9)],
        milestones=[5]),
    "StepLR": lambda opt: lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
    "ReduceLROnPlateau": lambda opt: lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.7),
}


def graph_count(optimizer):
    """Graphs of the optimizer's compiled steps (the factored class has two more functions:
    its statistics and its update)."""
    count = quantized.compiled_graph_count(optimizer.exp_avg_format, optimizer.exp_avg_sq_format)
    if isinstance(optimizer, AdamWFactored4bit):
        count += factored.compiled_graph_count(optimizer.exp_avg_format)
    return count


def free_port() -> int:
    """A TCP port free on this machine now, for a spawned process group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
