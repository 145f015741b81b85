"""Static cost of every Triton kernel variant we ship, compiled for GPUs on any machine.

    python benchmarks/kernel_stats.py                       # sm_90 and sm_80, every variant
    python benchmarks/kernel_stats.py --arch 90 --defaults  # the optimizer's defaults only
    python benchmarks/kernel_stats.py --json kernel_stats.json
    python benchmarks/kernel_stats.py --rules lion ademamix   # the other update rules' variants

Run it with the checkout you mean to measure first on ``sys.path`` (``PYTHONPATH=.`` from the
repository root): ``python benchmarks/...`` puts ``benchmarks/`` there, not the checkout, so
otherwise the installed ``lowbit_optim`` is measured.

No GPU is needed: ``lowbit_optim.step.kernels.launcher.launch`` is driven with ``meta``
tensors (which the host code treats as a GPU device: GPU tile sizes, no interpreter paths),
its kernel launches are recorded instead of run, and each recorded launch is specialised
exactly as Triton's JIT would specialise it (its own binder: pointer dtypes, 16-byte
alignment of pointers, divisibility of integers, constexprs) and compiled with
``triton.compile`` for ``GPUTarget("cuda", arch, 32)``. The ``meta`` tensors' addresses are
0 plus their view offset, so an aligned group (every tensor 16-byte aligned) and an
unaligned one (a parameter one element into its storage) are both reproducible.

Per variant it reports, from the cubin (``cuobjdump -sass``, shipped in the Triton wheel):
SASS instructions (without NOP padding) per element, where elements per thread is the
program's tile (``ROWS * BLOCK_SIZE``) over its threads, which approximates instructions
executed per element for these loop-free kernels; global loads and stores split into
128-bit/64-bit (vector) and narrower (scalar) ones, and shared-memory loads; from the
metadata: registers, spills, shared memory; from the PTX: IEEE (``div.rn``, ``sqrt.rn``,
``rcp.rn``) against approximate (``div.full``/``div.approx``, ``sqrt.approx``, ``rsqrt``,
``rcp.approx``) division and square-root instructions.

Prints a markdown table; ``--json PATH`` writes a JSON list, one row per (variant, arch),
each with the toolchain (Triton, ptxas) and the machine.
"""

import argparse
import contextlib
import itertools
import json
import pathlib
import re
import subprocess
import sys
import tempfile

import torch

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature
except ImportError:  # pragma: no cover - the script needs Triton, the package does not
    sys.exit("kernel_stats.py needs Triton: pip install triton")

from lowbit_optim.bench import harness
from lowbit_optim.formats.catalog import get_format
from lowbit_optim.step.hyperparams import GroupScalars
from lowbit_optim.step.kernels import launcher
from lowbit_optim.step.rules.adamw import adamw_kernel_constants, adamw_kernel_update
from lowbit_optim.step.rules.ademamix import ADEMAMIX
from lowbit_optim.step.rules.lion import LION

BIN = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
KINDS = {  # state kind -> (exp_avg format, exp_avg_sq format, default block size)
    "8bit": ("dynamic8-signed", "dynamic8-unsigned-nonzero", 256),
    "4bit": ("dynamic4-signed", "linear4-nonzero", 128),
    "fp8": ("float8-e4m3", "float8-e4m3-nonzero", 256),
}
# The update rules' default hyperparameters (bitsandbytes'), for their kernel constants.
RULE_GROUPS = {
    "lion": (LION, dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0)),
    "ademamix": (ADEMAMIX, dict(lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, eps=1e-8, weight_decay=1e-2,
                                t_alpha=None, t_beta3=None)),
}
RULES = ("adamw", *RULE_GROUPS)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Two parameters per group: a tile-multiple one and one that ends in a partly masked tile.
# The unaligned variant's first parameter starts one element into its storage.
NUMELS = (1 << 20, 4112)


