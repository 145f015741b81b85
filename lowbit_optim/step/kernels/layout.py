"""Multi-tensor layout: which parameter each program of one launch serves, and where its tensors are.

One launch covers a list of parameters of one kind. A program handles ``rows`` consecutive
blocks of a single parameter (each parameter's last program is partly masked), so its
tensors are found with one scalar load per tensor instead of one per element. The layout is
two small device tensors:

* ``table`` (int64, one row per parameter): for each of the eight tensor lists (param, grad,
  then the codes and scales of the update rule's three moment slots: AdamW's exp_avg,
  exp_avg_sq and max_exp_avg_sq; ``MOMENT_CODES``, ``MOMENT_SCALES``) the offset
  in elements of this parameter's tensor from the list's first tensor, which the kernel
  receives as a typed pointer; then ``numel`` and the parameter's first program; then, in a
  launch of parameters with master weights, the offset of their weight corrections (a ninth
  list, element for element like the parameters);
* ``program_param`` (int32, one entry per program): the parameter's row.

A launch is either aligned (every tensor 16 bytes aligned, every offset and ``numel`` a
multiple of 16 elements: the kernel promises that with ``tl.multiple_of`` and moves
parameters, gradients and codes with 128-bit accesses) or not; ``split_aligned`` sorts a
group's parameters into the two, so one odd tensor does not slow the rest of its group.

Offsets from a base pointer, rather than raw addresses, keep every pointer typed, so one
kernel serves every parameter dtype without casting integers to pointers. A table is built
with tensor operations and copied to the device from pinned memory without blocking the
host. The optimizer keeps each launch's layout with its step plan (``kernels.plan``) and,
when only the gradients moved, replaces their column (``with_column``: the program map is
reused). Direct calls of ``launcher.launch`` (the torch op, ``ops``) go through ``get_layout``,
which caches layouts by the tensors' addresses, sizes and dtypes (the same addresses with
other element sizes give other offsets).
"""

from collections import OrderedDict
from dataclasses import dataclass

import torch

# The table's columns: the eight tensor lists' offsets, then numel and the first program, then
# the weight corrections' offsets in a launch with master weights only (the others read a table
# of ``LAYOUT_COLUMNS``, whose columns do not depend on master weights).
(PARAM, GRAD, EXP_AVG_CODES, EXP_AVG_SCALES, EXP_AVG_SQ_CODES, EXP_AVG_SQ_SCALES, MAX_CODES,
 MAX_SCALES, NUMEL, FIRST_PROGRAM, WEIGHT_CORRECTION) = range(11)
LAYOUT_COLUMNS = 10
# The update rule's moments (up to three, in its order: AdamW's exp_avg, exp_avg_sq and
# max_exp_avg_sq) in the three (codes, scales) column pairs.
MOMENT_CODES = (EXP_AVG_CODES, EXP_AVG_SQ_CODES, MAX_CODES)
MOMENT_SCALES = (EXP_AVG_SCALES, EXP_AVG_SQ_SCALES, MAX_SCALES)
# The column of each tensor list, in the lists' order (``launcher.tensor_lists_of``).
LIST_COLUMNS = (PARAM, GRAD, EXP_AVG_CODES, EXP_AVG_SCALES, EXP_AVG_SQ_CODES, EXP_AVG_SQ_SCALES, MAX_CODES,
                MAX_SCALES, WEIGHT_CORRECTION)
# A launch's lists without master weights (the weight corrections are a ninth).
LIST_COUNT = 8
# The lists indexed element for element like the parameter (the others by block).
ELEMENTWISE_LISTS = tuple(LIST_COLUMNS.index(column) for column in (PARAM, GRAD, WEIGHT_CORRECTION))

# Offsets that are multiples of 16 elements let the kernel promise aligned, vectorisable
# loads; anything else (odd views) gets the unaligned kernel variant.
ALIGNMENT_ELEMENTS = 16
# Where every tensor of an aligned launch starts: 16 bytes, one vector load's width.
ALIGNMENT_BYTES = 16
CACHE_SIZE = 16


