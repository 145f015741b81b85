"""What every benchmark shares: optimizers by name, timing, compile counting, the machine and
versions recorded with each result, JSON rows and markdown tables.

Used by ``python -m lowbit_optim.bench`` and the micro-benchmarks in ``benchmarks/``.
"""

import datetime
import functools
import importlib.metadata
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters

from lowbit_optim.bench.torch_muon import TorchMuonWithAdamW
from lowbit_optim.formats.catalog import DYNAMIC_8BIT_UNSIGNED, DYNAMIC_8BIT_UNSIGNED_EDGES_KEPT
from lowbit_optim.optim import (
    AdamW4bit,
    AdamW8bit,
    AdamWFactored4bit,
    AdamWFp8,
    AdEMAMix4bit,
    AdEMAMix8bit,
    Lion4bit,
    Lion8bit,
    Muon4bit,
    Muon8bit,
    muon_param_groups,
)


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    label: str  # what the tables and plots call it
    package: str | None  # the distribution it needs beyond torch and lowbit_optim
    build: Callable  # build(params, **hyperparameters) -> torch.optim.Optimizer
    # The run whose loss it is also compared with, seed by seed: for another update rule
    # than AdamW, the rule in fp32 (the gap to fp32 AdamW would mix the rule's own merit in);
    # for a bfloat16 row, the same optimizer with float32 parameters.
    reference: str | None = None
    # The parameters' dtype this row always trains in; None: the run's ``--param-dtype``.
    param_dtype: str | None = None
    # ``build`` takes the model itself, not its parameters: Muon splits it by module (hidden
    # matrices to Muon; embeddings, head, norms and biases to AdamW).
    takes_module: bool = False


def _torchao(class_name: str):
    def build(params, **hyper):
        import torchao.optim

        return getattr(torchao.optim, class_name)(params, **hyper)
    return build


def _bnb(class_name: str, **fixed):
    def build(params, **hyper):
        import bitsandbytes.optim

        return getattr(bitsandbytes.optim, class_name)(params, **fixed, **hyper)
    return build


# Lion takes the run's AdamW hyperparameters adapted as its paper advises: a 3x smaller LR and
# a 3x larger weight decay (the decay per step, lr * weight_decay, stays AdamW's), and its own
# betas. AdEMAMix takes AdamW's betas and learning rate, and bitsandbytes' beta3 and alpha.
def _as_lion(build):
    def adapted(params, *, lr, betas, weight_decay):
        return build(params, lr=lr / 3, betas=(0.9, 0.99), weight_decay=weight_decay * 3)
    return adapted


def _as_ademamix(build):
    def adapted(params, *, lr, betas, weight_decay):
        return build(params, lr=lr, betas=(*betas, 0.9999), weight_decay=weight_decay)
    return adapted


_RULE_ROWS = (
    # name, label, package, build, reference
    ("bnb_lion_32bit", "bitsandbytes Lion (fp32)", "bitsandbytes", _as_lion(_bnb("Lion")), None),
    ("lowbit_lion_8bit", "lowbit_optim Lion8bit", None, _as_lion(Lion8bit), "bnb_lion_32bit"),
    ("lowbit_lion_4bit", "lowbit_optim Lion4bit", None, _as_lion(Lion4bit), "bnb_lion_32bit"),
    ("bnb_lion_8bit", "bitsandbytes Lion8bit", "bitsandbytes", _as_lion(_bnb("Lion8bit")), "bnb_lion_32bit"),
    ("bnb_ademamix_32bit", "bitsandbytes AdEMAMix (fp32)", "bitsandbytes", _as_ademamix(_bnb("AdEMAMix")),
     None),
    ("lowbit_ademamix_8bit", "lowbit_optim AdEMAMix8bit", None, _as_ademamix(AdEMAMix8bit),
     "bnb_ademamix_32bit"),
    ("lowbit_ademamix_4bit", "lowbit_optim AdEMAMix4bit", None, _as_ademamix(AdEMAMix4bit),
     "bnb_ademamix_32bit"),
    ("bnb_ademamix_8bit", "bitsandbytes AdEMAMix8bit", "bitsandbytes", _as_ademamix(_bnb("AdEMAMix8bit")),
     "bnb_ademamix_32bit"),
)


