"""Muon8bit and Muon4bit as users meet them: torch.optim.Muon's trajectory with float momentum,
the state they keep, the Muon/AdamW split, refusals, schedules and checkpoints. The quantized
momentum on every backend is tests/test_muon_backends.py's."""

import pytest
import torch
from conftest import num_threads
from helpers import assert_same_state, step_on_random_gradients
from torch import nn

from lowbit_optim import AdamW8bit, Muon4bit, Muon8bit, muon_param_groups
from lowbit_optim.checkpoint import to_torch_muon
from lowbit_optim.state.memory import tensor_state_bytes
from lowbit_optim.step.master_weights import CORRECTION_KEY, read_master

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"),
                                reason="torch.optim.Muon arrived in torch 2.9")



@pytest.fixture(autouse=True)
def _one_thread():
    """Newton-Schulz's bf16 matmuls on these small matrices took ~20x longer on two threads
    than on one (oneDNN's threading on a shared 2-core machine): one thread keeps the file fast,
    and the results are the same."""
    with num_threads(1):
        yield


# A wide and a tall matrix: Newton-Schulz transposes the tall one.
SHAPES = ((48, 64), (64, 48))
FLOAT_MOMENTUM = dict(min_quant_size=1 << 30)


def matrices(seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return [nn.Parameter((torch.randn(shape, generator=generator) * 0.1).to(dtype)) for shape in SHAPES]


def momenta(optimizer, params):
    return [optimizer.state[param]["momentum_buffer"] for param in params]


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
def test_muon_with_float_momentum_equals_torch_muon_bit_for_bit(adjust_lr_fn, nesterov):
    """With ``min_quant_size`` above every parameter the momentum is float32 and every step is
    torch.optim.Muon's, op for op, under an LR schedule that changes the LR at every step."""
    hyper = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    runs = []
    for make in (lambda p: torch.optim.Muon(p, **hyper), lambda p: Muon8bit(p, **hyper, **FLOAT_MOMENTUM)):
        params = matrices()
        optimizer = make(params)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.7)
        step_on_random_gradients(params, optimizer, 4, scheduler=scheduler)
        runs.append((params, momenta(optimizer, params)))
    (expected, expected_momenta), (actual, actual_momenta) = runs
    for index in range(len(SHAPES)):
        assert torch.equal(actual[index], expected[index]), f"parameter {index}"
        assert torch.equal(actual_momenta[index], expected_momenta[index]), f"momentum {index}"


def test_muon_with_float_momentum_leaves_torch_muon_with_another_momentum():
    """Sensitivity control for the test above: a different momentum shows."""
    expected, actual = matrices(), matrices()
    step_on_random_gradients(expected, torch.optim.Muon(expected, lr=0.02))
    step_on_random_gradients(actual, Muon8bit(actual, lr=0.02, momentum=0.9, **FLOAT_MOMENTUM))
    assert not torch.equal(actual[0], expected[0])


def test_code_written_for_torch_muon_runs_unchanged_with_its_arguments():
    """torch.optim.Muon's first six arguments positionally, the rest by name (keyword-only here:
    at most six positional arguments, tests/test_signatures.py)."""
    args = (0.02, 0.05, 0.9, False, (3.4, -4.7, 2.0))
    keywords = dict(eps=1e-6, ns_steps=4, adjust_lr_fn="match_rms_adamw")
    expected, actual = matrices(), matrices()
    step_on_random_gradients(expected, torch.optim.Muon(expected, *args, **keywords))
    step_on_random_gradients(actual, Muon4bit(actual, *args, **keywords, **FLOAT_MOMENTUM))
    for want, got in zip(expected, actual):
        assert torch.equal(got, want)


@pytest.mark.parametrize("cls, limit", [(Muon8bit, 1.05), (Muon4bit, 0.6)], ids=["8bit", "4bit"])
def test_state_bytes_per_parameter_of_a_1024_square_weight(cls, limit):
    param = torch.zeros(1024, 1024)
    state = cls.new_state(param)
    momentum = state["momentum_buffer"]
    assert momentum.format_name == cls.momentum_format.name
    assert tensor_state_bytes(momentum) / param.numel() <= limit


class TinyLM(nn.Module):
    """An embedding, two hidden Linear layers with biases, a LayerNorm and an output head."""

    def __init__(self, tied: bool, head_name: str = "lm_head"):
        super().__init__()
        self.embed = nn.Embedding(10, 16)
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 16)
        setattr(self, head_name, nn.Linear(16, 10, bias=False))
        if tied:
            getattr(self, head_name).weight = self.embed.weight