def layout_columns(list_count: int) -> int:
    """The table's width for a launch of ``list_count`` tensor lists: ``LIST_COUNT``, or one
    more with weight corrections."""
    return LAYOUT_COLUMNS if list_count == LIST_COUNT else WEIGHT_CORRECTION + 1


@dataclass(frozen=True)
class Layout:
    table: torch.Tensor
    program_param: torch.Tensor
    num_programs: int
    aligned: bool
    host_table: torch.Tensor | None = None  # the table on the host (``with_column`` edits a copy)


_CACHE: OrderedDict = OrderedDict()


def addresses_of(tensor_lists: list[list[torch.Tensor]]) -> torch.Tensor:
    """int64 ``(lists, parameters)``: every tensor's address, read once per launch and shared
    by ``split_aligned`` and ``get_layout``."""
    return torch.tensor([[t.data_ptr() for t in tensors] for tensors in tensor_lists], dtype=torch.int64)


def split_tails(tensor_lists: list[list[torch.Tensor]], block_size: int
                ) -> tuple[list[list[torch.Tensor]], list[int], list[int]]:
    """Split a parameter whose tensors are 16-byte aligned but whose size is not a multiple of
    16 into its whole blocks, which can take the aligned launch, and its last, partial block,
    which takes the unaligned one (a block is never split: its scale is its maximum).

    Returns the lists of pieces and, per piece, the index of its parameter and the element of
    that parameter it starts at (what ``kernels.plan`` needs to place a new gradient's pieces
    without making views of it)."""
    count = len(tensor_lists[0])
    if all(param.numel() % ALIGNMENT_ELEMENTS == 0 for param in tensor_lists[0]):
        return tensor_lists, list(range(count)), [0] * count  # the common case: nothing to split
    pieces: list[list[torch.Tensor]] = [[] for _ in tensor_lists]
    piece_param, piece_start = [], []
    for index, param in enumerate(tensor_lists[0]):
        tensors = [tensors[index] for tensors in tensor_lists]
        whole_blocks = param.numel() // block_size
        body = whole_blocks * block_size
        odd_size = param.numel() % ALIGNMENT_ELEMENTS != 0
        if (odd_size and whole_blocks and body % ALIGNMENT_ELEMENTS == 0
                and all(t.data_ptr() % ALIGNMENT_BYTES == 0 for t in tensors)):
            split = [(t.view(-1)[:body], t.view(-1)[body:]) if position in ELEMENTWISE_LISTS
                     else (t[:whole_blocks], t[whole_blocks:])
                     for position, t in enumerate(tensors)]
            for piece_list, (head, tail) in zip(pieces, split):
                piece_list += [head, tail]
            piece_param += [index, index]
            piece_start += [0, body]
        else:
            for piece_list, tensor in zip(pieces, tensors):
                piece_list.append(tensor)
            piece_param.append(index)
            piece_start.append(0)
    return pieces, piece_param, piece_start


def split_aligned(tensor_lists: list[list[torch.Tensor]],
                  address: torch.Tensor | None = None) -> list[tuple[bool, list[int]]]:
    """``[(aligned, parameter indices), ...]``: the parameters that can share an aligned launch
    (with the first such parameter as the base of every list), then the rest; empty parts are
    left out. ``address``: ``addresses_of(tensor_lists)`` if already read."""
    address = addresses_of(tensor_lists) if address is None else address
    sizes = torch.tensor([tensors[0].element_size() for tensors in tensor_lists], dtype=torch.int64)
    numel = torch.tensor([t.numel() for t in tensor_lists[0]], dtype=torch.int64)
    ok = (numel % ALIGNMENT_ELEMENTS == 0) & (address % ALIGNMENT_BYTES == 0).all(dim=0)
    if bool(ok.any()):
        base = address[:, int(ok.nonzero()[0])][:, None]
        ok &= ((address - base) % (sizes[:, None] * ALIGNMENT_ELEMENTS) == 0).all(dim=0)
    aligned, rest = ok.nonzero().flatten().tolist(), (~ok).nonzero().flatten().tolist()
    return [(flag, indices) for flag, indices in ((True, aligned), (False, rest)) if indices]


