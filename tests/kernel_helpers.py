"""The Triton kernel against its reference, shared by the tests/test_triton*.py files
(interpreter on CPU) and tests/test_cuda.py (a real GPU): cases, one step of each through the
torch op (``kernel_step``) or a param group's plan (``plan_step``), and the bounds they are
compared with. ``lowbit_optim.step.kernels`` is imported by
``conftest.pytest_configure``, under the interpreter when there is no GPU.

Tolerances (derived in the docstrings of ``lowbit_optim/step/kernels/moment_codes.py`` and of
``lowbit_optim.step.rules.adamw.adamw_kernel_update``).
Scales must be identical: the moments are computed operation for operation as in the
reference. A code may differ from the reference's only by one step of its map, and only for
a value whose normalised magnitude is within ``CODE_EDGE_RELATIVE * |x| +
CODE_EDGE_ABSOLUTE`` of the midpoint between the two codes' values (the kernel multiplies by
one reciprocal of the block scale, where the reference divides; its encoders give exactly
the codecs' codes, tests/test_triton_encoders.py, but the 8-bit dynamic maps' bin edges,
formed by float32 arithmetic, lie up to 2**-19 relative from the table midpoints this bound
is measured from). Checks of several steps copy the reference's state and parameters into
the kernel's after each step, so that one such code does not compound. Parameters may differ
by one ulp of their dtype plus ``UPDATE_RELATIVE`` of the step's update (approximate sqrt
and division on the GPU; under the interpreter only the reciprocal of the bias correction),
and torch's CPU ``sqrt`` is off by an ulp for some inputs (MKL/SLEEF vector code).
"""

import pytest
import torch
from conftest import assert_close_verbose

from lowbit_optim.formats.catalog import get_format
from lowbit_optim.state import QuantizedState
from lowbit_optim.step.chunks import RuleEntry, TailScratch
from lowbit_optim.step.hyperparams import StepOptions
from lowbit_optim.step.math import StepScalars
from lowbit_optim.step.rule_step import RulePlan, StoredMoment, quantized_rule_step
from lowbit_optim.step.rules.adamw import ADAMW

pytest.importorskip("triton")
from lowbit_optim.step.kernels import ops  # noqa: E402  (needs Triton; registers the op)

KINDS = {
    "8bit": (get_format("dynamic8-signed"), get_format("dynamic8-unsigned-nonzero"), 256),
    "4bit": (get_format("dynamic4-signed"), get_format("linear4-nonzero"), 128),
    "fp8": (get_format("float8-e4m3"), get_format("float8-e4m3-nonzero"), 256),
}
CODE_EDGE_RELATIVE, CODE_EDGE_ABSOLUTE = 2.0**-18, 2.0**-22
UPDATE_RELATIVE = 2.0**-20
# AdEMAMix's kernel divides through host reciprocals and adds eps with an FMA: its parameter
# change may differ from the reference's by this relative RMSE (tests/test_triton_rules.py).
AdEMAMIX_CHANGE_RMSE = 2e-6
# dtype -> (rtol, atol) for parameters: one ulp of the dtype (see the module docstring).
PARAM_TOLERANCE = {
    torch.float32: (2.0**-23, 1e-9),
    torch.bfloat16: (2.0**-8, 0.0),
    torch.float16: (2.0**-10, 0.0),
}
# (lr, betas, weight_decay) per step: a schedule that changes everything a kernel could bake in.
SCHEDULE = [(1e-3, (0.9, 0.999), 0.01), (5e-4, (0.8, 0.99), 0.0), (2e-3, (0.95, 0.9999), 0.1)]


def hyper_tensors(lr, betas, weight_decay, step, eps=1e-8):
    """The 0-d CPU tensors the optimizer passes (step.hyperparams.GroupScalars' dtypes)."""
    double = torch.float64
    return (torch.tensor(lr, dtype=torch.float32), torch.tensor(betas[0], dtype=double),
            torch.tensor(betas[1], dtype=double), torch.tensor(eps, dtype=double),
            torch.tensor(weight_decay, dtype=double), torch.tensor(float(step)))


