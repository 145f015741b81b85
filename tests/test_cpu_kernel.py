"""The C++ CPU step (``lowbit_optim.step.cpu_kernel``) against the eager reference step.

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

from lowbit_optim.step import cpu_kernel
from lowbit_optim.step.chunks import TailScratch
from lowbit_optim.step.math import adam_ratio_bound

SHAPES = [(1,), (127,), (4097,), (123, 123)]


@pytest.fixture
def ieee_sqrt(monkeypatch):
    """Eager steps with a correctly rounded float32 sqrt (the float64 root of a float32
    value, rounded once to float32, is the correctly rounded float32 root)."""
    eager_sqrt = torch.Tensor.sqrt
    monkeypatch.setattr(torch.Tensor, "sqrt", lambda self: eager_sqrt(self.double()).to(self.dtype))


@pytest.fixture(scope="module")
def kernel():
    if not cpu_kernel.load():
        pytest.skip("the C++ CPU step could not be built here")
    return cpu_kernel


def run_both(setup, grad, scalars, isa, **flags):
    """Kernel and reference from the same inputs; returns (kernel, reference) params and states."""
    ref_param, ref_states = setup.copies()
    setup.reference_step(ref_param, ref_states, grad, scalars, **flags)
    param, states = setup.copies()
    entry = setup.entry(param, grad, states)
    full = {"maximize": False, "stochastic_round": False, "decoupled_weight_decay": True, **flags}
    cpu_adamw_step(param, grad, entry.exp_avg, entry.exp_avg_sq, entry.max_exp_avg_sq, scalars,
                              isa=isa, **full)
    return (param, states), (ref_param, ref_states)


@pytest.mark.sweep
@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("pair", FORMAT_PAIRS)
def test_matches_reference_every_format_and_shape(kernel, ieee_sqrt, pair, shape, isa):
    setup = KernelSetup(pair, shape, torch.float32, amsgrad=False)
    grad = spread_gradient(shape, torch.float32, setup.generator)
    (param, states), (ref_param, ref_states) = run_both(setup, grad, make_scalars(step=setup.step), isa)
    assert_same_quantized(states, ref_states)
    torch.testing.assert_close(param, ref_param, rtol=0, atol=0)


FLAG_COMBOS = {
    "amsgrad": dict(amsgrad=True),
    "maximize": dict(maximize=True),
    "l2_weight_decay": dict(decoupled_weight_decay=False),
    "all": dict(amsgrad=True, maximize=True, decoupled_weight_decay=False),
}


@pytest.mark.sweep
@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("combo", FLAG_COMBOS)
@pytest.mark.parametrize("pair", FORMAT_PAIRS)
def test_matches_reference_every_dtype_and_flag(kernel, ieee_sqrt, pair, combo, dtype, isa):
    flags = dict(FLAG_COMBOS[combo])
    setup = KernelSetup(pair, (4097,), dtype, amsgrad=flags.pop("amsgrad", False))
    grad = spread_gradient((4097,), dtype, setup.generator)
    scalars = make_scalars(step=setup.step)
    (param, states), (ref_param, ref_states) = run_both(setup, grad, scalars, isa, **flags)
    assert_same_quantized(states, ref_states)
    torch.testing.assert_close(param, ref_param, rtol=0, atol=0)


@pytest.mark.parametrize("pair", FORMAT_PAIRS)
def test_smallest_block_size(kernel, ieee_sqrt, pair):
    # Block size 16, the smallest the optimizers accept: one AVX-512 vector per 8-bit block,
    # and for 4-bit halves of 8 elements that an AVX-512 vector does not tile, so the portable
    # path steps them there (AVX2's 8 lanes tile them).
    setup = KernelSetup(pair, (1000,), torch.float32, amsgrad=True, block_size=16)
    grad = spread_gradient((1000,), torch.float32, setup.generator)
    (param, states), (ref_param, ref_states) = run_both(setup, grad, make_scalars(step=setup.step),
                                                        cpu_kernel.default_isa())
    assert_same_quantized(states, ref_states)
    torch.testing.assert_close(param, ref_param, rtol=0, atol=0)


@pytest.mark.sweep
@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("pair", FORMAT_PAIRS)
def test_non_finite_huge_and_zero_gradients(kernel, ieee_sqrt, pair, isa):
    # NaN and inf gradients keep their elements; 1e30 overflows the second moment to inf,
    # which the scale ignores and the code stores as 1; a block of zeros keeps scale 0.
    setup = KernelSetup(pair, (4097,), torch.float32, amsgrad=True)
    grad = spread_gradient((4097,), torch.float32, setup.generator)
    grad[::97] = float("nan")
    grad[5::89] = float("inf")
    grad[7::91] = -float("inf")
    grad[11::83] = 1e30
    grad[:512] = 0.0
    param, states = setup.copies()
    for state in states:
        state.scales[:2] = 0.0
    setup.param, setup.states = param, states
    (param, states), (ref_param, ref_states) = run_both(setup, grad, make_scalars(step=setup.step), isa)
    assert_same_quantized(states, ref_states)
    torch.testing.assert_close(param, ref_param, rtol=0, atol=0, equal_nan=True)
    assert states[0].scales[0] == 0 and torch.isfinite(param).all()


@pytest.mark.sweep
@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("pair", FORMAT_PAIRS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("maximize", [False, True])
def test_blocks_with_and_without_a_non_finite_gradient_in_one_step(kernel, ieee_sqrt, pair, isa, maximize,
                                                                   dtype):
    # A block whose gradients are all finite takes the update without per-element guards; one
    # with a NaN or infinite gradient the guarded update. Here both kinds alternate in one call,
    # and finite blocks hold gradients whose square overflows the second moment to inf (float32,
    # bfloat16; float16's largest is the largest finite gradient there): the unguarded update
    # must still store it as 1 and take the scale without it.
    setup = KernelSetup(pair, (40 * 128 + 77,), dtype, amsgrad=True)
    grad = spread_gradient(setup.param.shape, dtype, setup.generator)
    huge = min(1e30, torch.finfo(dtype).max)
    block = setup.states[0].block_size
    grad[3 * block + 5] = float("nan")
    grad[7 * block + 100] = float("inf")
    grad[11 * block] = -float("inf")
    grad[-3] = float("nan")  # the partial last block
    grad[5 * block + 9] = huge
    grad[9 * block + 1:9 * block + 4] = -huge
    (param, states), (ref_param, ref_states) = run_both(setup, grad, make_scalars(step=setup.step), isa,
                                                        maximize=maximize)
    assert_same_quantized(states, ref_states)
    torch.testing.assert_close(param, ref_param, rtol=0, atol=0)
    assert torch.isfinite(param).all()


@pytest.mark.sweep
@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("pair", FORMAT_PAIRS)
def test_negative_second_moment_scales_count_magnitudes(kernel, ieee_sqrt, pair, isa):
    # A checkpoint with negative second-moment scales decodes to negative exp_avg_sq (and its
    # square root to NaN parameters): the new scale must still be the largest magnitude, as the
    # reference's absmax takes it; a running maximum that took an average of squares as its own
    # magnitude (one operation fewer, measured and not kept) fails here.
    setup = KernelSetup(pair, (4097,), torch.float32, amsgrad=True)
    param, states = setup.copies()
    for state in states[1:]:
        state.scales[::3] = -state.scales[::3]
    setup.param, setup.states = param, states
    grad = spread_gradient((4097,), torch.float32, setup.generator) * 1e-4
    (param, states), (ref_param, ref_states) = run_both(setup, grad, make_scalars(step=setup.step), isa)
    assert_same_quantized(states, ref_states)
    torch.testing.assert_close(param, ref_param, rtol=0, atol=0, equal_nan=True)
    assert ref_param.isnan().any()  # negative second moments reached the update


@pytest.mark.sweep
@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("pair", FORMAT_PAIRS)
def test_ratio_clamped_at_its_bound_and_nan_ratios_kept(kernel, ieee_sqrt, pair, isa):
    # A first moment far above the second's square root puts |exp_avg / denom| past
    # adam_ratio_bound in both signs, so the clamp decides the update; NaN and infinite
    # parameters under L2 decay (Adam's, not decoupled) make NaN moments and ratios, which the
    # clamp must keep NaN as torch's clamp does.
    setup = KernelSetup(pair, (4097,), torch.float32, amsgrad=False)
    param, states = setup.copies()
    states[0].scales.mul_(1e6)
    param[::101] = float("nan")
    param[3::103] = float("inf")
    param[5::107] = -float("inf")
    setup.param, setup.states = param, states
    grad = spread_gradient((4097,), torch.float32, setup.generator)
    scalars = make_scalars(step=setup.step)
    (param, states), (ref_param, ref_states) = run_both(setup, grad, scalars, isa,
                                                        decoupled_weight_decay=False)
    assert_same_quantized(states, ref_states)
    torch.testing.assert_close(param, ref_param, rtol=0, atol=0, equal_nan=True)
    lr, beta1 = float(scalars.lr), float(scalars.beta1)
    bound = float(adam_ratio_bound(scalars.beta1, scalars.beta2, scalars.step))
    largest_step = lr / (1 - beta1**setup.step) * bound
    moved = ref_param.double() - setup.param.double()
    clamped = (moved.abs() - largest_step).abs() <= 1e-4 * largest_step  # float32 rounding of p - step
    assert (clamped & (moved > 0)).sum() > 50 and (clamped & (moved < 0)).sum() > 50
    assert ref_param.isnan().any()


@pytest.mark.sweep
@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("pair", FORMAT_PAIRS)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_late_step_whose_bias_correction_rounds_to_one(kernel, ieee_sqrt, pair, isa, amsgrad):
    # Past ~325 steps at beta2 = 0.95 the second moment's bias correction, sqrt(1 - beta2**t),
    # rounds to 1.0 in float32 and the kernel skips its division (constant_divisor.h); a user's
    # long run with LLM betas is mostly such steps.
    betas, step = (0.9, 0.95), 1000
    assert torch.tensor((1 - betas[1] ** step) ** 0.5, dtype=torch.float32).item() == 1.0
    setup = KernelSetup(pair, (4097,), torch.float32, amsgrad=amsgrad)
    grad = spread_gradient((4097,), torch.float32, setup.generator)
    scalars = make_scalars(betas=betas, step=step)
    (param, states), (ref_param, ref_states) = run_both(setup, grad, scalars, isa)
    assert_same_quantized(states, ref_states)
    torch.testing.assert_close(param, ref_param, rtol=0, atol=0)
    assert not torch.equal(param, setup.param)


@pytest.mark.parametrize("isa", available_isas())
def test_negative_zero_moment_keeps_its_code(kernel, ieee_sqrt, isa):
    # float8's code 0x80 decodes to -0.0; an element whose gradient is not finite keeps it, and
    # the reference encodes -0.0 / scale = -0.0 back to 0x80, not to +0.0's code 0. (The kernel
    # divides by the scale through its reciprocal, whose correction step alone would give +0.0.)
    setup = KernelSetup("fp8", (4097,), torch.float32, amsgrad=False)
    negative_zero = int((setup.fmts[0].table == 0).logical_and(setup.fmts[0].table.signbit()).nonzero())
    param, states = setup.copies()
    states[0].codes.view(-1)[3:4097:7] = negative_zero
    setup.param, setup.states = param, states
    grad = spread_gradient((4097,), torch.float32, setup.generator)
    grad[3::7] = float("nan")
    (param, states), (ref_param, ref_states) = run_both(setup, grad, make_scalars(step=setup.step), isa)
    assert (ref_states[0].codes.view(-1)[3:4097:7] == negative_zero).all()
    assert_same_quantized(states, ref_states)
    torch.testing.assert_close(param, ref_param, rtol=0, atol=0)


def test_non_contiguous_parameter(kernel, ieee_sqrt):
    setup = KernelSetup("4bit", (96, 130), torch.float32, amsgrad=False)
    setup.param = setup.param.t().contiguous().t()  # same values, column-major
    grad = spread_gradient((96, 130), torch.float32, setup.generator)
    ref_param, ref_states = setup.param.clone().t().contiguous().t(), [s.clone() for s in setup.states]
    setup.reference_step(ref_param, ref_states, grad, make_scalars(step=setup.step))
    param, states = setup.param, setup.states
    cpu_adamw_step(param, grad, states[0], states[1], None, make_scalars(step=setup.step),
                              maximize=False, stochastic_round=False)
    assert not param.is_contiguous()
    assert_same_quantized(states, ref_states)
    torch.testing.assert_close(param, ref_param, rtol=0, atol=0)


@pytest.mark.parametrize("pair", FORMAT_PAIRS)
def test_bit_identical_at_1_and_3_threads(kernel, pair):
    from conftest import num_threads

    results = []
    for threads in (1, 3):
        with num_threads(threads):
            setup = KernelSetup(pair, (300_001,), torch.bfloat16, amsgrad=True)
            param, states = setup.copies()
            torch.manual_seed(1)
            grad = spread_gradient((300_001,), torch.bfloat16, setup.generator)
            cpu_adamw_step(param, grad, states[0], states[1], states[2],
                                      make_scalars(step=setup.step), maximize=False, stochastic_round=True)
            results.append((param, states))
    (param_1, states_1), (param_3, states_3) = results
    assert torch.equal(param_1.view(torch.int16), param_3.view(torch.int16))
    assert_same_quantized(states_1, states_3)


def test_bf16_stochastic_rounding_is_unbiased_and_seeded(kernel):
    """Each element is one of the two bfloat16 neighbours of the float32 update (which the same
    step on float32 copies gives exactly), rounded up with probability equal to the dropped
    fraction, from a stream that torch.manual_seed fixes. The stream itself is the kernel's
    (a hash of one draw from torch's generator and the element index), not the compiled
    step's ``randint_like``: both are unbiased, their bits differ."""
    numel = 200_000
    setup = KernelSetup("4bit", (numel,), torch.bfloat16, amsgrad=False)
    grad = spread_gradient((numel,), torch.bfloat16, setup.generator)
    scalars = make_scalars(lr=3e-3, step=setup.step)
    exact, exact_states = setup.param.float(), [s.clone() for s in setup.states]
    cpu_adamw_step(exact, grad.float(), *exact_states, None, scalars, maximize=False,
                              stochastic_round=False)
    rounded = []
    for seed in (5, 5, 6):
        param, states = setup.copies()
        torch.manual_seed(seed)
        cpu_adamw_step(param, grad, states[0], states[1], None, scalars, maximize=False,
                                  stochastic_round=True)
        assert_same_quantized(states, exact_states)
        rounded.append(param)
    assert torch.equal(rounded[0], rounded[1]) and not torch.equal(rounded[0], rounded[2])

    down = (exact.view(torch.int32) & -65536).view(torch.float32)
    up = (down.view(torch.int32) + 65536).view(torch.float32)
    result = rounded[0].float()
    assert ((result == down) | (result == up)).all()
    fraction = ((exact - down) / (up - down)).double()
    went_up = (result == up).double()
    # Bernoulli(fraction) per element: the mean error is 0 within 6 standard deviations.
    sd = (fraction * (1 - fraction)).sum().sqrt()
    assert abs(float((went_up - fraction).sum())) < 6 * float(sd)
    assert float(fraction.mean()) > 0.2  # the test rounds real fractions, not exact values


def test_matches_compiled_step(kernel):
    """Against ``backend="compile"`` unpatched: Inductor's sqrt is the IEEE one too."""
    for pair in FORMAT_PAIRS:
        setup = KernelSetup(pair, (4097,), torch.float32, amsgrad=False)
        grad = spread_gradient((4097,), torch.float32, setup.generator)
        scalars = make_scalars(step=setup.step)
        compiled_param, compiled_states = setup.copies()
        run_quantized_step("compile", setup.entry(compiled_param, grad, compiled_states), scalars,
                           TailScratch(), maximize=False, stochastic_round=False)
        param, states = setup.copies()
        cpu_adamw_step(param, grad, states[0], states[1], None, scalars, maximize=False,
                                  stochastic_round=False)
        assert_same_quantized(states, compiled_states)
        torch.testing.assert_close(param, compiled_param, rtol=0, atol=0)


def test_eager_reference_is_within_its_sqrt_rounding(kernel):
    """Unpatched eager: codes equal; parameters differ only where torch's eager sqrt is one
    ulp off, by at most 4 ulps of the update ``step_size * m / denom``."""
    setup = KernelSetup("8bit", (123, 123), torch.float32, amsgrad=False)
    grad = spread_gradient((123, 123), torch.float32, setup.generator)
    (param, states), (ref_param, ref_states) = run_both(setup, grad, make_scalars(step=setup.step),
                                                        cpu_kernel.default_isa())
    assert_same_quantized(states, ref_states)
    update = (ref_param - setup.param).abs()
    ulp = torch.finfo(torch.float32).eps * torch.maximum(update, ref_param.abs())
    assert ((param - ref_param).abs() <= 4 * ulp).all()


def test_checkpoints_move_between_kernel_and_compiled_step(kernel):
    from lowbit_optim import AdamW4bit

    def run(backends_per_phase):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(128, 130), torch.nn.Linear(130, 7))
        state = None
        for phase, backend in enumerate(backends_per_phase):
            optimizer = AdamW4bit(model.parameters(), lr=1e-2, backend=backend)
            assert optimizer.backend == backend
            if state is not None:
                optimizer.load_state_dict(state)
            for step in range(3):
                generator = torch.Generator().manual_seed(10 * phase + step)
                for param in model.parameters():
                    param.grad = torch.randn(param.shape, generator=generator)
                optimizer.step()
            state = optimizer.state_dict()
        return [p.detach().clone() for p in model.parameters()], state

    reference, reference_state = run(["compile", "compile"])
    for order in (["cpu", "compile"], ["compile", "cpu"], ["cpu", "cpu"]):
        params, state = run(order)
        for param, expected in zip(params, reference):
            assert torch.equal(param, expected), order
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state["state"][0][key].codes, reference_state["state"][0][key].codes)


