"""Lion and AdEMAMix with low-bit state: the rule modules (``step.rules``) against
bitsandbytes' fp32 optimizers, the quantized classes against the rule's fp32 step, every
backend, schedules without recompiles, checkpoints, extreme gradients, master weights and
bitsandbytes' arguments."""

import io

import pytest
import torch
from conftest import relative_rmse, slow_except
from helpers import STEPS, assert_same_state, regression_problem, train
from torch.optim import lr_scheduler

from lowbit_optim import AdEMAMix4bit, AdEMAMix8bit, Lion4bit, Lion8bit, QuantizedState, state_bytes
from lowbit_optim.step.hyperparams import GroupScalars
from lowbit_optim.step.master_weights import CORRECTION_KEY, read_master
from lowbit_optim.step.rule_step import rule_graph_count

bnb = pytest.importorskip("bitsandbytes")

LION = (Lion8bit, Lion4bit)
ADEMAMIX = (AdEMAMix8bit, AdEMAMix4bit)
CLASSES = (*LION, *ADEMAMIX)
# Every moment in float: the rule's exact step (``min_quant_size`` above any tensor here).
FLOAT_STATE = dict(min_quant_size=10**9)
WEIGHT_DECAY = 1.0  # large, so that the decay's placement matters
# Lion moves every element by lr per step: 1e-3 over 20 steps stays a fraction of the weights.
LR = {Lion8bit: 1e-3, Lion4bit: 1e-3, AdEMAMix8bit: 1e-2, AdEMAMix4bit: 1e-2}
# The warm-ups of alpha and beta3 end within the 20 steps, so both schedules are exercised.
SCHEDULES = dict(t_alpha=10, t_beta3=10)


def options(cls) -> dict:
    return dict(SCHEDULES) if cls in ADEMAMIX else {}


def fp32_rule(cls, lr_scale: float = 1.0):
    """``cls``'s rule with float moments (its exact step), the LR scaled by ``lr_scale``."""
    return lambda p, lr, **kw: cls(p, lr=lr * lr_scale, backend="eager", **FLOAT_STATE, **options(cls), **kw)


def bitsandbytes_fp32(cls):
    """bitsandbytes' 32-bit optimizer of ``cls``'s rule, with the same schedules."""
    if cls in LION:
        return bnb.optim.Lion
    return lambda params, **kw: bnb.optim.AdEMAMix(params, **SCHEDULES, **kw)


def run(factory, cls, **kw):
    return train(factory, STEPS, lr=LR[cls], weight_decay=WEIGHT_DECAY, **kw)


# --- the rule's fp32 step is bitsandbytes' ------------------------------------------------------
# Measured (2-core Xeon): Lion's float step equals bitsandbytes' Lion bit for bit (relative RMSE
# of the change 0.0); AdEMAMix's differs from bitsandbytes' AdEMAMix by 1.1e-7 (its C++ kernel
# divides m1 by the bias correction before adding alpha * m2; we divide the ratio), float32
# rounding over 20 steps. Bound 1e-5: a wrong bias correction or schedule moves it by >1e-3.
# (bitsandbytes' pure-PyTorch ``_ReferenceAdEMAMix`` overwrites the scheduled alpha and beta3
# in its parameter loop, so its second parameter gets them scheduled twice: not the reference.)
FP32_BOUND = 1e-5


@pytest.mark.parametrize("cls", [Lion8bit, AdEMAMix8bit], ids=lambda c: c.__name__)
def test_fp32_step_matches_bitsandbytes_fp32_optimizer(cls):
    initial, weight, bias, _ = run(fp32_rule(cls), cls)
    _, expected, expected_bias, _ = run(bitsandbytes_fp32(cls), cls)
    assert relative_rmse(weight - initial, expected - initial) < FP32_BOUND
    assert relative_rmse(bias, expected_bias) < FP32_BOUND


def test_fp32_bound_catches_a_wrong_schedule():
    initial, weight, _, _ = run(fp32_rule(AdEMAMix8bit), AdEMAMix8bit)
    _, unscheduled, _, _ = run(lambda p, **kw: bnb.optim.AdEMAMix(p, t_alpha=10, **kw), AdEMAMix8bit)
    assert relative_rmse(weight - initial, unscheduled - initial) > 100 * FP32_BOUND


# --- quantized state against the rule's fp32 step --------------------------------------------
# Relative error of the parameter change after 20 steps against the same rule with float
# moments. Measured: Lion8bit 0.022 (bitsandbytes' Lion8bit: 0.022), Lion4bit 0.116,
# AdEMAMix8bit 0.0229 (bitsandbytes' AdEMAMix8bit: 0.0230), AdEMAMix4bit 0.328 (the 4-bit
# second moment's zero-free linear map over-estimates small values, as for AdamW4bit, whose
# bound is the same 0.45). The 8-bit bound fails a 10% wrong LR (checked below).
CHANGE_ERROR_BOUND = {Lion8bit: 0.04, Lion4bit: 0.2, AdEMAMix8bit: 0.04, AdEMAMix4bit: 0.45}