def muon_names(model, groups):
    names = {id(p): name for name, p in model.named_parameters()}
    return {use_muon: sorted(names[id(p[1] if isinstance(p, tuple) else p)] for g in groups
                             if g["use_muon"] == use_muon for p in g["params"])
            for use_muon in (True, False)}


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "own-head"])
def test_default_split_sends_hidden_matrices_to_muon_and_the_rest_to_adamw(tied):
    model = TinyLM(tied)
    expected_adamw = ["embed.weight", "fc1.bias", "fc2.bias", "norm.bias", "norm.weight"]
    expected_adamw += [] if tied else ["lm_head.weight"]
    for params in (model, list(model.named_parameters())):
        split = muon_names(model, muon_param_groups(params))
        assert split == {True: ["fc1.weight", "fc2.weight"], False: sorted(expected_adamw)}
    # Bare parameters: only their number of dimensions decides.
    split = muon_names(model, muon_param_groups(list(model.parameters())))
    assert "embed.weight" in split[True]
    optimizer = Muon8bit(model, lr=0.02, adamw_lr=1e-3, adamw_weight_decay=0.0)
    muon_group, adamw_group = optimizer.param_groups
    assert (muon_group["use_muon"], muon_group["lr"], muon_group["weight_decay"]) == (True, 0.02, 0.1)
    assert (adamw_group["use_muon"], adamw_group["lr"], adamw_group["weight_decay"]) == (False, 1e-3, 0.0)
    assert (adamw_group["betas"], adamw_group["eps"]) == ((0.9, 0.95), 1e-8)
    assert "momentum" not in adamw_group


def test_a_group_with_use_muon_is_kept_and_a_group_without_it_splits_keeping_its_keys():
    model = TinyLM(tied=False, head_name="head")
    groups = [{"params": [model.head.weight], "use_muon": True},
              {"params": [model.fc1.weight, model.fc1.bias], "weight_decay": 0.0, "adamw_lr": 5e-4}]
    optimizer = Muon8bit(groups, lr=0.02)
    head, fc1_muon, fc1_adamw = optimizer.param_groups
    assert head["use_muon"] and head["params"] == [model.head.weight]
    assert fc1_muon["use_muon"] and fc1_muon["params"] == [model.fc1.weight]
    assert fc1_muon["weight_decay"] == 0.0
    assert not fc1_adamw["use_muon"] and fc1_adamw["params"] == [model.fc1.bias]
    assert (fc1_adamw["lr"], fc1_adamw["weight_decay"]) == (5e-4, 0.0)


def test_a_1d_parameter_with_use_muon_true_is_refused_before_any_change():
    model = TinyLM(tied=True)
    refusal = r"Muon only supports 2D parameters .*\('fc1.bias'\) .*torch.Size\(\[32\]\)"
    with pytest.raises(ValueError, match=refusal):
        Muon8bit([{"params": list(model.named_parameters()), "use_muon": True}])
    optimizer = Muon8bit([model.fc1.weight, model.fc2.weight])
    params = matrices()
    step_on_random_gradients(params[:1], Muon8bit(params[:1]))
    groups_before = [dict(group) for group in optimizer.param_groups]
    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
        optimizer.add_param_group({"params": [model.fc2.bias, model.norm.weight], "use_muon": True})
    assert optimizer.param_groups == groups_before


@pytest.mark.parametrize("bad, message", [
    (dict(lr=-1.0), "Learning rate should be >= 0 but is: -1.0"),
    (dict(momentum=-0.5), "momentum should be >= 0 but is: -0.5"),
    (dict(weight_decay=-0.1), "weight decay should be >= 0 but is: -0.1"),
    (dict(adjust_lr_fn="sqrt"), "Adjust learning rate function sqrt is not supported"),
    (dict(ns_steps=100), "Number of steps must be less than 100"),
    (dict(ns_coefficients=(1.0, 2.0)), "Coefficients must be a tuple of exactly 3 values"),
    (dict(adamw_betas=(0.9, 1.5)), "Invalid beta parameter at index 1: 1.5"),
], ids=["lr", "momentum", "weight_decay", "adjust_lr_fn", "ns_steps", "ns_coefficients", "adamw_betas"])
def test_bad_hyperparameters_are_refused_in_torch_words_before_any_change(bad, message):
    with pytest.raises(ValueError, match=message):
        Muon8bit(matrices(), **bad)
    # Edited into a group mid-training: refused at the next step, nothing stepped.
    params = matrices()
    optimizer = Muon8bit(params + [nn.Parameter(torch.zeros(5))], **FLOAT_MOMENTUM)
    step_on_random_gradients(params, optimizer, 1)
    group = optimizer.param_groups[0 if "adamw_betas" not in bad else 1]
    key, value = next(iter(bad.items()))
    group[key.removeprefix("adamw_")] = value
    before = [p.clone() for p in params]
    state_before = [m.clone() for m in momenta(optimizer, params)]
    with pytest.raises(ValueError, match=message):
        step_on_random_gradients(params, optimizer, 1)
    for param, old, momentum, old_momentum in zip(params, before, momenta(optimizer, params), state_before):
        assert torch.equal(param, old) and torch.equal(momentum, old_momentum)
        assert float(optimizer.state[param]["step"]) == 1


