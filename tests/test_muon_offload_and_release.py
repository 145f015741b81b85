"""Muon8bit/Muon4bit with the host step (``CPUOffloadOptimizer``) and with gradient release: both
step each matrix whole (Newton-Schulz is per parameter), so both must train bit-identically to
the plain optimizer. A tiny model with an embedding and a head (AdamW's part) and two hidden
matrices of quantized momentum."""


import pytest
import torch
from conftest import num_threads
from torch import nn

from lowbit_optim import CPUOffloadOptimizer, Muon4bit, Muon8bit, QuantizedState, release_gradients


@pytest.fixture(autouse=True)
def _one_thread():
    """Newton-Schulz's small bf16 matmuls are much slower on two threads on a shared 2-core
    machine (tests/test_muon.py)."""
    with num_threads(1):
        yield


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 64)
        self.fc = nn.Linear(64, 128)
        self.out = nn.Linear(128, 64)
        self.head = nn.Linear(64, 50)

    def forward(self, tokens):
        return self.head(torch.tanh(self.out(torch.tanh(self.fc(self.embed(tokens))))))


def train(model, optimizer, steps=3):
    tokens = torch.arange(16) % 50
    for _ in range(steps):
        nn.functional.cross_entropy(model(tokens), tokens).backward()
        optimizer.step()
        optimizer.zero_grad()


def assert_same_params(actual: nn.Module, expected: nn.Module) -> None:
    for (name, want), got in zip(expected.named_parameters(), actual.parameters(), strict=True):
        assert torch.equal(got, want), name


@pytest.mark.parametrize("cls", [Muon8bit, Muon4bit], ids=lambda cls: cls.__name__)
def test_offloaded_muon_of_a_module_trains_bit_identically_to_muon(cls):
    expected, model = TinyLM(), TinyLM()
    train(expected, cls(expected, lr=0.02))
    optimizer = CPUOffloadOptimizer(model, cls, lr=0.02)
    train(model, optimizer)
    assert_same_params(model, expected)
    # The module's split, made before offloading: the embedding and the head take AdamW.
    host = optimizer.host_param
    muon = {p for group in optimizer.param_groups if group["use_muon"] for p in group["params"]}
    assert muon == {host(model.fc.weight), host(model.out.weight)}
    assert isinstance(optimizer.state[host(model.fc.weight)]["momentum_buffer"], QuantizedState)


def test_offloading_a_module_for_a_class_that_does_not_split_one_is_refused_naming_why():
    with pytest.raises(TypeError, match=r"a module only for Muon8bit/Muon4bit; pass TinyLM.parameters\(\)"):
        CPUOffloadOptimizer(TinyLM(), torch.optim.AdamW, lr=1e-3)


def test_gradient_release_with_muon_steps_each_matrix_as_step_does():
    expected, model = TinyLM(), TinyLM()
    train(expected, Muon8bit(expected, lr=0.02))
    optimizer = Muon8bit(model, lr=0.02)
    release_gradients(optimizer)
    train(model, optimizer)
    assert_same_params(model, expected)
    assert all(param.grad is None for param in model.parameters())  # freed during backward
    # Sensitivity: another LR gives other weights.
    other = TinyLM()
    train(other, Muon8bit(other, lr=0.01))
    assert not torch.equal(other.fc.weight, expected.fc.weight)
