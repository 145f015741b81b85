"""Muon's step time: ``torch.optim.Muon`` against ``Muon8bit`` and ``Muon4bit`` on the same
parameters, in this one process, taking turns round after round (a slow minute of a shared host
slows all of them alike); the medians over the rounds and each one's ratio to torch's Muon.

Newton-Schulz (five bf16 quintic iterations on the whole matrix) dominates Muon's step; what the
low-bit classes add is the momentum's dequantize, update and quantize (one fused pass). Steps
after the first two only. The default shapes are small because a CPU without bf16 matmul
instructions (AVX512-BF16, AMX) multiplies bf16 matrices at about 1 GFLOP/s: a 1024 x 4096
matrix's Newton-Schulz takes minutes there; pass ``--shapes 1024x1024 1024x4096`` elsewhere.

    python benchmarks/bench_muon_step.py [--shapes 256x256 256x256 256x1024] [--threads 2] \
        [--rounds 5] [--steps 1]

Prints a markdown table and writes JSON rows.
"""

import argparse
import pathlib
import statistics
import sys

import torch

from lowbit_optim import Muon4bit, Muon8bit
from lowbit_optim.bench import harness
from lowbit_optim.state import state_bytes

CONTENDERS = {
    "torch_muon": ("torch.optim.Muon (fp32 momentum)", torch.optim.Muon),
    "muon8bit": ("lowbit_optim Muon8bit", Muon8bit),
    "muon4bit": ("lowbit_optim Muon4bit", Muon4bit),
}
SHAPES = ("256x256", "256x256", "256x1024")


def parse_shape(text: str) -> tuple[int, int]:
    rows, cols = (int(part) for part in text.lower().split("x"))
    return rows, cols


def stepper(name: str, shapes: list[tuple[int, int]]):
    """``name``'s step over fresh parameters of ``shapes`` with fixed gradients, warmed up."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape) / shape[-1] ** 0.5) for shape in shapes]
    for param in params:
        param.grad = torch.randn_like(param) * 1e-3
    optimizer = CONTENDERS[name][1](params, lr=0.02)
    for _ in range(2):
        optimizer.step()
    return optimizer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), metavar="ROWSxCOLS")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1, help="steps per optimizer per round")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_out/muon_step_time.json"))
    args = parser.parse_args(argv)
    shapes = [parse_shape(text) for text in args.shapes]
    torch.set_num_threads(args.threads)
    optimizers = {name: stepper(name, shapes) for name in CONTENDERS}
    seconds = harness.alternated_seconds({name: optimizer.step for name, optimizer in optimizers.items()},
                                         rounds=args.rounds, calls=args.steps)
    medians = {name: statistics.median(values) * 1e3 for name, values in seconds.items()}
    params = sum(rows * cols for rows, cols in shapes)
    rows = [{"optimizer": name, "label": label, "ms_per_step": medians[name],
             "ratio": medians[name] / medians["torch_muon"],
             "extra_ms": medians[name] - medians["torch_muon"],
             "state_bytes_per_param": state_bytes(optimizers[name]) / params}
            for name, (label, _) in CONTENDERS.items()]
    columns = [
        harness.Column("optimizer", "label"),
        harness.Column("ms/step (median)", "ms_per_step", "{:.1f}"),
        harness.Column("x torch.optim.Muon", "ratio", "{:.3f}x"),
        harness.Column("ms over torch's", "extra_ms", "{:+.1f}"),
        harness.Column("state B/param", "state_bytes_per_param", "{:.3f}"),
    ]
    env = harness.environment(torch.device("cpu"))
    harness.report(args.out, "muon_step_time", rows, columns, env=env,
                   heading=f"Muon step on {' + '.join(args.shapes)} ({params / 1e6:.1f}M parameters), "
                           f"{args.rounds} rounds of {args.steps} steps each; {harness.machine_line(env)}, "
                           f"load average {env['load_average_1min']:.1f}",
                   config={"shapes": args.shapes, "threads": args.threads, "rounds": args.rounds,
                           "steps": args.steps, "seconds": seconds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
