"""Transient memory of one steady-state step on one big parameter: the profiler's allocation
peak above what was live before the step, against the size of fp32 AdamW's whole state.

    python benchmarks/bench_transient.py                      # one 49152 x 1024 embedding (50.3M)
    python benchmarks/bench_transient.py --rows 8192 --chunks 1048576 0

``--chunks`` lists values of ``chunks.CHUNK_ELEMENTS`` to compare (0: the whole parameter in
one call, unchunked). Prints a markdown table and writes JSON rows.
"""

import argparse
import pathlib
import sys
import time

import torch

from lowbit_optim import AdamW4bit, AdamW8bit, state_bytes
from lowbit_optim.bench import harness
from lowbit_optim.bench.profiling import allocation_peak_bytes
from lowbit_optim.step import chunks

OPTIMIZERS = {"ours_8bit": AdamW8bit, "ours_4bit": AdamW4bit}


def measure(name: str, rows: int, chunk: int, repeats: int) -> dict:
    chunks.CHUNK_ELEMENTS = chunk or 1 << 62
    embedding = torch.nn.Embedding(rows, 1024)
    numel = embedding.weight.numel()
    if name == "torch_fused":
        optimizer = torch.optim.AdamW(embedding.parameters(), fused=True)
    else:
        optimizer = OPTIMIZERS[name](embedding.parameters())
    embedding.weight.grad = torch.randn_like(embedding.weight)
    optimizer.step()  # creates the state and compiles
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
    peak = allocation_peak_bytes(optimizer.step)
    fp32_state = 8 * numel
    return {
        "optimizer": name, "numel": numel, "chunk_elements": chunk if name != "torch_fused" else None,
        "transient_mib": peak / 2**20, "state_mib": state_bytes(optimizer) / 2**20,
        "transient_vs_fp32_state": peak / fp32_state, "step_ms": harness.median_ms(seconds),
    }


COLUMNS = [
    harness.Column("optimizer", "optimizer"),
    harness.Column("chunk (elements)", "chunk_elements"),
    harness.Column("step temporaries MiB", "transient_mib", "{:.1f}"),
    harness.Column("/ fp32 AdamW state", "transient_vs_fp32_state", "{:.3f}"),
    harness.Column("state MiB", "state_mib", "{:.1f}"),
    harness.Column("step ms", "step_ms", "{:.0f}"),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=49152, help="embedding rows of 1024 (default 49152)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[chunks.CHUNK_ELEMENTS, 0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_out/bench_transient.json"))
    args = parser.parse_args(argv)
    if args.rows < 1 or any(chunk < 0 for chunk in args.chunks):
        parser.error(f"--rows must be >= 1 and --chunks >= 0, got {args.rows} and {args.chunks}")
    results = [measure("torch_fused", args.rows, 0, args.repeats)]
    for name in OPTIMIZERS:
        for chunk in args.chunks:
            print(f"{name} chunk={chunk} ...", file=sys.stderr, flush=True)
            results.append(measure(name, args.rows, chunk, args.repeats))
    env = harness.environment(torch.device("cpu"))
    harness.report(args.out, "transient", results, COLUMNS, env=env,
                   heading=f"one {args.rows} x 1024 fp32 parameter; {harness.machine_line(env)}",
                   config=vars(args) | {"out": str(args.out)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
