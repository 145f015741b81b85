"""AdamWFactored4bit in the C++ CPU kernel (``backend="cpu"``) against the compiled step
(``backend="compile"``, the reference on CPU) and, for the variants of dtype and flags, the
eager step with a correctly rounded square root (the same float32 operations, without a
compile per variant).

The element pass (``csrc/rules/adamw_factored.h``) performs ``AdamWFactoredRule.update``'s float32
operations in its order (AdamW's update shared with ``rules/adamw.h``), so from the same
statistics the first moment's codes and scales and the parameters are compared for exact
equality: every instruction-set path, odd shapes (columns that are not a multiple of the block,
partial last blocks, blocks spanning several rows, a 3-D parameter), NaN, ±inf and 1e30
gradients, maximize, L2 decay, bf16 and fp16 parameters rounded or with master weights, a
learning rate that changes each step. Those runs take the reference's own statistics pass and
column normalisation (``use_reference_statistics``), so that only the element pass differs.

The statistics pass (``csrc/factored_statistics.h``) sums the reference's float64 terms in
another order, so a statistic may differ by one float32 ulp per step (docs/cpu_kernel.md gives
the argument); the end-to-end runs check the statistics within ``STATISTIC_ULPS`` and the
parameters within the bound that follows (``parameter_bound``). bf16 stochastic rounding uses
the kernel's own random bits: within one bfloat16 ulp of the rounded step.
"""

import functools

import pytest
import torch
from conftest import num_threads
from helpers import assert_same_state, available_isas, make_scalars

from lowbit_optim import AdamWFactored4bit, FactoredState, QuantizedState
from lowbit_optim.state.factored import normalized_columns
from lowbit_optim.step import chunks, cpu_kernel
from lowbit_optim.step.chunks import TailScratch
from lowbit_optim.step.factored import FactoredParams, accumulate_statistics
from lowbit_optim.step.math import adam_ratio_bound
from lowbit_optim.step.rule_step import RuleEntry
from lowbit_optim.step.rules.adamw import ADAMW

# (33, 70): 2310 = 18 * 128 + 6, columns not a multiple of the block; (12, 300): columns above
# the block, 3600 = 28 * 128 + 16; (40, 64): two rows per block; (4, 9, 40): factored as (36, 40).
SHAPES = [(33, 70), (12, 300), (40, 64), (4, 9, 40)]
STEPS = 4
LRS = [1e-2, 3e-3, 2e-2, 5e-3]  # changed before each step
BETAS = (0.9, 0.999)
ISA_ENV = cpu_kernel.ISA_ENV
# Each statistic is within one float32 ulp of the reference's per step (summation order), and
# a difference carries into the next step's beta2 * statistic (plus one rounding): STEPS ulps
# after STEPS steps, doubled for the float32 sums of the columns' chunks and the mean in
# normalized_columns.
STATISTIC_ULPS = 2 * STEPS


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if not cpu_kernel.load():
        pytest.skip("the C++ CPU step could not be built here")


def gradient(shape, dtype, generator) -> torch.Tensor:
    """Gradients over many magnitudes with NaN, ±inf, 1e30 and a run of zeros."""
    magnitude = 10 ** (torch.rand(shape, generator=generator) * 8 - 6)
    grad = (magnitude * torch.where(torch.rand(shape, generator=generator) < 0.5, -1.0, 1.0)).flatten()
    grad[::97] = float("nan")
    grad[5::89] = float("inf")
    grad[7::91] = -float("inf")
    grad[11::83] = 1e30
    grad[200:330] = 0.0
    return grad.view(shape).to(dtype)


def kernel_entries(optimizer) -> int:
    """How many factored parameters the optimizer's plans step in the C++ kernel."""
    return sum(sum(cache.plan.rule_plan.factored.kernel) for cache in optimizer._caches
               if cache.plan.rule_plan.factored is not None)


