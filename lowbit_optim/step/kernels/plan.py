"""One kind's launches, worked out once and reused at every step (host cost:
docs/benchmarks.md, "Host cost of the Triton path").

``launcher.launch`` works out on every call how its parameters split into an aligned and
an unaligned launch, where each of their tensors is, and the layout table. Between two steps
of an optimizer none of that changes except where the gradients are: parameters and states
stay where they are, and ``zero_grad(set_to_none=True)`` frees the gradients, so that
backward allocates new ones, possibly elsewhere. ``KindPlan`` therefore does the rest once. At
each step it reads one address per gradient (one ``data_ptr`` each, the only per-parameter
work) and compares them with the last step's (one C-level list comparison); only
if they moved does it place them in the table's gradient column (``layout.with_column``: a
few tensor operations on the whole column, the program map reused) and copy the table to the
device from pinned memory without blocking the host. A parameter split by ``layout.split_tails``
has its gradient's pieces placed by arithmetic (its address plus the piece's start), so no
view of a gradient is made per step.

If new gradients break an aligned launch's alignment (16-byte aligned, 16 elements apart),
the kind is planned again from them before anything is launched.
"""

from array import array

import torch

from lowbit_optim.formats.catalog import QuantFormat
from lowbit_optim.step.kernels import launcher
from lowbit_optim.step.kernels import layout as layouts

GRAD_ROW = 1  # the gradients' list among the kernel's (launcher.tensor_lists_of)


class _Launch:
    """One launch of a kind: its pieces' static addresses and its current layout."""

    def __init__(self, aligned: bool, bases: list[torch.Tensor], address: torch.Tensor, *,
                 piece_param: torch.Tensor, piece_start: torch.Tensor, numels: list[int],
                 element_sizes: list[int], whole_gradients: bool):
        self.aligned = aligned
        # The lists' first tensors; the gradient's is placed at every step (holding it
        # would keep a freed gradient's memory alive).
        self.bases = [bases[0], None, *bases[2:]]
        self.first_param, self.first_start = int(piece_param[0]), int(piece_start[0])
        self.address = address  # int64 (lists, pieces): every piece's tensors' addresses when planned
        self.grad_address: torch.Tensor | None = None  # the gradients' the layout has
        self.piece_param = piece_param  # int64: which gradient of the kind each piece reads
        self.piece_start = piece_start  # int64: the element of that gradient the piece starts at
        # Every gradient of the kind, whole and in order (nothing split, one launch: the usual
        # case): the pieces' addresses are the gradients', with no indexing to place them.
        self.whole_gradients = whole_gradients
        self.numels = numels
        self.element_sizes = element_sizes
        self.layout: layouts.Layout | None = None


