"""The step kernel's host side: what a launch needs of its tensors (checked, with the reason),
the kernel's compile-time options, and the launches themselves (``launch``: everything worked
out on every call; ``kernels.plan.KindPlan``: worked out once per kind and reused).

An update rule reaches the kernel as a ``KernelUpdate``: its ``@triton.jit`` element-wise piece
(``step_kernel``'s ``UPDATE``) and the piece's compile-time variant; its per-step constants
are a tuple of floats the rule forms on the host.
"""

import contextlib
from typing import NamedTuple

import torch

from lowbit_optim.formats.catalog import QuantFormat, check_block_size
from lowbit_optim.step import master_weights
from lowbit_optim.step.kernels import layout as layouts
from lowbit_optim.step.kernels.step_kernel import lowbit_step_kernel
from lowbit_optim.step.kernels.tables import codec_kind, device_tables

# Elements per program: 2048 with 4 warps is 16 elements per thread (four 16-byte loads of
# float32), which keeps the ~10 live float32 values per element in registers.
GPU_TILE_ELEMENTS = 2048
# Register cap (ptxas maxnreg) for aligned launches of rules with one or two moments (AdamW
# without amsgrad: the common case): 96 lets five 128-thread programs share an SM (65536
# registers) and costs no spill there (benchmarks/kernel_stats.py). Three moments and
# unaligned launches would spill under it and go uncapped.
MAX_REGISTERS = 96
CAPPED_MOMENT_COUNT = 2
# The interpreter runs programs one after another in Python; bigger tiles mean fewer of them.
INTERPRETER_TILE_ELEMENTS = 16384
# The kernel's moment slots: a rule keeps one to three moments.
MAX_MOMENTS = 3
# Where the rule's constants are among the kernel's positional arguments (``launch_one``).
CONSTANTS_ARGUMENT = layouts.LIST_COUNT + 3 + 2 * MAX_MOMENTS

# Decided when the kernel was defined: Triton reads TRITON_INTERPRET in its @jit decorator.
_KERNEL_KIND = type(lowbit_step_kernel)
_INTERPRETED = _KERNEL_KIND.__name__ == "InterpretedFunction"


class KernelUpdate(NamedTuple):
    """An update rule as the kernel takes it: ``function``, its ``@triton.jit`` element-wise
    piece (``step_kernel``'s ``UPDATE``), and ``variant``, the piece's compile-time switch
    (AdamW: ``rules.adamw.ADAMW_L2_DECAY`` for torch.optim.Adam's weight decay; 0 for none)."""

    function: object
    variant: int = 0


def is_interpreted() -> bool:
    """Whether the kernel was built for the Triton interpreter (``TRITON_INTERPRET=1`` when
    this module was imported): the only way it runs on CPU tensors."""
    return _INTERPRETED


def check_update(update: KernelUpdate) -> None:
    """A rule's piece must be built as the kernel is, interpreted or compiled: Triton reads
    ``TRITON_INTERPRET`` when a function is defined, and the rules' pieces are defined when
    ``lowbit_optim`` is imported."""
    if type(update.function) is not _KERNEL_KIND:
        raise RuntimeError(
            f"the update rule's Triton piece {getattr(update.function, '__name__', update.function)!r} "
            f"is a {type(update.function).__name__}, the kernel a {_KERNEL_KIND.__name__}: set (or unset) "
            "TRITON_INTERPRET before lowbit_optim is first imported")


def check_launch_lists(params: list[torch.Tensor], grads: list[torch.Tensor], block_size: int,
                       weight_corrections: list[torch.Tensor] | None = None) -> None:
    """What every launch needs of its parameters, gradients and weight corrections, refused
    with the reason."""
    check_block_size(block_size)  # a power of two: tl.arange spans half a block
    device = params[0].device
    if device.type == "cpu" and not is_interpreted():
        raise RuntimeError(
            "the Triton kernel runs on CPU tensors only under the Triton interpreter: set "
            "TRITON_INTERPRET=1 before lowbit_optim is imported, or use a CUDA device"
        )
    for name, tensors in (("params", params), ("grads", grads)):
        if any(t.device != device or t.dtype != tensors[0].dtype or not t.is_contiguous() for t in tensors):
            raise ValueError(f"{name} must be contiguous tensors of one dtype on {device}")
    if any(p.numel() >= 2**31 for p in params):
        raise ValueError("a parameter of 2**31 elements or more: the kernel indexes within a tensor in int32")
    if weight_corrections is not None:
        master_weight_bits(params, weight_corrections)


