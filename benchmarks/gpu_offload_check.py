"""GPU check of ``CPUOffloadOptimizer``: GPU memory saved, iteration and step time
against torchao's wrapper, and whether the gradient copies overlap backward (profiler trace).

Trains the benchmark's ByteGPT (``--model-size``, default gpu-114m; fp32 weights, bf16
autocast) for a few iterations with each setup and prints one markdown table:

* peak GPU memory during training, and what it saves against the same optimizer on the GPU;
* median iteration time (forward + backward + step) and median ``step()`` time;
* for our 8-bit offload, one profiled iteration written as a Chrome trace
  (``offload_trace.json``), and the share of device-to-host copy time that ran while compute
  kernels were running (above 0: the downloads overlap backward).

Exits 0 with a message when there is no CUDA device. Writes JSON rows under ``--out``.

    python benchmarks/gpu_offload_check.py [--model-size gpu-114m] [--steps 6] [--out DIR]
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # runs from a plain checkout

from lowbit_optim import AdamW4bit, AdamW8bit, CPUOffloadOptimizer  # noqa: E402
from lowbit_optim.bench import harness  # noqa: E402
from lowbit_optim.bench.__main__ import PRESETS  # noqa: E402
from lowbit_optim.bench.model import ByteGPT  # noqa: E402

BATCH = 8


def torchao_offload(params, **kwargs):
    import torchao.optim

    return torchao.optim.CPUOffloadOptimizer(params, torch.optim.AdamW, fused=True, **kwargs)


# name -> (build(params), the on-GPU setup it is compared with)
SETUPS = {
    "gpu_torch_adamw_fused": (lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True), None),
    "gpu_lowbit_8bit": (lambda p: AdamW8bit(p, lr=1e-4), None),
    "gpu_lowbit_4bit": (lambda p: AdamW4bit(p, lr=1e-4), None),
    "offload_lowbit_8bit": (lambda p: CPUOffloadOptimizer(p, AdamW8bit, lr=1e-4), "gpu_lowbit_8bit"),
    "offload_lowbit_4bit": (lambda p: CPUOffloadOptimizer(p, AdamW4bit, lr=1e-4), "gpu_lowbit_4bit"),
    "offload_lowbit_8bit_offload_gradients": (
        lambda p: CPUOffloadOptimizer(p, AdamW8bit, offload_gradients=True, lr=1e-4), "gpu_lowbit_8bit"),
    "torchao_offload_torch_adamw_fused": (lambda p: torchao_offload(p, lr=1e-4), "gpu_torch_adamw_fused"),
    "torchao_offload_gradients": (
        lambda p: torchao_offload(p, offload_gradients=True, lr=1e-4), "gpu_torch_adamw_fused"),
}


def iteration(model, tokens, optimizer, step_seconds):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    start = time.perf_counter()
    optimizer.step()
    step_seconds.append(time.perf_counter() - start)
    optimizer.zero_grad()


def copy_overlap(trace_path: pathlib.Path) -> float | None:
    """Share of device-to-host memcpy time during which a compute kernel was running."""
    events = json.loads(trace_path.read_text()).get("traceEvents", [])
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("cat") == "kernel" and "dur" in e)
    copies = [(e["ts"], e["ts"] + e["dur"]) for e in events
              if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "") and "dur" in e]
    if not copies:
        return None
    merged = []
    for start, end in kernels:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    overlapped = sum(max(0.0, min(end, k_end) - max(start, k_start))
                     for start, end in copies for k_start, k_end in merged)
    return overlapped / sum(end - start for start, end in copies)


def run(name: str, args, device) -> dict:
    build, _ = SETUPS[name]
    torch.manual_seed(0)
    config = PRESETS[args.model_size]["model"]
    model = ByteGPT(config).to(device)
    tokens = torch.randint(0, 256, (BATCH, config.context + 1), device=device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    weights = torch.cuda.memory_allocated()
    optimizer = build(model.parameters())
    step_seconds, iteration_seconds = [], []
    for _ in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        iteration(model, tokens, optimizer, step_seconds)
        torch.cuda.synchronize()
        iteration_seconds.append(time.perf_counter() - start)
    row = {
        "setup": name,
        "peak_gpu_gb": torch.cuda.max_memory_allocated() / 2**30,
        "peak_over_weights_gb": (torch.cuda.max_memory_allocated() - weights) / 2**30,
        "iteration_ms": 1e3 * statistics.median(iteration_seconds[args.warmup:]),
        "step_ms": 1e3 * statistics.median(step_seconds[args.warmup:]),
    }
    if name == "offload_lowbit_8bit":
        trace = args.out / "offload_trace.json"
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as profiler:
            iteration(model, tokens, optimizer, [])
            torch.cuda.synchronize()
        profiler.export_chrome_trace(str(trace))
        row["dtoh_overlap"] = copy_overlap(trace)
        row["trace"] = str(trace)
    del optimizer, model
    torch.cuda.empty_cache()
    return row


COLUMNS = [
    harness.Column("setup", "setup"),
    harness.Column("peak GPU GB", "peak_gpu_gb", "{:.2f}"),
    harness.Column("peak over weights GB", "peak_over_weights_gb", "{:.2f}"),
    harness.Column("saved vs on-GPU GB", "saved_gb", "{:.2f}"),
    harness.Column("iteration ms", "iteration_ms", "{:.0f}"),
    harness.Column("step() ms", "step_ms", "{:.0f}"),
    harness.Column("DtoH copy time overlapping kernels", "dtoh_overlap", "{:.0%}"),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-size", choices=sorted(PRESETS), default="gpu-114m")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--setups", nargs="+", default=list(SETUPS))
    parser.add_argument("--out", type=pathlib.Path,
                        default=pathlib.Path(os.environ.get("OUT", "/tmp")) / "offload")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_offload_check: no CUDA device, nothing to check (exit 0)")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    rows = {}
    for name in args.setups:
        if name.startswith("torchao") and harness.package_version("torchao") is None:
            print(f"skipping {name}: torchao is not installed", file=sys.stderr)
            continue
        try:
            rows[name] = run(name, args, device)
        except Exception as error:  # one failing setup must not hide the others' numbers
            print(f"{name} failed: {type(error).__name__}: {error}", file=sys.stderr)
            rows[name] = {"setup": name, "error": f"{type(error).__name__}: {error}"}
    for row in rows.values():
        reference = rows.get(SETUPS[row["setup"]][1] or "")
        if reference and "peak_gpu_gb" in reference and "peak_gpu_gb" in row:
            row["saved_gb"] = reference["peak_gpu_gb"] - row["peak_gpu_gb"]
    env = harness.environment(device)
    harness.report(args.out / "gpu_offload_check.json", "gpu_offload_check", list(rows.values()),
                   COLUMNS, heading=f"### CPU offload on the GPU, {args.model_size}, batch {BATCH} "
                                    f"({harness.machine_line(env)})",
                   env=env, config={"model_size": args.model_size, "steps": args.steps,
                                    "warmup": args.warmup, "batch": BATCH})
    failed = [name for name, row in rows.items() if "error" in row and not name.startswith("torchao")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
