"""A checkpoint of torchao's low-bit optimizer resumes in ours, with real torchao: its AdamW8bit,
AdamW4bit, AdamWFp8 and AdamFp8 (every format, and Adam's L2 decay) into our class of the same name,
its codes and scales carried over (``lowbit_optim.checkpoint.torchao.quantized_from_torchao``),
so that training continues as torchao's own optimizer would; and such a checkpoint file read
without torchao (``lowbit_optim.checkpoint.torchao.load_torchao_optimizer_state``)."""

import io
import math
import pathlib
import pickle
import re
import subprocess
import sys
from typing import NamedTuple

import pytest
import torch
from conftest import slow_except
from helpers import assert_same_state

from lowbit_optim import Adam4bit, Adam8bit, AdamFp8, AdamW4bit, AdamW8bit, AdamWFp8, QuantizedState
from lowbit_optim.checkpoint.torchao import load_torchao_optimizer_state, quantized_from_torchao
from lowbit_optim.formats.codecs import ZeroFreeCodec
from lowbit_optim.step.math import adam_ratio_bound

torchao_optim = pytest.importorskip("torchao.optim")

PAIRS = {
    "AdamW8bit": (torchao_optim.AdamW8bit, AdamW8bit),
    "AdamW4bit": (torchao_optim.AdamW4bit, AdamW4bit),
    "Adam8bit": (torchao_optim.Adam8bit, Adam8bit),
    "Adam4bit": (torchao_optim.Adam4bit, Adam4bit),
    "AdamWFp8": (torchao_optim.AdamWFp8, AdamWFp8),
    "AdamFp8": (torchao_optim.AdamFp8, AdamFp8),
}
STEPS = 3  # before the checkpoint, and again after it
LR, WEIGHT_DECAY, BETAS = 1e-2, 0.1, (0.9, 0.999)


class TorchaoRun(NamedTuple):
    """torchao's optimizer after STEPS steps on a weight and a bias (the checkpoint, saved to
    a file and read back), and the gradients of STEPS more steps."""

    optimizer: torch.optim.Optimizer
    weight: torch.nn.Parameter
    bias: torch.nn.Parameter
    checkpoint: dict
    grads: list


def gradients(steps: int, *, with_tiny: bool) -> list:
    """Gaussian gradients for the weight and the bias. ``with_tiny``: a quarter of each weight
    row 1e-4 times the rest, so that their squares, 1e-8 of their block's largest, fall below
    the 8-bit and float8 maps' smallest positive values: torchao stores their second moment
    as code 0, the value 0."""
    grads = []
    for _ in range(steps):
        weight_grad = torch.randn(64, 128)
        if with_tiny:
            weight_grad[:, 96:] *= 1e-4
        grads.append((weight_grad, torch.randn(64)))
    return grads


