"""The Triton kernel on a real GPU against the CPU reference.

Every test here is marked ``cuda`` (skipped without a GPU; ``benchmarks/gpu_check.sh`` runs
them). They compare the compiled kernel with the AdamW rule's quantized step run eagerly **on the
CPU**, with the bounds the kernel documents (``tests/kernel_helpers.py``: scales
identical, codes one map step at most and only next to a bin edge, parameters within one ulp
plus 2**-20 of the update), and check what only a GPU shows: groups past 2**31 elements,
misaligned views, fp16, amsgrad, bfloat16 stochastic rounding, and a training loop's layout
rebuilds, host-to-device copies and synchronisations.
"""

import pytest
import torch
from kernel_helpers import (
    KINDS,
    SCHEDULE,
    assert_params_close,
    assert_states_equal,
    gradient,
    hyper_tensors,
    kernel_step,
    make_case,
    reference_step,
)

from lowbit_optim import AdamW4bit, AdamW8bit
from lowbit_optim.state import QuantizedState

pytestmark = pytest.mark.cuda


def on(device, param, states):
    return param.to(device), [state.to(device) for state in states]


def run_against_cpu_reference(cases, *, steps=SCHEDULE, maximize=False):
    """``cases``: ``[(param, states)]`` on CUDA. Each step: the kernel on CUDA, the reference
    on CPU copies; compared, then the CPU result copied back so one edge case never compounds."""
    for step, (lr, betas, weight_decay) in enumerate(steps, start=1):
        hyper = hyper_tensors(lr, betas, weight_decay, step)
        grads = [gradient(p.numel(), p.dtype).view(p.shape) for p, _ in cases]
        reference = [on("cpu", p, s) for p, s in cases]
        kernel_step([(p, g.cuda(), s) for (p, s), g in zip(cases, grads)], hyper, maximize=maximize)
        for index, ((param, states), (ref_param, ref_states), grad) in enumerate(
                zip(cases, reference, grads)):
            before = ref_param.double() * (1 - lr * weight_decay)
            reference_step(ref_param, grad, ref_states, hyper, maximize=maximize)
            name = f"param {index}, step {step}"
            assert_states_equal([s.to("cpu") for s in states], ref_states, name)
            assert_params_close(param.cpu(), ref_param, name, update=ref_param.double() - before)
            param.copy_(ref_param)
            for state, ref_state in zip(states, ref_states):
                state.codes.copy_(ref_state.codes)
                state.scales.copy_(ref_state.scales)


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", list(KINDS))
def test_cuda_kernel_matches_the_cpu_reference(kind, dtype, amsgrad):
    cases = []
    for numel in (65536, 4097, 1000, 123 * 123):
        param, states = make_case(numel, kind, dtype, amsgrad=amsgrad)
        cases.append(on("cuda", param, states))
    run_against_cpu_reference(cases)
    run_against_cpu_reference(cases, steps=SCHEDULE[:1], maximize=True)


def test_cuda_misaligned_views_match_the_cpu_reference():
    """Views one element into a buffer (not 16-byte aligned) take the unaligned launch."""
    cases = []
    for numel in (4096, 5000):
        param, states = make_case(numel, "8bit", torch.float32)
        buffer = torch.empty(numel + 1, device="cuda")
        view = buffer[1:]
        view.copy_(param)
        assert view.data_ptr() % 16
        cases.append((view, [s.to("cuda") for s in states]))
    run_against_cpu_reference(cases)