def test_without_a_compiler_the_compiled_step_serves(kernel, monkeypatch):
    """A failed build warns (once per process: ``load`` is cached) and every CPU parameter
    goes to the compiled step."""
    from torch.utils import cpp_extension

    from lowbit_optim import AdamW8bit
    from lowbit_optim.step.dispatch import resolve_backend

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(cpu_kernel, "_load_built", lambda *args: False)  # as on a machine that never built it
    with pytest.warns(RuntimeWarning, match="could not be built .*command not found.*backend='compile'"):
        assert cpu_kernel.load.__wrapped__() is False
    monkeypatch.setattr(cpu_kernel, "load", lambda: False)
    assert resolve_backend(None, [torch.device("cpu")]) == "compile"
    assert resolve_backend("cpu", [torch.device("cpu")]) == "compile"
    assert AdamW8bit([torch.nn.Parameter(torch.zeros(5000))]).backend == "compile"


@pytest.mark.slow  # compiles the float64 graphs (~10 s on 2 cores)
def test_float64_parameters_take_the_compiled_step(kernel):
    from lowbit_optim import AdamW8bit

    param = torch.nn.Parameter(torch.randn(5000, dtype=torch.float64))
    param.grad = torch.randn_like(param)
    optimizer = AdamW8bit([param], backend="cpu")
    optimizer.step()
    plan = optimizer._caches[0].plan
    assert not plan.rule_plan.cpu_indices and len(plan.rule_plan.quantized) == 1