def torchao_run(name: str, *, with_tiny: bool = False) -> TorchaoRun:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(64, 128))  # quantized by both (8192 elements)
    bias = torch.nn.Parameter(torch.randn(64))  # float32 state in both
    grads = gradients(2 * STEPS, with_tiny=with_tiny)
    theirs = PAIRS[name][0]([weight, bias], lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    for weight_grad, bias_grad in grads[:STEPS]:
        weight.grad, bias.grad = weight_grad.clone(), bias_grad.clone()
        theirs.step()
    return TorchaoRun(theirs, weight, bias, saved_and_loaded(theirs.state_dict()), grads[STEPS:])


def saved_and_loaded(state_dict):
    """Through a file, as users move checkpoints (torchao's classes must be importable)."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def ulp(values: torch.Tensor) -> torch.Tensor:
    """The float32 spacing above each value's magnitude."""
    magnitude = values.abs()
    return torch.nextafter(magnitude, torch.full_like(magnitude, math.inf)) - magnitude


def torchao_step_size_ratio(step: int) -> float:
    """torchao's bias-corrected step size ``sqrt(1 - beta2**t) / (1 - beta1**t)`` over ours.

    torchao raises the betas to a float32 step tensor, so it rounds them to float32 and
    computes ``1 - beta**t`` in float32, where the subtraction cancels most digits (``1 -
    0.999**4`` is 0.004): its step size is off by up to 1e-5. Ours, as ``torch.optim.AdamW``,
    computes them in float64. This is the largest of the differences in arithmetic."""
    beta1, beta2 = BETAS
    t = torch.tensor(float(step))
    theirs = float((1 - beta2**t).sqrt()) / float(1 - beta1**t)
    ours = math.sqrt(1 - beta2**step) / (1 - beta1**step)
    return theirs / ours


def carried_codes(moment) -> torch.Tensor:
    """Codes of a torchao moment as ours would hold them (converted layout)."""
    carried = quantized_from_torchao(moment)
    assert isinstance(carried, QuantizedState)
    return carried.codes


def codes_per_element(state: QuantizedState) -> torch.Tensor:
    return state.format.unpack(state.codes).view(-1)[: state.numel()].view(state.shape)


def zero_free(optimizer) -> bool:
    """Whether the optimizer's second moment reads code 0 as half its smallest value, where
    torchao's map reads 0."""
    return isinstance(optimizer.moment_format("exp_avg_sq").codec, ZeroFreeCodec)


# Each torchao class compiles its own steps (per shape): the fast tier runs AdamW4bit's (its
# nibble order and signed map are the ones that differ most from ours).
FAST_PAIRS = ("AdamW4bit",)
# The runs of torchao's classes: every format, and Adam's L2 decay once (AdamFp8): torchao's
# Adam8bit and Adam4bit are its AdamW8bit and AdamW4bit with the decay of AdamFp8, and their
# runs cost a compile each without testing another conversion.
RUN_PAIRS = ["AdamW8bit", "AdamW4bit", "AdamWFp8", "AdamFp8"]


@pytest.mark.parametrize("name", slow_except(RUN_PAIRS, *FAST_PAIRS))
def test_torchao_checkpoint_loads_with_codes_carried(name):
    our_cls = PAIRS[name][1]
    run = torchao_run(name, with_tiny=True)
    saved = run.checkpoint["state"]
    ours = our_cls([run.weight, run.bias], lr=1.0)  # the checkpoint's hyperparameters win
    ours.load_state_dict(run.checkpoint)
    group = ours.param_groups[0]
    assert float(group["lr"]) == pytest.approx(LR) and group["weight_decay"] == WEIGHT_DECAY
    assert group["maximize"] is False and group["block_size"] == our_cls.exp_avg_format.default_block_size
    state = ours.state[run.weight]
    assert state["step"].item() == STEPS
    for key in ("exp_avg", "exp_avg_sq"):
        fmt, theirs = ours.moment_format(key), saved[0][key]
        assert state[key].format_name == fmt.name
        assert torch.equal(state[key].codes, carried_codes(theirs))
        ours_values, theirs_values = state[key].dequantize(), theirs.dequantize()
        if isinstance(fmt.codec, ZeroFreeCodec):
            # Code 0: torchao reads 0, ours half the map's smallest value of the block's scale.
            zero = codes_per_element(state[key]) == 0
            assert zero.any() and not theirs_values[zero].any()
            scales = state[key].scales.repeat_interleave(group["block_size"])[: zero.numel()].view(zero.shape)
            assert torch.equal(ours_values[zero], (fmt.table[0] * scales)[zero])
            ours_values, theirs_values = ours_values[~zero], theirs_values[~zero]
        if fmt.name.startswith("float8"):
            # torchao stores absmax / 448: ours is that times 448 in float32, so the values
            # are e4m3(c) / 448 * (scale * 448), two roundings more than torchao's e4m3(c) *
            # scale: at most 2 ulps apart.
            assert torch.equal(state[key].scales, theirs.scale * 448)
            torch.testing.assert_close(ours_values, theirs_values, rtol=2**-22, atol=0)
        else:
            # Same map, same layout: the very values torchao reads.
            assert torch.equal(state[key].scales, theirs.scale)
            assert torch.equal(ours_values, theirs_values)
        if isinstance(fmt.codec, ZeroFreeCodec) or fmt.name.startswith("float8"):
            # Where our map differs only at code 0 (zero-free) or only in its scale convention
            # (float8), quantizing torchao's values again would give these same codes and
            # scales: carrying them is no choice between two answers.
            again = QuantizedState.from_float(theirs.dequantize(), fmt, group["block_size"])
            assert torch.equal(again.codes, state[key].codes) and torch.equal(again.scales, state[key].scales)
    if our_cls.exp_avg_format.name.startswith("dynamic"):
        # The signed dynamic maps stop short of -1: quantizing torchao's first moment again
        # would shrink the scale of every block whose largest magnitude is negative.
        again = QuantizedState.from_float(saved[0]["exp_avg"].dequantize(), ours.moment_format("exp_avg"),
                                          group["block_size"])
        assert (again.scales < state["exp_avg"].scales).any()
        assert not torch.equal(again.dequantize(), state["exp_avg"].dequantize())
    assert torch.equal(ours.state[run.bias]["exp_avg"], saved[1]["exp_avg"].float())


ZERO_FREE_PAIRS = [name for name in RUN_PAIRS if "4bit" not in name]
# Float32 rounding of Adam's bound, the ratio and the step size, as in
# tests/test_fuzz_extreme_gradients.py: a few ulps, far below this.
BOUND_SLACK = 1 + 2.0**-16


def adam_step_limit(step: int) -> float:
    """``lr / (1 - beta1**t) * adam_ratio_bound(t)``: the most an element's Adam update (decay
    aside) can be at step ``t``, and what ours is clamped at."""
    beta1, beta2 = (torch.tensor(beta, dtype=torch.float64) for beta in BETAS)
    bound = adam_ratio_bound(beta1, beta2, torch.tensor(float(step), dtype=torch.float64))
    return LR / (1 - BETAS[0]**step) * float(bound)


def adam_update(before: torch.Tensor, after: torch.Tensor, decoupled: bool) -> torch.Tensor:
    """The step's Adam update without the decoupled weight decay (``p - lr * wd * p`` first,
    as both torchao and ours compute it)."""
    decayed = before * (1 - LR * WEIGHT_DECAY) if decoupled else before
    return (decayed - after).abs()


@pytest.mark.parametrize("name, with_tiny", [
    (name, with_tiny) if name in FAST_PAIRS else pytest.param(name, with_tiny, marks=pytest.mark.slow)
    for name, with_tiny in [(name, False) for name in RUN_PAIRS] + [(name, True) for name in ZERO_FREE_PAIRS]
], ids=[*RUN_PAIRS, *(f"{name}-zero-codes" for name in ZERO_FREE_PAIRS)])
def test_torchao_checkpoint_resumes_as_torchao_would(name, with_tiny):
    """STEPS steps from torchao's checkpoint, with torchao and with ours, same gradients.

    The state stays code for code; parameters differ only by the two optimizers' arithmetic,
    bounded per element and step by one float32 rounding of the parameter plus the step-size
    difference (``torchao_step_size_ratio``) and an ulp of the update: measured at most 1.71x
    that sum, bounded at 2x. (Other sources, all within it: torchao computes ``v.lerp(g**2,
    1 - beta2)`` where torch computes ``v * beta2 + (1 - beta2) * g**2``, its weight decay as
    ``p - lr * wd * p`` and its denominator as ``sqrt(v) / sqrt(bc2) + eps``, with a float32 LR.)

    Ours clamps every element's ``exp_avg / denom`` at Adam's own bound (``adam_ratio_bound``),
    torchao does not: where its quantized moments put an element's update beyond that bound
    (the rounded-down second moment of a quantized state; no Adam could move it so far), ours
    moves it by the bound, and those elements are set apart. Every element of ours, set apart
    or not, moves by at most ``adam_step_limit`` plus the decoupled decay in every step.

    ``with_tiny``: the 8-bit and float8 second moments then hold code 0, which torchao reads as
    0 (and jumps by ``lr * m_hat / eps``) and ours as half the map's smallest value; the
    elements stored with code 0 are set apart too. With L2 weight decay (Adam) an element's
    parameter feeds its gradient, so a difference reaches its first moment and, through the
    block's scale, the rest of its block: then the whole block is set apart.
    """
    theirs_cls, our_cls = PAIRS[name]
    run = torchao_run(name, with_tiny=with_tiny)
    start = (run.weight.detach().clone(), run.bias.detach().clone())
    weight, bias = (torch.nn.Parameter(p.clone()) for p in start)
    ours = our_cls([weight, bias], lr=1.0)
    ours.load_state_dict(run.checkpoint)
    decoupled = ours.param_groups[0]["decoupled_weight_decay"]

    def stored_as_zero():
        """Second-moment elements at code 0 in torchao's state or ours: read as 0 by one and
        as half the smallest value by the other, or rounded to it by ours only (ours rounds
        up to 3/4 of the smallest value down to code 0, torchao up to 1/2)."""
        theirs = quantized_from_torchao(run.optimizer.state[run.weight]["exp_avg_sq"])
        return (codes_per_element(theirs) == 0) | (codes_per_element(ours.state[weight]["exp_avg_sq"]) == 0)

    zero_codes = stored_as_zero()
    beyond_adam = [torch.zeros_like(p, dtype=torch.bool) for p in start]  # torchao's, any step
    bound = [torch.zeros_like(p) for p in start]
    for index, (weight_grad, bias_grad) in enumerate(run.grads):
        theirs_before = (run.weight.detach().clone(), run.bias.detach().clone())
        ours_before = (weight.detach().clone(), bias.detach().clone())
        for optimizer, params in ((run.optimizer, (run.weight, run.bias)), (ours, (weight, bias))):
            params[0].grad, params[1].grad = weight_grad.clone(), bias_grad.clone()
            optimizer.step()
        limit = adam_step_limit(STEPS + index + 1)
        for param, previous in zip((weight, bias), ours_before):
            allowed = limit * BOUND_SLACK + ulp(torch.maximum(param.detach().abs(), previous.abs()))
            assert (adam_update(previous, param.detach(), decoupled) <= allowed).all()
        for beyond, param, previous in zip(beyond_adam, (run.weight, run.bias), theirs_before):
            beyond |= adam_update(previous, param.detach(), decoupled) > limit / BOUND_SLACK
        step_size_error = abs(torchao_step_size_ratio(STEPS + index + 1) - 1) + 2**-23
        for total, param, previous in zip(bound, (run.weight, run.bias), theirs_before):
            total += 2 * (ulp(param.detach()) + (param.detach() - previous).abs() * step_size_error)
        zero_codes |= stored_as_zero()

    if not zero_free(ours):
        zero_codes = torch.zeros_like(zero_codes)
    assert zero_codes.any() == with_tiny  # the tiny gradients made torchao store zeros
    if with_tiny:  # torchao jumps at its zeros, beyond what Adam could move them
        assert (beyond_adam[0] & zero_codes).any()
    else:  # rounding alone takes few elements beyond Adam's bound (measured over the three
        # steps: 1.9% with the 4-bit second moment, 0.26% float8, 0.01% 8-bit)
        assert beyond_adam[0].float().mean() < 0.025
    set_apart = zero_codes | beyond_adam[0]
    block_size = ours.param_groups[0]["block_size"]
    blocks_set_apart = set_apart.view(-1, block_size).any(dim=1)
    if not decoupled:
        set_apart = blocks_set_apart[:, None].expand(-1, block_size).reshape(weight.shape)
    for key in ("exp_avg", "exp_avg_sq"):
        theirs_state = quantized_from_torchao(run.optimizer.state[run.weight][key])
        our_state, kept = ours.state[weight][key], ~blocks_set_apart
        same_codes = codes_per_element(our_state) == codes_per_element(theirs_state)
        assert same_codes[~set_apart].all(), key
        # Same codes; the scales (the block's largest value) carry the last-bit differences.
        torch.testing.assert_close(our_state.scales[kept], theirs_state.scales[kept], rtol=2**-21, atol=0)

    for param, theirs, total, previous, apart in zip((weight, bias), (run.weight, run.bias), bound, start,
                                                     (set_apart, beyond_adam[1])):
        assert ((theirs.detach() - previous).abs() > 0).all()
        difference = (param.detach() - theirs.detach()).abs()
        excess = (difference > total) & ~apart
        assert not excess.any(), f"{int(excess.sum())} elements beyond the bound"
        if with_tiny and param is weight:  # reading torchao's zeros as zeros shows where they were read
            assert (difference[apart] > total[apart]).any()


def test_torchao_checkpoint_with_another_block_size_is_quantized_again():
    run = torchao_run("AdamW4bit")
    ours = AdamW4bit([run.weight, run.bias], block_size=64)
    ours.load_state_dict(run.checkpoint)
    assert ours.param_groups[0]["block_size"] == 64  # ours, since torchao's groups have none
    for key in ("exp_avg", "exp_avg_sq"):
        values = run.checkpoint["state"][0][key].dequantize()
        expected = QuantizedState.from_float(values, ours.moment_format(key), 64)
        assert torch.equal(ours.state[run.weight][key].codes, expected.codes)
        assert torch.equal(ours.state[run.weight][key].scales, expected.scales)


# --- the file, without torchao ----------------------------------------------------------------
# Run in a process of its own, where importing torchao fails: reads each torchao checkpoint
# file (argv: source, target, source, target, ...) and saves what it read, which holds plain
# tensors only.
READ_WITHOUT_TORCHAO = """
import sys


class BlockTorchao:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torchao":
            raise ImportError(f"{name} imported while reading a torchao checkpoint")


sys.meta_path.insert(0, BlockTorchao())
import torch
from lowbit_optim.checkpoint.torchao import load_torchao_optimizer_state

for source, target in zip(sys.argv[1::2], sys.argv[2::2]):
    torch.save(load_torchao_optimizer_state(source), target)
imported = [name for name in sys.modules if name.split(".")[0] == "torchao"]
assert not imported, imported
"""


@pytest.fixture(scope="module")
def read_without_torchao(tmp_path_factory):
    """name -> (its ``TorchaoRun``, its checkpoint file as ``load_torchao_optimizer_state`` read
    it in a process where torchao cannot be imported). One process for all the files."""
    folder = tmp_path_factory.mktemp("torchao_checkpoints")
    runs, arguments = {}, []
    for name in RUN_PAIRS:
        runs[name] = torchao_run(name)
        torch.save(runs[name].optimizer.state_dict(), folder / f"{name}.pt")
        arguments += [str(folder / f"{name}.pt"), str(folder / f"{name}.read.pt")]
    process = subprocess.run(
        [sys.executable, "-c", READ_WITHOUT_TORCHAO, *arguments],
        cwd=pathlib.Path(__file__).parent.parent, capture_output=True, text=True, timeout=300,
    )
    assert process.returncode == 0, process.stderr
    # weights_only=True: what was read needs none of torchao's classes.
    return {name: (run, torch.load(folder / f"{name}.read.pt", weights_only=True))
            for name, run in runs.items()}


# Slow tier: its fixture runs torchao's classes and a fresh interpreter.
@pytest.mark.slow
@pytest.mark.parametrize("name", RUN_PAIRS)
def test_torchao_file_read_without_torchao_loads_like_torchao_state(name, read_without_torchao):
    run, read = read_without_torchao[name]
    our_cls = PAIRS[name][1]
    for key in ("exp_avg", "exp_avg_sq"):
        assert type(read["state"][0][key]) is QuantizedState, key
        assert torch.equal(read["state"][0][key].codes, carried_codes(run.optimizer.state[run.weight][key]))
    optimizers, weights = [], []
    for state_dict in (run.optimizer.state_dict(), read):  # torchao's tensors, then the file's
        weight, bias = (torch.nn.Parameter(p.detach().clone()) for p in (run.weight, run.bias))
        optimizer = our_cls([weight, bias], lr=1.0)
        optimizer.load_state_dict(state_dict)
        optimizers.append(optimizer)
        weights.append((weight, bias))
    assert_same_state(optimizers[1].state_dict(), optimizers[0].state_dict())

    # Training continues, identically from either.
    start = run.weight.detach().clone()
    for optimizer, (weight, bias) in zip(optimizers, weights):
        weight.grad, bias.grad = run.grads[0][0].clone(), run.grads[0][1].clone()
        optimizer.step()
    assert not torch.equal(weights[1][0], start)
    assert torch.equal(weights[1][0], weights[0][0]) and torch.equal(weights[1][1], weights[0][1])
    assert_same_state(optimizers[1].state_dict(), optimizers[0].state_dict())


def random_torchao_state(kind: str, shape, block_size: int | None = None):
    """A torchao state tensor of ``shape`` with random codes and scales (its default block
    size unless given)."""
    sizes = {} if block_size is None else {"block_size": block_size}
    if kind == "fp8":
        moment = torchao_optim.subclass_fp8.OptimStateFp8.zeros(shape, **sizes)
        moment.codes.copy_(torch.randn(shape).mul(100).to(moment.codes.dtype))
    else:
        module = {"8bit": torchao_optim.subclass_8bit, "4bit": torchao_optim.subclass_4bit}[kind]
        moment = getattr(module, f"OptimState{kind}").zeros(shape, **sizes)
        moment.codes.random_(0, 256)
    moment.scale.uniform_()
    return moment


def read_back(obj, zip_format: bool = True):
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=zip_format)
    buffer.seek(0)
    return load_torchao_optimizer_state(buffer)


