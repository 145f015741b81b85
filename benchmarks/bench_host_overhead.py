"""Host cost of the Triton path's step, measured on CPU with the kernel launch stubbed.

A GPU step's wall time is the kernel's plus the Python around it; on a model with hundreds of
parameters the Python is the larger part if redone every step (~13-25 us per parameter, 15 ms per step
for 562 parameters). Here every host-side piece runs for real (the group's plan and its
checks, ``lowbit_optim.step.plan``; the float-state step of the small parameters; each kind's
launches and layout table, ``lowbit_optim.step.kernels.plan``) and only
``lowbit_step_kernel[grid](...)`` is replaced by a counter, so the figures hold without a
GPU:

* host microseconds per parameter per step (all parameters counted, quantized or not), with
  gradients kept between steps and with ``zero_grad(set_to_none=True)`` and new gradients at
  new addresses every step; median and minimum over the steps (the minimum is the cost
  without interference from other processes, the median what a shared machine gives);
* new gradients come two ways: cloned (~20 MB written by the CPU just before each step,
  which flushes the host's caches: ~1.2 us per parameter of that figure is the step's own
  code and objects fetched again from memory) and allocated but not written (``empty_like``
  for the quantized parameters, whose values the stubbed launch never reads), closer to what
  a GPU step sees of them on the host: new tensors at new addresses, their bytes on the device;
* of each figure, the time in ``torch._foreach_copy_`` (the small parameters' gather and
  write-back): on CPU a loop of one ``copy_`` per tensor (~0.3-0.6 us per parameter here), on
  CUDA one multi-tensor launch each;
* kernel launches, layout tables copied to the device and group plans built per step;
* tensor ops of the small (float-state) parameters' step, for 10 and for 100 of them
  (profiler; views and the CPU fallback of ``_foreach_copy_`` aside): constant means O(1)
  launches on a GPU.

Runs at one thread (``--threads``): the host cost is single-threaded Python, and the small
parameters' few real CPU ops would otherwise measure OpenMP's thread wake-ups on a busy
machine. Those ops (~30 over ~10k elements) are in the figures: on a GPU they are launches.

    python benchmarks/bench_host_overhead.py [--params 562] [--steps 50] [--threads 1]

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

from lowbit_optim import AdamW4bit, AdamW8bit, QuantizedState  # noqa: E402
from lowbit_optim.bench import harness  # noqa: E402
from lowbit_optim.step.kernels import launcher  # noqa: E402
from lowbit_optim.step.kernels import layout as layouts  # noqa: E402

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


GRADIENTS = {
    "kept": "kept",
    "cloned": "new each step, cloned (new addresses)",
    "not_written": "new each step, not written (new addresses)",
}


class TimedForeachCopy:
    """``torch._foreach_copy_``, timed: on CPU a loop of ``copy_`` calls, one kernel on CUDA."""

    def __init__(self, copy):
        self.copy, self.seconds = copy, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.copy(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def host_us_per_param(name: str, count: int, steps: int, *, gradients: str) -> dict:
    params, quantized = model_params(count)
    optimizer = OPTIMIZERS[name](params, backend="triton")
    grads = [torch.randn_like(p) for p in params]
    for param, grad in zip(params, grads):
        param.grad = grad
    stub = StubbedKernel()
    copies = []
    real_to_device = layouts._to_device
    real_kernel, launcher.lowbit_step_kernel = launcher.lowbit_step_kernel, stub
    layouts._to_device = lambda *args: copies.append(1) or real_to_device(*args)
    foreach_copy = torch._foreach_copy_ = TimedForeachCopy(torch._foreach_copy_)
    try:
        optimizer.step()  # state creation, the group's plan, first layout
        seconds, foreach_seconds, held = [], [], []
        plans = optimizer._caches[0].plan
        # Read only by the stubbed launch: the small parameters' are read for real.
        unread = [gradients == "not_written" and isinstance(optimizer.state[param]["exp_avg"], QuantizedState)
                  for param in params]
        for _ in range(steps):
            if gradients != "kept":
                optimizer.zero_grad(set_to_none=True)
                for param, grad, skip_write in zip(params, grads, unread):
                    param.grad = torch.empty_like(grad) if skip_write else grad.clone()
                # The previous gradients stay alive, so the new ones are at new addresses.
                held = [p.grad for p in params] + held[:count]
            stub.launches = 0
            copies.clear()
            foreach_copy.seconds = 0.0
            start = time.perf_counter()
            optimizer.step()
            seconds.append(time.perf_counter() - start)
            foreach_seconds.append(foreach_copy.seconds)
        replanned = optimizer._caches[0].plan is not plans
    finally:
        launcher.lowbit_step_kernel = real_kernel
        layouts._to_device = real_to_device
        torch._foreach_copy_ = foreach_copy.copy
    step_ms = harness.median_ms(seconds)
    fastest = min(range(steps), key=seconds.__getitem__)
    return {
        "optimizer": name, "params": count, "quantized_params": quantized,
        "gradients": GRADIENTS[gradients],
        "step_ms": step_ms, "us_per_param": 1e3 * step_ms / count,
        "min_us_per_param": 1e6 * seconds[fastest] / count,
        "foreach_copy_us_per_param": 1e3 * harness.median_ms(foreach_seconds) / count,
        "min_foreach_copy_us_per_param": 1e6 * foreach_seconds[fastest] / count,
        "launches_per_step": stub.launches, "tables_copied_per_step": len(copies),
        "replanned": replanned,
    }


def small_param_ops(count: int) -> int:
    """Tensor ops of one step over ``count`` float-state parameters (see module docstring)."""
    from torch.profiler import ProfilerActivity

    from lowbit_optim.bench.profiling import quiet_profile

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
    harness.Column("host ms/step (median)", "step_ms", "{:.2f}"),
    harness.Column("host us/param (median)", "us_per_param", "{:.2f}"),
    harness.Column("host us/param (min)", "min_us_per_param", "{:.2f}"),
    harness.Column("of which CPU foreach copy (median)", "foreach_copy_us_per_param", "{:.2f}"),
    harness.Column("of which CPU foreach copy (min step)", "min_foreach_copy_us_per_param", "{:.2f}"),
    harness.Column("launches/step", "launches_per_step"),
    harness.Column("tables copied/step", "tables_copied_per_step"),
    harness.Column("plan rebuilt", "replanned"),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=562, help="parameters in the model (default 562)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, see above)")
    parser.add_argument("--out", type=pathlib.Path,
                        default=pathlib.Path("bench_out/bench_host_overhead.json"))
    args = parser.parse_args(argv)
    if min(args.params, args.steps, args.threads) < 1:
        parser.error(f"--params, --steps and --threads must be >= 1, got {args.params}, {args.steps} "
                     f"and {args.threads}")
    torch.set_num_threads(args.threads)
    rows = []
    for name in OPTIMIZERS:
        for gradients in GRADIENTS:
            row = host_us_per_param(name, args.params, args.steps, gradients=gradients)
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
