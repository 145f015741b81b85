"""The one-pass CPU step: a C++ kernel, built on first use, behind ``lowbit_optim::cpu_rule_step``.

For each block of a parameter it loads the parameter, gradient, codes and scales, decodes,
updates (the rule's functor, ``csrc/rules/<name>.h``: AdamW's ``step.math.adamw_update``,
Lion's and AdEMAMix's ``update``), takes the block's absmax and encodes, with nothing of the
parameter's size written in between (``csrc/cpu_step_kernel.h``); AVX-512, AVX2 and a
portable path are chosen at run time, threaded over blocks with ``at::parallel_for``. The
compiled step keeps several passes and float32 buffers between them (docs/design.md), which
is what this replaces for CPU parameters.

No compiler runs at ``pip install``: the sources are built by
``torch.utils.cpp_extension.load`` the first time a step needs them, into a directory named
after a hash of the sources (so each version is built once per machine and reused by every
later process), and a machine that cannot build them gets one warning and the compiled step.
docs/cpu_kernel.md has the build times, the formats covered and the numerics contract.
"""

import functools
import hashlib
import operator
import os
import pathlib
import struct
import sys
import warnings
from typing import NamedTuple

import torch

from lowbit_optim.formats import cell_tables, codecs
from lowbit_optim.formats.catalog import QuantFormat

SOURCE_DIR = pathlib.Path(__file__).parent / "csrc"
SOURCES = ("cpu_step_op.cpp", "cpu_step_avx512.cpp", "cpu_step_avx2.cpp", "cpu_step_scalar.cpp")
HEADERS = ("cpu_step_args.h", "constant_divisor.h", "cpu_step_vector_ops.h", "cpu_step_kernel.h",
           "factored_statistics.h", "rules/adamw.h", "rules/adamw_factored.h", "rules/lion.h",
           "rules/ademamix.h", "rules/muon.h")
# -ffp-contract=off: no multiply-add may be fused, so every path rounds exactly where the
# reference (eager PyTorch, which never fuses) rounds.
# -fopenmp: with torch's OpenMP build, ``at::parallel_for`` is a header-inline
# ``#pragma omp parallel`` compiled into this library; without the flag it silently runs on
# one thread (measured: 2 threads took as long as 1).
CFLAGS = ["-O3", "-ffp-contract=off", "-std=c++17", "-fopenmp"]
LDFLAGS = ["-fopenmp"]

# Instruction-set paths by the names the operators take (cpu_step_op.cpp's kIsas);
# LOWBIT_OPTIM_CPU_ISA forces one.
ISAS = ("scalar", "avx2", "avx512")
ISA_ENV = "LOWBIT_OPTIM_CPU_ISA"
MAX_BLOCK_SIZE = 2048

# The kernel's names of cell_tables' ways to read signs (cpu_step_op.cpp's kCellSignNames).
_CELL_SIGN_NAMES = {cell_tables.CLAMPED: "clamped", cell_tables.ABS: "abs", cell_tables.SIGNED: "signed"}
# cpu_step_kernel.h's cell layout constants are these.
if (cell_tables.INDEX_BITS, cell_tables.FLOOR_BINADE, cell_tables.SIGNED_POSITIVE_START) != (7, -23, 1 << 15):
    raise ImportError("lowbit_optim.formats.cell_tables' layout changed: "
                      "update csrc/cpu_step_kernel.h's kCell* constants")


def source_hash() -> str:
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((SOURCE_DIR / name).read_bytes())
    digest.update(" ".join(CFLAGS + LDFLAGS).encode())
    digest.update(torch.__version__.encode())  # the library links against this torch's ABI
    return digest.hexdigest()[:16]