# torch's legacy (non-zip) format cannot load float8 tensors at all (torch 2.13: "UntypedStorage
# has no attribute 'dtype'"), so fp8 is read from the zip format only.
@pytest.mark.parametrize("kind, zip_format", [
    ("8bit", True), ("8bit", False), ("4bit", True), ("4bit", False), ("fp8", True),
], ids=["8bit-zip", "8bit-legacy", "4bit-zip", "4bit-legacy", "fp8-zip"])
def test_torchao_state_read_with_its_codes(kind, zip_format):
    # Odd leading size: several blocks, and shapes the 4-bit packing must restore.
    moment = random_torchao_state(kind, (3, 256))
    read = read_back({"nested": [(moment,)], "plain": torch.arange(3)}, zip_format)
    state = read["nested"][0][0]
    assert type(state) is QuantizedState and state.shape == moment.shape
    expected = quantized_from_torchao(moment)  # as from torchao's live tensor
    assert state.format_name == expected.format_name
    assert torch.equal(state.codes, expected.codes) and torch.equal(state.scales, expected.scales)
    if kind == "fp8":  # ours is e4m3(c) / 448 * (scale * 448): two more roundings
        torch.testing.assert_close(state.dequantize(), moment.dequantize(), rtol=2**-22, atol=0)
    else:
        assert torch.equal(state.dequantize(), moment.dequantize())
    assert torch.equal(read["plain"], torch.arange(3))


