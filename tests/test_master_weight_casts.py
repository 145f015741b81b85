"""Master weights across a cast of the model and across checkpoints of other
``master_weight_bits`` (lowbit_optim.optim.master_weight_casts, checkpoint.load): the master
weight is carried over, or the parameter becomes it, before any step, on every backend.

The reference for a trajectory is the float32 model: with 32 bits a bfloat16 model's master
weights follow it bit for bit given the same gradients (tests/test_master_weights.py)."""

import copy

import pytest
import torch
from helpers import assert_same_state

import lowbit_optim
from lowbit_optim import AdamW8bit, master_weights_state_dict
from lowbit_optim.step.master_weights import CORRECTION_KEY

# float16 master weights are float32 bit for bit from this magnitude up (24 bits: a bfloat16
# 24-bit master weight's 16 significant bits fit float16's 24-bit encoding from there too).
FLOAT16_EXACT_FROM = 2.0**-15



def make(dtype, bits, backend, *, seed=0):
    """A model with a quantized weight (64 x 64) and a float-state bias, and its optimizer."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 64).to(dtype)
    optimizer = AdamW8bit(model.parameters(), lr=1e-3, min_quant_size=1024, master_weight_bits=bits,
                          backend=backend)
    return model, optimizer


def step_with(model, optimizer, gradients):
    for param, grad in zip(model.parameters(), gradients):
        param.grad = grad.to(param.dtype)
    optimizer.step()
    optimizer.zero_grad()


def gradients(model, seed):
    generator = torch.Generator().manual_seed(seed)
    # bfloat16 values, which every dtype here holds exactly: both runs read the same gradients.
    return [torch.randn(p.shape, generator=generator).to(torch.bfloat16) for p in model.parameters()]


def masters(model, optimizer):
    return {name: value.clone() for name, value in master_weights_state_dict(model, optimizer).items()}


def test_fp32_warmup_then_model_bfloat16_creates_the_correction_and_follows_float32(backend):
    model, optimizer = make(torch.float32, 32, backend)
    for seed in range(2):
        step_with(model, optimizer, gradients(model, seed))
    model.bfloat16()
    reference, reference_optimizer = copy.deepcopy(model).float(), None
    reference_optimizer = AdamW8bit(reference.parameters(), lr=1e-3, min_quant_size=1024, backend=backend)
    reference_optimizer.load_state_dict(optimizer.state_dict())
    for seed in range(2, 5):
        step_with(model, optimizer, gradients(model, seed))
        step_with(reference, reference_optimizer, gradients(reference, seed))
    assert optimizer.state[model.weight][CORRECTION_KEY].dtype == torch.int16
    for name, master in masters(model, optimizer).items():
        assert torch.equal(master, reference.state_dict()[name]), name


@pytest.mark.parametrize("bits", [24, 32])
def test_model_half_after_bfloat16_training_carries_the_master_weight_over(backend, bits):
    model, optimizer = make(torch.bfloat16, bits, backend)
    for seed in range(2):
        step_with(model, optimizer, gradients(model, seed))
    before = masters(model, optimizer)
    model.half()
    after = masters(model, optimizer)
    for name, master in before.items():
        exact = master.abs() >= FLOAT16_EXACT_FROM
        assert torch.equal(after[name][exact], master[exact]), name
        # Below, the bfloat16 parameter came back from its float16 cast within 2**-25.
        assert (after[name] - master).abs().max() <= 2.0**-25, name
    assert all(optimizer.state[p][CORRECTION_KEY].dtype == (torch.int8 if bits == 24 else torch.int16)
               for p in model.parameters())
    counts = [float(optimizer.state[p]["step"]) for p in model.parameters()]
    step_with(model, optimizer, gradients(model, 2))
    assert [float(optimizer.state[p]["step"]) for p in model.parameters()] == [c + 1 for c in counts]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_model_float_after_bfloat16_training_makes_the_parameter_its_master_weight(backend):
    model, optimizer = make(torch.bfloat16, 32, backend)
    for seed in range(2):
        step_with(model, optimizer, gradients(model, seed))
    still_bf16, still_optimizer = copy.deepcopy(model), None
    still_optimizer = AdamW8bit(still_bf16.parameters(), lr=1e-3, min_quant_size=1024, master_weight_bits=32,
                                backend=backend)
    still_optimizer.load_state_dict(optimizer.state_dict())
    before = masters(model, optimizer)
    model.float()
    for name, master in masters(model, optimizer).items():
        assert torch.equal(master, before[name]), name
        assert torch.equal(model.state_dict()[name], before[name]), name
    assert all(CORRECTION_KEY not in optimizer.state[p] for p in model.parameters())
    # The float32 model now steps as its bfloat16 twin's master weights do.
    for seed in range(2, 4):
        step_with(model, optimizer, gradients(model, seed))
        step_with(still_bf16, still_optimizer, gradients(still_bf16, seed))
    for name, master in masters(still_bf16, still_optimizer).items():
        assert torch.equal(model.state_dict()[name], master), name
    reloaded = AdamW8bit(model.parameters(), lr=1e-3, min_quant_size=1024, master_weight_bits=32)
    reloaded.load_state_dict(optimizer.state_dict())  # no correction left for a float32 parameter


def test_model_bfloat16_after_float16_training_restarts_the_master_weight_with_a_warning(backend):
    model, optimizer = make(torch.float16, 32, backend)
    for seed in range(2):
        step_with(model, optimizer, gradients(model, seed))
    model.bfloat16()
    with pytest.warns(UserWarning, match="restart from the bfloat16 values"):
        after = masters(model, optimizer)
    for name, value in model.state_dict().items():
        assert torch.equal(after[name], value.float()), name
    assert all(not optimizer.state[p][CORRECTION_KEY].any() for p in model.parameters())
    step_with(model, optimizer, gradients(model, 2))
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(("saved_bits", "loaded_bits"), [(24, 32), (32, 24), (32, None)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_checkpoint_of_other_master_weight_bits_loads_and_saves_and_reloads_bit_exactly(
        backend, saved_bits, loaded_bits, dtype):
    model, optimizer = make(dtype, saved_bits, backend)
    for seed in range(2):
        step_with(model, optimizer, gradients(model, seed))
    saved = copy.deepcopy(optimizer.state_dict())
    before = masters(model, optimizer)
    loading, loading_optimizer = make(dtype, loaded_bits, backend, seed=1)
    loading.load_state_dict(model.state_dict())
    if loaded_bits is None:
        with pytest.warns(UserWarning, match="dropped"):
            loading_optimizer.load_state_dict(saved)
    else:
        loading_optimizer.load_state_dict(saved)
    after = masters(loading, loading_optimizer)
    for name, master in before.items():
        if loaded_bits is None:
            assert torch.equal(after[name], loading.state_dict()[name].float()), name
        elif loaded_bits == 32:  # widened exactly
            assert torch.equal(after[name], master), name
        else:  # the nearest 24-bit master weight with the same parameter: 1.5 * 2**8 ulps at most
            assert ((after[name] - master).abs() <= 1.5 * 2.0**-15 * master.abs() + 2.0**-31).all(), name
    if loaded_bits is None:
        assert all(CORRECTION_KEY not in entry for entry in loading_optimizer.state_dict()["state"].values())
    resaved = copy.deepcopy(loading_optimizer.state_dict())
    twin_model, twin = make(dtype, loaded_bits, backend, seed=2)
    twin_model.load_state_dict(loading.state_dict())
    twin.load_state_dict(resaved)
    assert_same_state(twin.state_dict(), resaved)
    step_with(loading, loading_optimizer, gradients(loading, 2))
    step_with(twin_model, twin, gradients(twin_model, 2))
    assert_same_state(twin.state_dict(), loading_optimizer.state_dict())
    for name, value in loading.state_dict().items():
        assert torch.equal(twin_model.state_dict()[name], value), name


@pytest.mark.parametrize("cast", ["float", "half"])
def test_model_cast_under_gradient_release_matches_ordinary_stepping(cast):
    runs = []
    for release in (False, True):
        model, optimizer = make(torch.bfloat16, 32, "eager")
        handle = lowbit_optim.release_gradients(optimizer) if release else None
        for step in range(4):
            if step == 2:
                getattr(model, cast)()
            inputs = torch.randn(8, 64, generator=torch.Generator().manual_seed(step)).to(model.weight.dtype)
            model(inputs).float().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        if handle is not None:
            handle.remove()
        runs.append((model, optimizer))
    (plain, plain_optimizer), (released, released_optimizer) = runs
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), released.parameters()))
    assert_same_state(released_optimizer.state_dict(), plain_optimizer.state_dict())
    assert all((CORRECTION_KEY in plain_optimizer.state[p]) == (cast == "half") for p in plain.parameters())
