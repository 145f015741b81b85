"""``master_weight_bits``: bfloat16 and float16 parameters with a 24- or 32-bit master weight
kept as an integer correction in the optimizer state (lowbit_optim.step.master_weights; its
encodings value by value: tests/test_master_weight_encoding.py).

The reference is the same optimizer over float32 parameters given the same gradients (values
of the low-precision dtype, so both runs read identical gradients): with 32 bits the low-
precision run's master weights are that run's parameters bit for bit (for float16: while
every weight stays at or above 2**-15 in magnitude, which the runs here check); with 24 bits
within the rounding bound below.
"""

import copy

import pytest
import torch

import lowbit_optim
from lowbit_optim import (
    AdamW4bit,
    AdamW8bit,
    AdamWFactored4bit,
    CPUOffloadOptimizer,
    load_master_weights,
    master_weights_state_dict,
    state_bytes,
)
from lowbit_optim.checkpoint import to_torch_adamw
from lowbit_optim.step.master_weights import CORRECTION_KEY, read_master, split_master

# Quantized with a partial last block (300 x 70 = 21000 = 164 blocks of 128 + 8), quantized
# whole, and small (float moments, the flat float-state step).
SHAPES = [(300, 70), (64, 64), (33,), (7, 5)]
STEPS = 6
DTYPES = [torch.bfloat16, torch.float16]
# float16 master weights are float32 bit for bit from this magnitude up (master_weights).
FLOAT16_EXACT_FROM = 2.0**-15
# The 24-bit master's rounding per step, relative to the weight and absolute: bfloat16 keeps
# 16 significant bits (128 float32 ulps, 2**-16 relative); float16 18 (2**-18 of the
# parameter's binade, 2**-17 of a weight that rounded up into it), and 2**-32 below 2**-14,
# where the int8's unit is 2**-31.
ROUNDING_24 = {torch.bfloat16: (2.0**-16, 0.0), torch.float16: (2.0**-17, 2.0**-32)}


def params_pair(shapes=SHAPES, scale=0.02, dtype=torch.bfloat16, *, away_from_zero=False):
    """float32 parameters holding ``dtype`` values, and ``dtype`` copies of them.
    ``away_from_zero``: magnitudes from ``scale / 2`` to ``1.5 * scale``, so that a few small
    steps keep every weight far above float16's exact range's lower end."""
    fp32 = []
    for shape in shapes:
        values = torch.randn(shape) * scale
        if away_from_zero:
            values = torch.copysign(torch.rand(shape) * scale + scale / 2, values)
        fp32.append(torch.nn.Parameter(values.to(dtype).float()))
    low = [torch.nn.Parameter(p.detach().to(dtype)) for p in fp32]
    return fp32, low


def set_gradients(*param_lists):
    """The same gradient for the corresponding parameters of every list, with values of the
    last list's dtype (the low-precision one: float32 holds them exactly)."""
    for params in zip(*param_lists):
        grad = torch.randn(params[0].shape).to(params[-1].dtype)
        for param in params:
            param.grad = grad.to(param.dtype)


def masters(optimizer, params):
    return [read_master(p.detach(), optimizer.state[p][CORRECTION_KEY]) for p in params]


def same_bits(a, b):
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def assert_float16_exact_range(params):
    """The precondition of float16's bit-for-bit master weights, checked on the reference."""
    assert all((p.detach().abs() >= FLOAT16_EXACT_FROM).all() for p in params)


def compiled_cases_slow(cases):
    return [pytest.param(*case, marks=pytest.mark.slow) if case[2] == "compile" else case for case in cases]


# AdamW8bit's compiled step is the C++ kernel's bit for bit (tests/test_cpu_kernel_master_weights.py):
# its "cpu" cases stand for it here, and AdamW4bit's compile cases for the compiled split.
BIT_FOR_BIT = [(dtype, name, backend) for dtype in DTYPES for name, backend in [
    ("AdamW4bit", "eager"), ("AdamW4bit", "compile"), ("AdamW8bit", "cpu"),
    ("AdamWFp8", "eager"), ("AdamWFactored4bit", "eager"), ("Adam4bit", "eager"), ("Lion8bit", "eager"),
    ("AdEMAMix8bit", "eager"),
]] + [(torch.float16, "Lion8bit", "compile")]


