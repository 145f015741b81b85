"""Checkpoints written by an earlier version of the package (tests/fixtures, made by
tests/fixtures/make_checkpoints.py before the package was split into sub-packages) still
load, save back to the same bytes (plus the group options they predate, at their defaults),
and resume exactly.

The expected continuation is computed here, on the machine running the test, from the same
values put into an optimizer without ``load_state_dict``: nothing machine-dependent is stored.
"""

import importlib.util
import pathlib

import pytest
import torch

from lowbit_optim import FactoredState, QuantizedState
from lowbit_optim.checkpoint.validate import TORCH_ADAMW_GROUP_OPTIONS

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"


def _recipe():
    """The fixtures' own recipe (model, optimizer, gradients), read from the script that wrote
    them."""
    spec = importlib.util.spec_from_file_location("make_checkpoints", FIXTURES / "make_checkpoints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_checkpoints = _recipe()

RESUMED_STEPS = 3


def load_fixture(case: str, *, weights_only: bool):
    state_dict = torch.load(FIXTURES / f"{case}.optim.pt", weights_only=weights_only)
    values = torch.load(FIXTURES / f"{case}.params.pt", weights_only=True)
    params = [torch.nn.Parameter(value.clone()) for value in values]
    return state_dict, params


def rebuilt(value):
    """``value`` made again from its parts by the constructors, not by unpickling."""
    if isinstance(value, QuantizedState):
        return QuantizedState(value.codes.clone(), value.scales.clone(), value.format_name,
                              tuple(value.shape), value.dtype)
    if isinstance(value, FactoredState):
        return FactoredState(value.row.clone(), value.col.clone(), tuple(value.shape), value.dtype)
    return value.clone()


def resume(params, optimizer) -> list[torch.Tensor]:
    torch.manual_seed(0)  # stochastic rounding draws from it: both runs start from one state
    for step in range(make_checkpoints.STEPS, make_checkpoints.STEPS + RESUMED_STEPS):
        make_checkpoints.apply_gradients(params, step)
        optimizer.step()
    return [p.detach().clone() for p in params]


@pytest.mark.sweep
@pytest.mark.parametrize("weights_only", [True, False], ids=["weights_only", "full_pickle"])
@pytest.mark.parametrize("case", list(make_checkpoints.CASES))
def test_saved_checkpoint_loads_and_saves_back_unchanged(case, weights_only, tmp_path):
    state_dict, params = load_fixture(case, weights_only=weights_only)
    optimizer = make_checkpoints.make_optimizer(case, params)
    optimizer.load_state_dict(state_dict)
    # Same file name: torch.save names the archive's top folder after it.
    saved, expected = tmp_path / "saved" / f"{case}.optim.pt", tmp_path / "expected" / f"{case}.optim.pt"
    saved.parent.mkdir(), expected.parent.mkdir()
    torch.save(optimizer.state_dict(), saved)
    torch.save(with_options_it_predates(load_fixture(case, weights_only=True)[0]), expected)
    assert saved.read_bytes() == expected.read_bytes()


def with_options_it_predates(state_dict: dict) -> dict:
    """``state_dict`` as an optimizer that loaded it saves it back: each group with the options
    the fixtures predate appended at their defaults, ``torch.optim.AdamW``'s implementation
    options and ``master_weight_bits=None`` (no master weights, as the fixtures were trained);
    ``Optimizer.state_dict`` writes ``params`` last."""
    predated = {**TORCH_ADAMW_GROUP_OPTIONS, "master_weight_bits": None}
    groups = []
    for saved in state_dict["param_groups"]:
        group = {key: value for key, value in saved.items() if key != "params"}
        assert not group.keys() & predated.keys()
        groups.append({**group, **predated, "params": saved["params"]})
    return {**state_dict, "param_groups": groups}


@pytest.mark.parametrize("case", list(make_checkpoints.CASES))
def test_saved_checkpoint_resumes_like_the_same_state_in_memory(case):
    state_dict, params = load_fixture(case, weights_only=True)
    loaded = make_checkpoints.make_optimizer(case, params)
    loaded.load_state_dict(state_dict)

    _, same_params = load_fixture(case, weights_only=True)
    in_memory = make_checkpoints.make_optimizer(case, same_params)
    for saved_id, entry in state_dict["state"].items():
        in_memory.state[same_params[saved_id]] = {key: rebuilt(value) for key, value in entry.items()}

    expected = resume(same_params, in_memory)
    actual = resume(params, loaded)
    for index, (got, want) in enumerate(zip(actual, expected)):
        assert got.dtype == want.dtype
        assert torch.equal(got, want), f"{case}: parameter {index} differs after resuming"
    moved = [not torch.equal(a, b) for a, b in zip(actual, load_fixture(case, weights_only=True)[1])]
    assert moved == [True, True, False], "the resumed steps must move the parameters with gradients"
