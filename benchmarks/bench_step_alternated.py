"""Steady step time against torch's fused AdamW, every optimizer in this one process, taking
turns round after round: the ratio a shared machine can still measure.

``bench_step.py`` runs each optimizer in a process of its own (its first step is then what a
user sees); on a host whose speed moves from minute to minute (another job on the same cores)
its ratios compare runs minutes apart. Here all of them step the same workload (``bench_step``'s
``--model``s, fixed random gradients) in rounds, each taking ``--steps`` steps in turn, so a
slow minute slows all of them; the medians over the rounds and each one's ratio to torch's
fused AdamW are reported. Steps after the first three only (nothing compiled is timed).

    python benchmarks/bench_step_alternated.py [--model linear10] [--threads 1 2] [--rounds 9] \
        [--dtype bfloat16] [--start-step 20000]

``--start-step`` moves every optimizer's step count on before timing: from about 16,600 steps
(beta2 = 0.999) AdamW's second bias correction is 1.0 in float32, which the C++ kernel skips
dividing by, so a long run's steps are cheaper than the first ones there.

Prints a markdown table and writes JSON rows.
"""

import argparse
import pathlib
import statistics
import sys

import torch
from bench_step import MODELS

from lowbit_optim.bench import harness
from lowbit_optim.step import cpu_kernel

OPTIMIZERS = ("torch_adamw", "lowbit_8bit", "lowbit_4bit", "lowbit_fp8", "lowbit_4bit_factored")


def stepper(name: str, model: str, dtype: torch.dtype, start_step: int):
    """``name``'s step over ``model``'s parameters of ``dtype``, warmed up, its step count
    moved on to ``start_step`` (0: left where the warm-up leaves it)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(shape) / shape[-1] ** 0.5).to(dtype))
              for shape in MODELS[model][1]]
    for param in params:
        param.grad = torch.randn_like(param) * 1e-3
    optimizer = harness.make_optimizer(name, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=1e-2)
    optimizer.step()
    if start_step:
        for state in optimizer.state.values():
            state["step"].fill_(start_step)
    for _ in range(2):
        optimizer.step()
    return optimizer.step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS),
                        help="the first is the reference of the ratios (default: torch's fused AdamW)")
    parser.add_argument("--model", choices=sorted(MODELS), default="linear10")
    parser.add_argument("--threads", type=int, nargs="+", default=[1],
                        help="thread counts; several (1 2) take turns in the same rounds, so each row's "
                             "thread scaling compares times measured minutes apart on no shared host")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the parameters' dtype (bfloat16: rounded writes, no master weights; torch's "
                             "fused step keeps bfloat16 moments)")
    parser.add_argument("--steps", type=int, default=8, help="steps per optimizer per round (default 8)")
    parser.add_argument("--start-step", type=int, default=0,
                        help="move every step count on to this before timing (20000: a long run's steps, "
                             "where AdamW's second bias correction is 1.0 in float32; default: the first)")
    parser.add_argument("--out", type=pathlib.Path,
                        default=pathlib.Path("bench_out/bench_step_alternated.json"))
    args = parser.parse_args(argv)
    names, skipped = harness.resolve_optimizers(args.optimizers, all_names=OPTIMIZERS)
    for name in skipped:
        print(f"skipping {name}: its package is not installed", file=sys.stderr)
    threads = sorted(set(args.threads))
    torch.set_num_threads(threads[0])
    from_step = f" from step {args.start_step}" if args.start_step else ""
    dtype = getattr(torch, args.dtype)
    steppers = {name: stepper(name, args.model, dtype, args.start_step) for name in names}
    steps = {(name, count): steppers[name] for count in threads for name in names}

    def before_turn(key):
        torch.set_num_threads(key[1])
        steps[key]()  # untimed: the first step at a new thread count starts its threads

    seconds = harness.alternated_seconds(steps, rounds=args.rounds, calls=args.steps, before_turn=before_turn)
    medians = {key: statistics.median(values) * 1e3 for key, values in seconds.items()}
    reference = names[0]
    rows = [{"optimizer": name, "label": harness.OPTIMIZERS[name].label, "threads": count,
             "ms_per_step": medians[name, count], "ratio": medians[name, count] / medians[reference, count],
             "thread_scaling": medians[name, threads[0]] / medians[name, count]}
            for count in threads for name in names]
    columns = [
        harness.Column("optimizer", "label"),
        harness.Column("threads", "threads"),
        harness.Column("ms/step (median)", "ms_per_step", "{:.2f}"),
        harness.Column(f"x {harness.OPTIMIZERS[reference].label}", "ratio", "{:.2f}x"),
        harness.Column(f"speed-up over {threads[0]} thread(s)", "thread_scaling", "{:.2f}x"),
    ]
    env = harness.environment(torch.device("cpu"))
    env["torch_threads"] = "/".join(map(str, threads))  # the counts the rows were timed at
    harness.report(args.out, "step_alternated", rows, columns, env=env,
                   heading=f"{MODELS[args.model][0].replace('fp32', args.dtype)}, {args.rounds} rounds of "
                           f"{args.steps} steps each{from_step}, "
                           f"CPU kernel path {cpu_kernel.default_isa()}; "
                           f"{harness.machine_line(env)}",
                   config={"model": args.model, "dtype": args.dtype, "threads": threads,
                           "rounds": args.rounds, "steps": args.steps, "start_step": args.start_step})
    return 0


if __name__ == "__main__":
    sys.exit(main())