# Compiled, each (class, dtype) with a correction is a graph of its own: the slow tier's.
@pytest.mark.parametrize("dtype, name, backend", compiled_cases_slow(BIT_FOR_BIT),
                         ids=lambda v: str(v).removeprefix("torch."))
def test_32_bit_master_weights_follow_the_fp32_model_bit_for_bit(dtype, name, backend):
    optimizer_class = getattr(lowbit_optim, name)
    fp32, low = params_pair(dtype=dtype, away_from_zero=dtype == torch.float16)
    options = dict(lr=1e-3, weight_decay=0.1, backend=backend)
    reference = optimizer_class(fp32, **options)
    optimizer = optimizer_class(low, master_weight_bits=32, **options)
    for _ in range(STEPS):
        set_gradients(fp32, low)
        reference.step()
        optimizer.step()
        if dtype == torch.float16:
            assert_float16_exact_range(fp32)
    for expected, master, param in zip(fp32, masters(optimizer, low), low):
        assert same_bits(master, expected.detach())
        # The parameter the model sees is the master weight rounded: half up in bit space for
        # bfloat16, to nearest even for float16.
        assert torch.equal(param.detach(), split_master(expected.detach(), dtype, torch.int16)[0])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_factored_step_with_32_bit_master_weights_differs_only_by_its_row_sums(dtype):
    # The compiled statistics pass sums each row of the squared gradient in an order Inductor
    # picks by the gradient's dtype (bfloat16 or float16 here, float32 in the reference), so
    # the row statistics differ in their last bits (measured: the column statistics and the
    # first moment's codes stay equal). The update computed from them is exact; the master
    # weights then differ by the step's relative rounding of a statistic, ~2**-24 of an update
    # of size <= lr * (Adam's ratio bound, ~3 in 6 steps) per step.
    fp32, low = params_pair(dtype=dtype, away_from_zero=dtype == torch.float16)
    reference = AdamWFactored4bit(fp32, lr=1e-3, weight_decay=0.1, backend="compile")
    optimizer = AdamWFactored4bit(low, lr=1e-3, weight_decay=0.1, backend="compile", master_weight_bits=32)
    for _ in range(STEPS):
        set_gradients(fp32, low)
        reference.step()
        optimizer.step()
    gaps = [(m - p.detach()).abs().max().item() for m, p in zip(masters(optimizer, low), fp32)]
    assert max(gaps) <= STEPS * 1e-3 * 3 * 2**-20
    assert gaps[2] == 0 and gaps[3] == 0  # the small (float-state) parameters: bit for bit


BOUNDED_24 = [(dtype, name, backend) for dtype in DTYPES for name, backend in [
    ("AdamW4bit", None), ("AdamW8bit", "compile"), ("AdamWFp8", "eager"), ("AdamWFactored4bit", "eager"),
    ("Lion8bit", "eager"),
]]


@pytest.mark.parametrize("dtype, name, backend", compiled_cases_slow(BOUNDED_24),
                         ids=lambda v: str(v).removeprefix("torch."))
def test_24_bit_master_weights_stay_within_their_rounding_of_fp32(dtype, name, backend):
    # Given the same gradients both runs have the same moments, so the master weights differ
    # only by the 24-bit rounding of each step (ROUNDING_24), the float32 rounding of the
    # update computed from two slightly different weights (1 ulp, 2**-23 relative, each side)
    # and the weight decay's contraction of the gap (factor < 1): after n steps
    # |m24 - m32| <= n * ((relative + 2**-22) * max over the steps of |m32| + absolute).
    relative, absolute = ROUNDING_24[dtype]
    fp32, low = params_pair(scale=1.0, dtype=dtype)
    optimizer_class = getattr(lowbit_optim, name)
    reference = optimizer_class(fp32, lr=1e-3, weight_decay=0.1, backend=backend)
    optimizer = optimizer_class(low, lr=1e-3, weight_decay=0.1, backend=backend, master_weight_bits=24)
    largest = [p.detach().abs() for p in fp32]
    for step in range(1, 21):
        set_gradients(fp32, low)
        reference.step()
        optimizer.step()
        largest = [torch.maximum(m, p.detach().abs()) for m, p in zip(largest, fp32)]
        for expected, master, bound in zip(fp32, masters(optimizer, low), largest):
            gap = (master - expected.detach()).abs()
            assert (gap <= step * ((relative + 2**-22) * bound + absolute)).all()
    assert any(not same_bits(m, p.detach()) for m, p in zip(masters(optimizer, low), fp32))


