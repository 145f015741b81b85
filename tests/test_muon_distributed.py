"""Muon under FSDP2 (gloo, 2 ranks on CPU): Newton-Schulz of a sharded parameter gathers the
bf16 direction, orthogonalises the whole matrix and keeps each rank's rows, so every rank ends
with exactly what a single process computes.

``orthogonalize`` alone: weights 33 x 40 (rows shard 17/16) and 7 x 33 (4/3, a tall matrix that
Newton-Schulz transposes), uneven shards in both orientations. ``Muon8bit``/``Muon4bit``: an
MLP 64 -> 128 -> 40 whose weights have quantized momentum (each rank's rows, 64 x 64 and
20 x 128, are whole blocks, so the codes are the single process's); the 128 x 64 one is tall, so
its LR scale must come from the global shape, not the shard's; the biases take the AdamW part.
The gradients are made once here and set on every rank's shards, no forward or backward (see
tests/test_distributed.py for why): the result must be the single process's bit for bit. A
distributed checkpoint (DCP) saved after those steps and loaded into a fresh sharded model and
optimizer must continue exactly as the run that was not interrupted. With gradient release each
matrix steps in its own gradient hook, after FSDP2's reduce-scatter, gathering its direction there
(every rank's hooks in the same order): each rank must end exactly as ordinary stepping, forward
and backward included, leaves it on that rank. Each rank compares its own two runs, and the
ranks agree on the verdict before rank 0 reports it.
"""

import gc
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from conftest import num_threads
from helpers import dcp_load, free_port, seeded_mlp, step_with
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

from lowbit_optim import Muon4bit, Muon8bit, QuantizedState, release_gradients
from lowbit_optim.optim.released_gradient import is_released
from lowbit_optim.state.sharding import local, wrap_like
from lowbit_optim.step.muon_sharded import orthogonalize
from lowbit_optim.step.newton_schulz import NS_COEFFICIENTS, zeropower_via_newtonschulz

# Slow tier: spawned 2-rank process groups.
pytestmark = pytest.mark.slow

NS_WIDTHS = (40, 33, 7)
MLP_WIDTHS = (64, 128, 40)
CLASSES = {"Muon8bit": Muon8bit, "Muon4bit": Muon4bit}
OPTIONS = dict(lr=0.02, weight_decay=0.1, adamw_lr=1e-2)
STEPS = 3


def newton_schulz(update: torch.Tensor) -> torch.Tensor:
    return zeropower_via_newtonschulz(update, NS_COEFFICIENTS, 5, 1e-7)


def weights(model) -> dict:
    return {name: param for name, param in model.named_parameters() if param.ndim == 2}


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    inputs = torch.load(Path(out) / "inputs.pt")
    results = {"orthogonalized": {}}
    model = seeded_mlp(*NS_WIDTHS)
    fully_shard(model)
    for name, param in weights(model).items():
        shard = distribute_tensor(inputs["directions"][name], param.device_mesh, param.placements).to_local()
        rows = orthogonalize(shard, param, newton_schulz)
        results["orthogonalized"][name] = {"shard_rows": rows.shape[0],
                                           "whole": wrap_like(rows, param).full_tensor()}
    for name, cls in CLASSES.items():
        model = seeded_mlp(*MLP_WIDTHS)
        fully_shard(model)
        optimizer = cls(model, **OPTIONS)
        step_with(model, optimizer, inputs["grads"])
        full = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
        results[name] = {
            "params": {key: param.full_tensor().clone() for key, param in model.named_parameters()},
            "momenta": {key: entry["momentum_buffer"].clone() for key, entry in full["state"].items()
                        if "momentum_buffer" in entry},
            "momentum": type(optimizer.state[model[0].weight]["momentum_buffer"].to_local()).__name__,
        }
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=Path(out) / f"dcp-{name}")
        step_with(model, optimizer, inputs["grads_after_save"])
        resumed_model = seeded_mlp(*MLP_WIDTHS)
        fully_shard(resumed_model)
        resumed = cls(resumed_model, **OPTIONS)
        dcp_load(resumed_model, resumed, Path(out) / f"dcp-{name}")
        step_with(resumed_model, resumed, inputs["grads_after_save"])
        results[name]["resumed_equal"], results[name]["resumed_tensors"] = _same_on_every_rank(
            _run_tensors(model, optimizer), _run_tensors(resumed_model, resumed))
        ordinary = _trained_by_backward(cls, inputs["batches"], release=False)
        released = _trained_by_backward(cls, inputs["batches"], release=True)
        results[name]["released_equal"], _ = _same_on_every_rank(_run_tensors(*ordinary),
                                                                  _run_tensors(*released))
    if rank == 0:
        torch.save(results, Path(out) / "results.pt")
    # FSDP2's modules hold gloo work: freed after the group is torn down they can abort the
    # process (pytorch/pytorch#179291), so they go first.
    del model, optimizer, full, resumed_model, resumed, ordinary, released
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _run_tensors(model, optimizer) -> list[torch.Tensor]:
    """A run's rank-local state: each parameter shard, and its step count and moments (a
    quantized one as its codes and scales)."""
    tensors = []
    for param in model.parameters():
        tensors.append(local(param.detach()))
        for value in optimizer.state[param].values():
            shard = local(value)
            tensors += [shard.codes, shard.scales] if isinstance(shard, QuantizedState) else [shard]
    return tensors


