"""Gradient release under FSDP2 (``fully_shard``, gloo, 2 ranks on CPU) and its refusal under
DDP, in one spawned run with tests/test_distributed.py's worker, model and batches.

FSDP2 calls the sharded parameter's post-accumulate-grad hooks itself, after the
reduce-scatter, with the rank's shard of the averaged gradient: release then steps each
shard as ordinary stepping would. Both runs happen in the same worker, so their gradients
come from the same code at the same thread count and the comparison can be exact.
"""

import pytest
import torch
import torch.multiprocessing as mp
from test_distributed import OPTIMIZERS, OPTIONS, _free_port, _worker, make_model, shard, snapshot, train
from torch.nn.parallel import DistributedDataParallel

from lowbit_optim import AdamW8bit, release_gradients

# 4-bit blockwise state, and the factored second moment, whose column statistics are summed
# across ranks inside each parameter's step (an all-reduce from within the hook).
FORMATS = ("4bit", "factored")
STEPS = 3


def _error_of(function) -> str | None:
    try:
        function()
    except (RuntimeError, ValueError) as error:
        return str(error)
    return None


def _release_runs(rank: int, out) -> dict:
    results = {}
    for fmt in FORMATS:
        for release in (False, True):
            model = shard(make_model())
            optimizer = OPTIMIZERS[fmt](model.parameters(), **OPTIONS, backend="eager")
            if release:
                release_gradients(optimizer)
            train(model, optimizer, STEPS)
            results[f"{fmt}-release-{release}"] = snapshot(model, optimizer)
            results[f"{fmt}-release-{release}-steps"] = sorted(
                float(state["step"]) for state in optimizer.state.values())
        model(torch.randn(4, 40)).square().mean().backward()
        results[f"{fmt}-clip"] = _error_of(
            lambda model=model: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        results[f"{fmt}-accumulate"] = _error_of(
            lambda model=model: model(torch.randn(4, 40)).square().mean().backward())
    ddp = DistributedDataParallel(make_model())
    results["ddp"] = _error_of(lambda: release_gradients(AdamW8bit(ddp.parameters())))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("release")
    mp.spawn(_worker, args=(2, _free_port(), str(out), _release_runs, "release.pt"), nprocs=2)
    return torch.load(out / "release.pt")


@pytest.mark.parametrize("fmt", FORMATS)
def test_fsdp2_released_training_matches_ordinary_exactly(runs, fmt):
    ordinary, released = runs[f"{fmt}-release-False"], runs[f"{fmt}-release-True"]
    for part in ("params", "moments"):
        assert ordinary[part].keys() == released[part].keys()
        for key, value in ordinary[part].items():
            assert torch.equal(value, released[part][key]), (part, key)
    assert runs[f"{fmt}-release-True-steps"] == runs[f"{fmt}-release-False-steps"] == [STEPS] * 4


@pytest.mark.parametrize("fmt", FORMATS)
def test_fsdp2_clipping_and_accumulation_are_told(runs, fmt):
    assert "released gradient" in runs[f"{fmt}-clip"]
    assert "released gradient" in runs[f"{fmt}-accumulate"]


def test_ddp_is_refused(runs):
    assert "DistributedDataParallel" in runs["ddp"]