# The rules' compiled step on purpose (on CPU their default is the C++ kernel where it builds).
_RULE_COMPILE_ROWS = tuple(
    OptimizerSpec(f"lowbit_{rule}_{bits}_compile", f"lowbit_optim {cls.__name__} (backend='compile')", None,
                  adapt(functools.partial(cls, backend="compile")))
    for rule, adapt, classes in (("lion", _as_lion, (Lion8bit, Lion4bit)),
                                 ("ademamix", _as_ademamix, (AdEMAMix8bit, AdEMAMix4bit)))
    for bits, cls in zip(("8bit", "4bit"), classes)
)


# bfloat16 parameters, four ways to write the update into them: plain rounding (what a model
# cast to bf16 gets), stochastic rounding, and 24- and 32-bit master weights (an int8 or int16
# correction in the optimizer state). Each is compared with the same optimizer on float32
# parameters (the run's ``--param-dtype`` left at float32).
_BFLOAT16_WRITES = (
    # suffix, label, optimizer arguments
    ("bf16", "bf16 weights, rounded", {}),
    ("bf16_sr", "bf16 weights, stochastic rounding", {"bf16_stochastic_round": True}),
    ("mw24", "bf16 weights + 24-bit master", {"master_weight_bits": 24}),
    ("mw32", "bf16 weights + 32-bit master", {"master_weight_bits": 32}),
)
_BFLOAT16_ROWS = tuple(
    OptimizerSpec(f"{name}_{suffix}", f"{label}, {how}", None, functools.partial(cls, **arguments),
                  reference=name, param_dtype="bfloat16")
    for name, label, cls in (("lowbit_8bit", "lowbit_optim AdamW8bit", AdamW8bit),
                             ("lowbit_4bit", "lowbit_optim AdamW4bit", AdamW4bit),
                             ("lowbit_4bit_factored", "lowbit_optim AdamWFactored4bit", AdamWFactored4bit))
    for suffix, how, arguments in _BFLOAT16_WRITES
)


# Muon rows: the run's one LR for both parts, Muon's scaled by "match_rms_adamw" (its update's
# RMS then matches AdamW's, so AdamW's LR suits it: arXiv 2502.16982), the run's betas and
# weight decay for the AdamW part. "muon" is torch's Muon and fp32 AdamW on the same split.
MUON_ADJUST_LR_FN = "match_rms_adamw"


def _torch_muon(model, *, lr, betas, weight_decay):
    groups = muon_param_groups(model)
    return TorchMuonWithAdamW([p for g in groups if g["use_muon"] for p in g["params"]],
                              [p for g in groups if not g["use_muon"] for p in g["params"]],
                              lr=lr, betas=betas, weight_decay=weight_decay, adjust_lr_fn=MUON_ADJUST_LR_FN)


def _lowbit_muon(cls):
    def build(model, *, lr, betas, weight_decay):
        return cls(model, lr=lr, weight_decay=weight_decay, adjust_lr_fn=MUON_ADJUST_LR_FN, adamw_betas=betas)
    return build


_MUON_ROWS = (
    OptimizerSpec("muon", "torch Muon + AdamW (fp32)", None, _torch_muon, takes_module=True),
    OptimizerSpec("muon8bit", "lowbit_optim Muon8bit", None, _lowbit_muon(Muon8bit), reference="muon",
                  takes_module=True),
    OptimizerSpec("muon4bit", "lowbit_optim Muon4bit", None, _lowbit_muon(Muon4bit), reference="muon",
                  takes_module=True),
)


class _ZeroMapAdamW8bit(AdamW8bit):
    """Ablation: AdamW8bit with bitsandbytes' plain unsigned second-moment map, whose code 0
    is 0 (the zero-point hazard that ``AdamW8bit``'s zero-free map removes)."""

    exp_avg_sq_format = DYNAMIC_8BIT_UNSIGNED


class _EdgesKeptAdamW8bit(AdamW8bit):
    """Ablation: the plain map's bin edges and codes, code 0 read as half the smallest
    positive value instead of 0 (``AdamW8bit`` also moves the first edge to 3/4 of it)."""

    exp_avg_sq_format = DYNAMIC_8BIT_UNSIGNED_EDGES_KEPT


