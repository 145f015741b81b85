"""The pieces every step implementation shares: the one per-parameter record (``RuleEntry``),
running a step over a parameter's blocks in
bounded chunks with a scratch block for the partial last one (``for_each_block_chunk``,
``TailScratch``), and a function copy with its own code object, so that each compiled step gets
its own graph budget.

``torch.compile`` sees every parameter as a ``(num_blocks, block_size)`` view with only
``num_blocks`` dynamic. On this kind of CPU that keeps one graph for every size at close to
static-shape speed, whereas a flat 1-D tensor with a dynamic length compiles to code ~3.5x
slower (measured: the static block dimension is what vectorises). A parameter whose size is
not a multiple of the block size runs its whole blocks in place, in chunks of at most
``CHUNK_ELEMENTS`` (bounding the step's temporaries), and its last, partial block through a
one-block scratch buffer, all reusing the same graph.
"""

import functools
import types
from typing import NamedTuple

import torch
import torch._dynamo
import torch.fx.experimental._config as fx_config

# The most elements one call of the compiled (or eager) step updates. Its generated code keeps
# buffers of its input's size between passes (measured: ~23 bytes per element for the 4-bit
# step as first written), so a 50M-element embedding stepped whole allocated ~1.2 GB of temporaries,
# 3x fp32 AdamW's entire state. In chunks of 2**20 elements the temporaries stay at a few
# dozen MiB whatever the parameter's size; one chunk is still large enough that the per-call
# overhead (~0.1 ms) is negligible (docs/benchmarks.md, "Transient memory of one step").
CHUNK_ELEMENTS = 1 << 20

# Stochastic rounding's noise streams (the Triton backend): an optimizer's param group has
# stream ``rank << GROUP_STREAM_BITS | group index``, and each launch kind of the group
# ``stream << KIND_STREAM_BITS | kind index``: distinct while a rank has fewer than 2**16
# param groups and a group fewer than 2**10 kinds.
GROUP_STREAM_BITS = 16
KIND_STREAM_BITS = 10


class RuleEntry(NamedTuple):
    """One parameter's share of a rule's step: the tensors it updates (``moments`` in the
    rule's order, float tensors, ``QuantizedState`` or, for a factored second moment,
    ``FactoredState``), its step count and a bfloat16 or float16 parameter's master weight
    correction, if it keeps one."""

    param: torch.Tensor
    grad: torch.Tensor | None
    moments: tuple
    step: torch.Tensor
    weight_correction: torch.Tensor | None = None


def with_own_code_object(fn, name: str):
    """A copy of ``fn`` whose code object is its own.

    Dynamo keeps compiled graphs, and counts them against ``recompile_limit``, per code
    object. One copy per state kind means the 8-bit and 4-bit steps each get their own
    budget of graphs (one per parameter dtype and flag combination), instead of sharing one.
    """
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    copy = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__  # the keyword-only defaults (FunctionType drops them)
    return functools.update_wrapper(copy, fn)


def call_step(function, compiled: bool, dynamic: list[tuple[torch.Tensor, tuple[int, ...]]], *args, **kwargs):
    """``function(*args, **kwargs)``; ``compiled``: with the sizes in ``dynamic`` (a tensor and
    its dims) marked dynamic, so that one graph serves every shape.

    Size-oblivious reasoning too: without it a one-block tensor (a small parameter, or a
    partial last block) is specialised to size 1 and gets a graph of its own; with it the
    single dynamic graph serves every block count, 1 included.
    """
    if not compiled:
        return function(*args, **kwargs)
    for tensor, dims in dynamic:
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
    with fx_config.patch(backed_size_oblivious=True):
        return function(*args, **kwargs)


def leading_dims(tensors) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """``call_step``'s ``dynamic`` for block-shaped tensors: the block count of each (``None``s and
    0-d tensors skipped), or the length of a vector (a factored moment's statistics)."""
    return [(tensor, (0,)) for tensor in tensors if tensor is not None and tensor.dim()]


def compiled_graph_count_of(compiled_function) -> int:
    """How many graphs Dynamo holds for a ``torch.compile``'d function (0 before its first call)."""
    code = compiled_function._torchdynamo_orig_callable.__code__
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code))