# The compiled step of each class and format is a graph of its own (~20 s on 2 cores): the fast
# tier compiles the 8-bit ones (tests/test_cpu_kernel_rules.py compares them with the C++ kernel);
# the 4-bit ones, whose format the compiled AdamW4bit covers there, are the slow tier's.
BACKEND_CASES = [pytest.param(cls, backend, marks=pytest.mark.slow) if backend == "compile" and cls in (
    Lion4bit, AdEMAMix4bit) else (cls, backend) for cls in CLASSES for backend in ("eager", "compile")]


def case_id(value):
    return getattr(value, "__name__", value)


@pytest.mark.parametrize("cls, backend", BACKEND_CASES, ids=case_id)
def test_quantized_state_follows_the_fp32_rule(cls, backend):
    initial, weight, _, optimizer = run(lambda p, **kw: cls(p, backend=backend, **options(cls), **kw), cls)
    _, expected, _, _ = run(fp32_rule(cls), cls)
    state = optimizer.state[optimizer.param_groups[0]["params"][0]]
    assert all(isinstance(state[key], QuantizedState) for key in optimizer.rule.all_moment_keys)
    assert relative_rmse(weight - initial, expected - initial) < CHANGE_ERROR_BOUND[cls]


@pytest.mark.parametrize("cls", [Lion8bit, AdEMAMix8bit], ids=lambda c: c.__name__)
def test_8bit_bound_is_tight_enough_to_catch_a_wrong_lr(cls):
    initial, expected, _, _ = run(fp32_rule(cls), cls)
    _, scaled, _, _ = run(fp32_rule(cls, 1.1), cls)
    assert relative_rmse(scaled - initial, expected - initial) > CHANGE_ERROR_BOUND[cls]


# --- backends -----------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", slow_except(CLASSES, Lion8bit, AdEMAMix8bit), ids=lambda c: c.__name__)
def test_every_backend_steps_alike(cls):
    """Eager and compiled differ by Inductor's float rounding only; on CPU ``backend=None``
    (the C++ kernel for AdamW) steps a rule without a kernel of its own through the compiled
    step, bit for bit. Whole blocks and a tail (12480 elements), a small float tensor too."""
    torch.manual_seed(0)
    shapes = [(96, 130), (7,)]
    weights = [torch.randn(shape) for shape in shapes]
    runs = {}
    for backend in ("eager", "compile", None):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        optimizer = cls(params, backend=backend, lr=1e-2, weight_decay=0.1, **options(cls))
        generator = torch.Generator().manual_seed(1)
        for _ in range(5):
            for param in params:
                param.grad = torch.randn(param.shape, generator=generator)
            optimizer.step()
        runs[backend] = (params, optimizer)
    eager, compiled, default = (runs[b][0] for b in ("eager", "compile", None))
    assert relative_rmse(compiled[0], eager[0]) < 1e-5
    assert all(torch.equal(a, b) for a, b in zip(default, compiled))
    assert_same_state(runs[None][1].state_dict(), runs["compile"][1].state_dict())


@pytest.mark.parametrize("cls", [Lion8bit, AdEMAMix8bit], ids=lambda c: c.__name__)
def test_schedules_never_recompile(cls):
    """An LR schedule, AdEMAMix's alpha and beta3 warm-ups, two shapes and a tail: one graph."""
    params = [torch.nn.Parameter(torch.randn(64, 100)), torch.nn.Parameter(torch.randn(33, 257))]
    optimizer = cls(params, lr=1e-2, backend="compile", **options(cls))
    scheduler = lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=20)
    counts = []
    for _ in range(12):
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer.step()
        scheduler.step()
        formats = tuple(optimizer.state[params[0]][key].format for key in optimizer.rule.all_moment_keys)
        counts.append(rule_graph_count(optimizer.rule, formats))
    assert counts[-1] == counts[0] >= 1