@functools.cache
def load() -> bool:
    """Build (first time on this machine) or load (cached) the kernel; ``False``, with one
    warning, where it cannot be built."""
    try:
        import torch.utils.cpp_extension as cpp_extension

        name = f"lowbit_optim_cpu_step_{source_hash()}"
        if not _load_built():
            # A build takes tens of seconds with no output of its own: say what the wait is.
            print(f"lowbit_optim: building the C++ CPU step, once per machine and torch version "
                  f"(~30-60 s on 2 cores); cached in {library_path().parent}", file=sys.stderr, flush=True)
            cpp_extension.load(
                name=name, sources=[str(SOURCE_DIR / s) for s in SOURCES], extra_cflags=CFLAGS,
                extra_ldflags=LDFLAGS, is_python_module=False, verbose=False,
            )
    except Exception as error:  # no compiler, no ninja, a failed build: the compiled step serves
        warnings.warn(
            f"lowbit_optim: the C++ CPU step could not be built ({type(error).__name__}: "
            f"{str(error).strip().splitlines()[-1] if str(error).strip() else ''}); CPU "
            "parameters use the compiled step (backend='compile') instead, which is slower.",
            RuntimeWarning, stacklevel=2,
        )
        return False
    for op in ("cpu_rule_step", "cpu_factored_step", "cpu_factored_statistics", "cpu_factored_columns"):
        torch.library.register_fake(f"lowbit_optim::{op}")(_fake_step)
    return True


def library_path() -> pathlib.Path:
    """Where this version of the kernel is (or will be) built: torch's extensions directory
    (``TORCH_EXTENSIONS_DIR``), a folder named after the hash of the sources."""
    import torch.utils.cpp_extension as cpp_extension

    name = f"lowbit_optim_cpu_step_{source_hash()}"
    return pathlib.Path(cpp_extension._get_build_directory(name, False)) / f"{name}.so"


def _load_built() -> bool:
    """Load the library a previous process built, without ``cpp_extension.load``'s checks.

    Those run ninja to confirm the build is current (~1 s idle, ~5 s on a loaded 2-core
    machine); the name already holds a hash of the sources, flags and torch version, so a
    library under it is current. One that cannot be loaded (a build cut short) is rebuilt.
    """
    try:
        library = library_path()
        if not library.is_file():
            return False
        torch.ops.load_library(str(library))
    except (OSError, AttributeError):
        return False
    return True


def _fake_step(*args, **kwargs):
    return None  # it only writes into its inputs


