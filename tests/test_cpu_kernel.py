"""The C++ CPU step (``lowbit_optim.cpu_kernel``) against the eager reference step.

The kernel performs the reference's float32 operations in the reference's order
(docs/cpu_kernel.md), so codes, scales and parameters are compared for exact equality, on
every instruction-set path the CPU has (forced one by one) and at 1 and 3 threads. The
moments entering each step come from a few reference steps on varied gradients, so that
every code of every map is exercised, not only the fresh all-zero state.

One operation differs on purpose: torch's eager CPU ``sqrt`` of float32 is not correctly
rounded (about 0.6% of inputs come out one ulp off; measured against numpy on 1e7 uniform
values), while Inductor's generated code and the kernel use the IEEE instruction. The eager
reference here therefore runs with a correctly rounded sqrt (``ieee_sqrt``), under which
parameters are equal bit for bit; against the compiled step, which needs no such patch, they
are equal too (``test_matches_compiled_step``). Codes never depend on the sqrt.
"""

import pytest
import torch

from lowbit_optim import cpu_kernel
from lowbit_optim.backends import TailScratch, run_quantized_step
from lowbit_optim.backends import ParamStep
from lowbit_optim.functional import StepScalars
from lowbit_optim.quant import formats
from lowbit_optim.state import QuantizedState

FORMAT_PAIRS = {
    "8bit": (formats.DYNAMIC_8BIT_SIGNED, formats.DYNAMIC_8BIT_UNSIGNED_NONZERO),
    "4bit": (formats.DYNAMIC_4BIT_SIGNED, formats.LINEAR_4BIT_NONZERO),
    "fp8": (formats.FLOAT8, formats.FLOAT8_NONZERO),
}
SHAPES = [(1,), (127,), (4097,), (123, 123)]


@pytest.fixture
def ieee_sqrt(monkeypatch):
    """Eager steps with a correctly rounded float32 sqrt (the float64 root of a float32
    value, rounded once to float32, is the correctly rounded float32 root)."""
    eager_sqrt = torch.Tensor.sqrt
    monkeypatch.setattr(torch.Tensor, "sqrt", lambda self: eager_sqrt(self.double()).to(self.dtype))


@pytest.fixture(scope="session")
def kernel():
    if not cpu_kernel.load():
        pytest.skip("the C++ CPU step could not be built here")
    return cpu_kernel


def available_isas():
    capability = torch.backends.cpu.get_cpu_capability()
    isas = ["scalar"]
    if "AVX2" in capability or "AVX512" in capability:
        isas.append("avx2")
    if "AVX512" in capability:
        isas.append("avx512")
    return isas


def make_scalars(*, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, step=1):
    as64 = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    return StepScalars(as64(lr), as64(betas[0]), as64(betas[1]), as64(eps), as64(weight_decay),
                       torch.tensor(float(step)))


def gradient(shape, dtype, generator):
    """Gradients spanning many magnitudes within a block (every decade of the 8-bit map)."""
    magnitude = 10 ** (torch.rand(shape, generator=generator) * 8 - 6)
    sign = torch.where(torch.rand(shape, generator=generator) < 0.5, -1.0, 1.0)
    return (magnitude * sign).to(dtype)


class Setup:
    """A parameter with states warmed by reference steps, and a copy of both to step again."""

    def __init__(self, pair, shape, dtype, *, amsgrad, block_size=None, seed=0):
        self.fmts = FORMAT_PAIRS[pair]
        generator = torch.Generator().manual_seed(seed)
        block_size = block_size or self.fmts[0].default_block_size
        self.param = torch.randn(shape, generator=generator).to(dtype)
        self.states = [QuantizedState.zeros(shape, fmt, block_size, dtype=dtype)
                       for fmt in (self.fmts[0], self.fmts[1], self.fmts[1])[:3 if amsgrad else 2]]
        self.generator = generator
        self.dtype = dtype
        for step in range(1, 4):
            self.reference_step(self.param, self.states, gradient(shape, dtype, generator), make_scalars(step=step))
        self.step = 4

    def entry(self, param, grad, states):
        return ParamStep(param, grad, states[0], states[1], states[2] if len(states) == 3 else None, None)

    def reference_step(self, param, states, grad, scalars, **flags):
        flags = {"maximize": False, "stochastic_round": False, "decoupled_weight_decay": True, **flags}
        run_quantized_step("eager", self.entry(param, grad, states), scalars, TailScratch(), **flags)

    def copies(self):
        return self.param.clone(), [s.clone() for s in self.states]


def assert_same_state(states, expected_states):
    for state, expected in zip(states, expected_states):
        torch.testing.assert_close(state.scales, expected.scales, rtol=0, atol=0)
        mismatched = (state.codes != expected.codes).nonzero()
        assert mismatched.numel() == 0, f"{len(mismatched)} codes differ, first at {mismatched[:5].tolist()}"


def run_both(setup, grad, scalars, isa, **flags):
    """Kernel and reference from the same inputs; returns (kernel, reference) params and states."""
    ref_param, ref_states = setup.copies()
    setup.reference_step(ref_param, ref_states, grad, scalars, **flags)
    param, states = setup.copies()
    entry = setup.entry(param, grad, states)
    full = {"maximize": False, "stochastic_round": False, "decoupled_weight_decay": True, **flags}
    cpu_kernel.cpu_adamw_step(param, grad, entry.exp_avg, entry.exp_avg_sq, entry.max_exp_avg_sq, scalars,
                              isa=isa, **full)
    return (param, states), (ref_param, ref_states)


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("pair", FORMAT_PAIRS)
def test_matches_reference_every_format_and_shape(kernel, ieee_sqrt, pair, shape, isa):
    setup = Setup(pair, shape, torch.float32, amsgrad=False)
    grad = gradient(shape, torch.float32, setup.generator)
    (param, states), (ref_param, ref_states) = run_both(setup, grad, make_scalars(step=setup.step), isa)
    assert_same_state(states, ref_states)
    torch.testing.assert_close(param, ref_param, rtol=0, atol=0)


FLAG_COMBOS = {
    "amsgrad": dict(amsgrad=True),
    "maximize": dict(maximize=True),
    "l2_weight_decay": dict(decoupled_weight_decay=False),
    "all": dict(amsgrad=True, maximize=True, decoupled_weight_decay=False),
}


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("combo", FLAG_COMBOS)
@pytest.mark.parametrize("pair", FORMAT_PAIRS)
def test_matches_reference_every_dtype_and_flag(kernel, ieee_sqrt, pair, combo, dtype, isa):
    flags = dict(FLAG_COMBOS[combo])
    setup = Setup(pair, (4097,), dtype, amsgrad=flags.pop("amsgrad", False))
    grad = gradient((4097,), dtype, setup.generator)
    (param, states), (ref_param, ref_states) = run_both(setup, grad, make_scalars(step=setup.step), isa, **flags)
    assert_same_state(states, ref_states)
    torch.testing.assert_close(param, ref_param, rtol=0, atol=0)