def test_a_mixed_group_steps_in_one_call_per_dtype_as_one_by_one(kernel):
    """A user's model in one param group: weights of several shapes, a transposed (non-
    contiguous) one, bfloat16 and float32 ones, and small ones kept in float. The kernel steps
    each dtype's quantized parameters in one call (``KernelBatch``), its blocks spread over the
    threads together; that gives bit for bit what one call per parameter gives (a group per
    parameter), at 1 and at 3 threads, bf16 stochastic rounding included."""
    from conftest import num_threads

    from lowbit_optim import AdamW8bit

    shapes = [(300, 70), (4096,), (70, 90), (5,), (129, 64)]

    def bits(tensor):  # equal bits: NaN and -0.0 compared as stored
        return tensor.view(torch.int16 if tensor.dtype == torch.bfloat16 else torch.int32)

    def run(threads, one_group):
        torch.manual_seed(0)
        # The small one in float32 only: a bfloat16 one would draw its rounding noise after the
        # quantized ones in one group but between them in a group each.
        params = [torch.nn.Parameter(torch.randn(shape, dtype=dtype))
                  for dtype in (torch.float32, torch.bfloat16)
                  for shape in shapes if dtype == torch.float32 or shape != (5,)]
        params[2] = torch.nn.Parameter(torch.randn(90, 70).t())
        groups = [{"params": [param]} for param in params] if one_group else [{"params": params}]
        optimizer = AdamW8bit(groups, lr=1e-2, weight_decay=0.1, backend="cpu", bf16_stochastic_round=True)
        with num_threads(threads):
            for step in range(3):
                generator = torch.Generator().manual_seed(step)
                for param in params:
                    param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)
                optimizer.step()
        batches = [len(cache.plan.rule_plan.cpu_batches) for cache in optimizer._caches]
        return [param.detach().clone() for param in params], batches

    expected, batches = run(1, one_group=True)
    assert sum(batches) == 8  # the quantized ones: 4 shapes of at least 4096 elements, 2 dtypes
    for threads in (1, 3):
        params, batches = run(threads, one_group=False)
        assert batches == [2]
        for param, reference in zip(params, expected):
            assert torch.equal(bits(param), bits(reference))
