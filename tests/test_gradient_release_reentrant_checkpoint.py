"""Gradient release with reentrant activation checkpointing
(``torch.utils.checkpoint(..., use_reentrant=True)``): each segment runs a backward of its
own, so a parameter used in several segments gets its gradient in parts, each firing the
post-accumulate-grad hook. Release holds the gradients of such a backward until its end and
steps them then, which gives ordinary stepping's parameters and state bit for bit."""

import warnings

import pytest
import torch
from helpers import assert_same_state
from torch import nn
from torch.utils.checkpoint import checkpoint

from lowbit_optim import AdamW4bit, AdamW8bit, release_gradients
from lowbit_optim.optim.released_gradient import is_released

OPTIONS = dict(lr=1e-2, weight_decay=1e-2, min_quant_size=1024)
STEPS = 3


class SharedLayerNet(nn.Module):
    """ALBERT's pattern: one layer (a quantized weight, a float-state norm) applied in two
    reentrant segments, between an input layer and a head that are used once, outside them.
    With ``everything_inside``, the input layer and the head run inside the segments too, so
    no hook fires in the outer backward."""

    def __init__(self, everything_inside: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(16, 64)
        self.shared = nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 3)
        self.everything_inside = everything_inside

    def block(self, hidden):
        return self.norm(torch.tanh(self.shared(hidden)))

    def forward(self, inputs, use_reentrant: bool = True):
        if self.everything_inside:
            hidden = checkpoint(lambda x: self.block(self.embed(x)), inputs, use_reentrant=use_reentrant)
            return checkpoint(lambda h: self.head(self.block(h)), hidden, use_reentrant=use_reentrant)
        hidden = self.embed(inputs)
        for _ in range(2):
            hidden = checkpoint(self.block, hidden, use_reentrant=use_reentrant)
        return self.head(hidden)


def loss_of(model, step: int, use_reentrant: bool = True) -> torch.Tensor:
    # A reentrant segment passes gradients only to inputs that require them.
    inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).requires_grad_()
    return model(inputs, use_reentrant).square().mean()


def train(model, optimizer, steps: int = STEPS) -> None:
    for step in range(steps):
        loss_of(model, step).backward()
        optimizer.step()
        optimizer.zero_grad()


def assert_same_training(expected, actual) -> None:
    (model_a, optimizer_a), (model_b, optimizer_b) = expected, actual
    for (name, a), (_, b) in zip(model_a.state_dict().items(), model_b.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert_same_state(optimizer_b.state_dict(), optimizer_a.state_dict())


def runs(cls, backend, everything_inside=False):
    ordinary = SharedLayerNet(everything_inside)
    ordinary_optimizer = cls(ordinary.parameters(), backend=backend, **OPTIONS)
    released = SharedLayerNet(everything_inside)
    released_optimizer = cls(released.parameters(), backend=backend, **OPTIONS)
    release_gradients(released_optimizer)
    return (ordinary, ordinary_optimizer), (released, released_optimizer)


@pytest.mark.parametrize("backend", ["cpu", "compile", "eager"])
@pytest.mark.parametrize("cls", [AdamW8bit, AdamW4bit], ids=lambda c: c.__name__)
def test_shared_layer_in_two_reentrant_segments_steps_like_ordinary_training(cls, backend):
    ordinary, released = runs(cls, backend)
    train(*ordinary)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(*released)
    assert_same_training(ordinary, released)
    told = [w for w in caught if "use_reentrant=False" in str(w.message)]
    assert len(told) == 1  # once per release, not per backward
    assert all(float(state["step"]) == STEPS for state in released[1].state.values())


def test_reentrant_backward_frees_every_gradient_at_its_end():
    (_, _), (model, optimizer) = runs(AdamW8bit, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss_of(model, 0).backward()
    assert all(is_released(param.grad) for param in model.parameters())
    before = [param.detach().clone() for param in model.parameters()]
    optimizer.step()  # steps nothing: backward did
    assert all(map(torch.equal, before, model.parameters()))


@pytest.mark.parametrize("backend", ["cpu", "compile"])
def test_every_parameter_inside_reentrant_segments_is_stepped_by_step(backend):
    """No hook fires in the outer backward, so nothing marks its end: the held gradients wait
    for ``optimizer.step()``."""
    ordinary, released = runs(AdamW8bit, backend, everything_inside=True)
    train(*ordinary)
    model, optimizer = released
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss_of(model, 0).backward()
        assert not any(is_released(param.grad) for param in model.parameters())
        assert not optimizer.state  # nothing stepped with a part of a gradient
        optimizer.step()
        optimizer.zero_grad()
        for step in range(1, STEPS):
            loss_of(model, step).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert_same_training(ordinary, released)


class InsideAndOutside(nn.Module):
    """One weight used inside a reentrant segment and outside it, before or after it."""

    def __init__(self, outside_after: bool):
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(64, 64) / 8)
        self.other = nn.Linear(64, 64)
        self.outside_after = outside_after

    def forward(self, inputs):
        segment = lambda x: torch.tanh(self.other(x @ self.weight))  # noqa: E731
        if self.outside_after:
            return checkpoint(segment, inputs, use_reentrant=True) @ self.weight
        return checkpoint(segment, inputs @ self.weight, use_reentrant=True)


def test_weight_used_outside_before_a_reentrant_segment_steps_like_ordinary_training():
    trained = []
    for release in (False, True):
        model = InsideAndOutside(outside_after=False)
        optimizer = AdamW8bit(model.parameters(), backend="cpu", **OPTIONS)
        if release:
            release_gradients(optimizer)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in range(STEPS):
                inputs = torch.randn(8, 64, generator=torch.Generator().manual_seed(step)).requires_grad_()
                model(inputs).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
        trained.append((model, optimizer))
    assert_same_training(*trained)


def test_weight_used_outside_after_a_reentrant_segment_is_told_the_cause_and_the_fix():
    """The outside use's gradient is complete (autograd accumulates leaves first) before the
    segment's backward starts, and nothing in the graph says that the segment will add to
    it: the part is stepped, and the segment's part is refused, naming the cause."""
    model = InsideAndOutside(outside_after=True)
    optimizer = AdamW8bit(model.parameters(), backend="cpu", **OPTIONS)
    release_gradients(optimizer)
    inputs = torch.randn(8, 64, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"(?s)reentrant.*use_reentrant=False"):
        model(inputs).square().mean().backward()