class CompiledVariants:
    """``function`` compiled once per variant (a tuple of formats and flags), each copy with its
    own code object (``with_own_code_object``).

    Dynamo keeps at most ``recompile_limit`` (8) graphs per code object and past that runs the
    function eagerly, silently: slower, and with torch's eager float32 ``sqrt`` (1 ulp off on
    ~0.6% of inputs) instead of the compiled one. One code object per state kind held a graph
    per combination of flags, parameter dtype, amsgrad and master weights, and a process that
    used more than 8 of them (the test suite did) fell back. A variant names the master weight
    correction's dtype too (``None`` without one), so per variant only the parameter's dtype
    varies: at most 4 graphs (float32, float64, bfloat16, float16; 2 with a correction).
    """

    def __init__(self, function, prefix: str):
        self.function, self.prefix = function, prefix
        self.compiled: dict[tuple, object] = {}

    def get(self, variant: tuple):
        if variant not in self.compiled:
            name = "__".join((self.prefix, *map(variant_name, variant))).replace("-", "_")
            # Compiled as a plain function (formats and flags are passed as keyword arguments
            # at the call): torch.compile wraps a functools.partial in a shared helper whose
            # code object would again be common to every variant.
            self.compiled[variant] = torch.compile(with_own_code_object(self.function, name), dynamic=False)
        return self.compiled[variant]

    def graph_count(self, *leading: object) -> int:
        """Graphs held by the variants that begin with ``leading`` (a state kind's formats)."""
        return sum(compiled_graph_count_of(compiled) for variant, compiled in self.compiled.items()
                   if variant[:len(leading)] == leading)


def variant_name(part) -> str:
    if isinstance(part, torch.dtype):
        return str(part).removeprefix("torch.")
    return str(int(part)) if isinstance(part, bool) else getattr(part, "name", str(part))


def correction_dtype_of(weight_correction: torch.Tensor | None) -> torch.dtype | None:
    """The part of a compiled step's variant that says which master weight correction it
    reads and writes: its dtype, or ``None`` without one."""
    return None if weight_correction is None else weight_correction.dtype


class TailScratch:
    """Reusable one-block buffers for the last, partial block of each parameter.

    Allocated once per (device, dtype, block size), so a steady-state step allocates nothing.
    """

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}

    def get(self, like: torch.Tensor, block_size: int, role: str) -> torch.Tensor:
        key = (like.device, like.dtype, block_size, role)
        if key not in self._buffers:
            self._buffers[key] = torch.zeros(1, block_size, dtype=like.dtype, device=like.device)
        return self._buffers[key]

    def index_scalar(self, role: str) -> torch.Tensor:
        """A 0-d int64 CPU tensor for an index the compiled step reads (``factored``)."""
        key = ("index", role)
        if key not in self._buffers:
            self._buffers[key] = torch.zeros((), dtype=torch.int64)
        return self._buffers[key]


def for_each_block_chunk(param: torch.Tensor, grad: torch.Tensor, block_size: int,
                         scratch: TailScratch, update, *,
                         weight_correction: torch.Tensor | None = None) -> None:
    """Run ``update(param_blocks, grad_blocks, block_rows, first_element, correction_blocks)``
    over ``param``'s blocks in place: its whole blocks a bounded chunk at a time
    (``CHUNK_ELEMENTS``; every chunk reuses the compiled graph), then its last, partial block
    through a zero-padded scratch block. ``block_rows`` are the chunk's rows of the
    block-shaped state and ``first_element`` its offset in the flattened parameter;
    ``correction_blocks`` the same blocks of ``weight_correction`` (a master weight
    correction shaped like ``param``), ``None`` without one. A non-contiguous parameter
    (or correction) steps a contiguous copy, written back at the end."""
    # Detached, so views of a leaf that requires grad and the scratch buffers look alike to
    # the compiled graph's guards.
    tensors = [param.detach()] + ([] if weight_correction is None else [weight_correction])
    works = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    flats = [work.view(-1) for work in works]
    flat_param = flats[0]
    flat_grad = grad.detach().reshape(-1)
    whole_blocks, tail = divmod(flat_param.numel(), block_size)
    chunk_blocks = max(1, CHUNK_ELEMENTS // block_size)
    for first in range(0, whole_blocks, chunk_blocks):
        count = min(chunk_blocks, whole_blocks - first)
        elements = slice(first * block_size, (first + count) * block_size)
        blocks = [flat[elements].view(count, block_size) for flat in flats]
        update(blocks[0], flat_grad[elements].view(count, block_size),
               slice(first, first + count), first * block_size, blocks[1] if len(blocks) > 1 else None)
    if tail:
        start = whole_blocks * block_size
        roles = ("param", "correction")
        tail_blocks = [scratch.get(flat, block_size, role) for flat, role in zip(flats, roles)]
        grad_block = scratch.get(flat_grad, block_size, "grad")
        for block, flat in zip(tail_blocks, flats):
            block[0, :tail].copy_(flat[start:])
            # The padding must be zeros, not the last parameter's values: its moments then
            # stay exactly 0 and never set the block's scale, so neither the parameter order
            # nor a resumed run's fresh buffers change the result (tests/test_checkpoint.py).
            block[0, tail:].zero_()
        grad_block[0, :tail].copy_(flat_grad[start:])
        grad_block[0, tail:].zero_()
        update(tail_blocks[0], grad_block, slice(whole_blocks, None), start,
               tail_blocks[1] if len(tail_blocks) > 1 else None)
        for block, flat in zip(tail_blocks, flats):
            flat[start:].copy_(block[0, :tail])
    for tensor, work in zip(tensors, works):
        if work is not tensor:
            tensor.copy_(work)
