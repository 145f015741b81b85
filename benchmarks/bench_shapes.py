"""First-step (compile) time and graph count on a model with 12 distinct weight shapes.

torchao compiles one graph per distinct parameter shape; ours compiles one per state kind.
Run each optimizer in a fresh process with an empty Inductor cache for cold numbers:
``TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/bench_shapes.py lowbit_4bit``.
"""

import argparse
import json
import time

import torch

from lowbit_optim.bench import harness

SHAPES = [(256 + 64 * i, 512 + 32 * i) for i in range(12)]  # 5.3M parameters, 12 shapes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("optimizer", help="a harness optimizer name, e.g. lowbit_4bit, torchao_4bit")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the first")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(2)
    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in SHAPES]
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = harness.make_optimizer(args.optimizer, params, lr=1e-3)
    start = time.perf_counter()
    optimizer.step()
    first_step_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.steps):
        optimizer.step()
    row = {
        "optimizer": args.optimizer,
        "distinct_shapes": len(set(SHAPES)),
        "params": sum(p.numel() for p in params),
        "first_step_s": round(first_step_s, 2),
        "later_step_ms": round((time.perf_counter() - start) / args.steps * 1e3, 1),
        "graphs": harness.compiled_graphs(),
        **harness.environment(),
    }
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
