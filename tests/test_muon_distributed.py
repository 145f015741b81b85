"""Muon under FSDP2 (gloo, 2 ranks on CPU): Newton-Schulz of a sharded parameter gathers the
bf16 direction, orthogonalises the whole matrix and keeps each rank's rows, so every rank ends
with exactly the rows a single process computes. Weights 33 x 40 (rows shard 17/16) and
7 x 33 (4/3, a tall matrix that Newton-Schulz transposes): uneven shards, both orientations.
"""

import gc
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import free_port, seeded_mlp
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

from lowbit_optim.reference.muon import NS_COEFFICIENTS, zeropower_via_newtonschulz
from lowbit_optim.state.sharding import wrap_like
from lowbit_optim.step.muon_sharded import orthogonalize

# Slow tier: spawned 2-rank process groups.
pytestmark = pytest.mark.slow

WIDTHS = (40, 33, 7)


def newton_schulz(update: torch.Tensor) -> torch.Tensor:
    return zeropower_via_newtonschulz(update, NS_COEFFICIENTS, 5, 1e-7)


def weights(model) -> dict:
    return {name: param for name, param in model.named_parameters() if param.ndim == 2}


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    directions = torch.load(Path(out) / "directions.pt")
    model = seeded_mlp(*WIDTHS)
    fully_shard(model)
    results = {}
    for name, param in weights(model).items():
        shard = distribute_tensor(directions[name], param.device_mesh, param.placements).to_local()
        rows = orthogonalize(shard, param, newton_schulz)
        results[name] = {"shard_rows": rows.shape[0], "whole": wrap_like(rows, param).full_tensor()}
    if rank == 0:
        torch.save(results, Path(out) / "results.pt")
    # FSDP2's modules hold gloo work: freed after the group is torn down they can abort the
    # process (pytorch/pytorch#179291), so they go first.
    del model
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def orthogonalized(tmp_path_factory):
    out = tmp_path_factory.mktemp("muon_fsdp")
    generator = torch.Generator().manual_seed(3)
    directions = {name: torch.randn(param.shape, generator=generator)
                  for name, param in weights(seeded_mlp(*WIDTHS)).items()}
    torch.save(directions, out / "directions.pt")
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=2)
    return directions, torch.load(out / "results.pt")


def test_sharded_newton_schulz_gives_each_rank_the_single_process_rows_bit_for_bit(orthogonalized):
    directions, results = orthogonalized
    assert {name: got["shard_rows"] for name, got in results.items()} == {"0.weight": 17, "2.weight": 4}
    for name, direction in directions.items():
        expected = newton_schulz(direction)
        assert results[name]["whole"].dtype == torch.bfloat16
        assert torch.equal(results[name]["whole"], expected), name
        # Sensitivity: each rank orthogonalising only its own rows gives another matrix.
        rows = results[name]["shard_rows"]
        alone = torch.cat([newton_schulz(direction[:rows]), newton_schulz(direction[rows:])])
        assert not torch.allclose(alone.float(), expected.float(), atol=1e-2)
