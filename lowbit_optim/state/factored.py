"""``FactoredState``: a second moment stored as per-row and per-column float32 statistics.

``AdamWFactored4bit`` (lpmm's "4-bit Factor", after Adafactor, Shazeer & Stern 2018) keeps
the second moment ``v`` of a parameter with at least two dimensions as two vectors: viewing
the parameter as a ``(rows, columns)`` matrix (the last dimension against all the others
flattened), ``row[i]`` is the mean of ``v[i, :]`` and ``col[j]`` the mean of ``v[:, j]``. The
second moment it stands for is their outer product normalised by the overall mean,
``v[i, j] = row[i] * col[j] / mean(col)``, exact when ``v`` has rank one. It costs
``4 * (rows + columns)`` bytes instead of one value per element.

Like ``QuantizedState`` it only stores and converts (the step is ``lowbit_optim.step.factored``)
and looks like a tensor of the parameter's shape and dtype, so that ``state_dict``,
``load_state_dict``'s dtype cast, ``torch.save`` and ``copy.deepcopy`` handle it. Supported
aten ops: ``detach``/``alias`` (same vectors), ``clone``, ``_to_copy`` (moves the vectors; a
dtype cast only relabels), ``is_pinned``, and ``constant_pad_nd`` / ``all_gather_into_tensor``
on the reconstructed values (DTensor's ``full_tensor()``), all shared with ``QuantizedState``
(``lowbit_optim.state.stored_tensor``); and its own ``copy_`` (float -> state factors the values;
state -> float reconstructs them), ``zeros_like``/``empty_like``, ``equal``,
``view``/``reshape`` (same last dimension), and ``slice`` along dim 0 (whole rows: a view of
those rows' statistics and the same columns' — how ``torch.distributed.checkpoint`` reshards
an FSDP2 moment).
"""

import sys
from typing import NamedTuple

import torch

from lowbit_optim.state.stored_tensor import SHARED_HANDLERS, StoredTensor, infer_shape

aten = torch.ops.aten


class FactorShape(NamedTuple):
    rows: int
    columns: int


def factor_shape(shape) -> FactorShape:
    """``(rows, columns)`` of the matrix a parameter of ``shape`` (at least 2-D) is factored as."""
    shape = torch.Size(shape)
    if len(shape) < 2:
        raise ValueError(
            f"a factored second moment needs a parameter with >= 2 dims, got shape {tuple(shape)}"
        )
    return FactorShape(shape[:-1].numel(), shape[-1])