# --- checkpoints --------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_checkpoint_resumes_bit_exactly(cls):
    """Save after 3 steps (``torch.save``, loaded with ``weights_only=True``), resume 3 more in a
    new optimizer: the same parameters and state as 6 uninterrupted steps."""
    torch.manual_seed(0)
    initial = [torch.randn(40, 130), torch.randn(30)]
    grads = [[torch.randn_like(w) for w in initial] for _ in range(6)]

    def make():
        params = [torch.nn.Parameter(w.clone()) for w in initial]
        return params, cls(params, lr=1e-2, backend="eager", min_quant_size=1000, **options(cls))

    def steps(params, optimizer, which):
        for step in which:
            for param, grad in zip(params, grads[step]):
                param.grad = grad.clone()
            optimizer.step()

    params, optimizer = make()
    steps(params, optimizer, range(6))
    resumed_params, resumed = make()
    steps(resumed_params, resumed, range(3))
    buffer = io.BytesIO()
    torch.save(resumed.state_dict(), buffer)
    buffer.seek(0)
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in resumed_params]
    fresh = cls(fresh_params, lr=1e-2, backend="eager", min_quant_size=1000, **options(cls))
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    steps(fresh_params, fresh, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(fresh_params, params))
    assert_same_state(fresh.state_dict(), optimizer.state_dict())


@pytest.mark.parametrize("saver, loader, message", [
    # Its groups already do not fit: Lion's betas are a pair, AdEMAMix needs three.
    (Lion8bit, AdEMAMix8bit, r"parameter group 0 of the loaded state dict: Invalid betas"),
    # The groups fit (lr, betas, weight_decay); the state holds a moment Lion does not keep.
    (torch.optim.AdamW, Lion8bit, "state has exp_avg_sq, which Lion8bit does not keep"),
], ids=["lion-into-ademamix", "torch-adamw-into-lion"])
def test_state_dict_of_another_rule_is_refused_before_anything_changes(saver, loader, message):
    param = torch.nn.Parameter(torch.randn(64, 64))
    saving = saver([param])
    param.grad = torch.randn_like(param)
    saving.step()
    loading = loader([param])
    with pytest.raises(ValueError, match=message):
        loading.load_state_dict(saving.state_dict())
    assert not loading.state


# --- memory ---------------------------------------------------------------------------------------
# Bytes per parameter of a large tensor: codes (1 or 1/2 byte) plus one float32 scale per block,
# per moment. fp32 Lion keeps 4, fp32 AdEMAMix 12.
BYTES_PER_PARAM = {Lion8bit: 1 + 4 / 256, Lion4bit: 0.5 + 4 / 128,
                   AdEMAMix8bit: 3 * (1 + 4 / 256), AdEMAMix4bit: 3 * (0.5 + 4 / 128)}


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_state_bytes_per_parameter(cls):
    param = torch.nn.Parameter(torch.randn(256, 512))
    optimizer = cls([param])
    param.grad = torch.randn_like(param)
    optimizer.step()
    assert state_bytes(optimizer) == BYTES_PER_PARAM[cls] * param.numel()  # moments only, as torch counts


# --- extreme gradients ----------------------------------------------------------------------------
def largest_move(optimizer, step: int) -> float:
    """How far exact arithmetic lets an element move at ``step`` (weight decay 0): Lion ``lr``;
    AdEMAMix ``lr * (fast_bound / bc1 + alpha * slow_bound)`` (``rules.ademamix``)."""
    scalars = GroupScalars(optimizer.rule)
    scalars.refresh(optimizer.param_groups[0])
    if isinstance(optimizer, LION):
        return float(scalars.lr)
    c = optimizer.rule.step_constants(scalars, torch.tensor(float(step)))
    return float(c.lr * (c.fast_bound / c.bias_correction1 + c.alpha * c.slow_bound))


@pytest.mark.parametrize("cls, backend", BACKEND_CASES, ids=case_id)
def test_extreme_gradients_leave_parameters_finite(cls, backend):
    """NaN and inf elements keep their values; a gradient of 3e38 (its square overflows float32,
    and a quantized second moment stores it at its block's scale) moves its element no further
    than exact arithmetic could, and every element stays finite."""
    param = torch.nn.Parameter(torch.zeros(4096))
    optimizer = cls([param], lr=1e-3, weight_decay=0.0, backend=backend, **options(cls))
    for step in range(1, 6):
        grad = torch.full((4096,), 1e-3)
        grad[0], grad[1], grad[2] = float("nan"), float("inf"), 3e38 if step == 3 else 1.0
        before = param.detach().clone()
        param.grad = grad
        optimizer.step()
        assert torch.isfinite(param).all()
        assert param[0] == before[0] and param[1] == before[1]
        # One float32 rounding of the parameter on top of the bound.
        assert (param - before).abs().max() <= largest_move(optimizer, step) * (1 + 1e-6) + 1e-9


