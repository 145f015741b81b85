"""Helpers shared by several test modules. (Two modules still read another's setup:
test_master_weights.py runs test_distributed.py's 2-rank worker, test_huggingface_muon.py its
HF counterpart's tiny model and data.)"""

import socket
from typing import NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import distribute_tensor
from torch.optim import lr_scheduler

from lowbit_optim import AdamWFactored4bit, FactoredState, QuantizedState
from lowbit_optim.formats import catalog as formats
from lowbit_optim.step import cpu_kernel, factored, rule_step
from lowbit_optim.step.chunks import TailScratch
from lowbit_optim.step.hyperparams import StepOptions
from lowbit_optim.step.math import StepScalars
from lowbit_optim.step.rules.adamw import ADAMW, ADAMW_FACTORED

# The regression problem's length: the bounds against torch.optim.AdamW and Adam in
# tests/test_optimizer.py and tests/test_adam.py were measured at it.
STEPS = 20


def regression_problem(rows=64, cols=128, seed=0):
    """A least-squares problem (convex: quantization noise does not get amplified by chaos)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(256, cols, generator=generator)
    targets = inputs @ torch.randn(cols, rows, generator=generator) * 0.1
    weight = torch.randn(rows, cols, generator=generator) * 0.05
    return inputs, targets, weight


def train(optimizer_factory, steps, *, weight_decay=0.1, lr=1e-2, backend_kwargs=None):
    inputs, targets, initial = regression_problem()
    weight = torch.nn.Parameter(initial.clone())
    bias = torch.nn.Parameter(torch.zeros(initial.shape[0]))
    optimizer = optimizer_factory([weight, bias], lr=lr, weight_decay=weight_decay, **(backend_kwargs or {}))
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(inputs @ weight.T + bias, targets)
        loss.backward()
        optimizer.step()
    return initial, weight.detach(), bias.detach(), optimizer


def seeded_mlp(*widths: int, dtype=torch.float32, seed: int | None = 0) -> torch.nn.Sequential:
    """Linear layers ``widths[0] -> widths[1] -> ...`` with a Tanh between each two, drawn after
    ``torch.manual_seed(seed)`` (``None``: from the generator as it is), cast to ``dtype``."""
    if seed is not None:
        torch.manual_seed(seed)
    layers = []
    for inputs, outputs in zip(widths, widths[1:]):
        layers += [torch.nn.Tanh(), torch.nn.Linear(inputs, outputs)]
    return torch.nn.Sequential(*layers[1:]).to(dtype)


def assert_same_state(actual: dict, expected: dict) -> None:
    """Two optimizer state dicts hold bit-identical state and equal hyperparameters."""
    assert actual["state"].keys() == expected["state"].keys()
    for saved_id, entry in expected["state"].items():
        other = actual["state"][saved_id]
        assert other.keys() == entry.keys(), f"parameter {saved_id}"
        for key, value in entry.items():
            where = f"parameter {saved_id} {key}"
            if isinstance(value, FactoredState):
                assert isinstance(other[key], FactoredState), where
                assert (other[key].shape, other[key].dtype) == (value.shape, value.dtype), where
                assert torch.equal(other[key].row, value.row), where
                assert torch.equal(other[key].col, value.col), where
            elif isinstance(value, QuantizedState):
                assert isinstance(other[key], QuantizedState), where
                assert (other[key].format_name, other[key].shape, other[key].dtype) == (
                    value.format_name, value.shape, value.dtype), where
                assert torch.equal(other[key].codes, value.codes), where
                assert torch.equal(other[key].scales, value.scales), where
            else:
                assert other[key].dtype == value.dtype, where
                assert torch.equal(other[key], value), where
    assert len(actual["param_groups"]) == len(expected["param_groups"])
    for group, other in zip(expected["param_groups"], actual["param_groups"]):
        assert {k: float(v) if k == "lr" else v for k, v in group.items()} == {
            k: float(v) if k == "lr" else v for k, v in other.items()}


# Steps of tests/test_schedules.py's runs: the schedules below reach their ends within it.
SCHEDULE_STEPS = 30

# One of each torch LR scheduler kind, built on an optimizer.
SCHEDULES = {
    "LinearLR": lambda opt: lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=SCHEDULE_STEPS),
    "CosineAnnealingLR": lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=SCHEDULE_STEPS),
    "CosineAnnealingWarmRestarts": lambda opt: lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=7),
    "OneCycleLR": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=SCHEDULE_STEPS + 1),
    "LambdaLR": lambda opt: lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step)),
    "SequentialLR": lambda opt: lr_scheduler.SequentialLR(
        opt,
        [lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=5),
         lr_scheduler.ExponentialLR(opt, gamma=0.9)],
        milestones=[5]),
    "StepLR": lambda opt: lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
    "ReduceLROnPlateau": lambda opt: lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.7),
}


def graph_count(optimizer):
    """Graphs of the optimizer's compiled steps (the factored class has two more: its statistics
    pass and the step of its factored rule over the first moment alone)."""
    count = rule_step.rule_graph_count(ADAMW, (optimizer.exp_avg_format, optimizer.exp_avg_sq_format))
    if isinstance(optimizer, AdamWFactored4bit):
        count += factored.compiled_graph_count(optimizer.exp_avg_format)
        count += rule_step.rule_graph_count(ADAMW_FACTORED, (optimizer.exp_avg_format,))
    return count


def free_port() -> int:
    """A TCP port free on this machine now, for a spawned process group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- the C++ CPU step's tests (tests/test_cpu_kernel*.py) -------------------------------------