# --- recording launches --------------------------------------------------------------------
class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` is recorded."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.launches.append((self.kernel, grid, args, kwargs))
        return record


@contextlib.contextmanager
def recorded_launches():
    launches = []
    jitted = {name: value for name, value in vars(launcher).items() if isinstance(value, JITFunction)}
    for name, kernel in jitted.items():
        setattr(launcher, name, _Recorder(kernel, launches))
    try:
        yield launches
    finally:
        for name, kernel in jitted.items():
            setattr(launcher, name, kernel)


def _moment(fmt, numel, block_size, aligned):
    blocks = -(-numel // block_size)
    pad = 0 if aligned else 1
    codes = torch.empty(blocks * block_size // fmt.codes_per_byte + pad, dtype=torch.uint8, device="meta")
    scales = torch.empty(blocks + pad, dtype=torch.float32, device="meta")
    return codes[pad:].view(blocks, -1), scales[pad:]


def rule_launch(rule_name, exp_avg_format, exp_avg_sq_format, amsgrad):
    """(formats of the rule's moments, its ``KernelUpdate``, its constants at step 1)."""
    if rule_name == "adamw":
        formats = (exp_avg_format, exp_avg_sq_format, exp_avg_sq_format)[:3 if amsgrad else 2]
        return formats, launcher.KernelUpdate(adamw_kernel_update), adamw_kernel_constants(
            1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0)
    rule, group = RULE_GROUPS[rule_name]
    scalars = GroupScalars(rule)
    scalars.refresh(group)
    formats = tuple(exp_avg_format if spec.signed else exp_avg_sq_format for spec in rule.moments)
    constants = rule.kernel_constants(rule.step_constants(scalars, torch.tensor(1.0)))
    return formats, launcher.KernelUpdate(rule.kernel_update), constants


def variant_launches(kind, dtype, *, amsgrad, stochastic_round, aligned, master_weight_bits=None,
                     rule="adamw"):
    """What ``launch`` launches for a group of ``NUMELS`` parameters of this kind
    (``master_weight_bits``: with int8 or int16 weight corrections) and update rule (its signed
    moments in the kind's first format, the others in its second)."""
    exp_avg_name, exp_avg_sq_name, block_size = KINDS[kind]
    exp_avg_format, exp_avg_sq_format = get_format(exp_avg_name), get_format(exp_avg_sq_name)
    formats, update, constants = rule_launch(rule, exp_avg_format, exp_avg_sq_format, amsgrad)
    params, grads, moments, corrections = [], [], [[] for _ in formats], []
    correction_dtype = torch.int8 if master_weight_bits == 24 else torch.int16
    for index, numel in enumerate(NUMELS):
        # Only the first parameter is misaligned: the rest of the group is as usual.
        pad = 1 if not aligned and index == 0 else 0
        params.append(torch.empty(numel + pad, dtype=dtype, device="meta")[pad:])
        grads.append(torch.empty(numel + pad, dtype=dtype, device="meta")[pad:])
        corrections.append(torch.empty(numel + pad, dtype=correction_dtype, device="meta")[pad:])
        for moment, fmt in zip(moments, formats):
            moment.append(_moment(fmt, numel, block_size, aligned or index))
    with recorded_launches() as launches:
        launcher.launch(params, grads, moments, constants, update=update, formats=formats,
                        block_size=block_size, maximize=False, stochastic_round=stochastic_round, seed=1,
                        weight_corrections=corrections if master_weight_bits else None)
    return launches


# --- compiling -----------------------------------------------------------------------------
def compile_launch(kernel, args, kwargs, arch):
    """Specialise like ``JITFunction.run`` does, then compile for ``sm_{arch}``."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(kwargs, debug=False)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization,
                                                              options)
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options.__dict__), bound_args


def sass_of(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([str(BIN / "cuobjdump"), "-sass", file.name], check=True,
                              capture_output=True, text=True).stdout


_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def sass_opcodes(sass: str) -> list[str]:
    return [m.group(2) for m in map(_INSTRUCTION.search, sass.splitlines()) if m and m.group(2) != "NOP"]


def resource_usage(cubin: bytes) -> dict:
    """Registers and local memory per thread from ``cuobjdump -res-usage`` (Triton reads these
    from the driver when it loads a kernel, which needs a GPU)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        out = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", file.name], check=True,
                             capture_output=True, text=True).stdout
    usage = dict(re.findall(r"(REG|LOCAL|STACK):(\d+)", out))
    # Triton's n_spills is the driver's local memory size per thread in 4-byte words; spilled
    # registers live in the stack frame (STACK), as this kernel has no local arrays.
    local_bytes = int(usage["LOCAL"]) + int(usage["STACK"])
    return {"registers": int(usage["REG"]), "spills": local_bytes // 4, "stack_bytes": int(usage["STACK"])}


def _memory_ops(opcodes, prefix):
    """(vector: 64/128-bit, scalar: 32-bit or narrower) counts of opcodes ``prefix...``."""
    ops = [op for op in opcodes if op.split(".")[0] == prefix]
    vector = sum(1 for op in ops if ".64" in op or ".128" in op)
    return vector, len(ops) - vector


def ptx_math(ptx: str) -> dict:
    count = lambda pattern: len(re.findall(pattern, ptx))  # noqa: E731
    return {
        "ieee_div_sqrt": count(r"\b(div\.rn|sqrt\.rn|rcp\.rn)\.f32"),
        "approx_div_sqrt": count(
            r"\b(div\.full|div\.approx|sqrt\.approx|rsqrt\.approx|rcp\.approx|ex2\.approx|lg2\.approx)(\.ftz)?\.f32"),
    }


def ptxas_version() -> str:
    out = subprocess.run([str(BIN / "ptxas"), "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release ([\d.]+), V([\d.]+)", out)
    return found.group(2) if found else out.strip().splitlines()[-1]


def measure(kind, dtype_name, *, amsgrad, stochastic_round, aligned, archs,
            master_weight_bits=None, rule="adamw") -> list[dict]:
    launches = variant_launches(kind, DTYPES[dtype_name], amsgrad=amsgrad, stochastic_round=stochastic_round,
                                aligned=aligned, master_weight_bits=master_weight_bits, rule=rule)
    # AdamW's variants keep their names; the other rules' carry theirs in front.
    name = ("" if rule == "adamw" else f"{rule}-") + f"{kind}-{dtype_name}"
    name += "-sr" if stochastic_round else ""
    name += (f"-mw{master_weight_bits}" if master_weight_bits else "") + ("-amsgrad" if amsgrad else "")
    name += "" if aligned else "-unaligned"
    default = aligned and not amsgrad and not stochastic_round and not master_weight_bits
    rows = []
    seen = set()
    for arch in archs:
        for kernel, _grid, args, kwargs in launches:
            if kwargs.get("ALIGNED", aligned) != aligned:
                continue  # the aligned rest of a group that holds one misaligned tensor
            compiled, bound = compile_launch(kernel, args, kwargs, arch)
            key = (arch, compiled.hash)
            if key in seen:  # a group split into launches of one compiled kernel
                continue
            seen.add(key)
            metadata = compiled.metadata
            opcodes = sass_opcodes(sass_of(compiled.asm["cubin"]))
            threads = metadata.num_warps * 32
            elements = bound["ROWS"] * bound["BLOCK_SIZE"]
            per_thread = elements / threads
            loads, stores = _memory_ops(opcodes, "LDG"), _memory_ops(opcodes, "STG")
            rows.append({
                "variant": name, "rule": rule,
                "default": default, "arch": f"sm_{arch}", "kind": kind, "param_dtype": dtype_name,
                "amsgrad": amsgrad, "stochastic_round": stochastic_round, "aligned": aligned,
                "master_weight_bits": master_weight_bits,
                "kernel": kernel.__name__, "block_size": bound["BLOCK_SIZE"],
                "elements_per_program": elements,
                "num_warps": metadata.num_warps, "sass_instructions": len(opcodes),
                "sass_instructions_per_element": round(len(opcodes) / per_thread, 1),
                **resource_usage(compiled.asm["cubin"]), "shared_bytes": metadata.shared,
                "local_memory_instructions": sum(1 for op in opcodes if op.startswith(("LDL", "STL"))),
                "global_loads_vector": loads[0], "global_loads_scalar": loads[1],
                "global_stores_vector": stores[0], "global_stores_scalar": stores[1],
                "shared_loads": sum(1 for op in opcodes if op.startswith("LDS")),
                **ptx_math(compiled.asm["ptx"]),
            })
    return rows


COLUMNS = [
    harness.Column("variant", "variant"),
    harness.Column("default", "default", "{}"),
    harness.Column("arch", "arch"),
    harness.Column("SASS/elem", "sass_instructions_per_element", "{:.1f}"),
    harness.Column("regs", "registers"),
    harness.Column("spills", "spills"),
    harness.Column("smem B", "shared_bytes"),
    harness.Column("LDG vec/scalar", "loads"),
    harness.Column("STG vec/scalar", "stores"),
    harness.Column("LDS", "shared_loads"),
    harness.Column("div/sqrt IEEE/approx", "div_sqrt"),
]


def variants(defaults_only: bool, kinds, rules=("adamw",)):
    for rule, kind, dtype_name, amsgrad, stochastic_round, master_weight_bits, aligned in itertools.product(
            rules, kinds, DTYPES, (False, True), (False, True), (None, 24, 32), (True, False)):
        if amsgrad and rule != "adamw":
            continue  # amsgrad is AdamW's
        if stochastic_round and dtype_name != "bf16":
            continue  # stochastic rounding applies to bfloat16 parameters only
        if master_weight_bits and dtype_name == "fp32":
            continue  # float32 parameters are their own master weights
        if stochastic_round and master_weight_bits:
            continue  # refused: the master weight keeps what rounding loses
        if defaults_only and (amsgrad or stochastic_round or master_weight_bits or not aligned):
            continue
        yield kind, dtype_name, dict(amsgrad=amsgrad, stochastic_round=stochastic_round, aligned=aligned,
                                     master_weight_bits=master_weight_bits, rule=rule)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80], help="compute capabilities")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--rules", nargs="+", default=["adamw"], choices=list(RULES),
                        help="update rules (adamw: AdamW and Adam, the default)")
    parser.add_argument("--defaults", action="store_true", help="only the variants of default arguments")
    parser.add_argument("--json", type=pathlib.Path, help="write the rows here as a JSON list")
    args = parser.parse_args(argv)

    env = harness.environment()
    toolchain = {"triton": triton.__version__, "ptxas": ptxas_version()}
    rows = []
    for kind, dtype_name, flags in variants(args.defaults, args.kinds, args.rules):
        for row in measure(kind, dtype_name, archs=args.arch, **flags):
            rows.append({**row, **toolchain, "machine": harness.machine_line(env), "torch": env["torch"]})
            print(f"{row['variant']:>32} {row['arch']}: "
                  f"{row['sass_instructions_per_element']:6.1f} SASS/elem, "
                  f"{row['registers']} regs, {row['spills']} spills", file=sys.stderr, flush=True)
    rows.sort(key=lambda r: (not r["default"], r["arch"] != "sm_90", r["variant"]))
    shown = [{**r, "loads": f"{r['global_loads_vector']}/{r['global_loads_scalar']}",
              "stores": f"{r['global_stores_vector']}/{r['global_stores_scalar']}",
              "div_sqrt": f"{r['ieee_div_sqrt']}/{r['approx_div_sqrt']}"} for r in rows]
    print(f"## Triton kernel static cost (Triton {toolchain['triton']}, ptxas {toolchain['ptxas']}, "
          f"num_warps {rows[0]['num_warps'] if rows else '-'})\n")
    print(harness.markdown_table(shown, COLUMNS))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