# --- master weights, maximize -----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("cls", [Lion8bit, AdEMAMix8bit], ids=lambda c: c.__name__)
def test_32_bit_master_weights_follow_the_fp32_parameter_run_bit_for_bit(cls):
    torch.manual_seed(0)
    start = torch.randn(64, 100).bfloat16().float()
    grads = [torch.randn(64, 100) for _ in range(4)]
    fp32 = torch.nn.Parameter(start.clone())
    bf16 = torch.nn.Parameter(start.bfloat16())
    optimizers = [cls([fp32], backend="compile", **options(cls)),
                  cls([bf16], backend="compile", master_weight_bits=32, **options(cls))]
    for grad in grads:
        # The same gradient values for both: the bf16 run's, read in float32 by the step.
        bf16.grad = grad.bfloat16()
        fp32.grad = bf16.grad.float()
        for optimizer in optimizers:
            optimizer.step()
    master = optimizers[1].state[bf16][CORRECTION_KEY]
    assert torch.equal(read_master(bf16.detach(), master), fp32.detach())


@pytest.mark.parametrize("cls", [Lion4bit, AdEMAMix8bit], ids=lambda c: c.__name__)
def test_maximize_ascends(cls):
    initial, ascended, _, _ = run(lambda p, **kw: cls(p, maximize=True, backend="eager", **kw), cls)
    _, descended, _, _ = run(lambda p, **kw: cls(p, backend="eager", **kw), cls)
    inputs, targets, _ = regression_problem()

    def loss(weight):
        return torch.nn.functional.mse_loss(inputs @ weight.T, targets)

    assert loss(ascended) > loss(initial) > loss(descended)


# --- bitsandbytes users' arguments --------------------------------------------------------------
def test_bitsandbytes_positional_arguments_and_defaults():
    param = torch.nn.Parameter(torch.randn(10))
    lion = Lion8bit([param], 3e-4, (0.95, 0.98), 0.1, None, 2048)
    assert lion.defaults["lr"] == 3e-4 and lion.defaults["betas"] == (0.95, 0.98)
    assert lion.defaults["weight_decay"] == 0.1 and lion.defaults["min_quant_size"] == 2048
    assert Lion8bit([param]).defaults["lr"] == 1e-4 and Lion8bit([param]).defaults["betas"] == (0.9, 0.99)
    ademamix = AdEMAMix8bit([param], 1e-3, (0.9, 0.999, 0.9999), 8.0, 100, 200)
    assert [ademamix.defaults[key] for key in ("alpha", "t_alpha", "t_beta3")] == [8.0, 100, 200]
    assert AdEMAMix8bit([param]).defaults["weight_decay"] == 1e-2
    assert AdEMAMix8bit([param], min_8bit_size=10).defaults["min_quant_size"] == 10
    assert Lion4bit([param]).defaults["block_size"] == 128 and Lion8bit([param]).defaults["block_size"] == 256


@pytest.mark.parametrize("make, message", [
    (lambda p: AdEMAMix8bit(p, betas=(0.9, 0.999)), r"Invalid betas: \(0.9, 0.999\) \(a 3-tuple"),
    (lambda p: AdEMAMix8bit(p, t_alpha=0), "Invalid t_alpha: 0"),
    (lambda p: AdEMAMix8bit(p, t_beta3=1.5), "Invalid t_beta3: 1.5"),
    (lambda p: AdEMAMix8bit(p, alpha=-1.0), "Invalid alpha value: -1.0"),
    (lambda p: AdEMAMix8bit(p, betas=(0.0, 0.999, 0.9999), t_beta3=10), "both must be > 0"),
    (lambda p: Lion8bit(p, betas=(0.9, 1.0)), "Invalid beta parameter at index 1: 1.0"),
    (lambda p: Lion8bit(p, lr=-1.0), "Invalid learning rate: -1.0"),
    (lambda p: Lion8bit(p, percentile_clipping=5), "Invalid percentile_clipping: 5"),
    (lambda p: Lion8bit(p, is_paged=True), "Invalid is_paged: True"),
    (lambda p: Lion8bit(p, block_wise=False), "Invalid block_wise: False"),
    (lambda p: Lion8bit(p, args={"x": 1}), "Invalid args"),
    (lambda p: Lion8bit(p, min_8bit_size=10, min_quant_size=20), "name the same threshold"),
])
def test_bad_arguments_are_refused_naming_the_value(make, message):
    with pytest.raises(ValueError, match=message):
        make([torch.nn.Parameter(torch.randn(10))])


def test_a_bad_value_set_in_a_group_later_is_refused_before_anything_changes():
    param = torch.nn.Parameter(torch.randn(64, 100))
    optimizer = AdEMAMix8bit([param], min_quant_size=1)
    param.grad = torch.randn_like(param)
    optimizer.step()
    before = (param.detach().clone(), optimizer.state[param]["exp_avg"].codes.clone())
    optimizer.param_groups[0]["alpha"] = float("nan")
    with pytest.raises(ValueError, match="Invalid alpha value: nan"):
        optimizer.step()
    assert torch.equal(param, before[0]) and torch.equal(optimizer.state[param]["exp_avg"].codes, before[1])