def master_weight_bits(params: list[torch.Tensor], weight_corrections: list[torch.Tensor] | None) -> int:
    """The kernel's ``MASTER_WEIGHT_BITS`` for these parameters and corrections (0: none),
    with what master weights need of them refused with the reason."""
    if weight_corrections is None:
        return 0
    if len(weight_corrections) != len(params):
        raise ValueError("weight_corrections must have one entry per parameter")
    dtype = weight_corrections[0].dtype
    if dtype not in (torch.int8, torch.int16) or params[0].dtype not in master_weights.CORRECTED_DTYPES:
        raise ValueError(f"master weights need bfloat16 or float16 parameters and int8 or int16 "
                         f"corrections (got {params[0].dtype} and {dtype})")
    for param, correction in zip(params, weight_corrections):
        if (correction.dtype != dtype or correction.device != param.device or not correction.is_contiguous()
                or correction.numel() != param.numel()):
            raise ValueError(f"weight_corrections must be contiguous {dtype} tensors with their parameters' "
                             f"sizes on {param.device}")
    return 24 if dtype == torch.int8 else 32


def rows_per_program(device: torch.device, block_size: int) -> int:
    tile = INTERPRETER_TILE_ELEMENTS if device.type == "cpu" else GPU_TILE_ELEMENTS
    return max(1, tile // block_size)


def tensor_lists_of(params, grads, moments: list[list[tuple]],
                    weight_corrections=None) -> list[list[torch.Tensor]]:
    """The kernel's eight tensor lists: parameters, gradients, then each moment slot's codes
    and scales (``moments``: one list of ``(codes, scales)`` pairs per moment of the rule; the
    slots past its last repeat that one's lists, which the kernel then never reads), and the
    weight corrections as a ninth where there are any. The layout and the kernel address
    every tensor by its data pointer as a flat array, so contiguous tensors of any shape serve
    as they are."""
    if not 1 <= len(moments) <= MAX_MOMENTS:
        raise ValueError(f"the kernel steps one to {MAX_MOMENTS} moments (got {len(moments)})")
    slots = list(moments) + [moments[-1]] * (MAX_MOMENTS - len(moments))
    lists = [list(params), list(grads)] + [[pair[i] for pair in moment] for moment in slots for i in (0, 1)]
    return lists if weight_corrections is None else lists + [list(weight_corrections)]


def moment_tables(formats: tuple[QuantFormat, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Every moment slot's (decode table, encoder table) on ``device``, flat, as the kernel takes
    them (the slots past the rule's last repeat its tables, never read)."""
    slots = list(formats) + [formats[-1]] * (MAX_MOMENTS - len(formats))
    return tuple(table for fmt in slots for table in device_tables(fmt, device))


def launch(params: list[torch.Tensor], grads: list[torch.Tensor], moments: list[list[tuple]],
           constants: tuple[float, ...], *, update: KernelUpdate, formats: tuple[QuantFormat, ...],
           block_size: int, maximize: bool, stochastic_round: bool, seed: int,
           weight_corrections: list[torch.Tensor] | None = None) -> None:
    """Update params and moments in place: one launch for the parameters whose tensors are
    aligned (``layout.split_aligned``), one for the rest, where there are any.

    ``params``/``grads`` are contiguous tensors of one dtype each; ``moments`` one list of
    ``(codes, scales)`` pairs (laid out as in ``QuantizedState``) per moment of the rule, in
    its order, stored in ``formats``; ``constants`` the rule's for this step. ``weight_corrections``:
    bfloat16 or float16 parameters' master weight corrections (``master_weights``; contiguous,
    all int8 or all int16), updated in place with them.
    Works everything out on every call, with layouts cached by address (``layout.get_layout``);
    the optimizer's steps go through ``kernels.plan.KindPlan``, which works it out once.
    """
    if not params:
        return
    check_launch_lists(params, grads, block_size, weight_corrections)
    device = params[0].device
    rows = rows_per_program(device, block_size)
    tensor_lists, _, _ = layouts.split_tails(tensor_lists_of(params, grads, moments, weight_corrections),
                                             block_size)
    address = layouts.addresses_of(tensor_lists)
    options = kernel_options(formats, update=update, block_size=block_size, rows=rows, maximize=maximize,
                             stochastic_round=stochastic_round and params[0].dtype == torch.bfloat16,
                             master_weight_bits=master_weight_bits(params, weight_corrections),
                             interpreted=device.type == "cpu")
    tables = moment_tables(formats, device)
    for aligned, indices in layouts.split_aligned(tensor_lists, address):
        lists = [[tensors[i] for i in indices] for tensors in tensor_lists]
        numels = [tensor_lists[0][i].numel() for i in indices]
        layout = layouts.get_layout(lists, numels, block_size, rows, device, aligned=aligned,
                                    address=address[:, indices])
        launch_one([tensors[0] for tensors in lists], layout, tables, constants, seed, options)


def device_guard(device: torch.device):
    """Launch on the parameters' device (and so on its current stream), whichever is current."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def kernel_options(formats: tuple[QuantFormat, ...], *, update: KernelUpdate, block_size: int, rows: int,
                   maximize: bool, stochastic_round: bool, interpreted: bool,
                   master_weight_bits: int = 0) -> dict:
    """The kernel's compile-time options for one kind (``ALIGNED`` and the register cap are
    per launch: ``launch_one`` adds them). ``formats``: the rule's moments'; ``master_weight_bits``:
    24 or 32 for parameters with weight corrections, 0 for none."""
    check_update(update)
    if stochastic_round and master_weight_bits:
        raise ValueError("stochastic rounding and master weights exclude each other: the master "
                         "weight keeps what rounding loses")
    slots = list(formats) + [formats[-1]] * (MAX_MOMENTS - len(formats))
    per_moment = {}
    for index, fmt in enumerate(slots):
        per_moment[f"MOMENT{index}_BITS"] = fmt.bits
        per_moment[f"MOMENT{index}_CODEC"] = codec_kind(fmt)
    return dict(
        UPDATE=update.function, UPDATE_VARIANT=update.variant, MOMENT_COUNT=len(formats),
        BLOCK_SIZE=block_size, ROWS=rows,
        LAYOUT_COLUMNS=layouts.layout_columns(layouts.LIST_COUNT + bool(master_weight_bits)), **per_moment,
        MAXIMIZE=maximize, STOCHASTIC_ROUND=stochastic_round,
        MASTER_WEIGHT_BITS=master_weight_bits, INTERPRETED=interpreted, num_warps=4, enable_fp_fusion=False,
    )


def launch_one(bases: list[torch.Tensor], layout: layouts.Layout, tables: tuple, constants: tuple[float, ...],
               seed: int, options: dict) -> None:
    """One launch: ``bases`` are the lists' first tensors (``tensor_lists_of``), which ``layout``
    is relative to; ``tables`` from ``moment_tables``, ``options`` from ``kernel_options``."""
    # Without master weights the corrections' pointer is None: a constexpr, no argument at all.
    weight_correction_base = bases[layouts.LIST_COUNT] if options["MASTER_WEIGHT_BITS"] else None
    capped = layout.aligned and options["MOMENT_COUNT"] <= CAPPED_MOMENT_COUNT
    with device_guard(bases[0].device):
        lowbit_step_kernel[(layout.num_programs,)](
            *bases[:layouts.LIST_COUNT], weight_correction_base, layout.table, layout.program_param, *tables,
            tuple(constants), seed, ALIGNED=layout.aligned, maxnreg=MAX_REGISTERS if capped else None,
            **options,
        )