def run(backend: str, *, dtype=torch.float32, steps=STEPS, shapes=SHAPES, state=None, generator_seed=0,
        **kwargs):
    """``steps`` steps on ``shapes`` (every one factored) from fixed seeds, the learning rate
    changed each step; returns the parameters, the state dict and the optimizer."""
    generator = torch.Generator().manual_seed(generator_seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in shapes]
    # decoupled_weight_decay=False (L2, as torch.optim.Adam) is a param group option.
    group = {"params": params, "decoupled_weight_decay": kwargs.pop("decoupled_weight_decay", True)}
    optimizer = AdamWFactored4bit([group], lr=LRS[0], betas=BETAS, weight_decay=0.1, backend=backend,
                                  min_quant_size=0, **kwargs)
    if state is not None:
        optimizer.load_state_dict(state)
    for step in range(steps):
        optimizer.param_groups[0]["lr"] = LRS[step % len(LRS)]
        for param in params:
            param.grad = gradient(param.shape, dtype, generator)
        optimizer.step()
    return [p.detach().clone() for p in params], optimizer.state_dict(), optimizer


_SCRATCH = TailScratch()


def reference_statistics(backend: str):
    """``FactoredParams._kernel_statistics`` replaced by the reference's statistics pass
    (``"compile"`` or ``"eager"``), so that only the element pass differs."""

    def statistics(self, kernel, grads, hyper, *, flags):
        for position, (index, entry) in enumerate(self.entries):
            if kernel[position]:
                FactoredParams._accumulate_statistics(
                    backend, entry._replace(grad=grads[index]), hyper, self.column_means[position],
                    self.all_rows[position], _SCRATCH, flags=flags)

    return statistics


def reference_columns(self, kernel, hyper):
    """``FactoredParams._kernel_columns`` replaced by the foreach accumulation and
    ``normalized_columns`` the other backends run."""
    positions = [position for position, by_kernel in enumerate(kernel) if by_kernel]
    accumulate_statistics([self.entries[p][1].moments[1].col for p in positions], hyper.beta2,
                          [self.column_means[p] for p in positions])
    for position in positions:
        normalized_columns(self.entries[position][1].moments[1].col, out=self.normalized_columns[position])


def use_reference_statistics(monkeypatch, backend: str) -> None:
    """The kernel's statistics pass and column normalisation replaced by the reference's."""
    monkeypatch.setattr(FactoredParams, "_kernel_statistics", reference_statistics(backend))
    monkeypatch.setattr(FactoredParams, "_kernel_columns", reference_columns)


@functools.cache
def compiled(**kwargs):
    """The reference run (shared by every instruction set's comparison)."""
    params, state, optimizer = run("compile", **kwargs)
    assert kernel_entries(optimizer) == 0
    return params, state


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits (so that -0.0 and 0.0 differ)."""
    return tensor.view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


def assert_element_pass_matches_compiled(monkeypatch, isa, **kwargs):
    monkeypatch.setenv(ISA_ENV, isa)
    use_reference_statistics(monkeypatch, "compile")
    params, state, optimizer = run("cpu", **kwargs)
    assert kernel_entries(optimizer) == len(SHAPES)
    expected_params, expected_state = compiled(**kwargs)
    assert_same_state(state, expected_state)
    for param, expected in zip(params, expected_params):
        assert torch.equal(bits(param), bits(expected))


@pytest.mark.parametrize("isa", available_isas())
def test_element_pass_matches_compiled_step(monkeypatch, isa):
    assert_element_pass_matches_compiled(monkeypatch, isa)


# The flags ride along with the dtypes, so that each case is one more path of the kernel.
VARIANTS = {
    "fp32-maximize-l2": dict(maximize=True, decoupled_weight_decay=False),
    "bf16-rounded": dict(dtype=torch.bfloat16),
    "bf16-master24-l2": dict(dtype=torch.bfloat16, master_weight_bits=24, decoupled_weight_decay=False),
    "fp16-master32-maximize": dict(dtype=torch.float16, master_weight_bits=32, maximize=True),
}


def use_ieee_sqrt(monkeypatch):
    """Eager steps with a correctly rounded float32 sqrt, as Inductor's code and the kernel have
    (the float64 root of a float32 value, rounded once to float32, is the correctly rounded one)."""
    eager_sqrt = torch.Tensor.sqrt
    monkeypatch.setattr(torch.Tensor, "sqrt", lambda self: eager_sqrt(self.double()).to(self.dtype))


@pytest.mark.parametrize("variant", VARIANTS)
def test_element_pass_variants_match_eager_step(monkeypatch, variant):
    """Maximize, L2 decay, bfloat16 and float16 parameters rounded or with their master
    weight's correction (compared as part of the state), on the widest and the portable path,
    against the eager step: the pure-PyTorch reference, whose float32 operations the compiled
    step performs too (``test_element_pass_matches_compiled_step`` holds the kernel to that),
    but for torch's eager CPU square root, not correctly rounded (tests/test_cpu_kernel.py), so
    it runs here with a correctly rounded one. Compiling a reference per variant instead cost
    about 70 s of the suite's cold run."""
    use_ieee_sqrt(monkeypatch)
    use_reference_statistics(monkeypatch, "eager")
    expected_params, expected_state, _ = run("eager", **VARIANTS[variant])
    for isa in {cpu_kernel.default_isa(), "scalar"}:
        monkeypatch.setenv(ISA_ENV, isa)
        params, state, optimizer = run("cpu", **VARIANTS[variant])
        assert kernel_entries(optimizer) == len(SHAPES)
        assert_same_state(state, expected_state)
        for param, expected in zip(params, expected_params):
            assert torch.equal(bits(param), bits(expected))