def get_layout(tensor_lists: list[list[torch.Tensor]], numels: list[int], block_size: int, rows: int,
               device: torch.device, *, aligned: bool = False,
               address: torch.Tensor | None = None) -> Layout:
    """The layout for these tensors (eight or nine lists, one tensor per parameter in each).

    ``aligned=True`` asserts what ``split_aligned`` checked; it is verified again on a build.
    ``address``: ``addresses_of(tensor_lists)`` if already read.
    """
    address = addresses_of(tensor_lists) if address is None else address
    dtypes = tuple(tensors[0].dtype for tensors in tensor_lists)
    # The addresses as bytes: one cheap key however many parameters there are.
    key = (device, block_size, rows, aligned, dtypes, address.numpy().tobytes(), tuple(numels))
    layout = _CACHE.get(key)
    if layout is None:
        element_sizes = [tensors[0].element_size() for tensors in tensor_lists]
        layout = build_layout(address, element_sizes, numels, block_size, rows, device)
        if aligned and not layout.aligned:
            raise ValueError("tensors are not aligned as an aligned launch needs (see split_aligned)")
        layout = Layout(layout.table, layout.program_param, layout.num_programs, aligned, layout.host_table)
        _CACHE[key] = layout
        if len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    return layout


def build_layout(address: torch.Tensor, element_sizes: list[int], numels: list[int], block_size: int,
                 rows: int, device: torch.device) -> Layout:
    """The table and program map, computed with tensor operations (no Python loop per tensor),
    copied to ``device``. ``address``: int64 ``(lists, parameters)``, each list's base first.
    ``aligned`` says whether they could take the aligned launch (every base 16-byte aligned,
    every offset and size a multiple of 16 elements)."""
    num_params = len(numels)
    sizes = torch.tensor(element_sizes, dtype=torch.int64)[:, None]
    delta = address - address[:, :1]
    if bool((delta % sizes).any()):
        raise ValueError("tensor addresses are not whole elements apart")
    offsets = delta // sizes
    numel = torch.tensor(numels, dtype=torch.int64)
    aligned = (bool((address[:, 0] % ALIGNMENT_BYTES == 0).all())
               and bool((offsets % ALIGNMENT_ELEMENTS == 0).all())
               and bool((numel % ALIGNMENT_ELEMENTS == 0).all()))
    blocks = (numel + block_size - 1) // block_size
    programs = (blocks + rows - 1) // rows
    table = torch.empty(num_params, layout_columns(len(element_sizes)), dtype=torch.int64)
    table[:, list(LIST_COLUMNS[:len(element_sizes)])] = offsets.t()
    table[:, NUMEL] = numel
    table[:, FIRST_PROGRAM] = torch.cumsum(programs, 0) - programs
    program_param = torch.repeat_interleave(torch.arange(num_params, dtype=torch.int32), programs)
    return Layout(_to_device(table, device), _to_device(program_param, device), int(programs.sum()), aligned,
                  table)


def with_column(layout: Layout, column: int, address: torch.Tensor, element_size: int) -> Layout | None:
    """``layout`` with one list's tensors at new addresses (int64, one per row, the list's base
    first): the gradients of a step after ``zero_grad(set_to_none=True)``. A few tensor
    operations and one small copy to the device; the program map is reused. ``None`` if they
    do not fit the layout's kind of launch (not 16-byte aligned and 16 elements apart for an
    aligned one)."""
    delta = address - address[0]
    if bool((delta % element_size).any()):
        return None
    offsets = delta // element_size
    starts_aligned = int(address[0]) % ALIGNMENT_BYTES == 0
    if layout.aligned and not (starts_aligned and not bool((offsets % ALIGNMENT_ELEMENTS).any())):
        return None
    table = layout.host_table.clone()
    table[:, column] = offsets
    return Layout(_to_device(table, layout.table.device), layout.program_param, layout.num_programs,
                  layout.aligned, table)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """CUDA: through pinned memory, without blocking the host (the caching host allocator keeps
    the pinned buffer until the copy has run)."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def clear_cache() -> None:
    _CACHE.clear()
