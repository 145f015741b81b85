"""GPU optimizer-step benchmark: a Llama-7B-like set of shapes scaled to ~1B parameters.

Per implementation: median ms/step (CUDA events), achieved GB/s (bytes a step must move:
parameters read and written, gradients read, optimizer state read and written) against the
device's measured copy bandwidth, kernel launches per step and host-to-device copies per step
(torch.profiler), and peak memory. Prints a markdown table; writes JSON rows (with versions
and hardware) to $OUT/bench_gpu_step.json when OUT is set.

    python benchmarks/bench_gpu_step.py [--preset llama1b|embedding|group] [--layers 18]
                                        [--dtype float32] [--steps 10] [--json PATH]
"""

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # runs from a plain checkout

from lowbit_optim import AdamW4bit, AdamW8bit  # noqa: E402

HIDDEN, INTERMEDIATE, VOCAB = 2048, 5504, 32000  # Llama-7B's ratios (4096, 11008) at half width


def llama_shapes(layers: int) -> list[tuple[int, ...]]:
    shapes = [(VOCAB, HIDDEN)]
    for _ in range(layers):
        shapes += [(HIDDEN, HIDDEN)] * 4 + [(INTERMEDIATE, HIDDEN)] * 2 + [(HIDDEN, INTERMEDIATE)]
        shapes += [(HIDDEN,)] * 2  # norms: below min_quant_size, float32 state
    return shapes + [(HIDDEN,), (VOCAB, HIDDEN)]


def group_shapes() -> list[tuple[int, ...]]:
    """~24 tensors, 2.53e9 elements: past 2**31 elements in one launch of a group."""
    return [(8192, 8192)] * 22 + [(128256, 4096)] * 2


PRESETS = {
    "llama1b": None,  # llama_shapes(--layers)
    "embedding": lambda: [(128256, 8192)],  # one Llama-3-8B-sized embedding, 1.05e9 elements
    "group": group_shapes,
}


def implementations() -> dict:
    impls = {
        "torch_fused": lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True),
        "lowbit_triton_8bit": lambda p: AdamW8bit(p, lr=1e-4, backend="triton"),
        "lowbit_compile_8bit": lambda p: AdamW8bit(p, lr=1e-4, backend="compile"),
        "lowbit_triton_4bit": lambda p: AdamW4bit(p, lr=1e-4, backend="triton"),
        "lowbit_compile_4bit": lambda p: AdamW4bit(p, lr=1e-4, backend="compile"),
    }
    if importlib.util.find_spec("torchao") is not None:
        from torchao.optim import AdamW4bit as TorchaoAdamW4bit
        from torchao.optim import AdamW8bit as TorchaoAdamW8bit

        impls["torchao_8bit"] = lambda p: TorchaoAdamW8bit(p, lr=1e-4)
        impls["torchao_4bit"] = lambda p: TorchaoAdamW4bit(p, lr=1e-4)
    if importlib.util.find_spec("bitsandbytes") is not None:
        import bitsandbytes as bnb

        impls["bnb_8bit"] = lambda p: bnb.optim.AdamW8bit(p, lr=1e-4)
    return impls


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second), median of 10."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times[2:]) / 1e9


def inner_tensors(value):
    """Plain tensors behind a state entry (tensor subclasses are flattened)."""
    if not isinstance(value, torch.Tensor):
        return []
    if hasattr(value, "__tensor_flatten__") and type(value) is not torch.Tensor:
        names, _ = value.__tensor_flatten__()
        return [t for name in names for t in inner_tensors(getattr(value, name))]
    return [value]


def state_bytes(optimizer) -> int:
    return sum(t.nbytes for state in optimizer.state.values() for value in state.values()
               for t in inner_tensors(value) if t.is_cuda and t.dim() > 0)


def profile_step(optimizer) -> tuple[int, int]:
    """(kernel launches, host-to-device copies) in one step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        optimizer.step()
        torch.cuda.synchronize()
    device_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = sum("HtoD" in e.name for e in device_events)
    launches = sum(not e.name.startswith(("Memcpy", "Memset")) for e in device_events)
    return launches, copies


def run(name, make, shapes, dtype, steps, copy_gbs) -> dict:
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=dtype) * 0.02) for s in shapes]
    for p in params:  # gradients kept between steps, as in training with set_to_none=False
        p.grad = torch.randn_like(p) * 1e-3
    torch.cuda.synchronize()
    base_memory = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    optimizer = make(params)
    for _ in range(3):  # state creation and compilation
        optimizer.step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        optimizer.step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    launches, copies = profile_step(optimizer)
    ms = statistics.median(times)
    moved = sum(2 * p.nbytes + p.grad.nbytes for p in params) + 2 * state_bytes(optimizer)
    achieved_gbs = moved / (ms / 1e3) / 1e9
    numel = sum(p.numel() for p in params)
    return dict(
        impl=name, dtype=str(dtype).replace("torch.", ""), params=numel, ms_per_step=round(ms, 3),
        gb_per_s=round(achieved_gbs, 1), pct_of_copy_bw=round(100 * achieved_gbs / copy_gbs, 1),
        launches_per_step=launches, h2d_copies_per_step=copies,
        state_bytes_per_param=round(state_bytes(optimizer) / numel, 3),
        peak_extra_gib=round((torch.cuda.max_memory_allocated() - base_memory) / 2**30, 3),
        backend=getattr(optimizer, "backend", None),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", nargs="*", help="implementation names to run (default: all)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama1b",
                        help="llama1b: Llama-like shapes (--layers); embedding: one 128256x8192 "
                             "tensor; group: 24 tensors, 2.53e9 elements")
    parser.add_argument("--json", help="write the rows here (default: $OUT/bench_gpu_step.json)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu_step.py needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    shapes = llama_shapes(args.layers) if args.preset == "llama1b" else PRESETS[args.preset]()
    copy_gbs = copy_bandwidth_gbs()
    env = dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
        triton=getattr(importlib.import_module("triton"), "__version__", None)
        if importlib.util.find_spec("triton") else None,
        python=platform.python_version(), copy_gb_per_s=round(copy_gbs, 1), preset=args.preset,
    )
    print(f"{env['gpu']}: measured copy bandwidth {copy_gbs:.0f} GB/s; "
          f"torch {env['torch']}, triton {env['triton']}")
    rows = []
    for name, make in implementations().items():
        if args.only and name not in args.only:
            continue
        try:
            rows.append({**run(name, make, shapes, dtype, args.steps, copy_gbs), **env})
        except Exception as error:  # one broken peer must not hide the others' numbers
            rows.append({"impl": name, "error": f"{type(error).__name__}: {error}", **env})
        print(json.dumps(rows[-1]), flush=True)
    columns = ["impl", "ms_per_step", "gb_per_s", "pct_of_copy_bw", "launches_per_step",
               "h2d_copies_per_step", "state_bytes_per_param", "peak_extra_gib"]
    print("\n| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row.get(c, row.get("error", ""))) for c in columns) + " |")
    path = args.json
    if path is None and os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "bench_gpu_step.json")
    if path:
        with open(path, "w") as handle:
            json.dump(rows, handle, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
