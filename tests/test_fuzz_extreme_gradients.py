"""Extreme gradients for every optimizer class and backend, fuzzed with Hypothesis (seeded).

Each example builds one of our optimizers and ``torch.optim.AdamW`` (``torch.optim.Adam`` for
the Adam classes) with the same hyperparameters over the same starting values, feeds both the
same gradients for a few steps and checks after every step:

(a) wherever torch's parameter element is finite, ours is too;
(b) no element of ours moves by more than ``lr / (1 - beta1**t) * adam_ratio_bound(t) *
    SLACK`` plus, for AdamW, ``lr * weight_decay * |p|`` (the decoupled decay), plus one
    rounding of the parameter dtype (``eps * |p|``, ``p`` the larger of old and new).

``adam_ratio_bound`` is Adam's own bound on ``|exp_avg / denom|`` (Cauchy-Schwarz; exact Adam
meets it at step 1, where every update is ``lr * sign(g)``). SLACK is the same for every
format, ``1 + 2**-16``: quantized and factored moments have the ratio clamped at the bound
(``functional.parameter_update``), and float moments are exact Adam; what is left is the
float32 rounding of the bound, the ratio and the step size (a few ulps, far below 2**-16).
(An unclamped quantized second moment broke this by 1e35 times for a 3e38 spike, and the
factored statistics' float32 sums made whole rows NaN for 1e25.)

Gradients: magnitudes from the smallest subnormal (1e-45) to 3e38, as single spikes, whole
tensors, noise, runs of zero gradients, sign flips of the last gradient, and NaN/±inf mixed
in; parameters float32, bfloat16, float16 and float64 (eager), shapes of 1 element, odd
sizes (37, 4097) and 2-D with one row or one column. Each optimizer has a quantized group
(``min_quant_size=0``, block size 16) and a float-state group of the same shape and
gradients. Cost: the compiled backend takes float32 parameters at the class's default block
size only, the graphs tests/test_optimizer.py and tests/test_adam.py compile (the block size
and the dtype are static in the compiled step: another of either is another graph, ~10 s
each on 2 cores with a cold cache), over one shape list; Triton (under the interpreter, slow
per launch) takes float32 and tiny shapes; each backend takes fewer examples than eager.
"""

import pytest
import torch
from torch import nn

hypothesis = pytest.importorskip("hypothesis")
pytest.importorskip("triton")
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lowbit_optim import (  # noqa: E402
    Adam4bit,
    Adam8bit,
    AdamFp8,
    AdamW4bit,
    AdamW8bit,
    AdamWFactored4bit,
    AdamWFp8,
)
from lowbit_optim.step.math import adam_ratio_bound  # noqa: E402

# NaN gradients, and squares that overflow float32, flow into the interpreter's numpy
# arithmetic before the kernel's selects and clamps.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")]

CLASSES = [AdamW8bit, AdamW4bit, AdamWFp8, AdamWFactored4bit, Adam8bit, Adam4bit, AdamFp8]
SLACK = 1 + 2.0**-16
MAGNITUDES = [1e-45, 1e-38, 1e-20, 1e-3, 1.0, 1e10, 1e19, 1e25, 1e30, 3e38]
KINDS = ["noise", "spike", "whole", "zeros", "flip", "non-finite"]
SHAPES = {
    "all": [(1,), (37,), (4097,), (1, 40), (40, 1), (16, 24)],  # (16, 24) is factored
    # One element; several blocks of every default block size and a partial last one;
    # factored.
    "compile": [(1,), (4097,), (16, 24)],
    "tiny": [(1,), (37,), (1, 40), (40, 1), (16, 16)],  # (16, 16): the smallest factored square
}
# Block size 16 puts several blocks into the smallest shapes; the compiled step takes the
# default, shared with the rest of the suite (see the module docstring).
BLOCK_SIZES = {"eager": {"block_size": 16}, "triton": {"block_size": 16}, "compile": {}}
STEP = st.tuples(st.sampled_from(KINDS), st.sampled_from(MAGNITUDES), st.booleans(),
                 st.integers(0, 2**31 - 1))


def largest_update(lr: float, betas, count: torch.Tensor) -> torch.Tensor:
    """``lr / (1 - beta1**t) * adam_ratio_bound(t) * SLACK`` at the parameter's step count."""
    beta1, beta2 = (torch.tensor(beta, dtype=torch.float64) for beta in betas)
    count = count.double()
    return lr / (1 - beta1**count) * adam_ratio_bound(beta1, beta2, count) * SLACK


