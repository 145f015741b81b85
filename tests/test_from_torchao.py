"""A checkpoint of torchao's low-bit optimizer resumes in ours (issue 15), with real torchao:
each of its AdamW8bit, AdamW4bit, AdamWFp8, Adam8bit, Adam4bit and AdamFp8 into our class of the
same name; and such a checkpoint file read without torchao (``lowbit_optim.checkpoint.torchao``)."""

import io
import pathlib
import pickle
import re
import subprocess
import sys
from typing import NamedTuple

import pytest
import torch
from helpers import assert_same_state

from lowbit_optim import Adam4bit, Adam8bit, AdamFp8, AdamW4bit, AdamW8bit, AdamWFp8, QuantizedState
from lowbit_optim.checkpoint.load import foreign_float_values
from lowbit_optim.checkpoint.torchao import load_torchao_optimizer_state

torchao_optim = pytest.importorskip("torchao.optim")

PAIRS = {
    "AdamW8bit": (torchao_optim.AdamW8bit, AdamW8bit),
    "AdamW4bit": (torchao_optim.AdamW4bit, AdamW4bit),
    "Adam8bit": (torchao_optim.Adam8bit, Adam8bit),
    "Adam4bit": (torchao_optim.Adam4bit, Adam4bit),
    "AdamWFp8": (torchao_optim.AdamWFp8, AdamWFp8),
    "AdamFp8": (torchao_optim.AdamFp8, AdamFp8),
}
STEPS = 3


class TorchaoRun(NamedTuple):
    """torchao's optimizer after STEPS steps on a weight and a bias; ``grads`` has one more."""

    optimizer: torch.optim.Optimizer
    weight: torch.nn.Parameter
    bias: torch.nn.Parameter
    grads: list


def torchao_run(name: str) -> TorchaoRun:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(64, 128))  # quantized by both (8192 elements)
    bias = torch.nn.Parameter(torch.randn(64))  # float32 state in both
    grads = [(torch.randn(64, 128), torch.randn(64)) for _ in range(STEPS + 1)]
    theirs = PAIRS[name][0]([weight, bias], lr=1e-2, weight_decay=0.1)
    for weight_grad, bias_grad in grads[:STEPS]:
        weight.grad, bias.grad = weight_grad.clone(), bias_grad.clone()
        theirs.step()
    return TorchaoRun(theirs, weight, bias, grads)


def saved_and_loaded(state_dict):
    """Through a file, as users move checkpoints (torchao's classes must be importable)."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("name", PAIRS)
def test_torchao_checkpoint_resumes_in_ours(name):
    our_cls = PAIRS[name][1]
    theirs, weight, bias, grads = torchao_run(name)
    checkpoint = saved_and_loaded(theirs.state_dict())
    saved_moments = {key: foreign_float_values(checkpoint["state"][0][key])
                     for key in ("exp_avg", "exp_avg_sq")}

    ours = our_cls([weight, bias], lr=1.0)  # the checkpoint's hyperparameters win
    ours.load_state_dict(checkpoint)
    group = ours.param_groups[0]
    assert float(group["lr"]) == pytest.approx(1e-2) and group["weight_decay"] == 0.1
    assert group["maximize"] is False and group["block_size"] == our_cls.exp_avg_format.default_block_size
    state = ours.state[weight]
    assert state["step"].item() == STEPS
    for key, values in saved_moments.items():
        # Their dequantized values, quantized once in our format.
        expected = QuantizedState.from_float(values, ours.moment_format(key), group["block_size"])
        assert torch.equal(state[key].codes, expected.codes)
        assert torch.equal(state[key].scales, expected.scales)
    assert torch.equal(ours.state[bias]["exp_avg"], checkpoint["state"][1]["exp_avg"].float())

    # Training continues where torchao's would have gone, to the moments' quantization noise.
    start = weight.detach().clone()
    moved = []
    for optimizer in (theirs, ours):
        with torch.no_grad():
            weight.copy_(start)
        weight.grad, bias.grad = grads[STEPS][0].clone(), grads[STEPS][1].clone()
        optimizer.step()
        moved.append(weight.detach() - start)
    relative = float((moved[1] - moved[0]).norm() / moved[0].norm())
    # One step moves each weight by about lr; the two moments' roundings (ours after theirs)
    # bound the difference: ~1% of the update at 8 bits, ~10% at 4 bits (tests/test_optimizer.py).
    assert relative < 0.2, relative


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
    it in a process where torchao cannot be imported). One process for all six files."""
    folder = tmp_path_factory.mktemp("torchao_checkpoints")
    runs, arguments = {}, []
    for name in PAIRS:
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