def default_isa() -> str:
    """``LOWBIT_OPTIM_CPU_ISA`` if set, else the widest path torch's own CPU kernels use."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced:
        if forced not in ISAS:
            raise ValueError(f"Invalid {ISA_ENV}: {forced!r} (choose one of {sorted(ISAS)})")
        return forced
    capability = torch.backends.cpu.get_cpu_capability()
    return "avx512" if "AVX512" in capability else "avx2" if "AVX2" in capability else "scalar"


def _f32(value: float) -> float:
    """``value`` rounded to float32, as torch rounds a Python number that meets a float32 tensor."""
    return struct.unpack("f", struct.pack("f", value))[0]


@functools.cache
def _cells(codec) -> tuple[torch.Tensor, int]:
    """(cell words, sign handling) of a codec, built once per process (~30 ms)."""
    return cell_tables.cell_words(codec.encode, type(codec).__name__)


def _encodes_by_cells(codec) -> bool:
    """The 8-bit dynamic maps (zero-free or not) encode through their cell table: one gather
    and one comparison per value instead of the codec's arithmetic, which divides (AdamW8bit's
    step 32.9 -> 22.5 ms, docs/cpu_kernel.md). float8 keeps its bit arithmetic, as fast as a
    gather here (22.0 against 21.2 ms), and the 4-bit maps their 15-midpoint search."""
    inner = codec.inner if isinstance(codec, codecs.ZeroFreeCodec) else codec
    return isinstance(inner, codecs.DynamicExponentCodec)


class EncoderRow(NamedTuple):
    """One moment's encoder as the kernel takes it (``cpu_step_args.h``'s ``EncoderConstants``),
    by field: ``encoder`` and ``cell_sign`` by the kernel's names for them, the numbers as the
    float32 values the reference encoders (``formats/codecs.py``) compare with."""

    encoder: str  # "cells", "small_table", "linear16" or "e4m3"
    zero_free: bool  # codes below first_edge become 0 first (ZeroFreeCodec)
    first_edge: float
    midpoints: tuple[float, ...]  # small_table: its ascending midpoints (the kernel pads with +inf)
    cell_sign: str  # cells: how its table reads negative values


class EncoderLayout(NamedTuple):
    """The kernel's layout of a row of the operators' ``encoders`` (``cpu_encoder_layout``):
    its fields' names and widths in float32 slots, and the names of the encoders and cell signs
    in the order of the values that stand for them."""

    fields: tuple[str, ...]
    widths: tuple[int, ...]
    encoders: tuple[str, ...]
    cell_signs: tuple[str, ...]


@functools.cache
def encoder_layout() -> EncoderLayout:
    """The layout the loaded kernel reads, checked against ``EncoderRow``: a field added, renamed
    or moved on either side would otherwise feed an encoder the wrong values."""
    fields, widths, encoders, cell_signs = torch.ops.lowbit_optim.cpu_encoder_layout()
    layout = EncoderLayout(tuple(fields), tuple(widths), tuple(encoders), tuple(cell_signs))
    if layout.fields != EncoderRow._fields:
        raise RuntimeError(f"lowbit_optim: the C++ CPU kernel reads an encoder's fields "
                           f"{list(layout.fields)}, but Python builds {list(EncoderRow._fields)}; make "
                           "cpu_step_op.cpp's kEncoderFields and cpu_kernel.EncoderRow agree")
    return layout


def encoder_row(codec) -> tuple[EncoderRow, torch.Tensor]:
    """A codec's ``EncoderRow`` and its cell table (one unused word where it encodes otherwise)."""
    zero_free, first_edge, midpoints, unused_cells = False, 0.0, (), torch.zeros(1, dtype=torch.int32)
    if _encodes_by_cells(codec):
        cells, sign = _cells(codec)
        if sign not in _CELL_SIGN_NAMES:
            raise ValueError(f"the CPU kernel has no cell encoder for {type(codec).__name__}'s signs")
        return EncoderRow("cells", zero_free, first_edge, midpoints, _CELL_SIGN_NAMES[sign]), cells
    if isinstance(codec, codecs.ZeroFreeCodec):
        zero_free, first_edge, codec = True, _f32(codec.first_edge), codec.inner
    if isinstance(codec, codecs.LinearNonzeroCodec):
        if codec.table.numel() != 16:
            raise ValueError("the CPU kernel's linear encoder is for 16 levels")
        encoder = "linear16"
    elif isinstance(codec, codecs.SmallTableCodec):
        encoder, midpoints = "small_table", tuple(_f32(m) for m in codec._midpoints)
    elif isinstance(codec, codecs.Float8Codec):
        encoder = "e4m3"
    else:
        raise ValueError(f"the CPU kernel has no encoder for {type(codec).__name__}")
    return EncoderRow(encoder, zero_free, first_edge, midpoints, "clamped"), unused_cells


def encoder_values(row: EncoderRow, layout: EncoderLayout) -> list[float]:
    """``row`` as the kernel's float32 slots, in ``layout``'s order and widths."""
    named = {"encoder": layout.encoders, "cell_sign": layout.cell_signs}
    slots = []
    for name, width in zip(layout.fields, layout.widths):
        value = getattr(row, name)
        if name == "midpoints":
            if len(value) > width:
                raise ValueError(f"the CPU kernel's small-table encoder takes at most {width} midpoints")
            slots += [*value, *[float("inf")] * (width - len(value))]
        else:
            slots.append(float(named[name].index(value) if name in named else value))
    return slots


