"""Gradient release: the peak memory and time of a training step with and without it.

    python benchmarks/bench_release.py                             # medium preset's model
    python benchmarks/bench_release.py --context 16               # activations far below gradients
    python benchmarks/bench_release.py --model-size gpu-114m --steps 2
    python benchmarks/bench_release.py --model-size gpu-114m --steps 1 --optimizers ours_4bit \
        --param-dtype bfloat16 --master-weight-bits 24 --activation-checkpointing --context 64

One training step is forward, backward, ``step()`` and ``zero_grad()`` of the benchmark's
byte-level GPT (one sequence of the preset's context). Its peak is the CPU allocation
profiler's high-water mark above what was live before the step (parameters, state), so
with ordinary stepping it includes every gradient and the step's temporaries, with release
at most the gradients still being computed. But each released step runs while backward
still holds the activations of the layers before it, so the saving is the gradients' size
only when activations are small beside them (short sequences, small batches, fine-tuning a
large model); with as many bytes of activations as of gradients it vanishes. ``--context``
sets the sequence length, ``--activation-checkpointing`` keeps only the blocks' inputs (each
block is recomputed in backward), ``--param-dtype bfloat16 --master-weight-bits 24`` trains as
the footprint table of docs/benchmarks.md does. Prints a markdown table and writes JSON rows.
"""

import argparse
import dataclasses
import functools
import pathlib
import sys
import time

import torch

from lowbit_optim import AdamW4bit, AdamW8bit, AdamWFactored4bit, release_gradients
from lowbit_optim.bench import harness
from lowbit_optim.bench.__main__ import PRESETS
from lowbit_optim.bench.data import VOCAB_SIZE
from lowbit_optim.bench.model import ByteGPT
from lowbit_optim.bench.profiling import allocation_peak_bytes

OPTIMIZERS = {"ours_8bit": AdamW8bit, "ours_4bit": AdamW4bit, "ours_factored_4bit": AdamWFactored4bit}


def measure(name: str, release: bool, args) -> dict:
    config = dataclasses.replace(PRESETS[args.model_size]["model"],
                                 activation_checkpointing=args.activation_checkpointing)
    context = args.context or config.context
    torch.manual_seed(0)
    model = ByteGPT(config).to(getattr(torch, args.param_dtype))
    build = OPTIMIZERS[name]
    if args.master_weight_bits is not None:
        build = functools.partial(build, master_weight_bits=args.master_weight_bits)
    optimizer = build(model.parameters(), lr=1e-3)
    if release:
        release_gradients(optimizer)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB_SIZE, (1, context + 1), generator=generator)

    def training_step():
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()

    training_step()  # creates the state and compiles
    seconds = []
    for _ in range(args.steps):
        start = time.perf_counter()
        training_step()
        seconds.append(time.perf_counter() - start)
    peak = allocation_peak_bytes(training_step)
    params = sum(param.numel() for param in model.parameters())
    gradient_bytes = sum(param.nbytes for param in model.parameters())
    return {
        "optimizer": name, "release": release, "params": params,
        "gradients_mib": gradient_bytes / 2**20, "step_peak_mib": peak / 2**20,
        "step_ms": harness.median_ms(seconds),
    }


COLUMNS = [
    harness.Column("optimizer", "optimizer"),
    harness.Column("gradient release", "release"),
    harness.Column("gradients MiB", "gradients_mib", "{:.1f}"),
    harness.Column("training-step peak MiB", "step_peak_mib", "{:.1f}"),
    harness.Column("saved MiB", "saved_mib", "{:.1f}"),
    harness.Column("step ms", "step_ms", "{:.0f}"),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-size", choices=sorted(PRESETS), default="medium")
    parser.add_argument("--optimizers", nargs="+", choices=sorted(OPTIMIZERS), default=sorted(OPTIMIZERS))
    parser.add_argument("--context", type=int, help="tokens per sequence (default: the preset's)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the first (default 3)")
    parser.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--master-weight-bits", type=int, choices=(24, 32),
                        help="master weights for bfloat16 parameters (default: none)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block in backward (only the blocks' inputs stay alive)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_out/bench_release.json"))
    args = parser.parse_args(argv)
    longest = PRESETS[args.model_size]["model"].context
    if args.steps < 1 or (args.context is not None and not 1 <= args.context <= longest):
        parser.error(f"--steps must be >= 1 and --context in 1..{longest}: {args.steps}, {args.context}")
    results = []
    for name in args.optimizers:
        for release in (False, True):
            print(f"{name} release={release} ...", file=sys.stderr, flush=True)
            results.append(measure(name, release, args))
            ordinary = results[-2]["step_peak_mib"] if release else None
            results[-1]["saved_mib"] = ordinary - results[-1]["step_peak_mib"] if release else None
    env = harness.environment(torch.device("cpu"))
    params = results[0]["params"]
    harness.report(args.out, "release", results, COLUMNS, env=env,
                   heading=f"{args.model_size} model ({params / 1e6:.2f}M params), one sequence of "
                           f"{args.context or PRESETS[args.model_size]['model'].context} tokens per step, "
                           f"{args.param_dtype} weights"
                           f"{f', {args.master_weight_bits}-bit master' if args.master_weight_bits else ''}"
                           f"{', activation checkpointing' if args.activation_checkpointing else ''}; "
                           f"{harness.machine_line(env)}",
                   config=vars(args) | {"out": str(args.out)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
