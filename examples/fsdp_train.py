"""FSDP2 training with a low-bit optimizer, saved and resumed with torch.distributed.checkpoint.

    torchrun --nproc-per-node 2 examples/fsdp_train.py --optimizer AdamW4bit --steps 10
    torchrun --nproc-per-node 2 examples/fsdp_train.py --param-dtype bfloat16 --master-weight-bits 24

Runs on CPU (gloo) or on GPUs (nccl, one per process). Trains a small MLP for ``--steps``
steps, saves model and optimizer with DCP halfway, and checks that a fresh model and
optimizer resumed from that checkpoint end with the same parameters. Resume the same
checkpoint with another ``--nproc-per-node`` to reshard it (``--resume-only``).
"""

import argparse
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import lowbit_optim


def build(args):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    model.to(getattr(torch, args.param_dtype))
    if torch.cuda.is_available():
        model.cuda()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    # min_quant_size is compared with each parameter's global size, whatever the sharding.
    # master_weight_bits: each bf16 parameter shard keeps an int8 (24) or int16 (32) correction,
    # sharded and checkpointed like its parameter.
    optimizer = getattr(lowbit_optim, args.optimizer)(model.parameters(), lr=1e-3, min_quant_size=4096,
                                                      master_weight_bits=args.master_weight_bits)
    return model, optimizer


def train(model, optimizer, steps: range) -> float:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for step in steps:
        generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())  # a shard of the data
        inputs = torch.randn(32, 64, generator=generator).to(device, next(model.parameters()).dtype)
        loss = nn.functional.mse_loss(model(inputs), inputs.flip(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return loss.item()


def save(model, optimizer, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def load(model, optimizer, path: str) -> None:
    # The state dicts are the targets: DCP loads into them in place (resharding if the
    # checkpoint was saved on another number of ranks), then they are handed back.
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--optimizer", default="AdamW8bit",
                        choices=["AdamW8bit", "AdamW4bit", "AdamWFp8", "AdamWFactored4bit", "Lion8bit",
                                 "AdEMAMix8bit"])
    parser.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--master-weight-bits", type=int, choices=[24, 32],
                        help="with --param-dtype bfloat16: keep 24- or 32-bit master weights")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "lowbit_fsdp_ckpt"))
    parser.add_argument("--resume-only", action="store_true",
                        help="load --checkpoint (saved by an earlier run) and train the second half")
    args = parser.parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    rank, half = dist.get_rank(), args.steps // 2

    if not args.resume_only:
        model, optimizer = build(args)
        train(model, optimizer, range(half))
        save(model, optimizer, args.checkpoint)
        loss = train(model, optimizer, range(half, args.steps))
        uninterrupted = [p.full_tensor() for p in model.parameters()]

    model, optimizer = build(args)
    load(model, optimizer, args.checkpoint)
    resumed_loss = train(model, optimizer, range(half, args.steps))
    if not args.resume_only:
        same = all(torch.equal(p.full_tensor(), q) for p, q in zip(model.parameters(), uninterrupted))
        if rank == 0:
            print(f"{args.optimizer}: loss {loss:.5f}, resumed {resumed_loss:.5f}, identical: {same}")
        if not same:
            raise SystemExit("the resumed run differs from the uninterrupted one")
    elif rank == 0:
        print(f"{args.optimizer}: resumed on {dist.get_world_size()} rank(s), loss {resumed_loss:.5f}")
    # Gloo aborts a process ("terminate called without an active exception", seen once in CI)
    # when objects holding its work (FSDP2's modules, their gradients) are freed after their
    # process group is torn down, as locals are at interpreter exit (pytorch/pytorch#179291):
    # free them first, and let every rank get here before any tears the group down.
    del model, optimizer
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
