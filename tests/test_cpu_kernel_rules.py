"""Lion and AdEMAMix in the C++ CPU kernel (``backend="cpu"``) against the compiled step
(``backend="compile"``, the reference on CPU).

The functors (``step/csrc/rules/lion.h``, ``ademamix.h``) perform the rule's ``update``
(``step/rules/lion.py``, ``ademamix.py``) operation for operation in float32, with the host's
0-d float64 values combined in float64 and rounded to float32 where the compiled step rounds
them; the kernel wraps them in ``rule_step.apply_rule``'s policies, and like Inductor's code it
uses the IEEE square root and division and fuses no multiply-add (docs/cpu_kernel.md). The
operation order matches everywhere, so codes, scales and parameters are compared for exact
equality: on every instruction-set path the CPU has (forced one by one), odd shapes with
partial last blocks, NaN, ±inf and zero gradients, AdEMAMix's alpha and beta3 warm-ups, maximize,
bfloat16 and float16 parameters with master weights or rounded, and at 1 and 3 threads.
The one exception is bfloat16 stochastic rounding, whose random bits are the kernel's own
stream (as for AdamW, tests/test_cpu_kernel.py): there the bound is one bfloat16 ulp.
"""

import functools

import pytest
import torch
from conftest import num_threads, slow_except
from helpers import assert_same_state, available_isas, spread_gradient

from lowbit_optim import AdEMAMix4bit, AdEMAMix8bit, Lion4bit, Lion8bit, QuantizedState
from lowbit_optim.formats.catalog import DYNAMIC_8BIT_SIGNED
from lowbit_optim.step import cpu_kernel
from lowbit_optim.step.rule_step import RuleEntry, RulePlan
from lowbit_optim.step.rules.lion import LION as LION_RULE

LION = (Lion8bit, Lion4bit)
ADEMAMIX = (AdEMAMix8bit, AdEMAMix4bit)
CLASSES = (*LION, *ADEMAMIX)
# Partial last blocks for both block sizes (256 and 128): 4097 = 16 * 256 + 1, 777 = 3 * 256 + 9
# = 6 * 128 + 9, 33 * 65 = 2145 = 8 * 256 + 97.
SHAPES = [(4097,), (777,), (33, 65)]
STEPS = 4
# AdEMAMix's warm-ups end within the run: steps 1-2 scheduled, 3-4 at the final alpha and beta3.
SCHEDULES = dict(t_alpha=3, t_beta3=3)
LR = {Lion8bit: 1e-3, Lion4bit: 1e-3, AdEMAMix8bit: 1e-2, AdEMAMix4bit: 1e-2}
ISA_ENV = cpu_kernel.ISA_ENV


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if not cpu_kernel.load():
        pytest.skip("the C++ CPU step could not be built here")


def options(cls) -> dict:
    return dict(SCHEDULES) if cls in ADEMAMIX else {}


def gradient(shape, dtype, generator) -> torch.Tensor:
    """Gradients over many magnitudes (every decade of the 8-bit map), with NaN, ±inf and a run
    of zeros (a whole zero block on the longest shape)."""
    grad = spread_gradient(shape, torch.float32, generator).flatten()
    grad[::97] = float("nan")
    grad[5::89] = float("inf")
    grad[7::91] = -float("inf")
    grad[256:512] = 0.0
    return grad.view(shape).to(dtype)


def kernel_entries(optimizer) -> int:
    """How many parameters the optimizer's plans step in the C++ kernel."""
    return sum(len(cache.plan.rule_plan.cpu_indices) for cache in optimizer._caches)


