"""The C++ CPU step with master weights: a bfloat16 or float16 parameter and its int8 (24-bit)
or int16 (32-bit) correction read as the float32 master weight, updated and split again in
the kernel (bfloat16's bit split, float16's scaled residual: lowbit_optim.step.master_weights).

Exact comparisons, as in tests/test_cpu_kernel.py: parameters (their bits), corrections,
codes and scales against the compiled step, and against the eager step with a correctly
rounded sqrt (the ``ieee_sqrt`` fixture's reason is in that file), on every instruction-set
path the CPU has and at 1 and 3 threads. The corrections entering each compared step come
from a few eager steps with master weights, so they are not the fresh all-zero ones.
"""

import pytest
import torch
from conftest import num_threads
from helpers import (
    FORMAT_PAIRS,
    KernelSetup,
    assert_same_quantized,
    available_isas,
    cpu_adamw_step,
    make_scalars,
    run_quantized_step,
    spread_gradient,
)

from lowbit_optim import AdamW4bit, AdamW8bit, AdamWFp8
from lowbit_optim.step import cpu_kernel
from lowbit_optim.step.chunks import TailScratch
from lowbit_optim.step.master_weights import correction_dtype, write_master, zeros_correction

SHAPES = [(1,), (4097,), (123, 123)]  # one element, a partial last block, a 2-D parameter
DTYPES = [torch.bfloat16, torch.float16]
FLAGS = {"plain": {}, "all": dict(amsgrad=True, maximize=True, decoupled_weight_decay=False)}


@pytest.fixture(scope="module")
def kernel():
    if not cpu_kernel.load():
        pytest.skip("the C++ CPU step could not be built here")
    return cpu_kernel


@pytest.fixture
def ieee_sqrt(monkeypatch):
    eager_sqrt = torch.Tensor.sqrt
    monkeypatch.setattr(torch.Tensor, "sqrt", lambda self: eager_sqrt(self.double()).to(self.dtype))


class MasterSetup(KernelSetup):
    """``KernelSetup`` for a bfloat16 or float16 parameter with a master weight correction,
    warmed by eager steps of the master weight (so the correction holds real remainders)."""

    def __init__(self, pair, shape, bits, *, dtype, amsgrad, seed=0):
        self.correction = None
        self.bits = bits
        super().__init__(pair, shape, dtype, amsgrad=amsgrad, seed=seed)

    def entry(self, param, grad, states, correction=None):
        if correction is None:
            if self.correction is None:
                self.correction = zeros_correction(param, self.bits)
            correction = self.correction
        return super().entry(param, grad, states)._replace(weight_correction=correction)

    def reference_step(self, param, states, grad, scalars, *, correction=None, backend="eager", **flags):
        flags = {"maximize": False, "stochastic_round": False, "decoupled_weight_decay": True, **flags}
        entry = self.entry(param, grad, states, correction)
        run_quantized_step(backend, entry, scalars, TailScratch(), **flags)

    def copies(self):
        param, states = super().copies()
        return param, states, self.correction.clone()


def kernel_step(setup, grad, scalars, isa, **flags):
    param, states, correction = setup.copies()
    full = {"maximize": False, "stochastic_round": False, "decoupled_weight_decay": True, **flags}
    cpu_adamw_step(param, grad, states[0], states[1], states[2] if len(states) == 3 else None,
                              scalars, isa=isa, weight_correction=correction, **full)
    return param, states, correction


def reference(setup, grad, scalars, backend, **flags):
    param, states, correction = setup.copies()
    # The whole suite compiles more variants of a state kind's step (dtypes, flags, correction
    # dtypes) than Dynamo's default recompile_limit of 8; past it Dynamo would silently run
    # this step eagerly, with torch's eager sqrt (see tests/test_cpu_kernel.py). Raised here,
    # and a hit made an error, so that the reference is always the compiled step.
    with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
        setup.reference_step(param, states, grad, scalars, correction=correction, backend=backend, **flags)
    return param, states, correction


def assert_same_master(result, expected):
    (param, states, correction), (ref_param, ref_states, ref_correction) = result, expected
    assert_same_quantized(states, ref_states)
    assert torch.equal(param.view(torch.int16), ref_param.view(torch.int16))
    assert correction.dtype == ref_correction.dtype and torch.equal(correction, ref_correction)


def dtype_id(value):
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


