"""Muon's quantized momentum on every backend: against the plain-PyTorch reference with the
same codec (``ReferenceMuon`` with ``BlockwiseMomentum`` of the class's format and block size),
and the C++ and Triton kernels against the compiled step, bit for bit.

Bounds. ``backend="eager"`` runs the reference's operations (``torch.lerp``, the format's
``quantize_blocks``, Newton-Schulz, the two in-place parameter operations), so it must equal
the reference bit for bit. The compiled step and the kernels form the lerps without a fused
multiply-add where eager ATen fuses one (``step.rules.muon``): the momentum may differ from the
reference's by one float32 rounding, so a code may differ only where the momentum sits at a bin
edge (one map step), and the direction only where it sits at a bf16 rounding edge before
Newton-Schulz. Over these few steps of random values that moves the parameter change by far
less than ``CHANGE_RMSE`` relative RMSE (measured: 0, every code equal); the control, the other
class's format, moves it by 0.07 (asserted: more than 20x the bound). The kernels write the
compiled step's operations (``csrc/rules/muon.h``, ``muon_kernel_update``), so their scales and
parameters must be the compiled step's exactly, and the C++ kernel's codes too; the Triton
kernel normalises by a reciprocal (``step.kernels.moment_codes``), so a code may take the
neighbouring value at a bin edge (bf16 gradients, coarse values, meet edges often: one byte in
3072 per step, measured).
"""

import pytest
import torch
from conftest import num_threads, relative_rmse, slow_except

from lowbit_optim import Muon4bit, Muon8bit
from lowbit_optim.reference.momentum_codecs import BlockwiseMomentum
from lowbit_optim.reference.muon import ReferenceMuon
from lowbit_optim.step.master_weights import CORRECTION_KEY

# A wide matrix of whole blocks and a tall one of odd size (a partial last block).
SHAPES = ((48, 64), (65, 63))
CLASSES = (Muon8bit, Muon4bit)
STEPS = 3
CHANGE_RMSE = 1e-3
HYPER = dict(lr=0.02, weight_decay=0.1, momentum=0.9)


@pytest.fixture(autouse=True)
def _one_thread():
    # As in tests/test_muon.py: Newton-Schulz's small bf16 matmuls are ~20x faster on one thread.
    with num_threads(1):
        yield


def run(make_optimizer):
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.1) for shape in SHAPES]
    starts = [param.detach().float().clone() for param in params]
    optimizer = make_optimizer(params)
    for _ in range(STEPS):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
    return params, starts, optimizer


def reference_run(fmt):
    return run(lambda params: ReferenceMuon(params, **HYPER, codec=BlockwiseMomentum(fmt)))


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_quantized_momentum_follows_the_reference_codec(cls, backend):
    ours, starts, optimizer = run(lambda params: cls(params, **HYPER, min_quant_size=1024, backend=backend))
    expected, _, reference = reference_run(cls.momentum_format)
    for index, (param, start, want) in enumerate(zip(ours, starts, expected)):
        stored = optimizer.state[param]["momentum_buffer"]
        codes = reference.state[want]["momentum_buffer"]["codes"]
        assert stored.format_name == cls.momentum_format.name
        assert stored.block_size == cls.momentum_format.default_block_size
        if backend == "eager":
            assert torch.equal(param, want), f"param {index}"
            assert torch.equal(stored.codes, codes), f"codes {index}"
            continue
        differ = int((stored.codes != codes).sum())
        assert differ <= max(2, codes.numel() // 200), f"param {index}: {differ} code bytes differ"
        change = relative_rmse(param.detach() - start, want.detach() - start)
        assert change < CHANGE_RMSE, f"param {index}: relative RMSE of the change {change:.3g}"
    # Control: the other class's format is told apart by the same measure.
    other = Muon4bit if cls is Muon8bit else Muon8bit
    control, _, _ = reference_run(other.momentum_format)
    assert relative_rmse(control[1].detach() - starts[1], expected[1].detach() - starts[1]) > 20 * CHANGE_RMSE


def assert_momenta_match(got, want, name, *, exact: bool):
    """Scales equal; codes equal, or for the Triton kernel (which normalises by a reciprocal,
    step.kernels.moment_codes) one map step apart next to a bin edge, for a few elements."""
    assert torch.equal(got.scales, want.scales), f"{name}: scales"
    if exact:
        assert torch.equal(got.codes, want.codes), f"{name}: codes"
        return
    codes_got, codes_want = (state.format.unpack(state.codes).long() for state in (got, want))
    steps = (codes_got - codes_want).abs()
    assert int(steps.max()) <= 1 and int((steps > 0).sum()) <= max(2, steps.numel() // 200), name


def kernel_matches_compiled(cls, kernel_backend, dtype=torch.float32, **options):
    """Both optimizers stepped with the same gradients (NaN and inf among them); after each step
    the kernel's codes are set to the compiled step's, so that a code the Triton kernel rounds
    the other way at a bin edge does not compound (the parameters do not depend on this step's
    codes: the direction is formed before they are encoded)."""
    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randn(shape, generator=generator) * 0.1).to(dtype) for shape in SHAPES]
    runs = {}
    for backend in (kernel_backend, "compile"):
        params = [torch.nn.Parameter(weight.clone()) for weight in weights]
        runs[backend] = params, cls(params, **HYPER, min_quant_size=1024, backend=backend, **options)
    (kernel, kernel_optimizer), (compiled, compiled_optimizer) = runs[kernel_backend], runs["compile"]
    for step in range(STEPS):
        for got, want in zip(kernel, compiled):
            grad = torch.randn(got.shape, generator=generator)
            grad[0, :2] = torch.tensor([float("nan"), float("inf")])
            got.grad, want.grad = grad.to(dtype), grad.to(dtype)
        kernel_optimizer.step()
        compiled_optimizer.step()
        for index, (got, want) in enumerate(zip(kernel, compiled)):
            name = f"param {index}, step {step}"
            assert torch.equal(got, want), name
            got_state, want_state = kernel_optimizer.state[got], compiled_optimizer.state[want]
            assert_momenta_match(got_state["momentum_buffer"], want_state["momentum_buffer"], name,
                                 exact=kernel_backend == "cpu")
            got_state["momentum_buffer"].codes.copy_(want_state["momentum_buffer"].codes)
            if CORRECTION_KEY in want_state:
                assert torch.equal(got_state[CORRECTION_KEY], want_state[CORRECTION_KEY]), name


@pytest.fixture(params=["cpu", "triton"])
def kernel_backend(request):
    if request.param == "triton":
        pytest.importorskip("triton")
        request.getfixturevalue("interpreter")
    return request.param


# Muon4bit (NF4, the format only Muon uses) in the fast tier; Muon8bit's graphs in the slow one.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("cls", slow_except(CLASSES, Muon4bit), ids=lambda c: c.__name__)
def test_kernels_give_the_compiled_steps_parameters_and_scales_bit_for_bit(cls, kernel_backend):
    kernel_matches_compiled(cls, kernel_backend)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_kernels_equal_the_compiled_step_with_bf16_master_weights_and_maximize(kernel_backend):
    kernel_matches_compiled(Muon8bit, kernel_backend, dtype=torch.bfloat16, master_weight_bits=24,
                            maximize=True)