class KindPlan:
    """The launches for one kind of parameters (its moments' formats, block size, parameter and
    gradient dtype, device, master weight correction
    dtype), with their layouts.

    ``params`` must be the tensors stepped at every ``run`` (contiguous), ``moments`` one list
    of ``(codes, scales)`` pairs per moment of the rule (in its order, stored in ``formats``),
    ``weight_corrections`` their master weight corrections (contiguous) or ``None``; ``grads``
    are the current gradients, which only decide the first split into aligned and unaligned
    launches.
    """

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor], moments: list[list[tuple]], *,
                 formats: tuple[QuantFormat, ...], block_size: int,
                 weight_corrections: list[torch.Tensor] | None = None):
        launcher.check_launch_lists(params, grads, block_size, weight_corrections)
        self.master_weight_bits = launcher.master_weight_bits(params, weight_corrections)
        self.params, self.moments, self.weight_corrections = list(params), moments, weight_corrections
        self.formats = tuple(formats)
        self.block_size = block_size
        self.device = params[0].device
        self.rows = launcher.rows_per_program(self.device, block_size)
        self.grad_element_size = grads[0].element_size()
        self.tables = launcher.moment_tables(self.formats, self.device)
        self.bf16 = params[0].dtype == torch.bfloat16
        self.launches = self._split(grads)
        self.grad_pointers: list[int] | None = None  # the gradients' addresses every layout has
        self.options: dict[tuple, dict] = {}

    def _split(self, grads: list[torch.Tensor]) -> list[_Launch]:
        params = self.params
        tensor_lists = launcher.tensor_lists_of(params, grads, self.moments, self.weight_corrections)
        pieces, piece_param, piece_start = layouts.split_tails(tensor_lists, self.block_size)
        address = layouts.addresses_of(pieces)
        element_sizes = [tensors[0].element_size() for tensors in tensor_lists]
        every_gradient = list(range(len(params)))
        launches = []
        for aligned, indices in layouts.split_aligned(pieces, address):
            launch_params = [piece_param[i] for i in indices]
            launch_starts = [piece_start[i] for i in indices]
            launches.append(_Launch(
                aligned, [tensors[indices[0]] for tensors in pieces], address[:, indices],
                piece_param=torch.tensor(launch_params, dtype=torch.int64),
                piece_start=torch.tensor(launch_starts, dtype=torch.int64),
                numels=[pieces[0][i].numel() for i in indices], element_sizes=element_sizes,
                # One piece per gradient is not enough: the last blocks of as many parameters
                # as the kind has are one piece each too, but start inside their gradients.
                whole_gradients=launch_params == every_gradient and not any(launch_starts)))
        return launches

    def _prepare(self, grads: list[torch.Tensor]) -> bool:
        """Bring every launch's layout up to date with ``grads``; ``False`` (nothing changed)
        if they no longer fit an aligned launch."""
        # Kept gradients: one C-level list comparison and no tensor operation at all. Moved:
        # an int64 array viewed as a tensor (~3x cheaper than ``torch.tensor`` of the list,
        # timeit; the tensor keeps the array alive).
        pointers = [*map(torch.Tensor.data_ptr, grads)]
        if pointers == self.grad_pointers:
            return True
        grad_address = torch.frombuffer(array("q", pointers), dtype=torch.int64)
        updates = []
        for launch in self.launches:
            piece_address = (grad_address if launch.whole_gradients else
                             grad_address[launch.piece_param] + launch.piece_start * self.grad_element_size)
            if launch.layout is not None and torch.equal(piece_address, launch.grad_address):
                continue
            if launch.layout is None:
                address = launch.address.clone()
                address[GRAD_ROW] = piece_address
                layout = layouts.build_layout(address, launch.element_sizes, launch.numels, self.block_size,
                                              self.rows, self.device)
                layout = layouts.Layout(layout.table, layout.program_param, layout.num_programs,
                                        launch.aligned, layout.host_table)
                if launch.aligned and not layout.aligned:
                    return False
            else:
                layout = layouts.with_column(launch.layout, GRAD_ROW, piece_address, self.grad_element_size)
                if layout is None:
                    return False
            updates.append((launch, piece_address, layout))
        for launch, piece_address, layout in updates:
            launch.grad_address, launch.layout = piece_address, layout
        self.grad_pointers = pointers
        return True

    def run(self, grads: list[torch.Tensor], constants: tuple[float, ...], *, update: launcher.KernelUpdate,
            maximize: bool, stochastic_round: bool, seed: int) -> None:
        """Step every parameter of the kind in place with ``grads`` (contiguous, one per
        parameter, in order) by the rule's ``update`` with its ``constants`` for this step."""
        if not self._prepare(grads):
            self.launches = self._split(grads)
            self.grad_pointers = None
            self._prepare(grads)
        stochastic_round = stochastic_round and self.bf16
        key = (update, maximize, stochastic_round)
        if key not in self.options:
            self.options[key] = launcher.kernel_options(
                self.formats, update=update, block_size=self.block_size, rows=self.rows,
                maximize=maximize, stochastic_round=stochastic_round, interpreted=self.device.type == "cpu",
                master_weight_bits=self.master_weight_bits)
        for launch in self.launches:
            first, start = launch.first_param, launch.first_start
            grad = grads[first] if start == 0 else grads[first].view(-1)[start:]
            bases = [launch.bases[0], grad, *launch.bases[2:]]
            launcher.launch_one(bases, launch.layout, self.tables, constants, seed, self.options[key])
