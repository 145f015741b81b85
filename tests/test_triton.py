"""The Triton kernel against the eager reference (``step.rule_step.quantized_rule_step``), the
AdamW rule (other rules and the op: tests/test_triton_rules.py, tests/test_triton_op.py).

On CPU the kernel runs under the Triton interpreter: ``TRITON_INTERPRET=1`` is set below,
before ``lowbit_optim.step.kernels`` is imported, because Triton reads it when a kernel is defined
(only ``lowbit_optim.step.dispatch`` imports the kernels otherwise, and only for the "triton"
backend). CUDA-marked tests check what the interpreter cannot: the hardware bfloat16 cast,
the absence of host-to-device copies, and no re-JIT when hyperparameters change.

Tolerances: tests/kernel_helpers.py.
"""


import pytest
import torch
from conftest import assert_close_verbose

from lowbit_optim import (
    AdamW4bit,
    AdamW8bit,
    AdamWFactored4bit,
    AdamWFp8,
    FactoredState,
)
from lowbit_optim.state import QuantizedState, sharding
from lowbit_optim.step import cpu_kernel
from lowbit_optim.step.dispatch import resolve_backend
from lowbit_optim.step.math import adam_ratio_bound
from lowbit_optim.step.rules.adamw import adamw_kernel_constants

pytest.importorskip("triton")
from kernel_helpers import (  # noqa: E402
    KINDS,
    SCHEDULE,
    LaunchCounter,
    assert_params_close,
    assert_states_equal,
    gradient,
    hyper_tensors,
    kernel_step,
    make_case,
    plan_step,
    reference_step,
    run_against_reference,
)

from lowbit_optim.step import kernels  # noqa: E402
from lowbit_optim.step.kernels import launcher, param_access  # noqa: E402

# NaN gradients (the non-finite policy) flow into the interpreter's numpy division before the
# kernel's selects put the old values back.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")