def reconstruct(row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """``row[i] * col[j] / mean(col)`` as a ``(rows, columns)`` float32 matrix (0 where every
    statistic is 0). The step computes the same product element by element."""
    return row[:, None] * normalized_columns(col)[None, :]


def normalized_columns(col: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``col / mean(col)``, or zeros when ``col`` is all zero (no gradient seen yet: the
    clamp turns 0 / 0 into 0 / tiny); into ``out`` if given (the step reuses one buffer).
    The mean is taken in float64: a float32 sum of column statistics near 1e37 (a gradient
    of 1e20) overflows, and every column would then normalise to 0."""
    mean = col.mean(dtype=torch.float64).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.div(col, mean, out=out)


class FactoredState(StoredTensor):
    # The name torch.save writes for this class, and torch.load(weights_only=True) checks. It
    # was defined in ``lowbit_optim/factored_state.py`` when the first checkpoints were
    # written; keeping that name (an alias module, registered at the end of this file) lets
    # those files load and makes new ones byte-identical to them and readable by older
    # versions (tests/test_saved_checkpoints.py).
    __module__ = "lowbit_optim.factored_state"

    row: torch.Tensor
    col: torch.Tensor

    @staticmethod
    def __new__(cls, row, col, shape, dtype=torch.float32):
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=row.device, requires_grad=False
        )

    def __init__(self, row, col, shape, dtype=torch.float32):
        self.row = row
        self.col = col

    # --- construction -------------------------------------------------------------------
    @classmethod
    def zeros(cls, shape, *, device=None, dtype=torch.float32):
        rows, columns = factor_shape(shape)
        return cls(torch.zeros(rows, device=device), torch.zeros(columns, device=device),
                   torch.Size(shape), dtype)

    @classmethod
    def from_float(cls, tensor: torch.Tensor, *, dtype=None):
        """The factors of a full second moment (``torch.optim.AdamW``'s ``exp_avg_sq``): its
        row and column means."""
        state = cls.zeros(tensor.shape, device=tensor.device, dtype=dtype or tensor.dtype)
        return state.factor_(tensor)

    # --- properties and conversion ------------------------------------------------------
    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The second moment these factors stand for, shaped like the parameter."""
        return reconstruct(self.row, self.col).view(self.shape).to(dtype or self.dtype)

    def factor_(self, tensor: torch.Tensor, *, all_rows: int | None = None,
                sum_columns=None) -> "FactoredState":
        """Store the row and column means of ``tensor`` (same shape) into these factors.

        For a shard holding some of a matrix's rows (FSDP2), ``all_rows`` is the whole
        matrix's row count and ``sum_columns`` adds every shard's share of the column means
        in place (an all-reduce), so that the columns are means over all of its rows. Each
        value is divided before it is summed, as in the step: a sum of large second moments
        must not overflow where their mean does not."""
        if tensor.shape != self.shape:
            raise ValueError(
                f"cannot factor a tensor of shape {tuple(tensor.shape)} into a state of shape "
                f"{tuple(self.shape)}"
            )
        rows, columns = self.row.numel(), self.col.numel()
        # float64 sums saturated at the largest float32, as the step keeps its statistics
        # (lowbit_optim.step.factored): a torch AdamW moment holding inf or values near FLT_MAX
        # gives saturated, not infinite, statistics.
        float32_max = torch.finfo(torch.float32).max
        matrix = tensor.detach().to(device=self.row.device, dtype=torch.float64).reshape(rows, columns)
        self.row.copy_((matrix / columns).sum(dim=1).clamp(max=float32_max))
        column_shares = (matrix / (all_rows or rows)).sum(dim=0).clamp(max=float32_max).float()
        if sum_columns is not None:
            column_shares = sum_columns(column_shares).clamp(max=float32_max)
        self.col.copy_(column_shares)
        return self

    def _rebuild(self, inner, shape, dtype):
        return FactoredState(inner["row"], inner["col"], shape, dtype)

    # --- torch.compile / serialization ----------------------------------------------------
    def __tensor_flatten__(self):
        return ["row", "col"], (tuple(self.shape), self.dtype)

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, ctx, outer_size, outer_stride):
        shape, dtype = ctx
        return cls(inner_tensors["row"], inner_tensors["col"], shape, dtype)

    def __reduce_ex__(self, protocol):
        # Plain tensors and builtins: torch.load(weights_only=True) accepts it once the class
        # is a safe global.
        return FactoredState, (self.row, self.col, tuple(self.shape), self.dtype)

    def __repr__(self):
        return (f"FactoredState(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"rows={self.row.numel()}, columns={self.col.numel()}, device={self.device})")

    _what_it_is = "AdamWFactored4bit's second moment stored as row and column statistics"


def _copy(dst, src, non_blocking=False):
    if isinstance(dst, FactoredState) and isinstance(src, FactoredState):
        if dst.shape != src.shape:
            raise RuntimeError(f"cannot copy a FactoredState of shape {tuple(src.shape)} into one of "
                               f"shape {tuple(dst.shape)}")
        dst.row.copy_(src.row)
        dst.col.copy_(src.col)
        return dst
    if isinstance(dst, FactoredState):
        return dst.factor_(src)
    return dst.copy_(src.dequantize(dst.dtype))


def _zeros_like(state, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return FactoredState.zeros(state.shape, device=device or state.device, dtype=dtype or state.dtype)


def _equal(a, b):
    if not (isinstance(a, FactoredState) and isinstance(b, FactoredState)):
        return False
    return a.shape == b.shape and torch.equal(a.row, b.row) and torch.equal(a.col, b.col)


def _view(state, shape):
    """The same statistics under another shape with the same last dimension (the factored
    matrix is unchanged); ``DTensor.from_local`` views its local tensor as itself."""
    shape = infer_shape(shape, state.numel())
    if len(shape) < 2 or shape[-1] != state.shape[-1] or shape.numel() != state.numel():
        raise NotImplementedError(
            f"FactoredState can be viewed only with the same last dimension and size (got "
            f"{tuple(shape)} for {tuple(state.shape)}): its statistics are per row and column"
        )
    return state._relabel(shape=shape)


def _slice(state, dim=0, start=None, end=None, step=1):
    """Indices ``[start, end)`` of dim 0: whole rows of the factored matrix, so a view of
    their row statistics with every column's. ``torch.distributed.checkpoint`` narrows saved
    and target moments this way when it loads FSDP2 shards with another sharding."""
    shape = list(state.shape)
    if dim % len(shape) != 0 or step != 1:
        raise NotImplementedError(
            f"FactoredState supports slices of whole rows only (dim 0, step 1; got dim={dim}, "
            f"step={step} on shape {tuple(shape)}); call .dequantize() first"
        )
    start, end, _ = slice(start, end).indices(shape[0])
    end = max(start, end)
    rows_per_index = torch.Size(shape[1:-1]).numel()
    shape[0] = end - start
    return state._relabel(row=state.row[start * rows_per_index:end * rows_per_index], shape=shape)


FactoredState._handlers = {
    **SHARED_HANDLERS,
    aten.copy_.default: _copy,
    aten.zeros_like.default: _zeros_like,
    aten.empty_like.default: _zeros_like,
    aten.equal.default: _equal,
    aten.slice.Tensor: _slice,
    aten.view.default: _view,
    aten.reshape.default: _view,
    aten._unsafe_view.default: _view,
}

sys.modules.setdefault(FactoredState.__module__, sys.modules[__name__])
torch.serialization.add_safe_globals([FactoredState])