class FormatConstants(NamedTuple):
    """What the kernel reads of a rule's moment formats, as the operators' keyword arguments of
    the same names: each moment's decode table, its encoder's constants (one row per moment),
    its cell table, and the moments' width in bits (4 or 8)."""

    tables: list[torch.Tensor]
    encoders: torch.Tensor
    cells: list[torch.Tensor]
    bits: int


@functools.cache
def format_constants(formats: tuple[QuantFormat, ...]) -> dict:
    """``FormatConstants`` of a rule's moment formats (in its moment order), made once, as the
    operators' keyword arguments."""
    rows = [encoder_row(fmt.codec) for fmt in formats]
    layout = encoder_layout()
    encoders = torch.tensor([encoder_values(row, layout) for row, _ in rows], dtype=torch.float32)
    tables = [fmt.table.to(torch.float32).contiguous() for fmt in formats]
    return FormatConstants(tables, encoders, [cells for _, cells in rows], formats[0].bits)._asdict()


def supports(formats: tuple[QuantFormat, ...], block_size: int, param: torch.Tensor,
             grad: torch.Tensor) -> bool:
    """Whether the kernel takes this parameter (else the compiled step does): CPU, float32,
    bfloat16 or float16 parameters with a gradient of the same dtype, every moment of one
    width with an encoder the kernel has (``formats``: the rule's moment formats), blocks of at
    most ``MAX_BLOCK_SIZE``. float64 parameters (updated in float64 by the reference) go to the
    compiled step. A bfloat16 or float16 parameter's master weight correction is taken with it
    (``weight_correction``)."""
    if param.device.type != "cpu" or grad.device.type != "cpu" or grad.dtype != param.dtype:
        return False
    if not load():
        return False
    if param.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if len({fmt.bits for fmt in formats}) != 1 or formats[0].bits not in (4, 8):
        return False
    if block_size > MAX_BLOCK_SIZE or block_size % 4:
        return False
    try:
        format_constants(tuple(formats))
    except ValueError:
        return False
    return True


class KernelOptions(NamedTuple):
    """The flags of one kernel call: the shared policies and the instruction-set path
    (``None``: ``default_isa()``)."""

    maximize: bool
    stochastic_round: bool
    isa: str | None = None


@functools.cache
def functor_constants(functor: str) -> tuple[str, ...]:
    """The names of the host values the kernel's ``functor`` reads, in the order it reads them
    (its ``kConstants`` in ``csrc/rules/<name>.h``; ``cpu_functor_constants`` in the kernel)."""
    return tuple(torch.ops.lowbit_optim.cpu_functor_constants(functor))


@functools.cache
def check_functor_constants(functor: str, constants: type) -> None:
    """Raise unless ``constants``, the NamedTuple whose values Python passes ``functor`` (a
    rule's ``step_constants``), has the fields the functor reads, in its order: a field added,
    renamed or moved on either side would otherwise feed the functor the wrong values.
    Checked once per functor and type, before the first call passes them."""
    expected = functor_constants(functor)
    fields = getattr(constants, "_fields", None)
    if fields != expected:
        raise RuntimeError(
            f"lowbit_optim: the C++ CPU kernel's functor {functor!r} reads the host values "
            f"{list(expected)} in this order, but Python passes {constants.__name__} with fields "
            f"{None if fields is None else list(fields)}; make the functor's kConstants "
            f"(lowbit_optim/step/csrc/rules/{functor}.h) and the NamedTuple agree")