# The state kinds the kernel steps, by name: (first moment's format, second moment's format).
FORMAT_PAIRS = {
    "8bit": (formats.DYNAMIC_8BIT_SIGNED, formats.DYNAMIC_8BIT_UNSIGNED_NONZERO),
    "4bit": (formats.DYNAMIC_4BIT_SIGNED, formats.LINEAR_4BIT_NONZERO),
    "fp8": (formats.FLOAT8, formats.FLOAT8_NONZERO),
}


def available_isas():
    """The kernel's instruction-set paths this CPU runs."""
    capability = torch.backends.cpu.get_cpu_capability()
    isas = ["scalar"]
    if "AVX2" in capability or "AVX512" in capability:
        isas.append("avx2")
    if "AVX512" in capability:
        isas.append("avx512")
    return isas


def make_scalars(*, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, step=1):
    """A ``StepScalars`` of 0-d CPU tensors, as the optimizer passes them."""
    as64 = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    return StepScalars(as64(lr), as64(betas[0]), as64(betas[1]), as64(eps), as64(weight_decay),
                       torch.tensor(float(step)))


def spread_gradient(shape, dtype, generator):
    """Gradients spanning many magnitudes within a block (every decade of the 8-bit map)."""
    magnitude = 10 ** (torch.rand(shape, generator=generator) * 8 - 6)
    sign = torch.where(torch.rand(shape, generator=generator) < 0.5, -1.0, 1.0)
    return (magnitude * sign).to(dtype)


class KernelSetup:
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
            grad = spread_gradient(shape, dtype, generator)
            self.reference_step(self.param, self.states, grad, make_scalars(step=step))
        self.step = 4

    def entry(self, param, grad, states):
        return AdamWEntry(param, grad, states[0], states[1], states[2] if len(states) == 3 else None)

    def reference_step(self, param, states, grad, scalars, **flags):
        flags = {"maximize": False, "stochastic_round": False, "decoupled_weight_decay": True, **flags}
        entry = self.entry(param, grad, states)
        run_quantized_step("eager", entry, scalars, TailScratch(), **flags)

    def copies(self):
        return self.param.clone(), [s.clone() for s in self.states]


