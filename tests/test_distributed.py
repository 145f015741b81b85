"""FSDP2, DDP and distributed checkpoints (DCP) on CPU with gloo, in spawned processes.

One 2-rank run and one 1-rank run (module fixture ``runs``) do all the distributed work and
save what they saw; the tests compare it with single-process runs made here. Every rank
trains on the same batch, so data-parallel gradient averaging is exact ((g + g) / 2 == g)
and any difference comes from the optimizer alone: that is what lets most bounds be zero.

Exact comparisons replay gradients, they do not recompute them. A forward and
backward here and the same one in a worker agree only to float rounding: they run at other
thread counts (a worker at 1 thread, this process at its own), and x86 torch computes them
with MKL, whose matmul (and vector math: ``tanh``, ``exp``, even ``sqrt``) results depend on
the kernel MKL picks for the CPU and on the thread split. On a 2-core AMD EPYC (Zen 4) the
gradients differed in the last bits and the exact tests failed. On a 2-core Intel Xeon,
measured: MKL's AVX-512 kernels give the same bits at 1, 2 and 4 threads; its AVX2 kernels
(``MKL_ENABLE_INSTRUCTIONS=AVX2``, standing in for another CPU's choice) change every
gradient of this model by up to 1 ulp (relative RMSE 1.3e-7) and also differ between 1 and 2
threads for a 256x512x384 Linear; ATen's own kernels (``ATEN_CPU_CAPABILITY=avx2``) and
storage offsets of the weights (FSDP2's all-gather views) change nothing, and gloo's
(g + g) / 2 is exact. So
each worker records, per step, the whole parameters and the gradients it stepped with
(``DTensor.full_tensor()`` of FSDP2's sharded gradients, DDP's averaged ones), and the
references here step ``make_model()``'s parameters with those very gradients: same blocks,
same inputs, same codes, whatever computed the gradients. That the gradients are right is
checked separately, to float rounding. The step itself must then give the same bits at any
thread count (tests/test_thread_count.py); it need not across CPUs (the eager step's
``sqrt`` goes through MKL, which is why the workers are not given other MKL kernels here).

Model: Linear(40, 33) -> Tanh -> Linear(33, 7), ``min_quant_size=200``, ``block_size=64``.
Both weights are quantized: 33 rows shard 17/16 and 7 rows 4/3 (uneven, and no shard edge is
a block edge), and the second weight's shards (132 and 99 elements) are each below
``min_quant_size`` although the weight (231) is not: the decision must use the global size.
``AdamWFactored4bit`` factors the first weight's second moment (33 rows, 40 columns; the
second weight's factors would cost more than its 4-bit map) and its ranks sum their column
statistics each step: most tests run it too, the blockwise-only ones do not.
"""

import gc
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from conftest import relative_rmse
from helpers import dcp_load, free_port, seeded_mlp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

from lowbit_optim import (
    AdamW4bit,
    AdamW8bit,
    AdamWFactored4bit,
    AdamWFp8,
    FactoredState,
    QuantizedState,
    release_gradients,
)

# Slow tier: every test here reads the runs of spawned 2-rank process groups (FSDP2, DDP, DCP).
pytestmark = pytest.mark.slow

OPTIMIZERS = {"8bit": AdamW8bit, "4bit": AdamW4bit, "fp8": AdamWFp8, "factored": AdamWFactored4bit}
BLOCKWISE = ("8bit", "4bit", "fp8")  # every moment blockwise codes: each shard's blocks stand alone
# Compiled in the 1-rank worker as well (each costs a compile at its thread count; the float8
# step's code is the 8-bit one's with another codec, both compiled through the same path).
COMPILED = ("4bit", "8bit", "factored")
OPTIONS = dict(lr=1e-2, weight_decay=1e-2, min_quant_size=200, block_size=64)
STEPS = 5  # training steps compared with a single process
SAVE_AT, RESUME_STEPS = 3, 3  # DCP: save after SAVE_AT steps, then train RESUME_STEPS more
MOMENTS = ("exp_avg", "exp_avg_sq")


def make_model() -> nn.Module:
    return seeded_mlp(40, 33, 7)


def batch(step: int):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 40, generator=generator), torch.randn(16, 7, generator=generator)


def train(model, optimizer, steps: int, first_step: int = 0, record: list | None = None) -> None:
    """``steps`` steps; with ``record``, appends each step's whole parameters (before the step)
    and the gradients the optimizer stepped with (collective under FSDP: every rank calls)."""
    for step in range(first_step, first_step + steps):
        inputs, targets = batch(step)
        if record is not None:
            params = {name: full(param) for name, param in named_parameters(model)}
        nn.functional.mse_loss(model(inputs), targets).backward()
        if record is not None:
            grads = {name: full(param.grad) for name, param in named_parameters(model)}
            record.append({"params": params, "grads": grads})
        optimizer.step()
        optimizer.zero_grad()


def named_parameters(model):
    """Parameter names as in ``make_model()`` (DDP prefixes them with ``module.``)."""
    return [(name.removeprefix("module."), param) for name, param in model.named_parameters()]