OPTIMIZERS = {
    spec.name: spec
    for spec in (
        OptimizerSpec("torch_adamw", "torch AdamW fused (fp32)", None,
                      lambda params, **hyper: torch.optim.AdamW(params, fused=True, **hyper)),
        OptimizerSpec("torch_adamw_foreach", "torch AdamW foreach (fp32)", None,
                      lambda params, **hyper: torch.optim.AdamW(params, foreach=True, **hyper)),
        OptimizerSpec("lowbit_8bit", "lowbit_optim AdamW8bit", None, AdamW8bit),
        OptimizerSpec("lowbit_8bit_zero_map", "AdamW8bit, v map with a zero code (ablation)", None,
                      _ZeroMapAdamW8bit),
        OptimizerSpec("lowbit_8bit_edges_kept", "AdamW8bit, v map edges kept (ablation)", None,
                      _EdgesKeptAdamW8bit),
        OptimizerSpec("lowbit_4bit", "lowbit_optim AdamW4bit", None, AdamW4bit),
        OptimizerSpec("lowbit_fp8", "lowbit_optim AdamWFp8", None, AdamWFp8),
        OptimizerSpec("lowbit_4bit_factored", "lowbit_optim AdamWFactored4bit", None, AdamWFactored4bit),
        *_BFLOAT16_ROWS,
        # The compiled step on purpose (on CPU the default is the C++ kernel where it builds).
        OptimizerSpec("lowbit_8bit_compile", "lowbit_optim AdamW8bit (backend='compile')", None,
                      lambda params, **hyper: AdamW8bit(params, backend="compile", **hyper)),
        OptimizerSpec("lowbit_4bit_compile", "lowbit_optim AdamW4bit (backend='compile')", None,
                      lambda params, **hyper: AdamW4bit(params, backend="compile", **hyper)),
        OptimizerSpec("lowbit_fp8_compile", "lowbit_optim AdamWFp8 (backend='compile')", None,
                      lambda params, **hyper: AdamWFp8(params, backend="compile", **hyper)),
        OptimizerSpec("lowbit_4bit_factored_compile", "lowbit_optim AdamWFactored4bit (backend='compile')",
                      None, lambda params, **hyper: AdamWFactored4bit(params, backend="compile", **hyper)),
        OptimizerSpec("torchao_8bit", "torchao AdamW8bit", "torchao", _torchao("AdamW8bit")),
        OptimizerSpec("torchao_4bit", "torchao AdamW4bit", "torchao", _torchao("AdamW4bit")),
        OptimizerSpec("torchao_fp8", "torchao AdamWFp8", "torchao", _torchao("AdamWFp8")),
        OptimizerSpec("bnb_8bit", "bitsandbytes AdamW8bit", "bitsandbytes", _bnb("AdamW8bit")),
        *(OptimizerSpec(*row) for row in _RULE_ROWS),
        *_RULE_COMPILE_ROWS,
        *_MUON_ROWS,
    )
}
# ``--optimizers rules``: Lion and AdEMAMix, ours and bitsandbytes', each with its fp32 reference.
RULES = tuple(row[0] for row in _RULE_ROWS)
# ``--optimizers precision``: fp32 AdamW, AdamW8bit and AdamW4bit on float32 parameters, and
# the two low-bit ones on bfloat16 parameters written each of the four ways.
PRECISION = ("torch_adamw", "lowbit_8bit", "lowbit_4bit",
             *(f"{name}_{suffix}" for name in ("lowbit_8bit", "lowbit_4bit")
               for suffix, _, _ in _BFLOAT16_WRITES))
PEERS = ("torchao_8bit", "torchao_4bit", "torchao_fp8", "bnb_8bit")


def package_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def is_available(name: str) -> bool:
    package = OPTIMIZERS[name].package
    return package is None or package_version(package) is not None


def resolve_optimizers(names: Iterable[str], *, all_names: Iterable[str]) -> tuple[list[str], list[str]]:
    """Expand ``"all"``/``"peers"``, check names; returns (runnable, skipped as not installed).

    Peers named explicitly but not installed are skipped with a note, not an error, so one
    command line works on every machine.
    """
    expanded: list[str] = []
    for name in names:
        groups = {"all": list(all_names), "peers": list(PEERS), "rules": list(RULES),
                  "precision": list(PRECISION)}
        group = groups.get(name, [name])
        for item in group:
            if item not in OPTIMIZERS:
                raise ValueError(f"Unknown optimizer {item!r}; choose from {sorted(OPTIMIZERS)}, "
                                 "'peers', 'rules', 'precision' or 'all'")
            if item not in expanded:
                expanded.append(item)
    runnable = [name for name in expanded if is_available(name)]
    skipped = [name for name in expanded if name not in runnable]
    return runnable, skipped