def op_keywords(hyper, formats, *, decoupled_weight_decay=True) -> dict:
    """``hyper_tensors``' values and the moments' ``formats`` as the op's keyword arguments for
    the AdamW rule (``"adam"``: torch.optim.Adam's L2 weight decay)."""
    return dict(rule="adamw" if decoupled_weight_decay else "adam", scalars=list(hyper[:5]), step=hyper[5],
                formats=[fmt if isinstance(fmt, str) else fmt.name for fmt in formats])


def make_case(numel, kind, dtype, amsgrad=False):
    exp_avg_format, exp_avg_sq_format, block_size = KINDS[kind]
    param = torch.randn(numel).to(dtype)
    states = [QuantizedState.from_float(torch.randn(numel) * 0.1, exp_avg_format, block_size),
              QuantizedState.from_float(torch.rand(numel) * 0.01, exp_avg_sq_format, block_size)]
    if amsgrad:
        states.append(QuantizedState.from_float(torch.rand(numel) * 0.02, exp_avg_sq_format, block_size))
    return param, states


def gradient(numel, dtype):
    grad = torch.randn(numel)
    grad[::97] = float("nan")  # the non-finite policy: these elements keep param and moments
    grad[5::101] = float("inf")
    return grad.to(dtype)


def reference_step(param, grad, states, hyper, *, maximize=False, decoupled_weight_decay=True,
                   correction=None):
    """The AdamW rule's ``quantized_rule_step`` on zero-padded blocks; updates ``param`` and
    ``states`` (and the master weight ``correction``, if given) in place."""
    exp_avg, exp_avg_sq = states[:2]
    block_size, num_blocks = exp_avg.block_size, exp_avg.num_blocks
    padding = num_blocks * block_size - param.numel()

    def blocks(tensor):
        return torch.nn.functional.pad(tensor.view(-1), (0, padding)).view(num_blocks, block_size)

    param_blocks, grad_blocks = blocks(param), blocks(grad)
    correction_blocks = None if correction is None else blocks(correction)
    stored = [StoredMoment(state.codes, state.scales) for state in states]
    rule = ADAMW.for_decay(decoupled_weight_decay)
    quantized_rule_step(
        param_blocks, grad_blocks, tuple(stored), rule.step_constants(StepScalars(*hyper), hyper[5]),
        rule=rule, formats=tuple(state.format for state in states), maximize=maximize, stochastic_round=False,
        weight_correction=correction_blocks,
    )
    param.copy_(param_blocks.view(-1)[: param.numel()].view(param.shape))
    if correction is not None:
        correction.copy_(correction_blocks.view(-1)[: param.numel()].view(param.shape))


def kernel_step(cases, hyper, *, corrections=None, decoupled_weight_decay=True, **flags):
    """One call of the op, the AdamW rule, for ``[(param, grad, states), ...]`` (one dtype and
    formats; with master weights: each parameter's correction in ``corrections``); ``flags``:
    the op's (``maximize``, ``stochastic_round``)."""
    torch.ops.lowbit_optim.triton_rule_step(
        [p for p, _, _ in cases], [g for _, g, _ in cases],
        ops.stored_tensors(state for _, _, states in cases for state in states), list(corrections or []),
        **op_keywords(hyper, [state.format for state in cases[0][2]],
                      decoupled_weight_decay=decoupled_weight_decay), **flags)


def plan_step(entries, hyper, *, maximize=False, stochastic_round=False, rounding_stream=None):
    """One step of ``[(param, grad, states, step), ...]`` as the optimizer steps a param group
    through the kernel: the AdamW rule's ``RulePlan`` (its Triton parameters sorted into kinds,
    one launch per kind, each kind's noise seed from ``rounding_stream``)."""
    rule_entries = [RuleEntry(param, grad, tuple(states), step) for param, grad, states, step in entries]
    plan = RulePlan(ADAMW, rule_entries, "triton")
    assert len(plan.triton_indices) == len(entries), "every parameter through the kernel"
    plan.run([entry.grad for entry in rule_entries], StepScalars(*hyper),
             StepOptions(maximize, stochastic_round, rounding_stream), TailScratch())


def _unpacked(state):
    return state.format.unpack(state.codes).long()