def test_bf16_at_lr_1e_5_loses_updates_without_master_weights_and_tracks_fp32_with_24_bits():
    # bfloat16 weights of an LLM-like scale (0.02): an update of ~1e-5 is below half a
    # bfloat16 ulp (~3e-5 at 0.01) for most elements, but far above half a 24-bit ulp.
    shapes = [(256, 256)]
    fp32, bf16 = params_pair(shapes)
    master_24 = [torch.nn.Parameter(p.detach().clone()) for p in bf16]
    start = fp32[0].detach().clone()
    optimizers = [AdamW8bit(params, lr=1e-5, weight_decay=0.0, **extra)
                  for params, extra in ((fp32, {}), (bf16, {}), (master_24, dict(master_weight_bits=24)))]
    for _ in range(20):
        set_gradients(fp32, bf16, master_24)
        for optimizer in optimizers:
            optimizer.step()
    moved = [(p.detach().float() - start).abs().mean().item() for p in (fp32[0], bf16[0])]
    moved_24 = (masters(optimizers[2], master_24)[0] - start).abs().mean().item()
    assert moved[1] < 0.2 * moved[0]  # plain rounding: most updates vanish
    assert abs(moved_24 - moved[0]) <= 0.01 * moved[0]
    assert (masters(optimizers[2], master_24)[0] - fp32[0].detach()).abs().max() <= 20 * 2**-16 * 0.2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_master_weights_resume_bit_for_bit_from_a_saved_state_dict(tmp_path, dtype):
    def run(params, optimizer, steps):
        for step in steps:
            torch.manual_seed(step)
            set_gradients(params)
            optimizer.step()

    _, straight = params_pair(dtype=dtype)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in straight]
    options = dict(lr=1e-3, master_weight_bits=24)
    straight_optimizer = AdamW4bit(straight, **options)
    run(straight, straight_optimizer, range(6))
    first = AdamW4bit(resumed, **options)
    run(resumed, first, range(3))
    torch.save(first.state_dict(), tmp_path / "optimizer.pt")
    second = AdamW4bit(resumed, **options)
    second.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    assert second.state[resumed[0]][CORRECTION_KEY].dtype == torch.int8
    run(resumed, second, range(3, 6))
    for a, b in zip(straight, resumed):
        assert torch.equal(a.detach().view(torch.int16), b.detach().view(torch.int16))
        assert torch.equal(straight_optimizer.state[a][CORRECTION_KEY], second.state[b][CORRECTION_KEY])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_state_dict_saved_without_master_weights_loads_with_zero_corrections(dtype):
    _, params = params_pair(dtype=dtype)
    plain = AdamW4bit(params)
    set_gradients(params)
    plain.step()
    optimizer = AdamW4bit(params, master_weight_bits=32)
    optimizer.load_state_dict(plain.state_dict())
    assert all(optimizer.state[p][CORRECTION_KEY].count_nonzero() == 0 for p in params)
    set_gradients(params)
    optimizer.step()  # and steps from there


@pytest.mark.parametrize("bits", [16, "24", True, 24.0])
def test_invalid_master_weight_bits_is_refused(bits):
    with pytest.raises(ValueError, match="Invalid master_weight_bits"):
        AdamW4bit(params_pair()[1], master_weight_bits=bits)


def test_master_weights_with_stochastic_rounding_are_refused():
    with pytest.raises(ValueError, match="Invalid master_weight_bits: 24 with bf16_stochastic_round"):
        AdamW8bit(params_pair()[1], master_weight_bits=24, bf16_stochastic_round=True)


def test_a_loaded_correction_of_the_wrong_dtype_is_refused_and_nothing_changes():
    _, params = params_pair()
    optimizer = AdamW4bit(params, master_weight_bits=24)
    set_gradients(params)
    optimizer.step()
    saved = optimizer.state_dict()
    saved["state"][0][CORRECTION_KEY] = saved["state"][0][CORRECTION_KEY].to(torch.int32)
    before = optimizer.state[params[0]][CORRECTION_KEY].clone()
    with pytest.raises(ValueError, match="master_weight_correction must be a torch.int8 tensor"):
        optimizer.load_state_dict(saved)
    assert torch.equal(optimizer.state[params[0]][CORRECTION_KEY], before)