class AdamWEntry(NamedTuple):
    """An AdamW parameter and its quantized moments by name (``max_exp_avg_sq``: amsgrad's or
    None), and its master weight correction, if it keeps one."""

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: QuantizedState
    exp_avg_sq: QuantizedState
    max_exp_avg_sq: QuantizedState | None
    weight_correction: torch.Tensor | None = None


def run_quantized_step(backend: str, entry: AdamWEntry, scalars: StepScalars, scratch: TailScratch, *,
                       maximize: bool, stochastic_round: bool, decoupled_weight_decay: bool = True) -> None:
    """One AdamW parameter's compiled (``"compile"``) or eager quantized step at ``scalars.step``."""
    moments = tuple(moment for moment in entry[2:5] if moment is not None)
    plan = rule_step.RulePlan(ADAMW, [rule_step.RuleEntry(entry.param, entry.grad, moments, scalars.step,
                                                          entry.weight_correction)], backend)
    options = StepOptions(maximize, stochastic_round, None, decoupled_weight_decay)
    plan.run([entry.grad], scalars, options, scratch)


def assert_same_quantized(states, expected_states):
    """Lists of ``QuantizedState``s with identical scales and codes (the first few differing
    codes named)."""
    for state, expected in zip(states, expected_states):
        torch.testing.assert_close(state.scales, expected.scales, rtol=0, atol=0)
        mismatched = (state.codes != expected.codes).nonzero()
        assert mismatched.numel() == 0, f"{len(mismatched)} codes differ, first at {mismatched[:5].tolist()}"


def cpu_adamw_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, scalars, *, maximize: bool,
                   stochastic_round: bool, decoupled_weight_decay: bool = True,
                   isa: str | None = None, weight_correction: torch.Tensor | None = None) -> None:
    """One AdamW parameter's step with the kernel, in place: the compiled step's result.

    ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` or ``None``) are ``QuantizedState``s
    of the whole parameter; ``scalars``: ``lr``, ``beta1``, ``beta2``, ``eps``,
    ``weight_decay`` and ``step``, 0-d CPU tensors (``math.StepScalars``). ``isa`` forces a path
    (``"avx512"``, ``"avx2"``, ``"scalar"``; default ``default_isa()``). ``weight_correction``
    as in ``cpu_kernel.cpu_rule_step``.
    """
    moments = (exp_avg, exp_avg_sq) if max_exp_avg_sq is None else (exp_avg, exp_avg_sq, max_exp_avg_sq)
    rule = ADAMW.for_decay(decoupled_weight_decay)
    cpu_kernel.cpu_rule_step(param, grad, moments, rule.step_constants(scalars, scalars.step),
                             functor=rule.cpu_functor, weight_correction=weight_correction,
                             options=cpu_kernel.KernelOptions(maximize, stochastic_round, isa))


def step_on_random_gradients(params, optimizer, steps: int = 3, *, seed: int = 1, scheduler=None,
                             grad=None) -> None:
    """``steps`` steps, each parameter's gradient drawn anew before each (from ``seed``'s
    generator, or ``grad(param)``), in the parameter's dtype; ``scheduler`` stepped after each."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for param in params:
            param.grad = (torch.randn(param.shape, generator=generator) if grad is None else grad(param)).to(
                param.dtype)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def dcp_load(model, optimizer, path) -> None:
    """The DCP recipe: state dicts as targets, load in place, hand them back."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def step_with(model, optimizer, grads: list[dict]) -> None:
    """One ``optimizer.step()`` per dict of ``grads`` (name -> full gradient), each parameter's
    gradient set first (an FSDP2 DTensor parameter gets its rank's shard of it)."""
    for step_grads in grads:
        for name, param in model.named_parameters():
            grad = step_grads[name]
            if hasattr(param, "device_mesh"):
                grad = distribute_tensor(grad, param.device_mesh, param.placements)
            param.grad = grad
        optimizer.step()
