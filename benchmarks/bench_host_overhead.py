"""Host cost of the Triton path's step, measured on CPU with the kernel launch stubbed.

A GPU step's wall time is the kernel's plus the Python around it; on a model with hundreds of
parameters the Python was the larger part (issue 17: ~25 us per quantized parameter, 15 ms
per step for 562 parameters). Here every host-side piece runs for real (grouping into kinds,
argument checks, the custom op, the layout table and its cache, the float-state step of the
small parameters) and only ``_adamw_lowbit_kernel[grid](...)`` is replaced by a counter, so
the figures hold without a GPU:

* host microseconds per quantized parameter per step, with gradients kept between steps
  (the layout cache hits) and with ``zero_grad(set_to_none=True)`` and new gradients every
  step (a new layout every step);
* kernel launches per step for the quantized parameters;
* tensor ops of the small (float-state) parameters' step, for 10 and for 100 of them
  (profiler; views and the CPU fallback of ``_foreach_copy_`` aside): constant means O(1)
  launches on a GPU.

    python benchmarks/bench_host_overhead.py [--params 562] [--steps 20]

Prints a markdown table and writes JSON rows. Target: <= 3 us per parameter per step.
"""

import argparse
import os
import pathlib
import sys
import time

# The Triton path on CPU tensors (its launch is stubbed below, so nothing is interpreted).
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from lowbit_optim import AdamW4bit, AdamW8bit  # noqa: E402
from lowbit_optim.bench import harness  # noqa: E402
from lowbit_optim.kernels import adamw_lowbit  # noqa: E402

OPTIMIZERS = {"lowbit_triton_8bit": AdamW8bit, "lowbit_triton_4bit": AdamW4bit}


class StubbedKernel:
    """Stands in for the ``@triton.jit`` kernel: ``kernel[grid](*args, **meta)`` counts."""

    def __init__(self):
        self.launches = 0

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.launches += 1
        return launch


def model_params(count: int) -> tuple[list[torch.nn.Parameter], int]:
    """A transformer-like mix: 5 of 7 parameters quantized (4096-16384 elements, several
    shapes), the rest small norms and biases with float state."""
    generator = torch.Generator().manual_seed(0)
    params, quantized = [], 0
    for index in range(count):
        if index % 7 < 5:
            shape = (64 + 16 * (index % 3), 64 * (1 + index % 4))
            quantized += 1
        else:
            shape = (64 + index % 5,)
        params.append(torch.nn.Parameter(torch.randn(*shape, generator=generator)))
    return params, quantized


def host_us_per_param(name: str, count: int, steps: int, *, new_grads: bool) -> dict:
    params, quantized = model_params(count)
    optimizer = OPTIMIZERS[name](params, backend="triton")
    grads = [torch.randn_like(p) for p in params]
    for param, grad in zip(params, grads):
        param.grad = grad
    stub = StubbedKernel()
    real_kernel, adamw_lowbit._adamw_lowbit_kernel = adamw_lowbit._adamw_lowbit_kernel, stub
    try:
        optimizer.step()  # state creation, first layout
        seconds = []
        for _ in range(steps):
            if new_grads:
                optimizer.zero_grad(set_to_none=True)
                for param, grad in zip(params, grads):
                    param.grad = grad.clone()  # new storage: the layout cache misses
            stub.launches = 0
            start = time.perf_counter()
            optimizer.step()
            seconds.append(time.perf_counter() - start)
    finally:
        adamw_lowbit._adamw_lowbit_kernel = real_kernel
    step_ms = harness.median_ms(seconds)
    return {
        "optimizer": name, "params": count, "quantized_params": quantized,
        "gradients": "new each step (layout rebuilt)" if new_grads else "kept (layout cached)",
        "step_ms": step_ms, "us_per_param": 1e3 * step_ms / count,
        "launches_per_step": stub.launches,
    }


def small_param_ops(count: int) -> int:
    """Tensor ops of one step over ``count`` float-state parameters (see module docstring)."""
    from torch.profiler import ProfilerActivity

    from lowbit_optim.profiling import quiet_profile

    params = [torch.nn.Parameter(torch.randn(64 + i % 5)) for i in range(count)]
    optimizer = AdamW8bit(params, backend="triton")
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()
    with quiet_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        optimizer.step()
    not_kernels = {"aten::view", "aten::reshape", "aten::as_strided", "aten::copy_"}
    return sum(
        1 for event in prof.events()
        if event.name.startswith("aten::") and event.name not in not_kernels
        and (event.name.startswith("aten::_foreach") or event.input_shapes[:1] not in ([], [[]]))
    )


COLUMNS = [
    harness.Column("optimizer", "optimizer"),
    harness.Column("params (quantized)", "label"),
    harness.Column("gradients", "gradients"),
    harness.Column("host ms/step", "step_ms", "{:.2f}"),
    harness.Column("host us/param", "us_per_param", "{:.2f}"),
    harness.Column("launches/step", "launches_per_step"),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=562, help="parameters in the model (default 562)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=pathlib.Path,
                        default=pathlib.Path("bench_out/bench_host_overhead.json"))
    args = parser.parse_args(argv)
    if args.params < 1 or args.steps < 1:
        parser.error(f"--params and --steps must be >= 1, got {args.params} and {args.steps}")
    rows = []
    for name in OPTIMIZERS:
        for new_grads in (False, True):
            row = host_us_per_param(name, args.params, args.steps, new_grads=new_grads)
            rows.append({**row, "label": f"{row['params']} ({row['quantized_params']})"})
    ops = {count: small_param_ops(count) for count in (10, 100)}
    env = harness.environment(torch.device("cpu"))
    harness.report(args.out, "host_overhead", rows, COLUMNS, env=env,
                   heading=f"Triton path, kernel stubbed; {harness.machine_line(env)}",
                   config=vars(args) | {"out": str(args.out), "small_param_tensor_ops": ops})
    print(f"\nsmall parameters' step: {ops[10]} tensor ops for 10 of them, {ops[100]} for 100")
    return 0


if __name__ == "__main__":
    sys.exit(main())