def test_float32_parameters_keep_no_correction_and_none_adds_no_state():
    fp32, bf16 = params_pair()
    for params, bits in ((fp32, 32), (bf16, None)):
        optimizer = AdamW4bit(params, master_weight_bits=bits)
        set_gradients(params)
        optimizer.step()
        assert all(CORRECTION_KEY not in optimizer.state[p] for p in params)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_state_bytes_with_24_bit_master_weights_and_4bit_moments(dtype):
    params = [torch.nn.Parameter(torch.zeros(1024, 1024, dtype=dtype))]
    optimizer = AdamW4bit(params, master_weight_bits=24)
    set_gradients(params)
    optimizer.step()
    # Two 4-bit moments (0.5 byte each) with a float32 scale per 128 elements, and one int8.
    assert state_bytes(optimizer) / params[0].numel() == 2 * (0.5 + 4 / 128) + 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_offload_keeps_the_correction_with_the_host_copy_and_steps_like_the_plain_optimizer(dtype):
    _, plain = params_pair(dtype=dtype)
    offloaded = [torch.nn.Parameter(p.detach().clone()) for p in plain]
    plain_optimizer = AdamW4bit(plain, master_weight_bits=32)
    offload_optimizer = CPUOffloadOptimizer(offloaded, AdamW4bit, master_weight_bits=32)
    for _ in range(3):
        set_gradients(plain, offloaded)
        plain_optimizer.step()
        offload_optimizer.step()
    for a, b in zip(plain, offloaded):
        host = offload_optimizer.host_param(b)
        correction = offload_optimizer.state[host][CORRECTION_KEY]
        assert correction.device == host.device and correction.dtype == torch.int16
        assert host.dtype == dtype and torch.equal(a.detach().view(torch.int16), b.detach().view(torch.int16))
        assert torch.equal(plain_optimizer.state[a][CORRECTION_KEY], correction)


def away_from_zero_(model, smallest):
    """Every parameter's magnitudes raised to at least ``smallest``, signs kept."""
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.copysign(param.abs().clamp(min=smallest), param))
    return model


def models(dtype):
    """A float32 model and a copy of it in ``dtype``, its weights 2**-8 or more in magnitude
    (float16 master weights are float32 ones from 2**-15 up)."""
    fp32 = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.LayerNorm(96), torch.nn.Linear(96, 64))
    away_from_zero_(fp32, 2.0**-8)
    return fp32, copy.deepcopy(fp32).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp32_export_and_import_of_master_weights(dtype):
    fp32, low = models(dtype)
    fp32_params, low_params = list(fp32.parameters()), list(low.parameters())
    # lr 1e-4: 3 steps move a weight by ~3e-4 at most, far less than its 2**-8.
    reference = AdamW4bit(fp32_params, lr=1e-4, min_quant_size=1024)
    optimizer = AdamW4bit(low_params, lr=1e-4, min_quant_size=1024, master_weight_bits=32)
    # The import: float32 weights that the dtype cannot hold become exact master weights.
    load_master_weights(low, optimizer, fp32.state_dict())
    for _ in range(3):
        set_gradients(fp32_params, low_params)
        reference.step()
        optimizer.step()
        assert_float16_exact_range(fp32_params)
    exported = master_weights_state_dict(low, optimizer)
    for name, value in fp32.state_dict().items():
        assert exported[name].dtype == torch.float32 and same_bits(exported[name], value)
    converted = to_torch_adamw(optimizer.state_dict(), params=low_params)
    assert all(CORRECTION_KEY not in entry for entry in converted["state"].values())
    for index, param in enumerate(fp32_params):
        assert same_bits(converted["master_weights"][index], param.detach())
    torch.optim.AdamW(fp32_params).load_state_dict(converted)
    with pytest.raises(ValueError, match="pass params="):
        to_torch_adamw(optimizer.state_dict())