def run(cls, backend: str, *, dtype=torch.float32, steps=STEPS, shapes=SHAPES, **kwargs):
    """``steps`` steps of ``cls`` on ``shapes`` (every tensor quantized), from fixed seeds;
    returns the parameters, the state dict and the optimizer."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in shapes]
    optimizer = cls(params, lr=LR[cls], weight_decay=0.1, backend=backend, min_quant_size=0,
                    **options(cls), **kwargs)
    for _ in range(steps):
        for param in params:
            param.grad = gradient(param.shape, dtype, generator)
        optimizer.step()
    return [p.detach().clone() for p in params], optimizer.state_dict(), optimizer


@functools.cache
def compiled(cls, **kwargs):
    """The reference run (shared by every instruction set's comparison)."""
    params, state, optimizer = run(cls, "compile", **kwargs)
    assert kernel_entries(optimizer) == 0
    return params, state


def assert_matches_compiled(monkeypatch, cls, isa, **kwargs):
    monkeypatch.setenv(ISA_ENV, isa)
    params, state, optimizer = run(cls, "cpu", **kwargs)
    assert kernel_entries(optimizer) == len(SHAPES)
    expected_params, expected_state = compiled(cls, **kwargs)
    assert_same_state(state, expected_state)
    for param, expected in zip(params, expected_params):
        assert torch.equal(bits(param), bits(expected))


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits (so that -0.0 and 0.0 differ)."""
    return tensor.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


# Each class compiles a graph of its own (the 4-bit ones ~15-25 s on 2 cores): the 8-bit ones,
# which exercise both functors at every ISA, in the fast tier.
@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("cls", slow_except(CLASSES, Lion8bit, AdEMAMix8bit), ids=lambda c: c.__name__)
def test_matches_compiled_step(monkeypatch, cls, isa):
    assert_matches_compiled(monkeypatch, cls, isa)


# Each case is one more compiled variant of the reference (a minute of compiling on a clean
# clone for the four), so maximize rides along with two of them.
HALF_PRECISION = {
    "Lion4bit-bf16-rounded-maximize": (Lion4bit, dict(dtype=torch.bfloat16, maximize=True)),
    "AdEMAMix8bit-bf16-master24-maximize": (AdEMAMix8bit, dict(dtype=torch.bfloat16, master_weight_bits=24,
                                                               maximize=True)),
    "Lion8bit-fp16-master32": (Lion8bit, dict(dtype=torch.float16, master_weight_bits=32)),
    "AdEMAMix4bit-fp16-rounded": (AdEMAMix4bit, dict(dtype=torch.float16)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", HALF_PRECISION)
def test_half_precision_parameters_and_maximize_match_compiled_step(monkeypatch, case):
    """bfloat16 and float16 parameters, rounded to nearest or with their master weight's
    correction (compared as part of the state), on the widest and the portable path."""
    cls, arguments = HALF_PRECISION[case]
    for isa in {cpu_kernel.default_isa(), "scalar"}:
        assert_matches_compiled(monkeypatch, cls, isa, **arguments)


@pytest.mark.slow
def test_bf16_stochastic_rounding_stays_within_one_ulp(monkeypatch):
    """The kernel's random bits are its own, so parameters are one of the two bfloat16
    neighbours of the update: at most one bfloat16 ulp from the nearest rounding, and not all
    of them on it. The moments do not depend on the rounding: identical to the compiled step's."""
    bf16 = dict(dtype=torch.bfloat16, steps=1, maximize=True)  # the reference compiled above
    rounded, rounded_state, _ = run(Lion4bit, "cpu", **bf16)
    torch.manual_seed(3)
    stochastic, stochastic_state, _ = run(Lion4bit, "cpu", **bf16, bf16_stochastic_round=True)
    for state in (rounded_state, stochastic_state):
        for saved_id, entry in compiled(Lion4bit, **bf16)[1]["state"].items():
            assert torch.equal(state["state"][saved_id]["exp_avg"].codes, entry["exp_avg"].codes)
    moved = 0
    for param, nearest in zip(stochastic, rounded):
        distance = (param.view(torch.int16).int() - nearest.view(torch.int16).int()).abs()
        assert distance.max() <= 1
        moved += int(distance.sum())
    assert moved > 1000


@pytest.mark.parametrize("cls", [Lion8bit, AdEMAMix4bit], ids=lambda c: c.__name__)
def test_bit_identical_at_1_and_3_threads(cls):
    """Five tasks of ~64K elements; bfloat16 with stochastic rounding, whose noise is a hash of
    the element's index, so neither it nor anything else depends on the thread count."""
    results = []
    for threads in (1, 3):
        with num_threads(threads):
            torch.manual_seed(1)
            params, state, optimizer = run(cls, "cpu", dtype=torch.bfloat16, steps=2, shapes=[(300_001,)],
                                           bf16_stochastic_round=True)
            assert kernel_entries(optimizer) == 1
            results.append((params, state))
    (params_1, state_1), (params_3, state_3) = results
    assert torch.equal(params_1[0].view(torch.int16), params_3[0].view(torch.int16))
    assert_same_state(state_1, state_3)


def test_float64_parameters_take_the_compiled_step():
    """The reference updates float64 parameters in float64; the kernel computes in float32,
    so the plan leaves them to the compiled step (whose own tests cover it)."""
    plans = {}
    for dtype in (torch.float64, torch.float32):
        param = torch.zeros(777, dtype=dtype)
        exp_avg = QuantizedState.zeros(param.shape, DYNAMIC_8BIT_SIGNED, 256, dtype=dtype)
        entry = RuleEntry(param, torch.ones_like(param), (exp_avg,), torch.tensor(1.0))
        plans[dtype] = RulePlan(LION_RULE, [entry], "cpu")
    assert not plans[torch.float64].cpu_indices and len(plans[torch.float64].quantized) == 1
    assert len(plans[torch.float32].cpu_indices) == 1 and not plans[torch.float32].quantized


@pytest.mark.parametrize("cls", slow_except([Lion4bit, AdEMAMix8bit], AdEMAMix8bit), ids=lambda c: c.__name__)
def test_checkpoints_move_between_kernel_and_compiled_step(cls):
    def train(backends_per_phase):
        generator = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]
        state = None
        for backend in backends_per_phase:
            optimizer = cls(params, lr=LR[cls], weight_decay=0.1, backend=backend, min_quant_size=0,
                            **options(cls))
            if state is not None:
                optimizer.load_state_dict(state)
            for _ in range(2):
                for param in params:
                    param.grad = gradient(param.shape, torch.float32, generator)
                optimizer.step()
            assert kernel_entries(optimizer) == (len(SHAPES) if backend == "cpu" else 0)
            state = optimizer.state_dict()
        return [p.detach().clone() for p in params], state

    reference, reference_state = train(["compile", "compile"])
    for order in (["cpu", "compile"], ["compile", "cpu"]):
        params, state = train(order)
        assert all(torch.equal(bits(p), bits(e)) for p, e in zip(params, reference)), order
        assert_same_state(state, reference_state)


def test_every_kernel_source_is_hashed_and_packaged():
    """The build's hash covers every file under ``csrc/`` (an edited rule header rebuilds the
    library), and the wheel's package data carries them all (the build happens on the user's
    machine, from the installed files)."""
    import fnmatch
    import pathlib

    import tomllib

    root = pathlib.Path(cpu_kernel.__file__).resolve().parents[2]
    files = {path.relative_to(cpu_kernel.SOURCE_DIR).as_posix() for path in cpu_kernel.SOURCE_DIR.rglob("*")
             if path.is_file()}
    assert files == set(cpu_kernel.SOURCES) | set(cpu_kernel.HEADERS)
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for name in files:
        packaged = f"step/csrc/{name}"
        assert any(fnmatch.fnmatch(packaged, pattern) and pattern.count("/") == packaged.count("/")
                   for pattern in patterns["lowbit_optim"]), packaged