def test_cuda_group_past_2_31_elements():
    """Three tensors, 2**31 + 1064 elements in one launch (~22 GB with gradients and state).
    Blocks are independent, so the blocks next to every tensor boundary and around element
    2**31 of the group are checked against the CPU reference run on just those blocks."""
    fmt_m, fmt_v, block = KINDS["8bit"]
    sizes = [2**30 + 48, 2**30 + 16, 1000]
    generator = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(n, device="cuda", generator=generator) for n in sizes]
    grads = [torch.randn(n, device="cuda", generator=generator) for n in sizes]
    states = [[QuantizedState.zeros((n,), fmt, block, device="cuda") for fmt in (fmt_m, fmt_v)]
              for n in sizes]
    # Per tensor: its first two and last two blocks; in tensor 1 also the blocks around the
    # group's element 2**31 (offset 2**31 - sizes[0] in tensor 1).
    around = (2**31 - sizes[0]) // block
    watched = [[0, 1, -2, -1], [0, 1, around - 1, around, around + 1, -2, -1], [0, -1]]
    watched = [[b % -(-n // block) for b in blocks] for blocks, n in zip(watched, sizes)]
    before = [[(param[b * block:(b + 1) * block].cpu(), grad[b * block:(b + 1) * block].cpu())
               for b in blocks] for param, grad, blocks in zip(params, grads, watched)]
    hyper = hyper_tensors(1e-3, (0.9, 0.999), 0.01, 1)
    kernel_step([(p, g, s) for p, g, s in zip(params, grads, states)], hyper)
    for index, (param, tensor_states, blocks) in enumerate(zip(params, states, watched)):
        for (value, grad), b in zip(before[index], blocks):
            numel = value.numel()
            expected = [QuantizedState.zeros((numel,), fmt, block) for fmt in (fmt_m, fmt_v)]
            reference_step(value, grad, expected, hyper)
            actual = [QuantizedState(s.codes[b:b + 1].cpu(), s.scales[b:b + 1].cpu(), s.format_name, (numel,))
                      for s in tensor_states]
            name = f"tensor {index}, block {b}"
            assert_states_equal(actual, expected, name)
            assert_params_close(param[b * block:(b + 1) * block].cpu(), value, name)


@pytest.mark.parametrize("optimizer_class", [AdamW8bit, AdamW4bit], ids=lambda c: c.__name__)
def test_cuda_bf16_stochastic_rounding_statistics_and_repeatability(optimizer_class):
    """Unbiased on average (a step smaller than half a bf16 ulp still moves the mean) and the
    same noise for the same step counts, whatever torch's generator does in between."""
    torch.manual_seed(0)
    values = torch.full((1 << 20,), 1.0, device="cuda", dtype=torch.bfloat16)
    runs = []
    for seed in (1, 2):
        param = torch.nn.Parameter(values.clone())
        optimizer = optimizer_class([param], lr=1e-3, weight_decay=0.0, bf16_stochastic_round=True)
        torch.manual_seed(seed)
        param.grad = torch.ones_like(param)
        optimizer.step()
        runs.append(param.detach().float())
    assert torch.equal(runs[0], runs[1]), "the noise depends on the step, not on torch's generator"
    # One step moves each element by -lr = -1e-3, a quarter of bf16's ulp at 1.0 (2**-7/2).
    mean_move = float(runs[0].mean() - 1.0)
    assert abs(mean_move + 1e-3) < 5e-5, mean_move
    assert len(torch.unique(runs[0])) == 2, "each element rounds to one of its two neighbours"


def test_cuda_training_loop_layout_rebuilds_copies_and_syncs(monkeypatch):
    """A real loop with zero_grad(set_to_none=True): gradients are new tensors every step, so
    a layout's gradient column may be replaced (the caching allocator often hands back the
    same blocks); that copies one small table from pinned memory, the only host-to-device
    copy a step makes. After the first step nothing is planned or built from scratch, and
    no step synchronises with the device."""
    from lowbit_optim.step import plan as step_plan
    from lowbit_optim.step.kernels import layout as layouts

    events = []

    def counting(name, function):
        return lambda *args, **kwargs: events.append(name) or function(*args, **kwargs)

    monkeypatch.setattr(layouts, "build_layout", counting("build", layouts.build_layout))
    monkeypatch.setattr(layouts, "with_column", counting("gradients", layouts.with_column))
    monkeypatch.setattr(step_plan.GroupPlan, "__init__", counting("plan", step_plan.GroupPlan.__init__))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512))
    model = model.cuda()
    optimizer = AdamW4bit(model.parameters(), lr=1e-3)
    data = torch.randn(64, 512, device="cuda")
    per_step = []
    for _ in range(6):
        optimizer.zero_grad(set_to_none=True)
        model(data).square().mean().backward()
        events.clear()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            torch.cuda.set_sync_debug_mode("error")
            try:
                optimizer.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
        copies = sum("HtoD" in event.name for event in profile.events())
        per_step.append((copies, events.count("plan"), events.count("build"), events.count("gradients")))
    # The first step plans and builds (and copies the maps' tables once per process). Every
    # size here is a multiple of 16: one launch, whose gradient column later steps may replace.
    assert per_step[0][1] == 1 and per_step[0][2] == 1
    for copies, plans, builds, gradient_updates in per_step[1:]:
        assert plans == 0 and builds == 0 and gradient_updates <= 1 and copies <= gradient_updates