def _fsdp_master_weight_runs(rank: int, out) -> dict:
    """Two ranks, for bfloat16 and float16: an FSDP2 float32 model and its twin in the dtype
    with 32-bit master weights, stepped with the same (dtype-valued) gradient shards; then a
    DCP save and load."""
    import torch.distributed.checkpoint as dcp
    from helpers import dcp_load
    from test_distributed import OPTIONS, batch, gathered, make_model, shard
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from lowbit_optim.state.sharding import local, wrap_like

    # lr 1e-3: 3 steps move a weight by a few 1e-3 at most, far less than its 2**-6.
    options = dict(OPTIONS, lr=1e-3, backend="eager", master_weight_bits=32)
    results = {}

    def low_model(dtype):
        return shard(away_from_zero_(make_model(), 2.0**-6).to(dtype))

    for dtype in DTYPES:
        reference = away_from_zero_(make_model(), 2.0**-6)
        with torch.no_grad():
            for param in reference.parameters():
                param.copy_(param.to(dtype))
        reference = shard(reference)
        model = low_model(dtype)
        reference_optimizer = AdamW4bit(reference.parameters(), **dict(options, master_weight_bits=None))
        optimizer = AdamW4bit(model.parameters(), **options)
        for step in range(3):
            inputs, targets = batch(step)
            torch.nn.functional.mse_loss(reference(inputs), targets).backward()
            for expected, param in zip(reference.parameters(), model.parameters()):
                grad = local(expected.grad).to(dtype)
                local(expected.grad).copy_(grad)
                param.grad = wrap_like(grad, param)
            reference_optimizer.step()
            optimizer.step()
            reference.zero_grad()
            model.zero_grad()
        found = {"same": [], "placements": [], "exact_range": []}
        for expected, param in zip(reference.parameters(), model.parameters()):
            correction = optimizer.state[param][CORRECTION_KEY]
            found["placements"].append(correction.placements == param.placements
                                       and correction.to_local().shape == param.to_local().shape)
            master = read_master(local(param).detach(), correction.to_local())
            found["same"].append(same_bits(master, local(expected).detach()))
            found["exact_range"].append(bool((local(expected).abs() >= FLOAT16_EXACT_FROM).all()))
        # Compared shard by shard: gloo (like NCCL) has no int16 collectives, so full_tensor()
        # of a 32-bit correction cannot gather it (docs/checkpoints.md).
        saved = [optimizer.state[p][CORRECTION_KEY].to_local().clone() for p in model.parameters()]
        model_sd, optim_sd = get_state_dict(model, optimizer)
        checkpoint = out / f"dcp-master-{str(dtype).removeprefix('torch.')}"
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)
        model = low_model(dtype)
        optimizer = AdamW4bit(model.parameters(), **options)
        dcp_load(model, optimizer, checkpoint)
        loaded = [optimizer.state[p][CORRECTION_KEY].to_local() for p in model.parameters()]
        found["dcp"] = all(torch.equal(a, b) for a, b in zip(saved, loaded))
        results[str(dtype)] = found
    return {"ranks": gathered(results)}


@pytest.mark.slow
def test_fsdp2_shards_the_correction_like_its_parameter_and_dcp_round_trips_it(tmp_path):
    import torch.multiprocessing as mp
    from helpers import free_port
    from test_distributed import _worker

    mp.spawn(_worker, args=(2, free_port(), str(tmp_path), _fsdp_master_weight_runs, "master.pt"), nprocs=2)
    ranks = torch.load(tmp_path / "master.pt")["ranks"]
    for results in ranks:
        assert results.keys() == {str(dtype) for dtype in DTYPES}
        for found in results.values():
            assert all(found["exact_range"]) and all(found["placements"])
            assert all(found["same"]) and found["dcp"]


def test_gradient_release_with_24_bit_master_weights_matches_ordinary_stepping_bit_for_bit():
    # The combination behind the 4.06 bytes per parameter of AdamW4bit (docs/usage.md).
    runs = []
    for release in (False, True):
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.LayerNorm(96)).to(torch.bfloat16)
        optimizer = AdamW4bit(model.parameters(), lr=1e-3, min_quant_size=1024, master_weight_bits=24,
                              backend="eager")
        handle = lowbit_optim.release_gradients(optimizer) if release else None
        for step in range(3):
            inputs = torch.randn(8, 64, generator=torch.Generator().manual_seed(step)).bfloat16()
            model(inputs).float().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        if handle is not None:
            handle.remove()
        runs.append((model, optimizer))
    (plain, plain_optimizer), (released, released_optimizer) = runs
    for a, b in zip(plain.parameters(), released.parameters()):
        assert torch.equal(a, b)
        corrections = [plain_optimizer.state[a][CORRECTION_KEY], released_optimizer.state[b][CORRECTION_KEY]]
        assert torch.equal(*corrections) and corrections[0].count_nonzero() > 0