def assert_states_equal(actual, expected, name, *, values=None):
    """Scales identical; codes identical except next to a bin edge (module docstring).

    ``values``: per moment, the unquantized values (flat, padded to whole blocks) when the test
    knows them; then each differing code is checked against the midpoint it straddles.
    Without them a differing code must still be one map step from the reference's.
    """
    for index, (a, e) in enumerate(zip(actual, expected)):
        assert torch.equal(a.scales, e.scales), f"{name}: moment {index}: scales differ"
        codes_a, codes_e = _unpacked(a), _unpacked(e)
        differ = codes_a != codes_e
        if not differ.any():
            continue
        steps = (codes_a - codes_e).abs()[differ]
        assert int(steps.max()) == 1, f"{name}: moment {index}: codes differ by {int(steps.max())} map steps"
        if values is None or values[index] is None:
            # Random values rarely fall that close to an edge.
            assert int(differ.sum()) <= max(2, differ.numel() // 200), (
                f"{name}: moment {index}: {int(differ.sum())} of {differ.numel()} codes differ")
            continue
        table = a.format.table
        normalized = (values[index].view(codes_a.shape) / a.scales[:, None])[differ]
        low = torch.minimum(codes_a, codes_e)[differ]
        midpoint = (table[low] + table[low + 1]) / 2
        distance = (normalized - midpoint).abs()
        bound = CODE_EDGE_RELATIVE * normalized.abs() + CODE_EDGE_ABSOLUTE
        assert bool((distance <= bound).all()), (
            f"{name}: moment {index}: a code differs {float((distance / bound).max()):.3g}x the bound "
            f"from its bin edge")


def assert_params_close(actual, expected, name, *, update=None, rounding=0.0):
    """One ulp of the dtype, plus ``UPDATE_RELATIVE`` of ``update`` (the reference's step), plus
    ``rounding`` relative: a rounding the values take after the update (24-bit master
    weights: 2**-15, one step of their 16-bit mantissa)."""
    rtol, atol = PARAM_TOLERANCE[actual.dtype]
    rtol += rounding
    assert torch.equal(actual.isnan(), expected.isnan()), f"{name}: NaN positions differ"
    if update is not None:
        slack = UPDATE_RELATIVE * update.abs().float()
        inside = (actual.float() - expected.float()).abs() <= slack
        actual = torch.where(inside, expected, actual)
    assert_close_verbose(actual.float(), expected.float(), rtol=rtol, atol=atol, name=name)


def resync(cases, reference):
    """Copy the reference's parameters and states into the kernel's."""
    for (param, _, states), (ref_param, ref_states) in zip(cases, reference):
        param.copy_(ref_param)
        for state, ref_state in zip(states, ref_states):
            state.codes.copy_(ref_state.codes)
            state.scales.copy_(ref_state.scales)


def run_against_reference(cases, *, steps=SCHEDULE, maximize=False):
    reference = [(p.clone(), [s.clone() for s in states]) for p, _, states in cases]
    for step, (lr, betas, weight_decay) in enumerate(steps, start=1):
        hyper = hyper_tensors(lr, betas, weight_decay, step)
        grads = [gradient(p.numel(), p.dtype).view(p.shape).to(p.device) for p, _, _ in cases]
        kernel_step([(p, g, s) for (p, _, s), g in zip(cases, grads)], hyper, maximize=maximize)
        updates = []
        for (ref_param, ref_states), grad in zip(reference, grads):
            before = ref_param.double() * (1 - lr * weight_decay)
            reference_step(ref_param, grad, ref_states, hyper, maximize=maximize)
            updates.append(ref_param.double() - before)
        for index, ((param, _, states), (ref_param, ref_states)) in enumerate(zip(cases, reference)):
            name = f"param {index}, step {step}"
            assert_states_equal(states, ref_states, name)
            assert_params_close(param, ref_param, name, update=updates[index])
        resync(cases, reference)


class LaunchCounter:
    """Wraps the real kernel and records each launch's grid and whether it was aligned."""

    def __init__(self, kernel):
        self.kernel, self.grids, self.aligned = kernel, [], []

    def __getitem__(self, grid):
        self.grids.append(grid)

        def run(*args, **kwargs):
            self.aligned.append(kwargs["ALIGNED"])
            return self.kernel[grid](*args, **kwargs)
        return run