@pytest.mark.parametrize("kind", ["8bit", "4bit", "fp8"])
def test_torchao_state_in_a_block_size_ours_cannot_hold_is_read_as_its_values(kind):
    # Our 4-bit formats need blocks of a multiple of 4, the 8-bit ones of 2.
    moment = random_torchao_state(kind, (3, 256), block_size={"4bit": 2}.get(kind, 3))
    values = read_back({"exp_avg": moment})["exp_avg"]
    assert type(values) is torch.Tensor and values.dtype == torch.float32
    assert torch.equal(values, moment.dequantize())


def test_torchao_4bit_nibbles_are_reordered():
    """torchao packs element 2k high and 2k + 1 low in byte k; ours element k low and
    k + block_size / 2 high."""
    moment = torchao_optim.subclass_4bit.OptimState4bit.zeros((128,))
    moment.codes.copy_(torch.arange(64, dtype=torch.uint8) % 8 * 16 + 8)  # codes 0..7 high, 8 low
    per_element = torch.stack([torch.arange(64) % 8, torch.full((64,), 8)], dim=-1).view(-1)
    state = quantized_from_torchao(moment)
    assert torch.equal(state.format.unpack(state.codes).view(-1), per_element.to(torch.int32))


def test_torchao_file_naming_another_torchao_class_is_refused():
    named = torchao_optim.AdamW8bit
    with pytest.raises(pickle.UnpicklingError, match=re.escape(f"{named.__module__}.AdamW8bit")):
        read_back({"state": {}, "param_groups": [], "optimizer": named})


def test_torchao_file_with_inconsistent_state_is_refused():
    moment = torchao_optim.subclass_8bit.OptimState8bit.zeros((64, 128))
    moment.scale = torch.zeros(3)  # 8192 codes cannot form 3 blocks
    with pytest.raises(pickle.UnpicklingError, match="OptimState8bit in the checkpoint is malformed"):
        read_back({"exp_avg": moment})