@pytest.mark.sweep
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(100,), (256,), (4097,), (123, 123)], ids=str)
@pytest.mark.parametrize("kind", list(KINDS))
def test_matches_reference(kind, shape, dtype):
    numel = torch.Size(shape).numel()
    param, states = make_case(numel, kind, dtype)
    run_against_reference([(param.view(shape), None, states)])


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("kind", list(KINDS))
def test_encoder_at_bin_edges(kind):
    """Moments placed on and one or two ulps around every bin edge of both maps (table
    midpoints, and powers of ten where the 8-bit maps change decade), in blocks whose largest
    value is 1, so they reach the encoder unscaled. With beta1 = beta2 = 0 the new moments are
    g and g * g."""
    exp_avg_format, exp_avg_sq_format, block_size = KINDS[kind]
    edges = [torch.tensor(10.0) ** -k for k in range(9)]
    for fmt in (exp_avg_format, exp_avg_sq_format):
        edges += list((fmt.table[1:] + fmt.table[:-1]) / 2)
    edges = torch.stack(edges).float().abs()
    near = [edges]
    for direction in (0.0, 2.0):
        stepped = edges
        for _ in range(2):
            stepped = torch.nextafter(stepped, torch.full_like(stepped, direction))
            near.append(stepped)
    values = torch.cat(near)
    values = torch.cat([values, -values, values.sqrt()])
    per_block = block_size - 1
    blocks = -(-values.numel() // per_block)
    body = torch.zeros(blocks * per_block)
    body[: values.numel()] = values
    grad = torch.cat([torch.ones(blocks, 1), body.view(blocks, per_block)], dim=1)
    param, states = make_case(grad.numel(), kind, torch.float32)
    for state in states:
        state.quantize_(torch.zeros(grad.numel()))
    reference = [s.clone() for s in states]
    ref_param = param.clone()
    hyper = hyper_tensors(1e-3, (0.0, 0.0), 0.0, 1)
    kernel_step([(param, grad.view(-1), states)], hyper)
    reference_step(ref_param, grad.view(-1), reference, hyper)
    # Every block's largest value is 1, so the scale is 1 and the new moments g and g * g are
    # the normalised values themselves.
    grad = grad.view(-1)
    assert_states_equal(states, reference, "bin edges", values=[grad, grad * grad])


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("kind", list(KINDS))
def test_amsgrad_maximize(kind):
    param, states = make_case(1000, kind, torch.float32, amsgrad=True)
    run_against_reference([(param, None, states)], maximize=True)


@pytest.fixture
def launches(monkeypatch, interpreter):
    counter = LaunchCounter(launcher.lowbit_step_kernel)
    monkeypatch.setattr(launcher, "lowbit_step_kernel", counter)
    return counter


@pytest.mark.parametrize("kind", list(KINDS))
def test_many_params_one_launch(kind, launches):
    sizes = [4096, 1, 300, 5000, 129, 2048, 777, 256, 4097, 64, 1000, 3]
    cases = []
    for numel in sizes:
        param, states = make_case(numel, kind, torch.bfloat16)
        cases.append((param, None, states))
    run_against_reference(cases, steps=SCHEDULE[:2])
    # Per step: the aligned launch (sizes that are multiples of 16) and the unaligned one.
    assert launches.aligned == [True, False, True, False]


@pytest.mark.parametrize("kind", list(KINDS))
def test_misaligned_tensor_launches_alone(kind, launches):
    """Sizes that are multiples of 16 share one aligned launch; a view one element into its
    storage goes to a second, unaligned launch without taking the others with it."""
    cases = []
    for numel in (4096, 272, 1024):
        param, states = make_case(numel, kind, torch.float32)
        cases.append((param, None, states))
    run_against_reference(cases, steps=SCHEDULE[:1])
    assert launches.aligned == [True]
    storage = torch.randn(2049)
    odd = storage[1:]  # 2048 elements, 4 bytes past a 16-byte boundary
    assert odd.data_ptr() % 16 != 0
    cases.append((odd, None, make_case(2048, kind, torch.float32)[1]))
    run_against_reference(cases, steps=SCHEDULE[:1])
    assert launches.aligned == [True, True, False]


@pytest.mark.parametrize("kind", list(KINDS))
def test_odd_size_splits_off_its_last_block(kind, launches, monkeypatch):
    """An aligned parameter of 4097 elements: its whole blocks take the aligned launch and only
    its last, partial block the unaligned one."""
    from lowbit_optim.step.kernels import layout as layouts

    seen = []
    real = launcher.launch_one

    def record(bases, layout, *args):
        seen.append((layout.aligned, layout.table[:, layouts.NUMEL].tolist()))
        return real(bases, layout, *args)

    monkeypatch.setattr(launcher, "launch_one", record)
    param, states = make_case(4097, kind, torch.float32)
    block_size = states[0].block_size
    run_against_reference([(param, None, states)], steps=SCHEDULE[:2])
    body = 4097 // block_size * block_size
    assert seen == [(True, [body]), (False, [4097 - body])] * 2


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_parameter_splits_off_its_last_block(kind, launches):
    """Two parameters whose partial last blocks both take the unaligned launch: one piece per
    gradient there too, each starting inside its gradient (at 4096 and 768, so the offsets
    between the gradients' starts do not give the pieces' offsets)."""
    cases = []
    for numel in (4097, 777):
        param, states = make_case(numel, kind, torch.float32)
        cases.append((param, None, states))
    run_against_reference(cases, steps=SCHEDULE[:2])
    assert launches.aligned == [True, False] * 2


@pytest.mark.usefixtures("interpreter")
def test_kinds_launch_separately(launches):
    """Different dtypes or step counts cannot share a launch; each kind gets exactly one (sizes
    that are multiples of 16: no unaligned tail launch)."""
    cases = [(*make_case(512, "8bit", dtype)[:1], None, make_case(512, "8bit", dtype)[1])
             for dtype in (torch.float32, torch.float32, torch.float16)]
    hyper = hyper_tensors(1e-3, (0.9, 0.999), 0.0, 1)
    entries = [(p, torch.randn(512).to(p.dtype), s, hyper[5]) for p, _, s in cases]
    entries[1] = (*entries[1][:3], torch.tensor(7.0))
    plan_step(entries, hyper)
    assert len(launches.grids) == 3


@pytest.mark.usefixtures("interpreter")
def test_stochastic_rounding_is_unbiased():
    """bf16 stochastic rounding: every result is one of the two bf16 neighbours of the float32
    update, and their mean is the float32 value (round-to-nearest would keep all at 1.0)."""
    numel = 8192
    param = torch.ones(numel, dtype=torch.bfloat16)
    states = make_case(numel, "8bit", torch.float32)[1]
    for state in states:
        state.quantize_(torch.zeros(numel))
    hyper = hyper_tensors(1e-4, (0.9, 0.999), 0.0, 1)
    kernel_step([(param, torch.ones(numel, dtype=torch.bfloat16), states)], hyper, stochastic_round=True)
    # First step from zero moments: m / (sqrt(v) / bc2 + eps) = 1 - 1e-8/1 for g = 1.
    expected = 1.0 - 1e-4 * (1.0 / (1.0 + 1e-8))
    values = param.float()
    below = torch.tensor(expected).to(torch.bfloat16).float()  # rounds to 1.0 - 2**-8 or 1.0
    assert set(values.unique().tolist()) <= {1.0, 1.0 - 2.0**-8}, values.unique()
    assert below == 1.0
    # P(down) = 1e-4 / 2**-8 = 0.0256; the mean's standard deviation is 2**-8 * sqrt(p(1-p)/n).
    std = 2.0**-8 * (0.0256 * (1 - 0.0256) / numel) ** 0.5
    assert abs(values.double().mean().item() - expected) < 5 * std


@pytest.mark.usefixtures("interpreter")
def test_stochastic_rounding_follows_torch_seed():
    results = []
    for _ in range(2):
        torch.manual_seed(3)
        param, states = make_case(600, "4bit", torch.bfloat16)
        kernel_step([(param, gradient(600, torch.bfloat16), states)],
                    hyper_tensors(1e-2, (0.9, 0.999), 0.0, 1), stochastic_round=True)
        results.append(param)
    assert torch.equal(results[0], results[1])


def test_factored_optimizer_with_the_triton_backend(launches):
    """AdamWFactored4bit with backend="triton": its factored weight goes through the compiled
    factored step (the kernel has no factored variant; within float rounding of eager), its
    1-D quantized parameter through the kernel, one launch per step."""
    torch.manual_seed(1)
    weights = [torch.randn(64, 80), torch.randn(4096)]  # 4096: one aligned launch per step
    runs = {}
    for backend in ("triton", "eager"):
        leaves = [torch.nn.Parameter(w.clone()) for w in weights]
        optimizer = AdamWFactored4bit(leaves, min_quant_size=1000, backend=backend)
        torch.manual_seed(2)
        for _ in range(2):
            for leaf in leaves:
                leaf.grad = torch.randn_like(leaf)
            optimizer.step()
        runs[backend] = (leaves, optimizer)
    (triton_leaves, triton_opt), (eager_leaves, _) = runs["triton"], runs["eager"]
    assert len(launches.grids) == 2
    assert isinstance(triton_opt.state[triton_leaves[0]]["exp_avg_sq"], FactoredState)
    torch.testing.assert_close(triton_leaves[0].detach(), eager_leaves[0].detach(), rtol=1e-6, atol=1e-7)
    assert_params_close(triton_leaves[1].detach(), eager_leaves[1].detach(), "1-D param")


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("optimizer_class", [AdamW8bit, AdamW4bit, AdamWFp8], ids=lambda c: c.__name__)
def test_optimizer_triton_backend_matches_eager(optimizer_class):
    """The whole optimizer: several quantized params in one group (one of them a transposed,
    non-contiguous view), a small float32-state bias, two groups, LR and betas changed
    between steps."""
    torch.manual_seed(1)
    weights = [torch.randn(64, 80), torch.randn(70, 60).t(), torch.randn(4097), torch.randn(10)]
    runs = {}
    for backend in ("triton", "eager"):
        leaves = [torch.nn.Parameter(w.clone()) for w in weights]
        assert not leaves[1].is_contiguous()
        optimizer = optimizer_class([{"params": leaves[:2]}, {"params": leaves[2:], "lr": 3e-3}],
                                    min_quant_size=1000, backend=backend)
        torch.manual_seed(2)
        for lr, betas, weight_decay in SCHEDULE:
            for group in optimizer.param_groups:
                group["lr"], group["betas"], group["weight_decay"] = lr, betas, weight_decay
            for leaf in leaves:
                leaf.grad = torch.randn_like(leaf)
            optimizer.step()
        runs[backend] = (leaves, optimizer)
    (triton_leaves, triton_opt), (eager_leaves, eager_opt) = runs["triton"], runs["eager"]
    for index, (a, e) in enumerate(zip(triton_leaves, eager_leaves)):
        assert_params_close(a.detach(), e.detach(), f"param {index}")
        state_a, state_e = triton_opt.state[a], eager_opt.state[e]
        if isinstance(state_a["exp_avg"], QuantizedState):
            assert_states_equal([state_a["exp_avg"], state_a["exp_avg_sq"]],
                                [state_e["exp_avg"], state_e["exp_avg_sq"]], f"param {index}")


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.81), (0.5, 0.0), (0.0, 0.99)])
def test_host_ratio_bound_is_adams_own(betas):
    """The kernel's clamp (a host float) is ``step.math.adam_ratio_bound``."""
    for step in (1, 2, 10, 1000):
        expected = adam_ratio_bound(*(torch.tensor(v, dtype=torch.float64) for v in (*betas, step)))
        assert adamw_kernel_constants(1e-3, *betas, 1e-8, 0.0, step).max_ratio == pytest.approx(
            float(expected), rel=1e-12)