def gradient(kind: str, magnitude: float, negative: bool, seed: int, shape, dtype, previous):
    """One step's gradient (float64 values, cast to ``dtype`` as autograd would give it)."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(shape, generator=generator, dtype=torch.float64)
    sign = -1.0 if negative else 1.0
    if kind == "noise":
        values = noise * magnitude
    elif kind == "spike":
        values = noise.clone()
        values.view(-1)[seed % noise.numel()] = sign * magnitude
    elif kind == "whole":
        values = torch.full(shape, sign * magnitude, dtype=torch.float64)
    elif kind == "zeros":
        values = torch.zeros(shape, dtype=torch.float64)
    elif kind == "flip":
        values = -previous.double() if previous is not None else noise * magnitude
    else:
        values = noise * magnitude
        bad = torch.rand(shape, generator=generator) < 0.3
        picks = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=torch.float64)
        values[bad] = picks[torch.randint(0, 3, (int(bad.sum()),), generator=generator)]
    return values.to(dtype)


def check_steps(cls, backend: str, shape, dtype, lr: float, steps) -> None:
    """Invariants (a) and (b) of the module docstring after every step."""
    weight_decay = 0.01
    betas = (0.9, 0.999)
    start = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(dtype)
    quantized, small = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    ours = cls([{"params": [quantized], "min_quant_size": 0}, {"params": [small], "min_quant_size": 10**9}],
               lr=lr, betas=betas, weight_decay=weight_decay, backend=backend, **BLOCK_SIZES[backend])
    reference_class = torch.optim.AdamW if ours.decoupled_weight_decay else torch.optim.Adam
    theirs = [nn.Parameter(start.clone()) for _ in range(2)]
    reference = reference_class(theirs, lr=lr, betas=betas, weight_decay=weight_decay)
    mine = [quantized, small]
    previous = None
    for index, step in enumerate(steps):
        for _ in range(10 if step[0] == "zeros" else 1):  # zeros: a run of them
            grad = previous = gradient(*step, shape, dtype, previous)
            old = [p.detach().double().clone() for p in mine]
            for param in mine + theirs:
                param.grad = grad.clone()
            ours.step()
            reference.step()
            for which, (param, before, their) in enumerate(zip(mine, old, theirs)):
                where = f"step {index} {step[:3]}, {'quantized' if which == 0 else 'float-state'} group"
                kept = torch.isfinite(their.detach())
                assert torch.isfinite(param.detach())[kept].all(), f"{where}: torch finite, ours not"
                allowed = largest_update(lr, betas, ours.state[param]["step"])
                if ours.decoupled_weight_decay:
                    allowed = allowed + lr * weight_decay * before.abs()
                after = param.detach().double()
                allowed = allowed + torch.finfo(dtype).eps * torch.maximum(before.abs(), after.abs())
                moved = (after - before).abs()
                both = torch.isfinite(moved)
                excess = (moved - allowed)[both]
                assert not (excess > 0).any(), (
                    f"{where}: moved {float(moved[both].max()):.6g}, allowed "
                    f"{float(torch.as_tensor(allowed).max()):.6g}"
                )


def fuzz(backend: str, shapes: str, dtypes, max_examples: int):
    """A Hypothesis test of ``check_steps`` for every class on ``backend``."""

    @pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None)
    # The worst cases found (each broke every class before the fixes): a gradient whose
    # square overflows float32, then a subnormal one (the stored second moment stood for
    # ~1e-38 of the element's own: it moved by 1e29); and one on a factored weight.
    @example(shape=(1,), dtype=torch.float32, lr=1e-3,
             steps=[("noise", 1e25, False, 0), ("noise", 1e-45, False, 0)])
    @example(shape=(16, 24), dtype=torch.float32, lr=0.1,
             steps=[("noise", 1e25, False, 0), ("spike", 3e38, True, 5), ("flip", 1.0, False, 1)])
    @given(shape=st.sampled_from(SHAPES[shapes]), dtype=st.sampled_from(dtypes),
           lr=st.sampled_from([1e-3, 0.1]), steps=st.lists(STEP, min_size=1, max_size=4))
    def test(cls, shape, dtype, lr, steps):
        check_steps(cls, backend, shape, dtype, lr, steps)

    return test


ALL_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# Examples per class, besides the two worst cases: eager is cheap per example and covers every
# dtype and shape; the compiled step and the interpreter cost ~10x more per example.
# All in the slow tier: the fast tier keeps the worst cases as the plain tests below.
test_extreme_gradients_eager = pytest.mark.slow(fuzz("eager", "all", ALL_DTYPES, max_examples=12))
test_extreme_gradients_compile = pytest.mark.slow(fuzz("compile", "compile", [torch.float32], max_examples=3))
test_extreme_gradients_triton = pytest.mark.slow(pytest.mark.usefixtures("interpreter")(
    fuzz("triton", "tiny", [torch.float32], max_examples=3)))


# --- the patterns users met, as plain tests -----------------------------------------------
@pytest.mark.sweep
@pytest.mark.parametrize("gradient_kind", ["one-element-1e25", "all-1e30"])
@pytest.mark.parametrize("backend", ["eager", "compile"])
def test_a_1e25_gradient_keeps_the_factored_weight_finite(backend, gradient_kind, compile_counter):
    """A huge but finite gradient (1e25 at one element, or 1e30 everywhere): each term
    ``(1 - beta2) * g**2`` overflows float32, and the row/column statistics became inf, row 3
    and column 5 (or the whole weight) NaN. torch's AdamW stays finite; so must we: the
    statistics saturate, the weight stays finite, and no element moves beyond Adam's bound.
    The compiled step gets no new graph from such values."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(64, 128))
    optimizer = AdamWFactored4bit([weight], backend=backend)
    assert optimizer.is_factored(weight, optimizer.param_groups[0], "exp_avg_sq")
    weight.grad = torch.randn_like(weight)
    optimizer.step()
    grad = torch.randn_like(weight)
    if gradient_kind == "one-element-1e25":
        grad[3, 5] = 1e25
    else:
        grad.fill_(1e30)
    with compile_counter() as counter:
        for step in range(3):
            before = weight.detach().clone()
            weight.grad = grad if step == 0 else torch.randn_like(weight)
            optimizer.step()
            assert torch.isfinite(weight).all(), f"step {step}: {(~torch.isfinite(weight)).sum()} non-finite"
            moved = (weight.detach() - before * (1 - 1e-3 * 1e-2)).abs().max()
            assert moved <= largest_update(1e-3, (0.9, 0.999), optimizer.state[weight]["step"]) + 1e-6
    statistics = optimizer.state[weight]["exp_avg_sq"]
    assert torch.isfinite(statistics.row).all() and torch.isfinite(statistics.col).all()
    assert counter.graphs == 0


