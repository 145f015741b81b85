"""Quantization throughput: elements/s of blockwise quantize and dequantize, per format,
eager and compiled (``torch.compile``, as the optimizer step uses them).

    python benchmarks/bench_quant.py                  # 4M elements per format
    python benchmarks/bench_quant.py --numel 1048576 --formats dynamic8-signed

Prints a markdown table and writes JSON rows with versions and hardware.
"""

import argparse
import pathlib
import sys

import torch

from lowbit_optim.bench import harness
from lowbit_optim.formats.catalog import FORMATS, get_format


def throughput(fn, numel: int, repeats: int, device: torch.device) -> tuple[float, float]:
    """(first call seconds, elements per second of the median later call)."""
    first = harness.timed(fn, device)
    seconds = [harness.timed(fn, device) for _ in range(repeats)]
    return first, numel / (harness.median_ms(seconds) / 1e3)


def measure(fmt, numel: int, repeats: int, device: torch.device) -> list[dict]:
    block_size = fmt.default_block_size
    num_blocks = fmt.num_blocks(numel, block_size)
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(num_blocks, block_size, generator=generator).to(device)
    if fmt.codec.table.min() >= 0:  # second-moment formats store non-negative values
        values = values.square()
    codes, scales = fmt.quantize_blocks(values)
    implementations = {
        "eager": (fmt.quantize_blocks, fmt.dequantize_blocks),
        # dynamic=False with one fixed shape: the same static inner block dimension that the
        # optimizer's compiled step sees.
        "compiled": (torch.compile(fmt.quantize_blocks, dynamic=False),
                     torch.compile(fmt.dequantize_blocks, dynamic=False)),
    }
    rows = []
    for mode, (quantize, dequantize) in implementations.items():
        for op, fn in (("quantize", lambda q=quantize: q(values)),
                       ("dequantize", lambda d=dequantize: d(codes, scales))):
            first_s, rate = throughput(fn, num_blocks * block_size, repeats, device)
            rows.append({"format": fmt.name, "bits": fmt.bits, "block_size": block_size,
                         "op": op, "mode": mode, "numel": num_blocks * block_size,
                         "elements_per_s": rate, "gelem_per_s": rate / 1e9, "first_call_s": first_s})
    return rows


COLUMNS = [
    harness.Column("format", "format"),
    harness.Column("bits", "bits"),
    harness.Column("block", "block_size"),
    harness.Column("op", "op"),
    harness.Column("mode", "mode"),
    harness.Column("G elements/s", "gelem_per_s", "{:.3f}"),
    harness.Column("first call s", "first_call_s", "{:.2f}"),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--numel", type=int, default=1 << 22, help="elements per tensor (default 4M)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_out/bench_quant.json"))
    args = parser.parse_args(argv)
    if args.numel < 1:
        parser.error(f"--numel must be >= 1, got {args.numel}")
    device = torch.device(args.device)
    rows = []
    for name in args.formats:
        print(f"{name} ...", file=sys.stderr, flush=True)
        rows += measure(get_format(name), args.numel, args.repeats, device)
    env = harness.environment(device)
    harness.report(args.out, "quant", rows, COLUMNS, env=env,
                   heading=f"{args.numel / 1e6:.1f}M elements per tensor; {harness.machine_line(env)}",
                   config={"numel": args.numel, "repeats": args.repeats, "device": str(device)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