def ulps_apart(actual: torch.Tensor, expected: torch.Tensor) -> int:
    """The largest distance in float32 ulps (non-negative values: their bits are ordered)."""
    return int((actual.view(torch.int32).long() - expected.view(torch.int32).long()).abs().max())


def parameter_bound(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """How far the kernel's parameters may be from the reference's after ``STEPS`` steps whose
    statistics differ by ``STATISTIC_ULPS``: the second moment ``row * col / mean(col)`` is then
    within ``3 * STATISTIC_ULPS`` ulps (relative ``2**-23`` each), its square root and the ratio
    within half that, and the update ``lr / (1 - beta1**t) * ratio`` (|ratio| at most Adam's
    bound) within that relative amount, each step; plus one ulp of the parameter per step where
    the two updates round to neighbours (and the decay carries it)."""
    relative = 1.5 * STATISTIC_ULPS * 2.0**-23
    betas = [torch.tensor(beta, dtype=torch.float64) for beta in BETAS]
    update = sum(lr / (1 - BETAS[0] ** t) * float(adam_ratio_bound(*betas, torch.tensor(float(t))))
                 for t, lr in enumerate(LRS[:STEPS], start=1))
    return [relative * update + STEPS * torch.finfo(p.dtype).eps * p.abs().float() for p in params]


@pytest.mark.parametrize("variant", ["fp32", "fp32-maximize-l2", "bf16-master24-l2"])
def test_both_passes_stay_within_the_statistics_bound(monkeypatch, variant):
    """The C++ statistics: within ``STATISTIC_ULPS`` of the reference's; the first moment's
    codes identical where the parameter does not reach the gradient (decoupled decay); the
    parameters within ``parameter_bound``; the same on every instruction-set path. The
    reference is the eager step with a correctly rounded square root
    (``test_element_pass_variants_match_eager_step``): its float64 sums are in yet another
    order than the compiled pass's, which the bound covers alike."""
    arguments = VARIANTS.get(variant, {})
    use_ieee_sqrt(monkeypatch)
    expected_params, expected_state, _ = run("eager", **arguments)
    results = []
    for isa in available_isas():
        monkeypatch.setenv(ISA_ENV, isa)
        params, state, optimizer = run("cpu", **arguments)
        assert kernel_entries(optimizer) == len(SHAPES)
        for saved_id, entry in expected_state["state"].items():
            factored = state["state"][saved_id]["exp_avg_sq"]
            assert ulps_apart(factored.row, entry["exp_avg_sq"].row) <= STATISTIC_ULPS
            assert ulps_apart(factored.col, entry["exp_avg_sq"].col) <= STATISTIC_ULPS
            if arguments.get("decoupled_weight_decay", True):
                assert torch.equal(state["state"][saved_id]["exp_avg"].codes, entry["exp_avg"].codes)
        for param, expected, bound in zip(params, expected_params, parameter_bound(expected_params)):
            assert ((param.float() - expected.float()).abs() <= bound).all()
        results.append((params, state))
    for params, state in results[1:]:
        assert all(torch.equal(bits(p), bits(q)) for p, q in zip(params, results[0][0]))
        assert_same_state(state, results[0][1])


@pytest.mark.parametrize("flags", [dict(maximize=False, decoupled_weight_decay=True),
                                   dict(maximize=True, decoupled_weight_decay=False)],
                         ids=["plain", "maximize-l2"])
def test_statistics_of_a_row_shard_in_chunks_match_compiled_pass(monkeypatch, flags):
    """An FSDP2 shard's pass (20 of 50 rows: the column shares over all 50, which
    ``sharding.sum_across_shards`` then adds up) in chunks of 4 rows, from non-zero statistics:
    the row statistics within one ulp, the column shares within one ulp per chunk (each chunk's
    share is rounded to float32 and added in float32, as the compiled pass adds them)."""
    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 300)  # 4 rows of 70: 5 chunks
    generator = torch.Generator().manual_seed(5)
    param = torch.randn(20, 70, generator=generator)
    grad = gradient((20, 70), torch.float32, generator)
    hyper = make_scalars(weight_decay=0.1)
    results = []
    for kernel in (True, False):
        factored = FactoredState.zeros(param.shape)
        factored.row.copy_(torch.rand(20, generator=torch.Generator().manual_seed(6)))
        exp_avg = QuantizedState.zeros(param.shape, AdamWFactored4bit.exp_avg_format, 128)  # its format only
        entry = (0, RuleEntry(param, None, (exp_avg, factored), hyper.step))
        # The parameter as the optimizer holds it says how many rows there are in all (a
        # DTensor's global shape under FSDP2): 50, of which this shard holds 20.
        whole = torch.empty(50, 70)
        params = FactoredParams([entry], [whole], kernel=[True], kernel_isa=cpu_kernel.default_isa())
        statistics = FactoredParams._kernel_statistics if kernel else reference_statistics("compile")
        statistics(params, [True], [grad], hyper, flags=flags)
        results.append((factored.row, params.column_means[0]))
    (row, columns), (expected_row, expected_columns) = results
    assert ulps_apart(row, expected_row) <= 1
    assert ulps_apart(columns, expected_columns) <= 5
    assert (columns > 0).all()  # every column saw a finite gradient