def full(tensor) -> torch.Tensor:
    """A parameter or moment as a plain float32 tensor of its global shape."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    if isinstance(tensor, (QuantizedState, FactoredState)):
        tensor = tensor.dequantize(torch.float32)
    return tensor.detach().float().clone()


def snapshot(model, optimizer) -> dict:
    """Full parameters and moments by parameter name (collective: every rank calls it)."""
    names = {param: name for name, param in model.named_parameters()}
    return {
        "params": {name: full(param) for param, name in names.items()},
        "moments": {
            (names[param], key): full(state[key]) for param, state in optimizer.state.items()
            for key in MOMENTS
        },
    }


def local_kinds(optimizer, model) -> list[dict]:
    """Per rank, per parameter: (is a DTensor, local moment types, local moment shape)."""
    names = {param: name for name, param in model.named_parameters()}
    kinds = {}
    for param, state in optimizer.state.items():
        moments = [state[key] for key in MOMENTS]
        local = [moment.to_local() if isinstance(moment, DTensor) else moment for moment in moments]
        kinds[names[param]] = (isinstance(moments[0], DTensor), *(type(m).__name__ for m in local),
                               tuple(local[0].shape))
    return gathered(kinds)


def gathered(obj) -> list:
    """``obj`` of every rank, in rank order (collective)."""
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, obj)
    return every_rank


def factored_statistics(optimizer, model) -> list[dict]:
    """Per rank, per factored parameter: this rank's row and column statistics."""
    names = {param: name for name, param in model.named_parameters()}
    statistics = {}
    for param, state in optimizer.state.items():
        moment = state["exp_avg_sq"].to_local()
        if isinstance(moment, FactoredState):
            statistics[names[param]] = (moment.row.clone(), moment.col.clone())
    return gathered(statistics)


def shard(model, mesh=None) -> nn.Module:
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def default_block_size(fmt: str) -> int:
    return OPTIMIZERS[fmt].exp_avg_format.default_block_size


def new_fsdp(fmt: str, **options):
    model = shard(make_model())
    return model, OPTIMIZERS[fmt](model.parameters(), **{**OPTIONS, "backend": "eager", **options})


