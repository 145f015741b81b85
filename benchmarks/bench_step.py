"""Optimizer step time: steady-state ms/step and first-step (compile) time, side by side.

Workloads (``--model``), fp32 (``--dtype bfloat16``: bf16) with fixed random gradients:
``linear10`` (default), 10 x ``Linear(1024, 1024, bias=False)`` (10.49M parameters);
``square4096``, one 4096 x 4096 parameter (16.8M); ``shapes12``, the 12 distinct shapes of
``bench_shapes.py`` (5.3M). torch's fused AdamW keeps bf16 moments for bf16 parameters. Each
optimizer runs in a fresh process so that its first step is what a user sees: nothing compiled
in memory and, with ``--cache cold`` (default), an empty Inductor cache too. Prints a markdown
table and writes JSON rows with versions and hardware.

    python benchmarks/bench_step.py                       # ours + torch, + peers installed
    python benchmarks/bench_step.py --optimizers lowbit_4bit torch_adamw --cache warm
    python benchmarks/bench_step.py --threads 1 --out bench_out/bench_step_1t.json
    python benchmarks/bench_step.py --model square4096 --optimizers torch_adamw lowbit_4bit
    LOWBIT_OPTIM_CPU_ISA=avx2 python benchmarks/bench_step.py --optimizers torch_adamw lowbit_4bit

``lowbit_8bit``/``lowbit_4bit``/``lowbit_fp8`` use the default backend (on CPU the C++ kernel,
``lowbit_optim.step.cpu_kernel``, on its widest instruction set unless ``LOWBIT_OPTIM_CPU_ISA``
says otherwise; the table's heading names the one used); the ``_compile`` rows pin
``backend="compile"``.

Besides wall-clock time, each row records the process CPU time per step (all threads): on a
machine shared with other work, wall time swings with the load while CPU time at one thread
stays close to the cost of the step itself.
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

# The package of this checkout, not whichever one is installed: the workers run this file as
# a script, so their sys.path starts at benchmarks/, not at the repository root.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lowbit_optim import state_bytes  # noqa: E402
from lowbit_optim.bench import harness  # noqa: E402
from lowbit_optim.step import cpu_kernel  # noqa: E402

DEFAULT_OPTIMIZERS = ("torch_adamw", "torch_adamw_foreach", "lowbit_8bit", "lowbit_4bit", "lowbit_fp8",
                      "lowbit_4bit_factored", "lowbit_8bit_compile", "lowbit_4bit_compile",
                      "lowbit_fp8_compile", "lowbit_4bit_factored_compile", *harness.PEERS)
MODELS = {
    "linear10": ("10 x Linear(1024, 1024, bias=False) fp32", [(1024, 1024)] * 10),
    "square4096": ("one 4096 x 4096 parameter, fp32", [(4096, 4096)]),
    "shapes12": ("the 12 shapes of bench_shapes.py, fp32", [(256 + 64 * i, 512 + 32 * i) for i in range(12)]),
}


def measure(name: str, steps: int, warmup: int, model: str, dtype: str) -> dict:
    """Runs in the worker process: one optimizer, timed."""
    device = torch.device("cpu")
    torch.manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(shape) / shape[-1] ** 0.5).to(getattr(torch, dtype)))
              for shape in MODELS[model][1]]
    for param in params:
        param.grad = torch.randn_like(param) * 1e-3
    # betas explicit (torch's default): the Lion and AdEMAMix rows adapt them (harness._as_lion).
    optimizer = harness.make_optimizer(name, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=1e-2)
    first_step_s = harness.timed(optimizer.step, device)
    graphs_after_first = harness.compiled_graphs()
    for _ in range(warmup):
        optimizer.step()
    seconds, cpu_seconds = [], []
    for _ in range(steps):
        cpu_start = time.process_time()
        seconds.append(harness.timed(optimizer.step, device))
        cpu_seconds.append(time.process_time() - cpu_start)
    num_params = sum(p.numel() for p in params)
    return {
        "optimizer": name,
        "backend": getattr(optimizer, "backend", None),
        "label": harness.OPTIMIZERS[name].label,
        "params": num_params,
        "step_ms": harness.median_ms(seconds),
        "step_ms_min": 1e3 * min(seconds),
        "cpu_ms": 1e3 * statistics.median(cpu_seconds),
        "threads": torch.get_num_threads(),
        "first_step_s": first_step_s,
        "graphs": harness.compiled_graphs(),
        "recompiles_after_first_step": harness.compiled_graphs() - graphs_after_first,
        "state_bytes_per_param": state_bytes(optimizer) / num_params,
    }


def run_isolated(name: str, args) -> dict:
    worker_args = [name, "--steps", str(args.steps), "--warmup", str(args.warmup), "--model", args.model,
                   "--dtype", args.dtype]
    return harness.run_worker(__file__, worker_args, cold_cache=args.cache == "cold")


COLUMNS = [
    harness.Column("optimizer", "label"),
    harness.Column("backend", "backend"),
    harness.Column("ms/step (median)", "step_ms", "{:.1f}"),
    harness.Column("x torch fused", "vs_fused", "{:.1f}x"),
    harness.Column("CPU ms/step", "cpu_ms", "{:.1f}"),
    harness.Column("x fused (CPU)", "cpu_vs_fused", "{:.1f}x"),
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
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the workers "
                        "(default: as set, else torch's default)")
    parser.add_argument("--model", choices=sorted(MODELS), default="linear10",
                        help="the parameters stepped (module docstring; default linear10)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the parameters' dtype (bfloat16: rounded writes, no master weights)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_out/bench_step.json"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args.worker, args.steps, args.warmup, args.model, args.dtype)))
        return 0

    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the workers
    names, skipped = harness.resolve_optimizers(args.optimizers, all_names=DEFAULT_OPTIMIZERS)
    if skipped:
        print(f"skipped (not installed): {', '.join(skipped)}", file=sys.stderr)
    rows = []
    for name in names:
        print(f"{name} ...", file=sys.stderr, flush=True)
        rows.append(run_isolated(name, args))
    fused = next((row for row in rows if row["optimizer"] == "torch_adamw"), None)
    for row in rows:
        row["vs_fused"] = row["step_ms"] / fused["step_ms"] if fused else None
        row["cpu_vs_fused"] = row["cpu_ms"] / fused["cpu_ms"] if fused else None
    env = harness.environment(torch.device("cpu"))
    env["torch_threads"] = rows[0]["threads"]  # the workers' (OMP_NUM_THREADS), not this process's
    config = {"model": MODELS[args.model][0].replace("fp32", args.dtype), "steps": args.steps,
              "warmup": args.warmup, "cache": args.cache, "threads": rows[0]["threads"],
              "cpu_kernel_isa": cpu_kernel.default_isa()}
    harness.report(args.out, "step", rows, COLUMNS, env=env, config=config,
                   heading=f"{config['model']}, {rows[0]['params'] / 1e6:.2f}M params, "
                           f"{args.cache} compile cache, CPU kernel path {config['cpu_kernel_isa']}; "
                           f"{harness.machine_line(env)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