@pytest.mark.sweep
@pytest.mark.parametrize("group", ["quantized", "float-state"])
@pytest.mark.parametrize("backend", ["eager", "compile", "triton"])
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_gradient_whose_square_overflows_float32_keeps_the_weight_finite(cls, backend, group, request):
    """One finite element of 3e38 at step 2: its ``(1 - beta2) * g**2`` is inf. torch's AdamW
    keeps the weight finite (``exp_avg_sq`` inf, update 0); ours moved that element by ~1e35
    (the stored second moment is its block's largest finite value) and further steps made it
    inf. Now every element stays finite and within Adam's bound per step, and the others
    follow torch as closely as on any step."""
    if backend == "triton":
        request.getfixturevalue("interpreter")
    torch.manual_seed(0)
    start = torch.randn(16, 24)
    ours, theirs = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    optimizer = cls([ours], min_quant_size=0 if group == "quantized" else 10**9, backend=backend,
                    **BLOCK_SIZES[backend])
    reference_class = torch.optim.AdamW if optimizer.decoupled_weight_decay else torch.optim.Adam
    reference = reference_class([theirs], weight_decay=optimizer.defaults["weight_decay"])
    for step in range(4):
        grad = torch.randn(16, 24)
        if step == 1:
            grad[3, 5] = 3e38
        before = ours.detach().clone()
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        optimizer.step()
        reference.step()
        assert torch.isfinite(theirs).all()
        assert torch.isfinite(ours).all(), f"step {step}: element [3, 5] = {float(ours[3, 5])}"
        if optimizer.decoupled_weight_decay:
            before = before * (1 - 1e-3 * optimizer.defaults["weight_decay"])
        limit = largest_update(1e-3, (0.9, 0.999), optimizer.state[ours]["step"])
        assert (ours.detach() - before).abs().max() <= limit + 1e-6