@pytest.mark.slow
def test_bf16_stochastic_rounding_stays_within_one_ulp(monkeypatch):
    """The kernel's random bits are its own: parameters are one of the two bfloat16 neighbours
    of the rounded step's update, and not all of them on it; the first moment is unchanged."""
    use_reference_statistics(monkeypatch, "compile")
    bf16 = dict(dtype=torch.bfloat16, steps=1)
    rounded, rounded_state, _ = run("cpu", **bf16)
    torch.manual_seed(3)
    stochastic, stochastic_state, _ = run("cpu", **bf16, bf16_stochastic_round=True)
    for saved_id, entry in rounded_state["state"].items():
        other = stochastic_state["state"][saved_id]
        assert torch.equal(other["exp_avg"].codes, entry["exp_avg"].codes)
        assert torch.equal(other["exp_avg_sq"].row, entry["exp_avg_sq"].row)
    moved = 0
    for param, nearest in zip(stochastic, rounded):
        distance = (param.view(torch.int16).int() - nearest.view(torch.int16).int()).abs()
        assert distance.max() <= 1
        moved += int(distance.sum())
    assert moved > 100


def test_column_statistics_accumulate_as_foreach_and_normalise_within_one_ulp():
    """``cpu_factored_columns`` against the foreach accumulation and ``normalized_columns``: the
    accumulated columns bit for bit (zeros, NaN, inf and a saturating sum included), the
    normalised ones within one float32 ulp (the mean's float64 sum in another order)."""
    generator = torch.Generator().manual_seed(0)
    beta2 = torch.tensor(0.999, dtype=torch.float64)
    cols, means = [], []
    for length in (1, 7, 64, 1000, 40000):  # statistics over twelve decades
        cols.append(10 ** (torch.rand(length, generator=generator) * 12 - 8))
        means.append(10 ** (torch.rand(length, generator=generator) * 12 - 10))
    cols.append(torch.zeros(50))  # no gradient seen yet
    means.append(torch.zeros(50))
    cols.append(torch.full((30,), 3e38))  # beta2 * 3e38 + 3e38 overflows: the largest float32
    means.append(torch.full((30,), 3e38))
    special = torch.rand(40, generator=generator)
    special[3], special[9] = float("nan"), float("inf")
    cols.append(special)
    means.append(torch.rand(40, generator=generator))
    expected = [col.clone() for col in cols]
    accumulate_statistics(expected, beta2, means)
    expected_normalized = [normalized_columns(col) for col in expected]
    normalized = [torch.empty_like(col) for col in cols]
    torch.ops.lowbit_optim.cpu_factored_columns(cols, means, normalized, beta2=beta2)
    for col, expected_col in zip(cols, expected):
        assert torch.equal(bits(col), bits(expected_col))
    assert torch.equal(cols[-2], torch.full((30,), torch.finfo(torch.float32).max))
    assert not normalized[-3].any()
    assert normalized[-1].isnan().all()
    for values, expected_values in zip(normalized[:-1], expected_normalized[:-1]):
        assert (bits(values) - bits(expected_values)).abs().max() <= 1