# --- workers (run in spawned processes) -----------------------------------------------------
def _init(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks on two cores; this process runs at its own count
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def _worker(rank: int, world_size: int, port: int, out: str, runs, filename: str) -> None:
    """``runs(rank, out)`` in a process group of ``world_size``; rank 0 saves what it returns."""
    _init(rank, world_size, port)
    results = runs(rank, Path(out))
    if rank == 0:
        torch.save(results, Path(out) / filename)
    # Gloo aborts a process ("terminate called without an active exception", seen once in CI
    # in the two-rank worker) when objects holding its work (FSDP2's modules and gradients)
    # are freed after their process group is torn down or during interpreter exit
    # (pytorch/pytorch#179291). ``runs`` has returned, so its models are unreferenced: free
    # them now, and let every rank get here before any tears the group down.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _two_rank_runs(rank: int, out: Path) -> dict:
    results = {}
    for fmt in OPTIMIZERS:
        model, optimizer = new_fsdp(fmt)
        results[f"fsdp-{fmt}-steps"] = []
        train(model, optimizer, STEPS, record=results[f"fsdp-{fmt}-steps"])
        results[f"fsdp-{fmt}"] = snapshot(model, optimizer)
        results[f"fsdp-{fmt}-kinds"] = local_kinds(optimizer, model)
        results[f"fsdp-{fmt}-statistics"] = factored_statistics(optimizer, model)
        full_osd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
        results[f"fsdp-{fmt}-full-state-dict"] = {
            (name, key): value.clone() for name, entry in full_osd["state"].items()
            for key, value in entry.items() if key in MOMENTS
        }
        # The full state dict loads back into a fresh sharded optimizer.
        fresh_model, fresh_optimizer = new_fsdp(fmt)
        fresh_model.load_state_dict(model.state_dict())
        set_optimizer_state_dict(fresh_model, fresh_optimizer, full_osd,
                                 options=StateDictOptions(full_state_dict=True))
        results[f"fsdp-{fmt}-full-reload"] = snapshot(fresh_model, fresh_optimizer)
        results[f"fsdp-{fmt}-full-reload-kinds"] = local_kinds(fresh_optimizer, fresh_model)
        results[f"fsdp-{fmt}-full-reload-statistics"] = factored_statistics(fresh_optimizer, fresh_model)
        # ... and into an unsharded model and optimizer (every rank alike).
        plain = make_model()
        plain_optimizer = OPTIMIZERS[fmt](plain.parameters(), **OPTIONS, backend="eager")
        set_optimizer_state_dict(plain, plain_optimizer, full_osd,
                                 options=StateDictOptions(full_state_dict=True))
        results[f"fsdp-{fmt}-full-into-plain"] = snapshot(plain, plain_optimizer)

        # DCP: save mid-run, then compare an uninterrupted run with one resumed from the save.
        model, optimizer = new_fsdp(fmt)
        train(model, optimizer, SAVE_AT)
        results[f"dcp-{fmt}-saved"] = snapshot(model, optimizer)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=out / f"dcp-{fmt}")
        train(model, optimizer, RESUME_STEPS, SAVE_AT)
        results[f"dcp-{fmt}-uninterrupted"] = snapshot(model, optimizer)
        model, optimizer = new_fsdp(fmt)
        dcp_load(model, optimizer, out / f"dcp-{fmt}")
        results[f"dcp-{fmt}-loaded-2"] = snapshot(model, optimizer)
        train(model, optimizer, RESUME_STEPS, SAVE_AT)
        results[f"dcp-{fmt}-resumed-2"] = snapshot(model, optimizer)

        # No DCP: each rank torch.save's its own optimizer.state_dict() (DTensors of its shards)
        # and loads it back with weights_only=True.
        path = out / f"per-rank-{fmt}-{rank}.pt"
        torch.save(optimizer.state_dict(), path)
        model, optimizer = new_fsdp(fmt)
        optimizer.load_state_dict(torch.load(path, weights_only=True))
        results[f"per-rank-{fmt}-loaded"] = snapshot(model, optimizer)

        # A single-process run's full state dict, continued under FSDP2 (every rank trains the
        # same plain model: no communication).
        plain = make_model()
        plain_optimizer = OPTIMIZERS[fmt](plain.parameters(), **OPTIONS, backend="eager")
        train(plain, plain_optimizer, SAVE_AT)
        results[f"single-{fmt}"] = snapshot(plain, plain_optimizer)
        plain_osd = get_optimizer_state_dict(plain, plain_optimizer,
                                             options=StateDictOptions(full_state_dict=True))
        model, optimizer = new_fsdp(fmt)
        set_optimizer_state_dict(model, optimizer, plain_osd, options=StateDictOptions(full_state_dict=True))
        results[f"single-to-fsdp-{fmt}"] = snapshot(model, optimizer)

    model = DistributedDataParallel(make_model())
    optimizer = AdamW8bit(model.parameters(), **OPTIONS, backend="eager")
    results["ddp-8bit-steps"] = []
    train(model, optimizer, STEPS, record=results["ddp-8bit-steps"])
    results["ddp-8bit"] = {name: param.detach().clone() for name, param in named_parameters(model)}

    # HSDP, 2 replicas of 1 shard: placements (Replicate(), Shard(0)). The factored step must
    # sum column statistics over the shard dimension only (over the replicas it would double them).
    model = shard(make_model(), init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard")))
    optimizer = AdamWFactored4bit(model.parameters(), **OPTIONS, backend="eager")
    results["hsdp-factored-steps"] = []
    train(model, optimizer, STEPS, record=results["hsdp-factored-steps"])
    results["hsdp-factored-statistics"] = factored_statistics(optimizer, model)
    results["hsdp-factored-placements"] = str(model[0].weight.placements)
    results.update(_gradient_release_runs())
    return results


# Gradient release: 4-bit blockwise state, and the factored second moment, whose column
# statistics are summed across ranks inside each parameter's step (an all-reduce from within
# the hook, every rank in the same order).
RELEASED = ("4bit", "factored")


def _error_of(function) -> str | None:
    try:
        function()
    except (RuntimeError, ValueError) as error:
        return str(error)
    return None


def _gradient_release_runs() -> dict:
    """FSDP2 calls the sharded parameter's post-accumulate-grad hooks itself, after the
    reduce-scatter: release then steps each shard as ordinary stepping would. Both runs are
    made here, so their gradients come from the same code and the comparison can be exact."""
    results = {}
    for fmt in RELEASED:
        for release in (False, True):
            model, optimizer = new_fsdp(fmt)
            if release:
                release_gradients(optimizer)
            train(model, optimizer, STEPS)
            results[f"release-{fmt}-{release}"] = snapshot(model, optimizer)
            results[f"release-{fmt}-{release}-steps"] = sorted(
                float(state["step"]) for state in optimizer.state.values())
        inputs = batch(0)[0]
        model(inputs).square().mean().backward()
        results[f"release-{fmt}-clip"] = _error_of(
            lambda model=model: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        results[f"release-{fmt}-accumulate"] = _error_of(
            lambda model=model, inputs=inputs: model(inputs).square().mean().backward())
    ddp = DistributedDataParallel(make_model())
    results["release-ddp"] = _error_of(lambda: release_gradients(AdamW8bit(ddp.parameters())))
    return results


def _one_rank_runs(rank: int, out: Path) -> dict:
    results = {}
    for fmt in OPTIMIZERS:
        # 2 -> 1 rank, into a sharded (1-rank mesh) model and into a plain one.
        model, optimizer = new_fsdp(fmt)
        dcp_load(model, optimizer, out / f"dcp-{fmt}")
        results[f"dcp-{fmt}-loaded-1"] = snapshot(model, optimizer)
        train(model, optimizer, RESUME_STEPS, SAVE_AT)
        results[f"dcp-{fmt}-resumed-1"] = snapshot(model, optimizer)
        model = make_model()
        optimizer = OPTIMIZERS[fmt](model.parameters(), **OPTIONS, backend="eager")
        dcp_load(model, optimizer, out / f"dcp-{fmt}")
        results[f"dcp-{fmt}-loaded-plain"] = snapshot(model, optimizer)

    # The torchao crash: 4-bit then 8-bit (then factored) compiled steps in one process, one compile cache,
    # DTensor-wrapped state. Each is compared with the same run in eager mode, and with its
    # gradients replayed in the main process. The formats' default block sizes: the graphs the
    # main process compiles for other tests anyway.
    for fmt in COMPILED:
        for backend in ("compile", "eager"):
            model, optimizer = new_fsdp(fmt, backend=backend, block_size=default_block_size(fmt))
            results[f"compiled-{fmt}-{backend}-steps"] = []
            train(model, optimizer, 2, record=results[f"compiled-{fmt}-{backend}-steps"])
            results[f"compiled-{fmt}-{backend}"] = snapshot(model, optimizer)

    # AdamWFactored4bit sums all of a group's column statistics in one all-reduce per step.
    model = shard(nn.Sequential(nn.Linear(40, 33), nn.Linear(33, 40), nn.Linear(40, 33)))
    optimizer = AdamWFactored4bit(model.parameters(), **OPTIONS, backend="eager")
    results["factored-all-reduces"] = []
    for step in range(2):
        model(batch(step)[0]).square().mean().backward()
        results["factored-all-reduces"].append(all_reduces_in(optimizer.step))
        optimizer.zero_grad()

    # AdamWFactored4bit refuses parameters sharded along their last dim, before any state
    # exists: a factored moment keeps every column of the rows it holds (docs/distributed.md).
    model = make_model()
    fully_shard(model[0], shard_placement_fn=lambda param: Shard(param.dim() - 1))
    try:
        AdamWFactored4bit(model.parameters(), **OPTIONS)
        results["factored-column-shard-error"] = None
    except ValueError as error:
        results["factored-column-shard-error"] = str(error)
    return results


def all_reduces_in(function) -> list[int]:
    """``function()``'s calls of ``torch.distributed.all_reduce``: the size of each tensor."""
    sizes, all_reduce = [], dist.all_reduce

    def counted(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        function()
    finally:
        dist.all_reduce = all_reduce
    return sizes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed")
    mp.spawn(_worker, args=(2, free_port(), str(out), _two_rank_runs, "two-ranks.pt"), nprocs=2)
    mp.spawn(_worker, args=(1, free_port(), str(out), _one_rank_runs, "one-rank.pt"), nprocs=1)
    return {**torch.load(out / "two-ranks.pt"), **torch.load(out / "one-rank.pt")}


# --- single-process references ----------------------------------------------------------------
def single_process(fmt: str, steps: int = STEPS, recorded: list | None = None, **options) -> dict:
    """The same training in this process: its own forward and backward, or, given ``recorded``
    (a worker's ``train(record=...)``), no backward at all but the worker's gradients."""
    model = make_model()
    optimizer = OPTIMIZERS[fmt](model.parameters(), **{**OPTIONS, "backend": "eager", **options})
    if recorded is None:
        train(model, optimizer, steps)
    for step in recorded or []:
        for name, param in model.named_parameters():
            param.grad = step["grads"][name].clone()
        optimizer.step()
        optimizer.zero_grad()
    return snapshot(model, optimizer)


def shard_blocked(fmt: str, recorded: list, world_size: int = 2) -> dict:
    """One process, but every parameter is split into FSDP's shards (``torch.chunk`` along
    dim 0), each stepped as a parameter of its own with its part of the recorded gradients:
    the same quantization blocks and the same inputs as the sharded run, so it should match
    that run exactly. Shards of quantized weights go in a group with ``min_quant_size=0``
    (the sharded run quantizes them by global size). Returns whole parameters and moments,
    as ``snapshot`` does."""
    model = make_model()
    shards = {name: [chunk.detach().clone().requires_grad_() for chunk in param.chunk(world_size)]
              for name, param in model.named_parameters()}
    quantized = {name for name, param in model.named_parameters()
                 if param.numel() >= OPTIONS["min_quant_size"]}
    groups = [
        {"params": [c for n in shards if n in quantized for c in shards[n]], "min_quant_size": 0},
        {"params": [c for n in shards if n not in quantized for c in shards[n]]},
    ]
    optimizer = OPTIMIZERS[fmt](groups, **OPTIONS, backend="eager")
    for step in recorded:
        for name, chunks in shards.items():
            for chunk, grad in zip(chunks, step["grads"][name].chunk(world_size)):
                chunk.grad = grad.clone()
        optimizer.step()
        optimizer.zero_grad()
    return {
        "params": {name: torch.cat(chunks).detach() for name, chunks in shards.items()},
        "moments": {(name, key): torch.cat([full(optimizer.state[chunk][key]) for chunk in chunks])
                    for name, chunks in shards.items() for key in MOMENTS},
    }


# --- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", BLOCKWISE)
def test_fsdp_matches_single_process_with_the_same_blocks_exactly(runs, fmt):
    """Same blocks, same gradients (replayed): the same codes, so bit-identical parameters and
    moments, whatever kernels computed the gradients."""
    expected = shard_blocked(fmt, runs[f"fsdp-{fmt}-steps"])
    for part in ("params", "moments"):
        for key, value in runs[f"fsdp-{fmt}"][part].items():
            assert torch.equal(value, expected[part][key]), key


# Gradients recomputed here from the worker's own parameters, against the worker's: one
# forward and backward of this model is a handful of float32 matmuls (sums of 16 to 40
# products) and elementwise ops, and another summation order moves a sum by at most
# (terms) * 2**-24 of the sum of its terms' magnitudes, ~2.4e-6 for 40 terms, per stage.
# Bound on the relative RMSE: 1e-5, a few stages of that. Measured between the gradients of
# MKL's AVX2 and AVX-512 kernels: at most 1.3e-7. A gradient summed instead of averaged
# over the 2 ranks is off by 1.0, a shard placed on the wrong rows by more.
GRADIENT_ROUNDING_BOUND = 1e-5


@pytest.mark.parametrize("run", [*(f"fsdp-{fmt}" for fmt in OPTIMIZERS), "ddp-8bit"])
def test_distributed_gradients_are_the_single_process_gradients(runs, run):
    model = make_model()
    params = dict(model.named_parameters())
    for step, recorded in enumerate(runs[f"{run}-steps"]):
        with torch.no_grad():
            for name, value in recorded["params"].items():
                params[name].copy_(value)
        inputs, targets = batch(step)
        nn.functional.mse_loss(model(inputs), targets).backward()
        for name, grad in recorded["grads"].items():
            error = relative_rmse(grad, params[name].grad)
            assert error < GRADIENT_ROUNDING_BOUND, (step, name, error)
        model.zero_grad()


@pytest.mark.parametrize("fmt", OPTIMIZERS)
def test_fsdp_matches_single_process_within_quantization_noise(runs, fmt):
    """Against the unsharded run the blocks differ (shard edges cut blocks), so the moments
    carry different rounding. Bound: the parameters' distance, relative to how far training
    moved them, stays below the relative error one quantization adds to the moments
    (measured on the same states: ``quantization_error``) times 2, for the two runs' roundings.
    Measured (torch 2.13, CPU): 0.0074 of a bound 0.0184 (8-bit), 0.091 of 0.253 (4-bit),
    0.0146 of 0.0412 (float8), 0.076 of 0.261 (factored: its first moment's 4-bit blocks are
    cut at the shard edges)."""
    expected = single_process(fmt)
    initial = dict(make_model().named_parameters())
    bound = 2 * quantization_error(fmt, expected["moments"])
    for name, param in runs[f"fsdp-{fmt}"]["params"].items():
        moved = (expected["params"][name] - initial[name]).norm()
        drift = (param - expected["params"][name]).norm()
        assert drift / moved < bound, (name, float(drift / moved), bound)


def storage(fmt: str, key: str, shape) -> str:
    """How ``fmt``'s optimizer stores moment ``key`` of a parameter of ``shape`` (its global
    shape): ``"float"``, ``"quantized"`` or ``"factored"``."""
    param = nn.Parameter(torch.zeros(shape))
    optimizer = OPTIMIZERS[fmt]([param], **OPTIONS)
    group = optimizer.param_groups[0]
    if optimizer.is_factored(param, group, key):
        return "factored"
    return "quantized" if optimizer.is_quantized(param, group) else "float"


def quantized_once(fmt: str, key: str, values: torch.Tensor) -> torch.Tensor:
    """``values`` quantized in ``fmt``'s format for moment ``key`` and dequantized."""
    optimizer = OPTIMIZERS[fmt]
    moment_format = optimizer.exp_avg_format if key == "exp_avg" else optimizer.exp_avg_sq_format
    return QuantizedState.from_float(values, moment_format, OPTIONS["block_size"]).dequantize()


def requantized(fmt: str, key: str, values: torch.Tensor) -> torch.Tensor:
    """``values`` (a whole moment) after one conversion into ``fmt``'s stored form for
    moment ``key``: quantized and dequantized, or factored and reconstructed."""
    kind = storage(fmt, key, values.shape)
    if kind == "factored":
        return FactoredState.from_float(values).dequantize()
    return quantized_once(fmt, key, values) if kind == "quantized" else values


def resharded(fmt: str, key: str, values: torch.Tensor) -> torch.Tensor:
    """``values`` after DCP loads them with another sharding: quantized moments are quantized
    once over the new blocks; factored ones move whole rows, unchanged."""
    return values if storage(fmt, key, values.shape) == "factored" else requantized(fmt, key, values)


def quantization_error(fmt: str, moments: dict) -> float:
    """The largest relative RMSE one quantization adds to these moments over other blocks than
    the ones that made them (shifted by half a block, as shard edges shift them). Over their
    own blocks it is ~0: quantizing dequantized values gives the same codes back (exactly for
    float8; the signed integer maps change only blocks whose largest magnitude is negative)."""
    def over_shifted_blocks(key, values):
        if storage(fmt, key, values.shape) != "quantized":
            return requantized(fmt, key, values)
        shift = OPTIONS["block_size"] // 2
        shifted = values.reshape(-1).roll(shift).view(values.shape)
        return requantized(fmt, key, shifted).reshape(-1).roll(-shift).view(values.shape)

    return max(
        relative_rmse(over_shifted_blocks(key, values), values)
        for (name, key), values in moments.items() if values.numel() >= OPTIONS["min_quant_size"]
    )


@pytest.mark.parametrize("fmt", OPTIMIZERS)
def test_quantization_is_decided_by_global_size(runs, fmt):
    """Each rank's moments are of the kind the whole parameter's would be: the second
    weight's shards are below ``min_quant_size``, and the factored optimizer factors the
    first weight by its global shape (33 x 40) whatever rows a rank holds."""
    second_moment = "FactoredState" if fmt == "factored" else "QuantizedState"
    for rank, rows in ((0, (17, 4)), (1, (16, 3))):
        kinds = runs[f"fsdp-{fmt}-kinds"][rank]
        assert kinds["0.weight"] == (True, "QuantizedState", second_moment, (rows[0], 40))
        assert kinds["2.weight"] == (True, "QuantizedState", "QuantizedState", (rows[1], 33))
        assert kinds["0.bias"] == (True, "Tensor", "Tensor", (rows[0],))
        assert kinds["2.bias"] == (True, "Tensor", "Tensor", (rows[1],))


# A factored moment reconstructed and factored again, with its columns summed across ranks
# rather than in one pass: each statistic is a mean of 33 or 40 float32 terms, so another
# summation order moves it by at most ~40 * 2**-24 = 2.4e-6 of itself (the terms are
# non-negative), and a reconstructed element (row * col / mean(col)) by a few of those.
# Measured: 3.3e-7 (largest relative error of an element; rows bit-identical, columns 1.8e-7).
# Without the reduction a column statistic would hold one rank's rows only: 17 or 16 of 33.
FACTORED_ROUNDING_BOUND = 1e-5


@pytest.mark.parametrize("fmt", BLOCKWISE)
def test_full_state_dict_holds_the_dequantized_moments_and_loads_back(runs, fmt):
    moments = runs[f"fsdp-{fmt}"]["moments"]
    full_osd = runs[f"fsdp-{fmt}-full-state-dict"]
    assert full_osd.keys() == moments.keys()
    for key, value in full_osd.items():
        assert torch.equal(value, moments[key]), key
    # Loaded back with the sharding that made it, each shard re-quantizes the values it
    # dequantized: the blocks are the same, so this is exact except where a signed block's
    # largest magnitude is negative (the signed maps stop short of -1, so the block's scale
    # shrinks by that code, e.g. 0.8875 in 4 bits). The expected values are that one rounding.
    reloaded = runs[f"fsdp-{fmt}-full-reload"]
    for (name, key), value in reloaded["moments"].items():
        expected = moments[(name, key)]
        if expected.numel() >= OPTIONS["min_quant_size"]:
            expected = torch.cat([quantized_once(fmt, key, chunk) for chunk in expected.chunk(2)])
        assert torch.equal(value, expected), (name, key)
    assert runs[f"fsdp-{fmt}-full-reload-kinds"] == runs[f"fsdp-{fmt}-kinds"]


def test_factored_full_state_dict_holds_the_reconstructed_moment_and_loads_back(runs):
    """The gathered full state dict holds the second moment the factors stand for; loaded
    back into the same sharding, each rank factors its rows and the ranks sum their column
    sums, so the statistics are those of the whole moment (to float rounding), and the
    first moment is quantized again as in the blockwise test above."""
    moments = runs["fsdp-factored"]["moments"]
    full_osd = runs["fsdp-factored-full-state-dict"]
    for key, value in full_osd.items():
        assert torch.equal(value, moments[key]), key
    reloaded = runs["fsdp-factored-full-reload"]["moments"]
    torch.testing.assert_close(reloaded[("0.weight", "exp_avg_sq")], moments[("0.weight", "exp_avg_sq")],
                               rtol=FACTORED_ROUNDING_BOUND, atol=0)
    # The reconstruction is blind to a common scale of the columns; the statistics are not.
    for saved, loaded in zip(runs["fsdp-factored-statistics"], runs["fsdp-factored-full-reload-statistics"]):
        for statistic, loaded_statistic in zip(saved["0.weight"], loaded["0.weight"]):
            torch.testing.assert_close(loaded_statistic, statistic, rtol=FACTORED_ROUNDING_BOUND, atol=0)
    for (name, key), value in moments.items():
        if storage("factored", key, value.shape) == "quantized":
            expected = torch.cat([quantized_once("factored", key, chunk) for chunk in value.chunk(2)])
            assert torch.equal(reloaded[(name, key)], expected), (name, key)
    assert runs["fsdp-factored-full-reload-kinds"] == runs["fsdp-factored-kinds"]


def test_factored_statistics_of_fsdp_shards_are_those_of_the_whole_parameter(runs):
    """Each rank holds its rows' statistics and every column's; the column sums are added
    across ranks every step, so every rank holds the same columns, and rows and columns are
    those of the same training in one process (the workers' gradients replayed), to float
    rounding: the columns are summed in another order (``FACTORED_ROUNDING_BOUND``)."""
    every_rank = runs["fsdp-factored-statistics"]
    assert [list(statistics) for statistics in every_rank] == [["0.weight"], ["0.weight"]]
    (rows_0, columns_0), (rows_1, columns_1) = every_rank[0]["0.weight"], every_rank[1]["0.weight"]
    assert (rows_0.numel(), rows_1.numel()) == (17, 16)
    assert torch.equal(columns_0, columns_1)

    expected = single_process_statistics(runs["fsdp-factored-steps"])
    rtol = FACTORED_ROUNDING_BOUND
    torch.testing.assert_close(torch.cat([rows_0, rows_1]), expected.row, rtol=rtol, atol=0)
    torch.testing.assert_close(columns_0, expected.col, rtol=rtol, atol=0)


def single_process_statistics(recorded: list) -> FactoredState:
    """The first weight's factored second moment after stepping ``make_model()`` with the
    gradients a worker recorded."""
    model = make_model()
    optimizer = AdamWFactored4bit(model.parameters(), **OPTIONS, backend="eager")
    for step in recorded:
        for name, param in model.named_parameters():
            param.grad = step["grads"][name].clone()
        optimizer.step()
    return optimizer.state[model[0].weight]["exp_avg_sq"]


def test_factored_statistics_under_hsdp_are_summed_over_shards_not_replicas(runs):
    """HSDP (2 replicas x 1 shard): each replica holds every row; summing the column
    statistics over the replicas as well would double them."""
    assert runs["hsdp-factored-placements"] == "(Replicate(), Shard(dim=0))"
    expected = single_process_statistics(runs["hsdp-factored-steps"])
    for statistics in runs["hsdp-factored-statistics"]:
        rows, columns = statistics["0.weight"]
        torch.testing.assert_close(rows, expected.row, rtol=FACTORED_ROUNDING_BOUND, atol=0)
        torch.testing.assert_close(columns, expected.col, rtol=FACTORED_ROUNDING_BOUND, atol=0)


@pytest.mark.parametrize("fmt", OPTIMIZERS)
def test_each_rank_saving_its_own_state_dict_with_torch_save_resumes_exactly(runs, fmt):
    """``torch.save(optimizer.state_dict())`` on every rank, without DCP, loaded back with
    ``weights_only=True`` into a fresh sharded optimizer: the same moments bit for bit."""
    resumed, saved = runs[f"per-rank-{fmt}-loaded"]["moments"], runs[f"dcp-{fmt}-resumed-2"]["moments"]
    for key, value in saved.items():
        assert torch.equal(resumed[key], value), key


@pytest.mark.parametrize("fmt", OPTIMIZERS)
def test_fsdp_full_state_dict_loads_into_an_unsharded_optimizer(runs, fmt):
    """The gathered full state dict (float values) loaded into a plain model's optimizer with
    ``set_optimizer_state_dict``: each moment stored once over the whole tensor's blocks
    (exact), a factored one re-factored (float rounding). Before, it was refused: "must be a
    QuantizedState, got a plain torch.float32 tensor"."""
    moments, loaded = runs[f"fsdp-{fmt}"]["moments"], runs[f"fsdp-{fmt}-full-into-plain"]["moments"]
    assert loaded.keys() == moments.keys()
    for (name, key), value in moments.items():
        if storage(fmt, key, value.shape) == "factored":
            torch.testing.assert_close(loaded[(name, key)], value, rtol=FACTORED_ROUNDING_BOUND, atol=0)
        else:
            assert torch.equal(loaded[(name, key)], requantized(fmt, key, value)), (name, key)


@pytest.mark.parametrize("fmt", OPTIMIZERS)
def test_single_process_checkpoint_continues_under_fsdp2(runs, fmt):
    """A plain optimizer's full state dict (``get_optimizer_state_dict``) loaded into FSDP2
    shards: ``distribute_tensor`` splits each stored moment as its values, and each shard
    stores them once more over its own blocks (exact), a factored moment re-factored from its
    reconstruction (float rounding). Before, the split raised ``NotImplementedError``."""
    single, loaded = runs[f"single-{fmt}"]["moments"], runs[f"single-to-fsdp-{fmt}"]["moments"]
    assert loaded.keys() == single.keys()
    for (name, key), value in single.items():
        kind = storage(fmt, key, value.shape)
        if kind == "factored":
            torch.testing.assert_close(loaded[(name, key)], value, rtol=FACTORED_ROUNDING_BOUND, atol=0)
            continue
        if kind == "quantized":
            value = torch.cat([quantized_once(fmt, key, chunk) for chunk in value.chunk(2)])
        assert torch.equal(loaded[(name, key)], value), (name, key)


def test_ddp_matches_single_process_exactly(runs):
    """Stepped with DDP's averaged gradients (replayed), a plain single-process optimizer
    gives the same parameters bit for bit."""
    expected = single_process("8bit", recorded=runs["ddp-8bit-steps"])["params"]
    for name, param in runs["ddp-8bit"].items():
        assert torch.equal(param, expected[name]), name


@pytest.mark.parametrize("fmt", OPTIMIZERS)
def test_dcp_two_to_two_ranks_resumes_exactly(runs, fmt):
    saved, loaded = runs[f"dcp-{fmt}-saved"], runs[f"dcp-{fmt}-loaded-2"]
    for part in ("params", "moments"):
        for key, value in saved[part].items():
            assert torch.equal(loaded[part][key], value), key
    resumed, uninterrupted = runs[f"dcp-{fmt}-resumed-2"], runs[f"dcp-{fmt}-uninterrupted"]
    for name, param in uninterrupted["params"].items():
        assert torch.equal(resumed["params"][name], param), name


@pytest.mark.parametrize("fmt", OPTIMIZERS)
def test_dcp_two_to_one_rank_requantizes_once(runs, fmt):
    """Loaded on one rank, each moment is the 2-rank moment's values quantized once over
    the new, whole-tensor blocks, and a factored moment is the saved one (its shards' rows
    put together, the columns every rank held): exactly, into a sharded model and into a
    plain one."""
    saved = runs[f"dcp-{fmt}-saved"]
    for target in ("loaded-1", "loaded-plain"):
        loaded = runs[f"dcp-{fmt}-{target}"]
        for name, value in saved["params"].items():
            assert torch.equal(loaded["params"][name], value), name
        for (name, key), value in saved["moments"].items():
            expected = resharded(fmt, key, value)
            assert torch.equal(loaded["moments"][(name, key)], expected), (target, name, key)


@pytest.mark.parametrize("fmt", OPTIMIZERS)
def test_dcp_two_to_one_rank_resumes_within_quantization_noise(runs, fmt):
    """Same bound and reasoning as the FSDP-vs-single-process test: the resumed 1-rank run
    and the uninterrupted 2-rank run differ in block boundaries only. Measured: 0.0086 of a
    bound 0.0169 (8-bit), 0.112 of 0.218 (4-bit), 0.021 of 0.039 (float8), 0.095 of 0.216
    (factored)."""
    uninterrupted = runs[f"dcp-{fmt}-uninterrupted"]
    saved = runs[f"dcp-{fmt}-saved"]
    bound = 2 * quantization_error(fmt, uninterrupted["moments"])
    for name, param in runs[f"dcp-{fmt}-resumed-1"]["params"].items():
        moved = (uninterrupted["params"][name] - saved["params"][name]).norm()
        drift = (param - uninterrupted["params"][name]).norm()
        assert drift / moved < bound, (name, float(drift / moved), bound)


@pytest.mark.parametrize("fmt", COMPILED)
def test_compiled_steps_of_every_format_share_one_process(runs, fmt):
    """4-bit, 8-bit then factored compiled in one process on DTensor state (torchao crashed
    here with 'wrong number of dimensions'). Compiled and eager code round differently, so a code can
    land one step apart: bound 1e-4 relative to the parameters, far below one quantization
    step's effect (~1e-2) and far above float rounding (measured: 1.2e-9)."""
    compiled, eager = runs[f"compiled-{fmt}-compile"]["params"], runs[f"compiled-{fmt}-eager"]["params"]
    for name, param in compiled.items():
        assert relative_rmse(param, eager[name]) < 1e-4, name


@pytest.mark.parametrize("backend", ["compile", "eager"])
@pytest.mark.parametrize("fmt", COMPILED)
def test_one_rank_steps_match_this_process_exactly(runs, fmt, backend):
    """The 1-rank worker's steps (DTensor state, 1 thread, its own compiled code) replayed
    here on plain tensors with its gradients: bit-identical parameters and moments. For
    ``"compile"`` this compares code generated for two thread counts: Inductor writes the
    thread count in force at compile time into its C++ (``#pragma omp parallel num_threads``)
    and the worker compiled at 1 thread; this process compiled at its own count (the same
    only where that is 1). Exact because the step has no reduction whose result depends on
    how the work is split: the block absmax is a max, exact in any order; the factored
    step's row and column sums are each reduced by one thread at these sizes (each output
    element's loop is not split), which this test would catch if it changed."""
    run = runs[f"compiled-{fmt}-{backend}"]
    expected = single_process(fmt, recorded=runs[f"compiled-{fmt}-{backend}-steps"], backend=backend,
                              block_size=default_block_size(fmt))
    for part in ("params", "moments"):
        for key, value in run[part].items():
            assert torch.equal(value, expected[part][key]), key


def test_factored_column_sums_of_all_parameters_go_in_one_all_reduce_per_step(runs):
    """Three factored weights (40, 33 and 40 columns): one all-reduce of 113 column sums per
    step, not one per parameter."""
    assert runs["factored-all-reduces"] == [[113], [113]]


def test_factored_optimizer_refuses_parameters_sharded_by_columns(runs):
    """FSDP2 with ``shard_placement_fn`` splitting the last dim: each rank would hold part of
    every row, whose statistics would then need a reduction too. Refused in the constructor,
    naming the placement."""
    message = runs["factored-column-shard-error"]
    assert message is not None, "AdamWFactored4bit accepted a parameter sharded by columns"
    assert "sharded along dim 0" in message and "Shard(dim=1)" in message, message


@pytest.mark.parametrize("fmt", RELEASED)
def test_fsdp2_released_training_matches_ordinary_exactly(runs, fmt):
    ordinary, released = runs[f"release-{fmt}-False"], runs[f"release-{fmt}-True"]
    for part in ("params", "moments"):
        assert ordinary[part].keys() == released[part].keys()
        for key, value in ordinary[part].items():
            assert torch.equal(value, released[part][key]), (part, key)
    assert runs[f"release-{fmt}-True-steps"] == runs[f"release-{fmt}-False-steps"] == [STEPS] * 4


@pytest.mark.parametrize("fmt", RELEASED)
def test_fsdp2_clipping_and_accumulation_under_release_are_told(runs, fmt):
    assert "released gradient" in runs[f"release-{fmt}-clip"]
    assert "released gradient" in runs[f"release-{fmt}-accumulate"]


def test_gradient_release_refuses_ddp(runs):
    assert "DistributedDataParallel" in runs["release-ddp"]
