"""Everything a lent GPU should answer, in one run: checks, their status, one summary.

    OUT=/some/dir python benchmarks/gpu_check.py          # or: bash benchmarks/gpu_check.sh

Each check runs as a subprocess with its own time limit; its output goes to one log, its
JSON into one summary. Under ``$OUT`` (default ``bench_out/gpu_check``) it writes exactly
three files, so the device tool's file limit is never reached: ``gpu_check.json`` (every
check's status, seconds, and the JSON rows it produced), ``gpu_check.md`` (the table) and
``gpu_check.log`` (all output).

A status is one of ``passed``, ``failed``, ``timeout``, ``skipped (no CUDA)`` and
``skipped (missing NAME)``: a missing optional package (torchao, bitsandbytes, ...) or a
missing GPU never reads as a failed check. Without CUDA only the CPU-side checks run (the
kernels' static statistics), the summary says so, and the exit status is 0. The exit status
is 1 exactly when a check that ran failed or timed out.
"""

import argparse
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parent.parent
OPTIONAL = ("triton", "transformers", "accelerate", "torchao", "bitsandbytes", "hypothesis", "matplotlib")


@dataclass
class Check:
    name: str
    what: str
    command: list[str]
    timeout_s: int
    needs_cuda: bool = True
    needs: tuple[str, ...] = ()
    json_files: list[str] = field(default_factory=list)  # relative to the check's scratch dir


def checks(scratch: pathlib.Path, steps_114m: int) -> list[Check]:
    python = sys.executable
    bench_step = "benchmarks/bench_gpu_step.py"
    found = [
        Check("kernel_stats", "registers, spills, SASS instructions per element of every kernel "
              "variant (sm_90, sm_80; compiled on this machine's CPU)",
              [python, "benchmarks/kernel_stats.py", "--json", str(scratch / "kernel_stats.json")],
              300, needs_cuda=False, needs=("triton",), json_files=["kernel_stats.json"]),
        Check("cuda_tests", "pytest -m cuda: the kernels against the CPU reference, graphs, offload",
              [python, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"], 300),
    ]
    for preset, dtype in (("embedding", "float32"), ("embedding", "bfloat16"),
                          ("group", "float32"), ("group", "bfloat16"), ("llama1b", "float32")):
        name = f"step_{preset}_{dtype}"
        found.append(Check(
            name, f"optimizer step GB/s vs device copy and torch fused ({preset}, {dtype} params)",
            [python, bench_step, "--preset", preset, "--dtype", dtype, "--steps", "5",
             "--only", "torch_fused", "lowbit_triton_8bit", "lowbit_triton_4bit",
             "--json", str(scratch / f"{name}.json")],
            240, json_files=[f"{name}.json"]))
    if shutil.which("ncu"):
        found.append(Check(
            "ncu", "one kernel launch under Nsight Compute: instructions, occupancy, sectors/request",
            ["ncu", "--kernel-name", "regex:lowbit_step_kernel", "--launch-skip", "2", "--launch-count", "1",
             "--metrics", "smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,"
             "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
             python, bench_step, "--preset", "embedding", "--steps", "1", "--only", "lowbit_triton_4bit"],
            240))
    found += [
        Check("train_gpu114m", f"the main benchmark's gpu-114m preset, {steps_114m} steps: peak memory, loss",
              [python, "-m", "lowbit_optim.bench", "--model-size", "gpu-114m", "--device", "cuda",
               "--steps", str(steps_114m), "--out", str(scratch / "train")],
              300, json_files=["train/results.json"]),
        Check("offload", "CPUOffloadOptimizer: GPU memory saved, step time, copy/compute overlap",
              [python, "benchmarks/gpu_offload_check.py", "--out", str(scratch / "offload")],
              240, json_files=["offload/gpu_offload_check.json"]),
    ]
    return found


def cuda_device() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def run_check(check: Check, scratch: pathlib.Path, log, device: str | None) -> dict:
    missing = [name for name in check.needs if importlib.util.find_spec(name) is None]
    missing += [arg for arg in check.command if arg.startswith("benchmarks/") and not (ROOT / arg).exists()]
    row = {"check": check.name, "what": check.what, "command": " ".join(check.command)}
    if check.needs_cuda and device is None:
        return {**row, "status": "skipped (no CUDA)"}
    if missing:
        return {**row, "status": f"skipped (missing {', '.join(missing)})"}
    log.write(f"\n===== {check.name}: {row['command']}\n")
    log.flush()
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    start = time.perf_counter()
    try:
        done = subprocess.run(check.command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=check.timeout_s)
        status = "passed" if done.returncode == 0 else f"failed (exit {done.returncode})"
    except subprocess.TimeoutExpired:
        status = f"timeout ({check.timeout_s} s)"
    row.update(status=status, seconds=round(time.perf_counter() - start, 1))
    results = {}
    for relative in check.json_files:
        path = scratch / relative
        if path.exists():
            results[relative] = json.loads(path.read_text())
    if results:
        row["results"] = results
    return row


def markdown(rows: list[dict], header: dict) -> str:
    lines = [f"# GPU check: {header['device'] or 'no CUDA device (CPU-side checks only)'}", "",
             f"torch {header['torch']}, triton {header.get('triton')}; optional packages missing: "
             f"{', '.join(header['missing_optional']) or 'none'}", "",
             "| check | status | seconds | what |", "|---|---|---|---|"]
    lines += [f"| {r['check']} | {r['status']} | {r.get('seconds', '-')} | {r['what']} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path,
                        default=pathlib.Path(os.environ.get("OUT") or ROOT / "bench_out" / "gpu_check"))
    parser.add_argument("--steps-114m", type=int, default=int(os.environ.get("GPU_BENCH_STEPS", 100)))
    parser.add_argument("--only", nargs="*", help="names of the checks to run (default: all)")
    args = parser.parse_args(argv)
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    device = cuda_device()
    triton = importlib.util.find_spec("triton")
    header = {
        "device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": importlib.import_module("triton").__version__ if triton else None,
        "missing_optional": [name for name in OPTIONAL if importlib.util.find_spec(name) is None],
    }
    if device is None:
        print("gpu_check: no CUDA device here; running the CPU-side checks only", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch_dir, \
            open(args.out / "gpu_check.log", "w") as log:
        scratch = pathlib.Path(scratch_dir)
        for check in checks(scratch, args.steps_114m):
            if args.only and check.name not in args.only:
                continue
            rows.append(run_check(check, scratch, log, device))
            print(f"{check.name}: {rows[-1]['status']}", flush=True)
    (args.out / "gpu_check.json").write_text(json.dumps({**header, "checks": rows}, indent=1, default=str))
    table = markdown(rows, header)
    (args.out / "gpu_check.md").write_text(table)
    print("\n" + table + f"\nwrote {args.out}/gpu_check.{{json,md,log}}")
    return int(any(row["status"].startswith(("failed", "timeout")) for row in rows))


if __name__ == "__main__":
    sys.exit(main())