def test_bit_identical_at_1_and_3_threads():
    """Several tiles of rows (statistics) and tasks of blocks (update): their order is fixed by
    the shape, and the stochastic rounding's noise is a hash of the element's index."""
    results = []
    for threads in (1, 3):
        with num_threads(threads):
            torch.manual_seed(1)
            params, state, optimizer = run("cpu", dtype=torch.bfloat16, steps=2, shapes=[(700, 400)],
                                           bf16_stochastic_round=True)
            assert kernel_entries(optimizer) == 1
            results.append((params, state))
    (params_1, state_1), (params_3, state_3) = results
    assert torch.equal(bits(params_1[0]), bits(params_3[0]))
    assert_same_state(state_1, state_3)


def test_checkpoints_move_between_kernel_and_compiled_step(monkeypatch):
    """A state saved by either backend continues on the other as on its own (the element pass
    exact: the compiled statistics in both)."""
    use_reference_statistics(monkeypatch, "compile")

    def train(backends):
        _, state, _ = run(backends[0], steps=2)
        return run(backends[1], steps=2, state=state, generator_seed=1)

    reference, reference_state, _ = train(["compile", "compile"])
    for order in (["cpu", "compile"], ["compile", "cpu"]):
        params, state, _ = train(order)
        assert all(torch.equal(bits(p), bits(e)) for p, e in zip(params, reference)), order
        assert_same_state(state, reference_state)


def test_float64_and_mixed_gradient_parameters_take_the_compiled_step():
    """The reference updates float64 parameters in float64, and the kernel reads a gradient of
    the parameter's dtype: the plan leaves both to the compiled step."""
    def plan(dtype, grad_dtype):
        param = torch.zeros(40, 64, dtype=dtype)
        exp_avg_format = AdamWFactored4bit.exp_avg_format
        entry = RuleEntry(param, torch.ones(40, 64, dtype=grad_dtype),
                          (QuantizedState.zeros(param.shape, exp_avg_format, 128, dtype=dtype),
                           FactoredState.zeros(param.shape, dtype=dtype)), torch.tensor(1.0))
        return ADAMW.plan([entry], "cpu", [param]).factored.kernel

    assert plan(torch.float32, torch.float32) == [True]
    assert plan(torch.bfloat16, torch.bfloat16) == [True]
    assert plan(torch.float64, torch.float64) == [False]
    assert plan(torch.bfloat16, torch.float32) == [False]