def test_backend_resolution(monkeypatch):
    cpu = [torch.device("cpu")]
    # CPU parameters default to the C++ kernel where it builds, never to the interpreter.
    cpu_default = "cpu" if cpu_kernel.load() else "compile"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend(None, cpu) == cpu_default
    assert resolve_backend("triton", cpu) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert resolve_backend(None, cpu) == cpu_default
    with pytest.raises(ValueError, match="needs CUDA parameters"):
        AdamW8bit([torch.nn.Parameter(torch.zeros(5000))], backend="triton")
    assert resolve_backend(None, [torch.device("cuda")]) == "triton"


# --- CUDA: what the interpreter cannot show ---------------------------------------------------
def _compiled_variants(kernel) -> int:
    """Number of compiled variants Triton keeps for ``kernel`` (its JIT cache)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(cache) for cache in kernel.cache.values())


@pytest.mark.cuda
@pytest.mark.parametrize("kind", list(KINDS))
def test_cuda_hardware_bf16_cast_rounds_to_nearest_even(kind):
    """On the GPU the kernel casts float32 -> bfloat16 in hardware: the bf16 result must equal
    torch's round-to-nearest-even cast of the same kernel's float32 result."""
    param, states = make_case(50_000, kind, torch.float32)
    param = param.to(torch.bfloat16).float().cuda()  # bf16 values, float32 storage
    states = [s.to("cuda") for s in states]
    bf16_param, bf16_states = param.to(torch.bfloat16), [s.clone() for s in states]
    grad = gradient(50_000, torch.float32).cuda()
    hyper = hyper_tensors(1e-2, (0.9, 0.999), 0.01, 1)
    kernel_step([(param, grad, states)], hyper)
    kernel_step([(bf16_param, grad, bf16_states)], hyper)
    assert torch.equal(bf16_param, param.to(torch.bfloat16))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", list(KINDS))
def test_cuda_within_stated_bounds(kind, dtype):
    """The compiled kernel (approximate reciprocal, sqrt and division, ftz quotient) against the
    eager CUDA reference, step by step from equal states: scales identical, codes one map step
    at most and rarely, parameters within one ulp plus 2**-20 of the update (the bounds derived
    in the kernel docstring; aligned and unaligned launches both)."""
    cases = []
    for numel in (65536, 4097, 1000):
        param, states = make_case(numel, kind, dtype)
        cases.append((param.cuda(), None, [s.to("cuda") for s in states]))
    run_against_reference(cases)


@pytest.mark.cuda
@pytest.mark.parametrize("optimizer_class", [AdamW8bit, AdamW4bit, AdamWFp8], ids=lambda c: c.__name__)
def test_cuda_matches_eager_no_copies_no_rejit(optimizer_class):
    """backend=None picks Triton on CUDA; against eager CUDA the codes may differ only at
    rounding ties (eager CUDA divides by a scalar as a multiply by its reciprocal), counted
    and bounded; no host-to-device copy and no new JIT variant once LR and betas change."""
    torch.manual_seed(0)
    shapes = [(512, 256), (1000,), (4097,), (123, 123)]
    runs = {}
    for backend in (None, "eager"):
        params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
        optimizer = optimizer_class(params, min_quant_size=1000, backend=backend)
        runs[backend] = (params, optimizer)
    assert runs[None][1].backend == "triton"
    variants_after_first_step = None
    for lr, betas, weight_decay in SCHEDULE * 2:
        grads = [torch.randn(s, device="cuda") for s in shapes]
        for params, optimizer in runs.values():
            for group in optimizer.param_groups:
                group["lr"], group["betas"], group["weight_decay"] = lr, betas, weight_decay
            for p, g in zip(params, grads):
                p.grad = g.clone()
            optimizer.step()
        if variants_after_first_step is None:
            variants_after_first_step = _compiled_variants(launcher.lowbit_step_kernel)
    assert _compiled_variants(launcher.lowbit_step_kernel) == variants_after_first_step
    params, optimizer = runs[None]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        optimizer.step()
        torch.cuda.synchronize()
    names = [event.name for event in profile.events()]
    assert not [n for n in names if "HtoD" in n], "host-to-device copy during a step"
    # One aligned launch (512 x 256) and one unaligned launch (sizes not multiples of 16).
    assert sum("lowbit_step_kernel" in n for n in names) == 2, "one launch per alignment class"
    # A tie resolved differently moves that element's moment by one bin and its later updates by
    # up to a few lr; everything else agrees to float rounding.
    total_lr = 2 * sum(lr for lr, _, _ in SCHEDULE)
    for a, e in zip(*(runs[b][0] for b in (None, "eager"))):
        state_a, state_e = runs[None][1].state[a], runs["eager"][1].state[e]
        allowed = max(2, a.numel() // 1000)
        for key in ("exp_avg", "exp_avg_sq"):
            different = int((state_a[key].codes != state_e[key].codes).sum())
            assert different <= allowed, (key, different)
        away = int((~torch.isclose(a.detach(), e.detach(), rtol=1e-5, atol=1e-7)).sum())
        assert away <= 2 * allowed, f"{away} parameters differ by more than float rounding"
        assert_close_verbose(a.detach(), e.detach(), rtol=0.0, atol=3 * total_lr, name="cuda params")


# --- host side: layouts, device, seeds ---------------------------------------------------
def test_layout_table_and_cache_key_include_dtypes():
    """The table holds each tensor's offset in elements from its list's first tensor; the same
    addresses with another element size are another layout, not a cache hit."""
    from lowbit_optim.step.kernels import layout as layouts

    layouts.clear_cache()
    buffer = torch.zeros(64)
    floats = [buffer[:16], buffer[16:32]]
    halves = [buffer.view(torch.bfloat16)[:16], buffer.view(torch.bfloat16)[32:48]]
    assert [t.data_ptr() for t in floats] == [t.data_ptr() for t in halves]
    lists = lambda tensors: [tensors] * 8  # noqa: E731
    as_float = layouts.get_layout(lists(floats), [16, 16], 16, 1, torch.device("cpu"), aligned=True)
    as_bf16 = layouts.get_layout(lists(halves), [16, 16], 16, 1, torch.device("cpu"), aligned=True)
    assert as_float.table[1, :8].tolist() == [16] * 8
    assert as_bf16.table[1, :8].tolist() == [32] * 8
    assert as_float.table[:, layouts.NUMEL].tolist() == [16, 16]
    assert as_float.program_param.tolist() == [0, 1] and as_float.num_programs == 2
    with pytest.raises(ValueError, match="not aligned"):
        layouts.get_layout(lists([buffer[1:17], buffer[17:33]]), [16, 16], 16, 1, torch.device("cpu"),
                           aligned=True)


def test_split_aligned_keeps_the_rest_together():
    from lowbit_optim.step.kernels import layout as layouts

    good = [torch.zeros(256) for _ in range(3)]
    odd_size, odd_view = torch.zeros(100), torch.zeros(257)[1:]
    params = [good[0], odd_size, good[1], odd_view, good[2]]
    assert layouts.split_aligned([params] * 8) == [(True, [0, 2, 4]), (False, [1, 3])]
    assert layouts.split_aligned([[odd_size]] * 8) == [(False, [0])]


def test_device_guard_is_the_parameters_device():
    guard = launcher.device_guard(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    with launcher.device_guard(torch.device("cpu")):
        pass


@pytest.mark.usefixtures("interpreter")
def test_stochastic_rounding_seed_from_the_step_count_and_a_stream():
    """With a rounding stream the noise is a function of (stream, step count): it repeats
    without torch's generator and leaves its state alone; another stream (another rank or
    group) or another step count gives other noise."""
    results = []
    for stream, step in ((5, 1.0), (5, 1.0), (6, 1.0), (5, 2.0)):
        torch.manual_seed(11)
        param, states = make_case(600, "4bit", torch.bfloat16)
        grad = gradient(600, torch.bfloat16)
        torch.manual_seed(stream * 1000)  # a different global state each time
        rng_before = torch.get_rng_state()
        plan_step([(param, grad, states, torch.tensor(step))], hyper_tensors(1e-2, (0.9, 0.999), 0.0, 1),
                  stochastic_round=True, rounding_stream=stream)
        assert torch.equal(torch.get_rng_state(), rng_before)
        results.append(param)
    assert torch.equal(results[0], results[1])
    assert not torch.equal(results[0], results[2]) and not torch.equal(results[0], results[3])
    seeds = {kernels.stochastic_round_seed(c, s) for c in range(100) for s in range(3)}
    assert len(seeds) == 300 and all(0 <= s < 2**31 for s in seeds)


@pytest.mark.usefixtures("interpreter")
def test_random_bits_use_the_whole_64_bit_index():
    import triton
    import triton.language as tl

    @triton.jit
    def bits_kernel(index_ptr, out_ptr, seed, N: tl.constexpr):
        offsets = tl.arange(0, N)
        tl.store(out_ptr + offsets, param_access.random_bits16(seed, tl.load(index_ptr + offsets)))

    index = torch.arange(256, dtype=torch.int64)
    index = torch.cat([index, index + 2**32, index + 2**40, index + 2**33])
    out = torch.empty(1024, dtype=torch.int32)
    bits_kernel[(1,)](index, out, 1234, N=1024)
    low, high, higher, _ = out.view(4, 256)
    assert (low != high).float().mean() > 0.95 and (low != higher).float().mean() > 0.95
    assert int(out.min()) >= 0 and int(out.max()) < 2**16


@pytest.mark.usefixtures("interpreter")
def test_optimizer_stochastic_rounding_resumes_exactly_without_rng_state(monkeypatch):
    """The optimizer's noise comes from its step counts and its rank: a run resumed from a
    state dict (torch's generator not restored) matches the uninterrupted one bit for bit,
    the user's random stream is untouched, and another rank rounds differently."""
    torch.manual_seed(0)
    start = torch.randn(64, 80).bfloat16()
    grads = [torch.randn(64, 80).bfloat16() for _ in range(4)]

    def run(steps, resume_from=None):
        param = torch.nn.Parameter(start.clone())
        optimizer = AdamW4bit([param], bf16_stochastic_round=True, min_quant_size=0, backend="triton")
        if resume_from is not None:
            param.data.copy_(resume_from[0])
            optimizer.load_state_dict(resume_from[1])
        for grad in steps:
            param.grad = grad.clone()
            rng_before = torch.get_rng_state()
            optimizer.step()
            assert torch.equal(torch.get_rng_state(), rng_before)
        return param.detach().clone(), optimizer.state_dict()

    uninterrupted, _ = run(grads)
    middle = run(grads[:2])
    torch.manual_seed(123)  # a fresh process: another generator state
    resumed, _ = run(grads[2:], resume_from=middle)
    assert torch.equal(resumed, uninterrupted)
    monkeypatch.setattr(sharding, "rank", lambda: 1)
    other_rank, _ = run(grads)
    assert not torch.equal(other_rank, uninterrupted)


@pytest.mark.usefixtures("interpreter")
def test_gradient_release_through_the_kernel_matches_ordinary_stepping():
    """``release_gradients`` launches the kernel once per parameter in backward instead of
    once per kind at ``step()``: the same parameters and codes (no stochastic rounding,
    whose noise depends on the position in the launch: docs/gradient_release.md)."""
    from lowbit_optim import release_gradients

    runs = []
    for release in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Linear(80, 70))
        optimizer = AdamW4bit(model.parameters(), lr=1e-2, min_quant_size=1024, backend="triton")
        if release:
            release_gradients(optimizer)
        for step in range(2):
            inputs = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
            model(inputs).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        runs.append((list(model.parameters()), optimizer))
    (params, ordinary), (released_params, released) = runs
    assert all(map(torch.equal, params, released_params))
    for param, other in zip(params, released_params):
        for key in ("exp_avg", "exp_avg_sq"):
            moment, other_moment = ordinary.state[param][key], released.state[other][key]
            if isinstance(moment, QuantizedState):
                moment, other_moment = (torch.cat([m.codes.flatten().float(), m.scales.flatten()])
                                        for m in (moment, other_moment))
            assert torch.equal(moment, other_moment), key