def make_optimizer(name: str, params, **hyper) -> torch.optim.Optimizer:
    if name not in OPTIMIZERS:
        raise ValueError(f"Unknown optimizer {name!r}; choose from {sorted(OPTIMIZERS)}")
    return OPTIMIZERS[name].build(params, **hyper)


# --- timing and compile counting --------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable, device: torch.device) -> float:
    """Seconds ``fn()`` takes, device work included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def alternated_seconds(functions: dict, *, rounds: int, calls: int, before_turn=None) -> dict:
    """Seconds per call of each of ``functions`` (CPU work), the functions taking turns: each
    called ``calls`` times in a row, round after round, so that a slow minute of a shared host
    slows all of them alike. One list of ``rounds`` per-call times per key. ``before_turn(key)``,
    if given, runs untimed before each turn (setting the thread count that key is timed at)."""
    seconds = {key: [] for key in functions}
    for _ in range(rounds):
        for key, fn in functions.items():
            if before_turn is not None:
                before_turn(key)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            seconds[key].append((time.perf_counter() - start) / calls)
    return seconds


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (first compiles and recompiles)."""
    return counters["stats"].get("unique_graphs", 0)


def median_ms(seconds: list[float]) -> float:
    return 1e3 * statistics.median(seconds) if seconds else float("nan")


# --- the machine ------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device | None = None) -> dict:
    """Versions and hardware, recorded with every result."""
    env = {
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # Other work on the machine slows every timing; the 1-minute load average says how much.
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "versions": {
            name: package_version(name)
            for name in ("lowbit-optim", "torchao", "bitsandbytes", "triton", "numpy")
        },
        "cuda": torch.version.cuda,
    }
    if device is not None:
        env["device"] = str(device)
        if device.type == "cuda":
            env["gpu"] = torch.cuda.get_device_name(device)
    return env


def machine_line(env: dict) -> str:
    where = env.get("gpu") or f"{env['cpu_count']}-core CPU ({env['cpu']})"
    return f"{where}, torch {env['torch']}, {env['torch_threads']} threads"


# --- output -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Column:
    header: str
    key: str
    fmt: str = "{}"

    def render(self, row: dict) -> str:
        value = row.get(self.key)
        if value is None or (isinstance(value, float) and value != value):
            return "-"
        return self.fmt.format(value)


def markdown_table(rows: list[dict], columns: list[Column]) -> str:
    lines = [
        "| " + " | ".join(c.header for c in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    lines += ["| " + " | ".join(c.render(row) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: pathlib.Path, benchmark: str, rows: list[dict], *, env: dict, config: dict) -> None:
    """One JSON file: ``{"benchmark", "environment", "config", "rows"}``; every row also names
    the machine and torch version, so rows copied elsewhere stay attributable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stamped = [{**row, "machine": machine_line(env), "torch": env["torch"]} for row in rows]
    payload = {"benchmark": benchmark, "environment": env, "config": config, "rows": stamped}
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def report(path: pathlib.Path, benchmark: str, rows: list[dict], columns: list[Column], *,
           heading: str, env: dict, config: dict) -> None:
    """What a micro-benchmark ends with: the JSON file, then a heading and the markdown table."""
    write_json(path, benchmark, rows, env=env, config=config)
    print(f"{heading}\n")
    print(markdown_table(rows, columns))
    print(f"\nwrote {path}")


def run_worker(script: str, worker_args: list[str], *, cold_cache: bool) -> dict:
    """Run ``script --worker ...`` in a fresh process and return the JSON row it prints last.

    A fresh process per measurement keeps compile caches, allocator state and imported peers
    from leaking between optimizers; ``cold_cache`` also gives it an empty Inductor cache, so
    first-step times include compilation.
    """
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="lowbit_bench_inductor_") as cache:
        if cold_cache:
            env["TORCHINDUCTOR_CACHE_DIR"] = cache
        done = subprocess.run([sys.executable, script, "--worker", *worker_args], env=env,
                              capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(worker_args)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
