"""What each parameter adds to a CPU step: the step time of ``--params`` parameters minus that of
one, per extra parameter, for the C++ CPU step of each optimizer against torch's fused AdamW.

A model of hundreds of small parameters (norms, biases, embeddings of a small vocabulary) pays
this on every step besides the elements' own cost. The parameters are (64, 64) float32 (the
factored class needs two dimensions; 4096 elements, large enough to be quantized), so the
elements' own cost is a few microseconds and the rest is the step's per-parameter handling:
Python, argument lists, operator calls. Every optimizer is measured in this one process, the
optimizers taking turns round after round (a shared host slows them alike), the median round
reported.

    python benchmarks/bench_cpu_per_param.py [--params 12] [--rounds 7] [--steps 300] [--threads 1]

Prints a markdown table and writes JSON rows.
"""

import argparse
import pathlib
import statistics
import sys

import torch

from lowbit_optim.bench import harness

OPTIMIZERS = ("torch_adamw", "lowbit_4bit", "lowbit_8bit", "lowbit_fp8", "lowbit_4bit_factored")
SHAPE = (64, 64)


def stepper(name: str, count: int):
    """A function that steps ``name`` over ``count`` parameters of SHAPE, warmed up."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(SHAPE, generator=generator) * 0.03) for _ in range(count)]
    for param in params:
        param.grad = torch.randn(SHAPE, generator=generator) * 1e-3
    optimizer = harness.make_optimizer(name, params, lr=1e-3, weight_decay=1e-2)
    for _ in range(3):
        optimizer.step()
    return optimizer.step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    parser.add_argument("--params", type=int, default=12, help="parameters of the larger model (default 12)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=300, help="steps timed per round (default 300)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=pathlib.Path,
                        default=pathlib.Path("bench_out/bench_cpu_per_param.json"))
    args = parser.parse_args(argv)
    if args.params < 2:
        parser.error(f"--params must be >= 2, got {args.params}")
    names, skipped = harness.resolve_optimizers(args.optimizers, all_names=OPTIMIZERS)
    for name in skipped:
        print(f"skipping {name}: its package is not installed", file=sys.stderr)
    torch.set_num_threads(args.threads)
    steps = {(name, count): stepper(name, count) for name in names for count in (1, args.params)}
    seconds = harness.alternated_seconds(steps, rounds=args.rounds, calls=args.steps)
    rows = []
    for name in names:
        one, many = (statistics.median(seconds[name, count]) * 1e6 for count in (1, args.params))
        rows.append({"optimizer": name, "label": harness.OPTIMIZERS[name].label, "one_param_us": one,
                     "many_params_us": many, "per_extra_param_us": (many - one) / (args.params - 1)})
    columns = [
        harness.Column("optimizer", "label"),
        harness.Column("1 parameter us/step", "one_param_us", "{:.1f}"),
        harness.Column(f"{args.params} parameters us/step", "many_params_us", "{:.1f}"),
        harness.Column("us per extra parameter", "per_extra_param_us", "{:.1f}"),
    ]
    env = harness.environment(torch.device("cpu"))
    harness.report(args.out, "cpu_per_param", rows, columns, env=env,
                   heading=f"{SHAPE[0]} x {SHAPE[1]} float32 parameters, median of {args.rounds} rounds of "
                           f"{args.steps} steps; {harness.machine_line(env)}",
                   config={"params": args.params, "rounds": args.rounds, "steps": args.steps,
                           "threads": args.threads})
    return 0


if __name__ == "__main__":
    sys.exit(main())