def _same_on_every_rank(tensors: list[torch.Tensor], others: list[torch.Tensor]) -> tuple[bool, int]:
    """Whether two runs' rank-local tensors are equal on every rank, and how many were compared."""
    same = len(tensors) == len(others) and all(map(torch.equal, tensors, others))
    verdict = torch.tensor(float(same))
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    return bool(verdict), len(tensors)


def _trained_by_backward(cls, batches: list[torch.Tensor], release: bool) -> tuple:
    model = seeded_mlp(*MLP_WIDTHS)
    fully_shard(model)
    optimizer = cls(model, **OPTIONS)
    if release:
        release_gradients(optimizer)
    for batch in batches:
        model(batch).square().mean().backward()
        # Released: every gradient was stepped and freed in its hook, a placeholder left for it.
        assert all(is_released(param.grad) for param in model.parameters()) == release
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("muon_fsdp")
    generator = torch.Generator().manual_seed(3)
    directions = {name: torch.randn(param.shape, generator=generator)
                  for name, param in weights(seeded_mlp(*NS_WIDTHS)).items()}
    shapes = {name: param.shape for name, param in seeded_mlp(*MLP_WIDTHS).named_parameters()}
    grads = [{name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
             for _ in range(STEPS)]
    grads_after_save = [{name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
                        for _ in range(2)]
    batches = [torch.randn(8, MLP_WIDTHS[0], generator=generator) for _ in range(STEPS)]
    inputs = {"directions": directions, "grads": grads, "grads_after_save": grads_after_save,
              "batches": batches}
    torch.save(inputs, out / "inputs.pt")
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=2)
    return inputs, torch.load(out / "results.pt")


def test_sharded_newton_schulz_gives_each_rank_the_single_process_rows_bit_for_bit(fsdp_runs):
    inputs, results = fsdp_runs
    got = results["orthogonalized"]
    assert {name: entry["shard_rows"] for name, entry in got.items()} == {"0.weight": 17, "2.weight": 4}
    for name, direction in inputs["directions"].items():
        # The ranks' thread count: a matmul may split its sums by thread count.
        with num_threads(1):
            expected = newton_schulz(direction)
        assert got[name]["whole"].dtype == torch.bfloat16
        assert torch.equal(got[name]["whole"], expected), name
        # Sensitivity: each rank orthogonalising only its own rows gives another matrix.
        rows = got[name]["shard_rows"]
        alone = torch.cat([newton_schulz(direction[:rows]), newton_schulz(direction[rows:])])
        assert not torch.allclose(alone.float(), expected.float(), atol=1e-2)


@pytest.mark.parametrize("name", CLASSES)
def test_fsdp2_muon_trains_like_a_single_process_bit_for_bit(fsdp_runs, name):
    inputs, results = fsdp_runs
    model = seeded_mlp(*MLP_WIDTHS)
    optimizer = CLASSES[name](model, **OPTIONS)
    with num_threads(1):  # the ranks' thread count, for Newton-Schulz's matmuls
        step_with(model, optimizer, inputs["grads"])
    assert isinstance(optimizer.state[model[0].weight]["momentum_buffer"], QuantizedState)
    assert results[name]["momentum"] == "QuantizedState"  # each rank holds quantized shards
    # A full state dict gathers the momentum's values (dequantized), the single process's.
    names = {id(param): key for key, param in model.named_parameters()}
    expected_momenta = {names[id(param)]: state["momentum_buffer"].dequantize(torch.float32)
                        for param, state in optimizer.state.items() if "momentum_buffer" in state}
    assert results[name]["momenta"].keys() == expected_momenta.keys() == {"0.weight", "2.weight"}
    for key, expected in expected_momenta.items():
        assert torch.equal(results[name]["momenta"][key], expected), key
    moved = 0.0
    for key, param in model.named_parameters():
        assert torch.equal(results[name]["params"][key], param.detach()), key
        moved += float((param.detach() - seeded_mlp(*MLP_WIDTHS).state_dict()[key]).abs().sum())
    assert moved > 0


@pytest.mark.parametrize("name", CLASSES)
def test_fsdp2_muon_resumed_from_a_distributed_checkpoint_continues_bit_for_bit(fsdp_runs, name):
    _, results = fsdp_runs
    # Four parameters, each with its tensors: a vacuous comparison would count none.
    assert results[name]["resumed_tensors"] >= 8
    assert results[name]["resumed_equal"]


@pytest.mark.parametrize("name", CLASSES)
def test_fsdp2_muon_with_gradient_release_steps_as_ordinary_stepping_bit_for_bit(fsdp_runs, name):
    _, results = fsdp_runs
    assert results[name]["released_equal"]