def cpu_rule_step(param, grad, moments: tuple, values, *, functor: str,
                  options: KernelOptions, weight_correction: torch.Tensor | None = None,
                  formats: tuple[QuantFormat, ...] | None = None) -> None:
    """One parameter's step with the kernel, in place: the rule's quantized step's result.

    ``moments``: the rule's ``QuantizedState``s of the whole parameter, in its moment order;
    ``values``: the 0-d CPU tensors its functor reads (``csrc/rules/<functor>.h``: the fields of
    the rule's ``step_constants``, checked by ``check_functor_constants`` when ``values`` is that
    NamedTuple; a plain sequence in ``functor_constants(functor)``'s order is passed as it is);
    ``functor``: the name of a functor of the kernel (a rule's ``cpu_functor``).
    ``weight_correction``: a bfloat16 or float16 parameter's master weight
    correction (int8 or int16, ``step.master_weights``), read and written with the parameter
    as its master weight. ``formats``: the formats whose decode table and encoder each moment
    uses (default: its own). A non-contiguous parameter (or correction) steps a contiguous
    copy, written back afterwards. ``KernelBatch`` steps many parameters in one call.
    """
    if hasattr(values, "_fields"):
        check_functor_constants(functor, type(values))
    torch.ops.lowbit_optim.cpu_rule_step(
        [param.detach()], [grad.detach()], [m.codes for m in moments], [m.scales for m in moments],
        [] if weight_correction is None else [weight_correction], list(values), functor=functor,
        **format_constants(formats or tuple(moment.format for moment in moments)),
        block_size=moments[0].block_size, maximize=options.maximize,
        stochastic_round=options.stochastic_round, isa=options.isa or default_isa(),
    )


_CODES = operator.attrgetter("codes")
_SCALES = operator.attrgetter("scales")


class KernelBatch:
    """Parameters the kernel steps in one call: one rule, one set of moment formats, one
    block size, parameter dtype and correction dtype (``kernel_batches`` sorts a group's
    parameters into them).

    One call instead of one per parameter: the per-parameter cost of a call from Python (~25 us
    of argument handling and dispatch, measured in docs/cpu_kernel.md) is paid once, and the
    kernel spreads every parameter's blocks over the threads in one parallel loop, so a model of
    many small parameters keeps both threads busy.
    """

    def __init__(self, entries: list[tuple], functor: str):
        first = entries[0][1]
        self.indices = [index for index, _ in entries]
        self.params = [entry.param.detach() for _, entry in entries]
        self.moments = [moment for _, entry in entries for moment in entry.moments]
        self.steps = [entry.step for _, entry in entries]
        corrections = [entry.weight_correction for _, entry in entries]
        self.corrections = [] if corrections[0] is None else corrections
        self.functor = functor
        self.constants = format_constants(tuple(moment.format for moment in first.moments))
        self.block_size = first.moments[0].block_size

    def run(self, grads: list[torch.Tensor], values_of, options: KernelOptions) -> None:
        """Step the batch's parameters with their gradients (``grads``: the caller's list, read
        at the batch's indices; each of its parameter's dtype, as the step checks before any
        plan steps) and ``values_of(step)``, the functor's values for a step count (the rule's
        ``step_constants``, a NamedTuple checked by ``check_functor_constants``)."""
        per_step = [values_of(step) for step in self.steps]
        check_functor_constants(self.functor, type(per_step[0]))
        values = [value for constants in per_step for value in constants]
        torch.ops.lowbit_optim.cpu_rule_step(
            self.params, [grads[i] for i in self.indices], [*map(_CODES, self.moments)],
            [*map(_SCALES, self.moments)], self.corrections, values,
            functor=self.functor, **self.constants, block_size=self.block_size, maximize=options.maximize,
            stochastic_round=options.stochastic_round, isa=options.isa or default_isa(),
        )


def kernel_batches(entries: list[tuple], functor: str) -> list[KernelBatch]:
    """``entries`` (``(index, rule_step.RuleEntry)``: its position in the step's gradient
    list) sorted into ``KernelBatch``es, in order of first appearance."""
    batches: dict[tuple, list[tuple]] = {}
    for index, entry in entries:
        correction = entry.weight_correction
        key = (tuple(moment.format for moment in entry.moments), entry.moments[0].block_size,
               entry.param.dtype, None if correction is None else correction.dtype)
        batches.setdefault(key, []).append((index, entry))
    return [KernelBatch(members, functor) for members in batches.values()]
