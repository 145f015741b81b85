"""Lion and AdEMAMix under FSDP2 (gloo, 2 ranks on CPU): the update rule is generic, so
each rank steps its shards with the same code as a single process. Rows shard 32/32, so each
rank's part of the weight is whole quantization blocks: the result must be the single-process
one bit for bit. The gradients are made once here and set on every rank's shards (no
forward or backward, so no BLAS rounding enters), and the full optimizer state dict
(``get_optimizer_state_dict(full_state_dict=True)``) holds the single process's moments.
"""

import gc
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import free_port, seeded_mlp, step_with
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

from lowbit_optim import AdEMAMix8bit, Lion4bit, QuantizedState

# Slow tier: the runs are spawned 2-rank process groups.
pytestmark = pytest.mark.slow

CLASSES = {"Lion4bit": (Lion4bit, {}), "AdEMAMix8bit": (AdEMAMix8bit, dict(t_alpha=3, t_beta3=3))}
OPTIONS = dict(lr=1e-2, weight_decay=0.1, min_quant_size=1024, backend="eager")
STEPS = 4


def make_model() -> nn.Module:
    return seeded_mlp(64, 64)  # a 4096-element weight (quantized) and a bias


def make_optimizer(name: str, params):
    cls, options = CLASSES[name]
    return cls(params, **OPTIONS, **options)


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    grads = torch.load(Path(out) / "grads.pt")
    results = {}
    for name in CLASSES:
        model = make_model()
        fully_shard(model)
        optimizer = make_optimizer(name, model.parameters())
        step_with(model, optimizer, grads)
        full = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
        results[name] = {
            "params": {key: param.full_tensor().clone() for key, param in model.named_parameters()},
            "moments": {(key, moment): value.clone() for key, entry in full["state"].items()
                        for moment, value in entry.items() if moment != "step"},
            "kinds": {moment: type(value.to_local()).__name__
                      for moment, value in optimizer.state[model[0].weight].items() if moment != "step"},
        }
    if rank == 0:
        torch.save(results, Path(out) / "results.pt")
    # FSDP2's modules hold gloo work: freed after the group is torn down (this function's
    # locals at its return) they can abort the process ("terminate called without an active
    # exception", pytorch/pytorch#179291), so they go first, and every rank gets here before
    # any tears the group down.
    del model, optimizer, full
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("rules_fsdp")
    generator = torch.Generator().manual_seed(1)
    shapes = {name: param.shape for name, param in make_model().named_parameters()}
    grads = [{name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
             for _ in range(STEPS)]
    torch.save(grads, out / "grads.pt")
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=2)
    return grads, torch.load(out / "results.pt")


@pytest.mark.parametrize("name", CLASSES)
def test_fsdp2_shards_step_like_a_single_process_bit_for_bit(fsdp_runs, name):
    grads, results = fsdp_runs
    model = make_model()
    optimizer = make_optimizer(name, model.parameters())
    step_with(model, optimizer, grads)
    got = results[name]
    assert set(got["kinds"].values()) == {"QuantizedState"}  # each rank holds quantized shards
    for key, param in model.named_parameters():
        assert torch.equal(got["params"][key], param.detach()), key
    state = optimizer.state[model[0].weight]
    for moment in optimizer.rule.moment_keys(optimizer.param_groups[0]):
        expected = state[moment]
        assert isinstance(expected, QuantizedState)
        assert torch.equal(got["moments"][("0.weight", moment)], expected.dequantize(torch.float32)), moment
