"""Optimizer step time: steady-state ms/step and first-step (compile) time, side by side.

Workload (issue 3): 10 x ``Linear(1024, 1024, bias=False)`` in fp32 (10.49M parameters) with
fixed random gradients, 2 threads. Each optimizer runs in a fresh process so that its first
step is what a user sees: nothing compiled in memory and, with ``--cache cold`` (default), an
empty Inductor cache too. Prints a markdown table and writes JSON rows with versions and
hardware.

    python benchmarks/bench_step.py                       # ours + torch, + peers installed
    python benchmarks/bench_step.py --optimizers lowbit_4bit torch_adamw --cache warm
"""

import argparse
import json
import pathlib
import sys

import torch

from lowbit_optim import state_bytes
from lowbit_optim.bench import harness

DEFAULT_OPTIMIZERS = ("torch_adamw", "torch_adamw_foreach", "lowbit_8bit", "lowbit_4bit",
                      *harness.PEERS)
LAYERS, WIDTH = 10, 1024


def measure(name: str, steps: int, warmup: int) -> dict:
    """Runs in the worker process: one optimizer, timed."""
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    optimizer = harness.make_optimizer(name, model.parameters(), lr=1e-3, weight_decay=1e-2)
    first_step_s = harness.timed(optimizer.step, device)
    graphs_after_first = harness.compiled_graphs()
    for _ in range(warmup):
        optimizer.step()
    seconds = [harness.timed(optimizer.step, device) for _ in range(steps)]
    num_params = sum(p.numel() for p in model.parameters())
    return {
        "optimizer": name,
        "label": harness.OPTIMIZERS[name].label,
        "params": num_params,
        "step_ms": harness.median_ms(seconds),
        "step_ms_min": 1e3 * min(seconds),
        "first_step_s": first_step_s,
        "graphs": harness.compiled_graphs(),
        "recompiles_after_first_step": harness.compiled_graphs() - graphs_after_first,
        "state_bytes_per_param": state_bytes(optimizer) / num_params,
    }


def run_isolated(name: str, args) -> dict:
    worker_args = [name, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    return harness.run_worker(__file__, worker_args, cold_cache=args.cache == "cold")


COLUMNS = [
    harness.Column("optimizer", "label"),
    harness.Column("ms/step (median)", "step_ms", "{:.1f}"),
    harness.Column("x torch fused", "vs_fused", "{:.1f}x"),
    harness.Column("first step s", "first_step_s", "{:.2f}"),
    harness.Column("graphs", "graphs"),
    harness.Column("recompiles", "recompiles_after_first_step"),
    harness.Column("state B/param", "state_bytes_per_param", "{:.2f}"),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizers", nargs="+", default=list(DEFAULT_OPTIMIZERS))
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after the first")
    parser.add_argument("--cache", choices=("cold", "warm"), default="cold",
                        help="cold: an empty Inductor cache per optimizer; warm: the usual one")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_out/bench_step.json"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args.worker, args.steps, args.warmup)))
        return 0

    names, skipped = harness.resolve_optimizers(args.optimizers, all_names=DEFAULT_OPTIMIZERS)
    if skipped:
        print(f"skipped (not installed): {', '.join(skipped)}", file=sys.stderr)
    rows = []
    for name in names:
        print(f"{name} ...", file=sys.stderr, flush=True)
        rows.append(run_isolated(name, args))
    fused = next((row["step_ms"] for row in rows if row["optimizer"] == "torch_adamw"), None)
    for row in rows:
        row["vs_fused"] = row["step_ms"] / fused if fused else None
    env = harness.environment(torch.device("cpu"))
    config = {"model": f"{LAYERS} x Linear({WIDTH}, {WIDTH}, bias=False) fp32", "steps": args.steps,
              "warmup": args.warmup, "cache": args.cache}
    harness.report(args.out, "step", rows, COLUMNS, env=env, config=config,
                   heading=f"{config['model']}, {rows[0]['params'] / 1e6:.2f}M params, "
                           f"{args.cache} compile cache; {harness.machine_line(env)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