@pytest.mark.parametrize("name", PAIRS)
def test_torchao_file_read_without_torchao_loads_like_torchao_state(name, read_without_torchao):
    run, read = read_without_torchao[name]
    our_cls = PAIRS[name][1]
    assert isinstance(read["state"][0]["exp_avg"], torch.Tensor)
    assert type(read["state"][0]["exp_avg"]) is torch.Tensor  # the float values, not a subclass
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
        weight.grad, bias.grad = run.grads[STEPS][0].clone(), run.grads[STEPS][1].clone()
        optimizer.step()
    assert not torch.equal(weights[1][0], start)
    assert torch.equal(weights[1][0], weights[0][0]) and torch.equal(weights[1][1], weights[0][1])
    assert_same_state(optimizers[1].state_dict(), optimizers[0].state_dict())


def saved(obj) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def random_torchao_state(kind: str, shape):
    """A torchao state tensor of ``shape`` with random codes and scales."""
    if kind == "fp8":
        moment = torchao_optim.subclass_fp8.OptimStateFp8.zeros(shape)
        moment.codes.copy_(torch.randn(shape).mul(100).to(moment.codes.dtype))
    else:
        module = {"8bit": torchao_optim.subclass_8bit, "4bit": torchao_optim.subclass_4bit}[kind]
        moment = getattr(module, f"OptimState{kind}").zeros(shape)
        moment.codes.random_(0, 256)
    moment.scale.uniform_()
    return moment


# torch's legacy (non-zip) format cannot load float8 tensors at all (torch 2.13: "UntypedStorage
# has no attribute 'dtype'"), so fp8 is read from the zip format only.
@pytest.mark.parametrize("kind, zip_format", [
    ("8bit", True), ("8bit", False), ("4bit", True), ("4bit", False), ("fp8", True),
], ids=["8bit-zip", "8bit-legacy", "4bit-zip", "4bit-legacy", "fp8-zip"])
def test_torchao_state_read_as_its_dequantized_values(kind, zip_format):
    # Odd leading size: several blocks, and shapes the 4-bit packing must restore.
    moment = random_torchao_state(kind, (3, 256))
    buffer = io.BytesIO()
    torch.save({"nested": [(moment,)], "plain": torch.arange(3)}, buffer,
               _use_new_zipfile_serialization=zip_format)
    buffer.seek(0)
    read = load_torchao_optimizer_state(buffer)
    values = read["nested"][0][0]
    assert type(values) is torch.Tensor and values.dtype == torch.float32
    assert torch.equal(values, moment.dequantize())
    assert torch.equal(read["plain"], torch.arange(3))


def test_torchao_file_naming_another_torchao_class_is_refused():
    named = torchao_optim.AdamW8bit
    checkpoint = saved({"state": {}, "param_groups": [], "optimizer": named})
    with pytest.raises(pickle.UnpicklingError, match=re.escape(f"{named.__module__}.AdamW8bit")):
        load_torchao_optimizer_state(checkpoint)


def test_torchao_file_with_inconsistent_state_is_refused():
    moment = torchao_optim.subclass_8bit.OptimState8bit.zeros((64, 128))
    moment.scale = torch.zeros(3)  # 8192 codes cannot form 3 blocks
    with pytest.raises(pickle.UnpicklingError, match="OptimState8bit in the checkpoint is malformed"):
        load_torchao_optimizer_state(saved({"exp_avg": moment}))