@pytest.mark.parametrize("storage", ["float", "quantized"])
def test_non_finite_gradients_keep_parameters_finite_and_the_momentum_of_their_elements(backend, storage):
    """Their elements get direction 0 and keep their momentum: exactly with float momentum (a
    quantized element is encoded again under its block's new scale: finite, not identical)."""
    params = matrices()
    optimizer = Muon8bit(params, lr=0.02, backend=backend,
                         **(FLOAT_MOMENTUM if storage == "float" else dict(min_quant_size=1024)))
    step_on_random_gradients(params, optimizer, 1)
    def values(momentum):
        return momentum if storage == "float" else momentum.dequantize()

    kept = [values(m)[0, :3].clone() for m in momenta(optimizer, params)]

    def gradient(param):
        grad = torch.randn(param.shape)
        grad[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        return grad

    step_on_random_gradients(params, optimizer, 2, grad=gradient)
    for param, momentum, old in zip(params, momenta(optimizer, params), kept):
        assert torch.isfinite(param).all()
        assert torch.isfinite(values(momentum)).all()
        if storage == "float":
            assert torch.equal(momentum[0, :3], old)
        else:  # one 8-bit rounding under a new scale: within a map step (< 1/64 of the scale)
            scale = float(values(momentum).abs().max())
            torch.testing.assert_close(values(momentum)[0, :3], old, rtol=0, atol=scale / 64)


def test_bf16_model_with_24_bit_master_weights_follows_the_float32_run():
    """bf16 parameters and gradients with 24-bit master weights against a float32 run from the
    same (bf16-representable) values: the momentum and the direction Newton-Schulz rounds to bf16
    are the same, so the master weights differ from the float32 parameters only by their
    rounding to 16 significant bits at each step (at most 2**-16 of the value each; measured
    8.3e-5 relative after 3 steps, below 2**-13, a sixteenth of a bf16 ulp); plain bf16
    parameters, rounded to 8 bits, are farther by orders of magnitude (the control)."""
    def bf16_gradient(param):
        return torch.randn(param.shape).bfloat16()

    expected = [nn.Parameter(p.detach().float()) for p in matrices(dtype=torch.bfloat16)]
    torch.manual_seed(0)
    step_on_random_gradients(expected, Muon8bit(expected, lr=0.02, min_quant_size=256), grad=bf16_gradient)
    errors = {}
    for bits in (24, None):
        actual = matrices(dtype=torch.bfloat16)
        optimizer = Muon8bit(actual, lr=0.02, min_quant_size=256, master_weight_bits=bits)
        torch.manual_seed(0)
        step_on_random_gradients(actual, optimizer, grad=bf16_gradient)
        if bits is not None:
            assert all(optimizer.state[p][CORRECTION_KEY].dtype == torch.int8 for p in actual)
            actual = [read_master(p, optimizer.state[p][CORRECTION_KEY]) for p in actual]
        with torch.no_grad():
            errors[bits] = max(float(((a.float() - e) / e.abs().clamp(min=1e-3)).abs().max())
                               for a, e in zip(actual, expected))
    assert errors[24] <= 2**-13, errors
    assert errors[None] > 50 * errors[24], errors


def test_one_lr_scheduler_drives_the_muon_and_the_adamw_groups():
    """Muon for the matrices, AdamW for a bias, one scheduler: each group's LR follows it and the
    Muon part stays torch.optim.Muon's bit for bit; the AdamW part follows torch.optim.AdamW."""
    params, bias = matrices(), nn.Parameter(torch.zeros(64))
    optimizer = Muon8bit([*params, bias], lr=0.02, adamw_lr=1e-3, adamw_betas=(0.9, 0.999),
                         **FLOAT_MOMENTUM)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=4)
    muon_params, torch_bias = matrices(), nn.Parameter(torch.zeros(64))
    torch_muon = torch.optim.Muon(muon_params, lr=0.02)
    torch_adamw = torch.optim.AdamW([torch_bias], lr=1e-3, weight_decay=0.1)
    schedulers = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4) for o in (torch_muon, torch_adamw)]
    generator = torch.Generator().manual_seed(3)
    for _ in range(4):
        for ours, theirs in zip([*params, bias], [*muon_params, torch_bias]):
            ours.grad = torch.randn(ours.shape, generator=generator)
            theirs.grad = ours.grad.clone()
        for stepper in (optimizer, scheduler, torch_muon, torch_adamw, *schedulers):
            stepper.step()
    assert [g["lr"] for g in optimizer.param_groups] == [torch_muon.param_groups[0]["lr"],
                                                        torch_adamw.param_groups[0]["lr"]]
    for ours, theirs in zip(params, muon_params):
        assert torch.equal(ours, theirs)
    torch.testing.assert_close(bias, torch_bias, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cls", [Muon8bit, Muon4bit])
def test_state_dict_round_trip_is_bit_exact_and_resumes_the_same_trajectory(cls):
    model = TinyLM(tied=False)
    optimizer = cls(model, lr=0.02, min_quant_size=256)
    grads = {name: torch.randn(p.shape) for name, p in model.named_parameters()}

    def step(model, optimizer):
        for name, param in model.named_parameters():
            param.grad = grads[name].clone()
        optimizer.step()

    step(model, optimizer)
    saved = optimizer.state_dict()
    assert type(optimizer.state[model.fc1.weight]["momentum_buffer"]).__name__ == "QuantizedState"
    resumed_model = TinyLM(tied=False)
    resumed_model.load_state_dict(model.state_dict())
    resumed = cls(resumed_model, lr=0.02, min_quant_size=256)
    resumed.load_state_dict(saved)
    assert_same_state(resumed.state_dict(), saved)
    step(model, optimizer)
    step(resumed_model, resumed)
    for (name, want), got in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(got, want), name


def test_torch_muon_state_dict_loads_and_converts_back():
    torch_params = matrices()
    torch_muon = torch.optim.Muon(torch_params, lr=0.02)
    step_on_random_gradients(torch_params, torch_muon, 2)
    # Into float momentum: the same trajectory from there on, bit for bit.
    ours = [nn.Parameter(p.detach().clone()) for p in torch_params]
    optimizer = Muon8bit(ours, lr=0.02, **FLOAT_MOMENTUM)
    optimizer.load_state_dict(torch_muon.state_dict())
    for momentum, theirs in zip(momenta(optimizer, ours), momenta(torch_muon, torch_params)):
        assert torch.equal(momentum, theirs)
    # Back into torch.optim.Muon: it steps as ours does.
    back_params = [nn.Parameter(p.detach().clone()) for p in ours]
    back = torch.optim.Muon(back_params, lr=0.02)
    back.load_state_dict(to_torch_muon(optimizer.state_dict()))
    step_on_random_gradients(ours, optimizer, 2, seed=5)
    step_on_random_gradients(back_params, back, 2, seed=5)
    step_on_random_gradients(torch_params, torch_muon, 2, seed=5)
    for a, b, c in zip(ours, back_params, torch_params):
        assert torch.equal(a, c) and torch.equal(b, c)
    # Into quantized momentum: quantized once, within the format's rounding.
    copies = [nn.Parameter(p.detach().clone()) for p in torch_params]
    quantized = Muon4bit(copies, lr=0.02, min_quant_size=256)
    quantized.load_state_dict(torch_muon.state_dict())
    for param, theirs in zip(quantized.param_groups[0]["params"], momenta(torch_muon, torch_params)):
        stored = quantized.state[param]["momentum_buffer"]
        assert stored.format_name == "normal4-signed"
        error = (stored.dequantize() - theirs).norm() / theirs.norm()
        assert error < 0.15  # NF4 blocks of 128 on Gaussian-like values: ~0.1 relative


def test_an_adamw_state_dict_does_not_become_muon_state():
    params = matrices()
    adamw = AdamW8bit(params)
    step_on_random_gradients(params, adamw, 1)
    optimizer = Muon8bit(params)
    with pytest.raises(ValueError, match="state has no momentum_buffer"):
        optimizer.load_state_dict(adamw.state_dict())
    assert not optimizer.state
