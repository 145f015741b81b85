"""CPU offload: host memory and host step time of ``CPUOffloadOptimizer`` with our low-bit
optimizers against the fp32 AdamW host step that torchao's offload runs.

Workload: the benchmark's ``gpu-114m`` ByteGPT (114M parameters, fp32) by default; each
optimizer trains it for a few steps in a fresh process (real forward/backward on a short
sequence, so the gradient hooks fire), and reports:

* tensor bytes it keeps on the host: the moments (``state_bytes``) and the host copies of the
  parameters and gradients (pinned on CUDA);
* process RSS growth from building the optimizer to the end of the run, both read with the
  device gradients allocated (on CPU the "device" model and its gradients are in the same
  process; they are not counted). It also holds what compiling our step keeps in memory;
* median ``step()`` time after the first steps (the first one compiles our step).

torchao's ``CPUOffloadOptimizer`` refuses to run without CUDA or XPU, so on a CPU machine its
host work is measured through ours: ``torch_adamw_offload`` is ``CPUOffloadOptimizer(params,
torch.optim.AdamW, fused=True)``, the same fused fp32 AdamW over host copies that torchao
steps (torchao keeps tensors under 4096 elements on the device; here they are a 0.2% share).
With CUDA, ``torchao_offload`` runs torchao's own wrapper too.

    python benchmarks/bench_offload.py                       # gpu-114m, CUDA if present
    python benchmarks/bench_offload.py --model-size medium --steps 5
"""

import argparse
import json
import os
import pathlib
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # runs from a plain checkout

from lowbit_optim import AdamW4bit, AdamW8bit, CPUOffloadOptimizer, state_bytes  # noqa: E402
from lowbit_optim.bench import harness  # noqa: E402
from lowbit_optim.bench.__main__ import PRESETS  # noqa: E402
from lowbit_optim.bench.model import ByteGPT  # noqa: E402

IMPLEMENTATIONS = {
    "lowbit_8bit_offload": ("lowbit_optim offload, AdamW8bit", None),
    "lowbit_4bit_offload": ("lowbit_optim offload, AdamW4bit", None),
    "torch_adamw_offload": ("lowbit_optim offload, torch AdamW fused (fp32, torchao's host step)", None),
    "torchao_offload": ("torchao CPUOffloadOptimizer, torch AdamW fused (fp32)", "torchao"),
}
SEQUENCE = 32  # tokens per step: enough for real gradients, short enough for a 2-core CPU


def build(name: str, params):
    if name == "torchao_offload":
        import torchao.optim

        return torchao.optim.CPUOffloadOptimizer(params, torch.optim.AdamW, fused=True, lr=1e-4)
    optimizer_class = {"lowbit_8bit_offload": AdamW8bit, "lowbit_4bit_offload": AdamW4bit,
                       "torch_adamw_offload": torch.optim.AdamW}[name]
    return CPUOffloadOptimizer(params, optimizer_class, lr=1e-4)


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def host_buffer_bytes(optimizer) -> int:
    """Host copies of the parameters and gradients (and staging buffers) the wrapper holds."""
    if isinstance(optimizer, CPUOffloadOptimizer):
        total = 0
        for item in optimizer._offloaded.values():
            total += item.host_param.nbytes + item.host_grad.nbytes
            total += item.staging.nbytes if item.staging is not None else 0
        return total
    return sum(2 * host.nbytes for host in optimizer.param_d2h_map.values())  # torchao


def measure(name: str, preset: str, steps: int, warmup: int, device: torch.device) -> dict:
    """Runs in the worker process."""
    import torch._inductor.config  # noqa: F401  (imported by every worker before the baseline)

    torch.manual_seed(0)
    model = ByteGPT(PRESETS[preset]["model"]).to(device)
    tokens = torch.randint(0, 256, (1, SEQUENCE + 1), device=device)

    def backward():
        model(tokens[:, :-1], tokens[:, 1:]).backward()

    backward()  # device gradients exist before the optimizer, as in training
    rss_before = rss_bytes()
    optimizer = build(name, model.parameters())
    seconds = []
    for step in range(warmup + steps):
        if step:
            backward()
        seconds.append(harness.timed(optimizer.step, device))
        optimizer.zero_grad()
    backward()  # device gradients back, as at the baseline: RSS growth is the optimizer's
    rss_after = rss_bytes()
    num_params = sum(p.numel() for p in model.parameters())
    if name == "torchao_offload":  # its host optimizers; small tensors' state stays on the GPU
        state = sum(state_bytes(inner) for inner in optimizer.optim_dict.values())
    else:
        state = state_bytes(optimizer)
    buffers = host_buffer_bytes(optimizer)
    return {
        "implementation": name,
        "label": IMPLEMENTATIONS[name][0],
        "params_m": num_params / 1e6,
        "state_mb": state / 2**20,
        "state_bytes_per_param": state / num_params,
        "host_buffers_mb": buffers / 2**20,
        "host_tensors_mb": (state + buffers) / 2**20,
        "rss_growth_mb": (rss_after - rss_before) / 2**20,
        "first_step_s": seconds[0],
        "step_ms": harness.median_ms(seconds[warmup:]),
        "device": str(device),
    }


COLUMNS = [
    harness.Column("implementation", "label"),
    harness.Column("state MB", "state_mb", "{:.0f}"),
    harness.Column("state B/param", "state_bytes_per_param", "{:.2f}"),
    harness.Column("host param+grad buffers MB", "host_buffers_mb", "{:.0f}"),
    harness.Column("host tensors MB", "host_tensors_mb", "{:.0f}"),
    harness.Column("RSS growth MB", "rss_growth_mb", "{:.0f}"),
    harness.Column("host step ms (median)", "step_ms", "{:.0f}"),
    harness.Column("first step s", "first_step_s", "{:.1f}"),
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-size", choices=sorted(PRESETS), default="gpu-114m")
    parser.add_argument("--steps", type=int, default=3, help="measured steps (default: 3)")
    parser.add_argument("--warmup", type=int, default=2, help="steps before measuring (default: 2)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS))
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_out/offload.json"))
    parser.add_argument("--worker", metavar="NAME", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.worker:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
        row = measure(args.worker, args.model_size, args.steps, args.warmup, device)
        print(json.dumps(row))
        return
    rows = []
    for name in args.implementations:
        package = IMPLEMENTATIONS[name][1]
        if name == "torchao_offload" and device.type != "cuda":
            print(f"skipping {name}: torchao's CPUOffloadOptimizer needs CUDA or XPU", file=sys.stderr)
            continue
        if package and harness.package_version(package) is None:
            print(f"skipping {name}: {package} is not installed", file=sys.stderr)
            continue
        worker_args = [name, "--model-size", args.model_size, "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--device", args.device]
        rows.append(harness.run_worker(__file__, worker_args, cold_cache=False))
    env = harness.environment(device)
    harness.report(args.out, "offload", rows, COLUMNS,
                   heading=f"### CPU offload, {args.model_size} ({harness.machine_line(env)})",
                   env=env, config=vars(args) | {"out": str(args.out), "sequence": SEQUENCE})


if __name__ == "__main__":
    main()