# Each case compiles a graph of its own (~20 s on 2 cores), so not the whole product: every
# format pair, dtype and correction width, and each dtype at both widths. float16 at 24 bits
# for every pair: the graphs the optimizer test below compiles too. The eager reference
# sweep below runs the whole product.
COMPILED_CASES = [(torch.float16, pair, 24) for pair in FORMAT_PAIRS] + [
    (torch.float16, "8bit", 32), (torch.bfloat16, "4bit", 24), (torch.bfloat16, "fp8", 32)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype, pair, bits", COMPILED_CASES, ids=lambda v: dtype_id(v) or str(v))
def test_matches_compiled_step_with_master_weights(kernel, dtype, pair, bits):
    """Every path, at 1 and 3 threads, against ``backend="compile"`` unpatched, on a parameter
    with a partial last block. 140_001 elements make three tasks of at most 65536 (the
    kernel's grain) at 3 threads, for every block size. bfloat16 with amsgrad and L2 weight decay;
    float16 with the optimizer's default flags, whose compiled graphs tests/test_master_weights.py
    and the last test here compile too (float16 with amsgrad and L2 weight decay is compared
    with the eager reference below)."""
    flags = dict(decoupled_weight_decay=False) if dtype == torch.bfloat16 else {}
    shape = (140_001,)
    setup = MasterSetup(pair, shape, bits, dtype=dtype, amsgrad=dtype == torch.bfloat16)
    assert setup.correction.dtype == correction_dtype(bits) and setup.correction.any()
    grad = spread_gradient(shape, dtype, setup.generator)
    scalars = make_scalars(step=setup.step)
    expected = reference(setup, grad, scalars, "compile", **flags)
    assert not torch.equal(expected[2], setup.correction)  # the step changed the corrections
    for isa in available_isas():
        for threads in (1, 3):
            with num_threads(threads):
                assert_same_master(kernel_step(setup, grad, scalars, isa, **flags), expected)


@pytest.mark.sweep
@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("flags", FLAGS)
@pytest.mark.parametrize("bits", [24, 32])
@pytest.mark.parametrize("pair", FORMAT_PAIRS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_matches_reference_with_master_weights(kernel, ieee_sqrt, dtype, pair, bits, flags, shape, isa):
    flags = dict(FLAGS[flags])
    setup = MasterSetup(pair, shape, bits, dtype=dtype, amsgrad=flags.pop("amsgrad", False))
    grad = spread_gradient(shape, dtype, setup.generator)
    scalars = make_scalars(step=setup.step, lr=1e-4)  # updates below a parameter ulp, kept by the master
    result = kernel_step(setup, grad, scalars, isa, **flags)
    assert_same_master(result, reference(setup, grad, scalars, "eager", **flags))


@pytest.mark.parametrize("bits", [24, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_non_finite_gradients_keep_the_master_weight(kernel, ieee_sqrt, dtype, bits):
    setup = MasterSetup("8bit", (4097,), bits, dtype=dtype, amsgrad=True)
    grad = spread_gradient((4097,), dtype, setup.generator)
    grad[::97] = float("nan")
    grad[5::89] = float("inf")
    grad[11::83] = 1e30 if dtype == torch.bfloat16 else 6e4  # the largest moments each dtype allows
    scalars = make_scalars(step=setup.step)
    for isa in available_isas():
        param, states, correction = kernel_step(setup, grad, scalars, isa)
        assert_same_master((param, states, correction), reference(setup, grad, scalars, "eager"))
        kept = ~torch.isfinite(grad)
        assert torch.equal(param[kept].view(torch.int16), setup.param[kept].view(torch.int16))
        assert torch.equal(correction[kept], setup.correction[kept])


@pytest.mark.parametrize("bits", [24, 32])
def test_float16_edge_values_match_the_reference(kernel, ieee_sqrt, bits):
    """Master weights at float16's edges, on every path: zeros, subnormals, 2**-15 (where
    int16 corrections become exact), binade edges, the largest float16 and a weight that
    overflows past it (the parameter becomes inf, its correction 0), inf and NaN (one quiet
    NaN, 0x7E00)."""
    setup = MasterSetup("4bit", (4097,), bits, dtype=torch.float16, amsgrad=False)
    below_overflow = 65520.0 - 2.0**-8  # the largest float32 below float16's overflow midpoint
    edges = torch.tensor([0.0, -0.0, 2.0**-24, -3 * 2.0**-24 + 2.0**-33, 2.0**-20 + 2.0**-37, 2.0**-15,
                          -(2.0**-14) + 2.0**-40, 1.0 - 2.0**-24, 2.0 + 2.0**-12, 2048.0 - 2.0**-11, 65504.0,
                          below_overflow, -below_overflow, float("inf"), -float("inf"), float("nan")])
    write_master(setup.param[:16], setup.correction[:16], edges)
    grad = spread_gradient((4097,), torch.float16, setup.generator)
    # A gradient that dominates the warmed moments pushes the two largest weights past 65520
    # (float16 inf) at lr 1e-2 without weight decay: an update of ~0.6 * lr. (A 24-bit master
    # weight holds them as 65520 already: inf from the start.)
    grad[11:13] = torch.tensor([-1e4, 1e4])
    scalars = make_scalars(step=setup.step, lr=1e-2, weight_decay=0.0)
    expected = reference(setup, grad, scalars, "eager")
    param = expected[0]
    assert torch.isinf(param[11:15].float()).all() and (param[15:16].view(torch.int16) == 0x7E00).all()
    assert not expected[2][11:16].any()
    for isa in available_isas():
        assert_same_master(kernel_step(setup, grad, scalars, isa), expected)


def test_non_contiguous_parameter_and_correction(kernel, ieee_sqrt):
    for dtype in DTYPES:
        setup = MasterSetup("4bit", (96, 130), 24, dtype=dtype, amsgrad=False)
        setup.param = setup.param.t().contiguous().t()  # same values, column-major
        setup.correction = setup.correction.t().contiguous().t()
        grad = spread_gradient((96, 130), dtype, setup.generator)
        scalars = make_scalars(step=setup.step)
        expected = reference(setup, grad, scalars, "eager")
        param, states, correction = setup.copies()  # clones keep the column-major strides
        cpu_adamw_step(param, grad, states[0], states[1], None, scalars, maximize=False,
                                  stochastic_round=False, weight_correction=correction)
        assert not param.is_contiguous() and not correction.is_contiguous()
        assert_same_master((param, states, correction), expected)


def test_the_operator_refuses_what_master_weights_exclude(kernel):
    setup = MasterSetup("4bit", (300,), 24, dtype=torch.bfloat16, amsgrad=False)
    grad = spread_gradient((300,), torch.bfloat16, setup.generator)
    param, states, correction = setup.copies()
    with pytest.raises(RuntimeError, match="stochastic rounding with a weight correction"):
        cpu_adamw_step(param, grad, states[0], states[1], None, make_scalars(step=setup.step),
                                  maximize=False, stochastic_round=True, weight_correction=correction)
    with pytest.raises(RuntimeError, match="needs a bfloat16 or float16 parameter, got Float"):
        cpu_adamw_step(param.float(), grad.float(), states[0], states[1], None,
                                  make_scalars(step=setup.step), maximize=False, stochastic_round=False,
                                  weight_correction=correction)
    assert torch.equal(param.view(torch.int16), setup.param.view(torch.int16))  # nothing written


# Each (class, dtype) compiles a graph of its own: slow tier, float16 (the graphs the test
# above compiles; the kernel's bfloat16 master weights are compared there and with the eager
# reference). The fast tier checks the kernel's master weights against the eager reference.
@pytest.mark.slow
@pytest.mark.parametrize("optimizer_class", [AdamW8bit, AdamW4bit, AdamWFp8], ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float16], ids=dtype_id)
def test_optimizer_with_master_weights_takes_the_kernel_and_matches_compiled(kernel, dtype, optimizer_class):
    """``backend="cpu"`` sends bfloat16 and float16 parameters with master weights to the
    kernel (the small bias keeps float moments) and follows ``backend="compile"`` bit for bit."""

    def run(backend):
        torch.manual_seed(0)
        model = torch.nn.Linear(96, 130).to(dtype)
        optimizer = optimizer_class(model.parameters(), lr=1e-4, backend=backend, master_weight_bits=24)
        for step in range(3):
            generator = torch.Generator().manual_seed(step)
            for param in model.parameters():
                param.grad = torch.randn(param.shape, generator=generator).to(dtype)
            optimizer.step()
        return model, optimizer

    model, optimizer = run("cpu")
    plan = optimizer._caches[0].plan
    assert len(plan.rule_plan.cpu_indices) == 1 and plan.rule_plan.quantized == []
    reference_model, reference_optimizer = run("compile")
    for param, expected in zip(model.parameters(), reference_model.parameters()):
        assert torch.equal(param.view(torch.int16), expected.view(torch.int16))
        state, expected_state = optimizer.state[param], reference_optimizer.state[expected]
        assert torch.equal(state["master_weight_correction"], expected_state["master_weight_correction"])
        if param.dim() == 2:
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[key].codes, expected_state[key].codes)
