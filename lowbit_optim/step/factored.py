"""The step of a parameter whose second moment is factored (``AdamWFactored4bit``).

Two passes over the parameter, each in bounded chunks (``chunks.CHUNK_ELEMENTS``), so no
parameter-sized float32 temporary is ever made:

1. ``second_moment_means``: per chunk of rows of the ``(rows, columns)`` view, the means over
   columns and (this chunk's share of) over rows of ``(1 - beta2) * g**2``
   (``math.squared_gradient_term``). They update the statistics as Adafactor does:
   ``row = beta2 * row + mean_j(...)``, ``col = beta2 * col + mean_i(...)``. Each term is
   divided before it is summed: a sum of terms torch's AdamW keeps finite (a gradient of
   1e20 gives 1e37) would overflow float32 over a few dozen columns, and the statistics would
   become inf, the parameter NaN.
2. ``factored_adamw_step``: per chunk of whole quantization blocks, the 4-bit first moment
   is decoded, updated and re-encoded as in ``rule_step.quantized_rule_step``, and each element's
   second moment is ``row[i] * col[j] / mean(col)`` (``state.factored.reconstruct``), found
   from its flat index. The parameter moves by ``math.parameter_update`` with the
   ratio ``exp_avg / denom`` clamped at Adam's own bound (``adam_ratio_bound``): the
   factored ``v`` can underestimate an element's own second moment by up to
   ``min(rows, columns)`` times (an identity-like gradient), and the clamp keeps every update
   within what Adam itself could do (docs/design.md, "The factored second moment").

Elements with a non-finite gradient keep their parameter value and first moment, and add 0
to the statistics. Every function takes tensors only (hyperparameters and indices as 0-d
tensors), so one compiled graph serves every shape and schedule.
"""

from typing import NamedTuple

import torch

from lowbit_optim.formats.catalog import QuantFormat
from lowbit_optim.state import sharding
from lowbit_optim.state.factored import factor_shape, normalized_columns
from lowbit_optim.step import chunks, cpu_kernel_factored
from lowbit_optim.step.chunks import (
    call_step,
    compiled_graph_count_of,
    correction_dtype_of,
    for_each_block_chunk,
    variant_name,
    with_own_code_object,
)
from lowbit_optim.step.master_weights import read_master, write_master
from lowbit_optim.step.math import (
    adam_ratio_bound,
    bias_corrections,
    compute_dtype,
    effective_gradient,
    first_moment_update,
    parameter_update,
    squared_gradient_term,
    write_param,
)


def second_moment_means(param_rows, grad_rows, beta2, weight_decay, columns, all_rows, *,
                        maximize: bool, decoupled_weight_decay: bool):
    """For a ``(k, columns)`` chunk of a matrix of ``all_rows`` rows (both 0-d int64): the
    float32 means of ``(1 - beta2) * g**2`` over each row ``(k,)``, and each column's sum
    over these rows divided by ``all_rows`` ``(columns,)``: the chunk's share of the column
    means."""
    # float64 whatever the parameter dtype: the terms of a gradient above ~1.8e19 overflow
    # float32 (module docstring); the means saturate when stored (``accumulate_statistic``).
    dtype = torch.float64
    _, safe_grad = effective_gradient(param_rows.to(dtype), grad_rows.to(dtype),
                                      weight_decay=weight_decay, maximize=maximize,
                                      decoupled_weight_decay=decoupled_weight_decay)
    term = squared_gradient_term(safe_grad, beta2)
    return saturate_float32((term / columns).sum(dim=1)), saturate_float32((term / all_rows).sum(dim=0))


def saturate_float32(values: torch.Tensor) -> torch.Tensor:
    """Non-negative ``values`` as float32, those above the largest float32 (inf too) at it."""
    return values.clamp(max=torch.finfo(torch.float32).max).to(torch.float32)


def accumulate_statistic(statistic: torch.Tensor, beta2, mean: torch.Tensor) -> None:
    """``statistic = beta2 * statistic + mean`` in place, saturated at the largest float32
    (two saturated values would add to inf)."""
    accumulate_statistics([statistic], beta2, [mean])


def accumulate_statistics(statistics: list[torch.Tensor], beta2, means: list[torch.Tensor]) -> None:
    """``accumulate_statistic`` of each statistic with its mean: three calls for the list (on
    the CPU the foreach operations run each tensor's own operation, so the values are the
    same)."""
    torch._foreach_mul_(statistics, beta2)
    torch._foreach_add_(statistics, means)
    torch._foreach_clamp_max_(statistics, torch.finfo(torch.float32).max)


class FactoredBlocks(NamedTuple):
    """The tensors ``factored_adamw_step`` reads and writes: one chunk of a parameter's whole
    blocks and its first moment's rows, and the parameter's statistics. The compiled step
    treats the first dimension of each as dynamic, so one graph serves every size."""

    param: torch.Tensor  # (n, block_size), updated in place
    grad: torch.Tensor  # (n, block_size)
    exp_avg_codes: torch.Tensor  # the chunk's rows of the first moment, updated in place
    exp_avg_scales: torch.Tensor
    row: torch.Tensor  # this step's row statistics
    col_normalized: torch.Tensor  # col / mean(col)


class FactoredScalars(NamedTuple):
    """The 0-d tensors ``factored_adamw_step`` reads (inputs of the compiled graph, so new
    values never recompile it)."""

    first_element: torch.Tensor  # int64: the chunk's first element in the flat parameter
    columns: torch.Tensor  # int64: the length of the last dimension
    lr: torch.Tensor
    beta1: torch.Tensor
    eps: torch.Tensor
    weight_decay: torch.Tensor
    bias_correction1: torch.Tensor
    bias_correction2_sqrt: torch.Tensor
    max_ratio: torch.Tensor  # adam_ratio_bound at this step


def factored_adamw_step(blocks: FactoredBlocks, scalars: FactoredScalars, *, exp_avg_format: QuantFormat,
                        maximize: bool, stochastic_round: bool, decoupled_weight_decay: bool,
                        weight_correction: torch.Tensor | None = None):
    """Whole blocks ``(n, block_size)`` of a parameter starting at flat element
    ``scalars.first_element``, in place: the first moment's codes and scales and the
    parameter. Elements past the parameter's end (a padded last block) read the last row's
    statistics. ``weight_correction``: the same blocks of a bfloat16 or float16 parameter's
    master weight correction (``master_weights``), or ``None``."""
    param, grad, exp_avg_codes, exp_avg_scales, row, col_normalized = blocks
    first_element, columns, lr, beta1, eps, weight_decay = scalars[:6]
    dtype = compute_dtype(param)
    blocks, block_size = param.shape
    exp_avg_parts = exp_avg_format.decode_parts(exp_avg_codes, exp_avg_scales)
    param_parts = exp_avg_format.split(param)
    grad_parts = exp_avg_format.split(grad)
    weight_correction_parts = None if weight_correction is None else exp_avg_format.split(weight_correction)
    part_width = block_size // len(param_parts)
    block_starts = first_element + torch.arange(blocks, device=param.device)[:, None] * block_size
    corrections = (scalars.bias_correction1, scalars.bias_correction2_sqrt)

    new_params, new_exp_avgs = [], []
    for index, param_part in enumerate(param_parts):
        flat = block_starts + (index * part_width + torch.arange(part_width, device=param.device))
        row_index = flat // columns
        col_index = flat - row_index * columns
        second_moment = row[row_index.clamp(max=row.shape[0] - 1)] * col_normalized[col_index]
        if weight_correction_parts is not None:
            param_part = read_master(param_part, weight_correction_parts[index])
        old_param, exp_avg = param_part.to(dtype), exp_avg_parts[index].to(dtype)
        finite, safe_grad = effective_gradient(old_param, grad_parts[index].to(dtype),
                                               weight_decay=weight_decay, maximize=maximize,
                                               decoupled_weight_decay=decoupled_weight_decay)
        new_exp_avg = first_moment_update(exp_avg, safe_grad, beta1)
        new_param = parameter_update(old_param, new_exp_avg, second_moment.to(dtype), lr=lr, eps=eps,
                                     weight_decay=weight_decay, corrections=corrections,
                                     decoupled_weight_decay=decoupled_weight_decay,
                                     max_ratio=scalars.max_ratio)
        new_params.append(torch.where(finite, new_param, old_param))
        new_exp_avgs.append(torch.where(finite, new_exp_avg, exp_avg))

    codes, scales = exp_avg_format.encode_parts(new_exp_avgs)
    exp_avg_codes.copy_(codes)
    exp_avg_scales.copy_(scales)
    for index, (param_part, new_param) in enumerate(zip(param_parts, new_params)):
        if weight_correction_parts is not None:
            write_master(param_part, weight_correction_parts[index], new_param)
        else:
            write_param(param_part, new_param, stochastic_round=stochastic_round)


class FactoredFunctions(NamedTuple):
    """The factored step's two passes, compiled for one first-moment format."""

    statistics: object  # second_moment_means
    update: object  # factored_adamw_step


# ``compiled_functions``' results: (first-moment format, correction dtype) -> both passes.
_COMPILED: dict[tuple, FactoredFunctions] = {}


def compiled_functions(exp_avg_format: QuantFormat,
                       correction_dtype: torch.dtype | None = None) -> FactoredFunctions:
    """Both passes compiled, once per process, format and master weight correction dtype
    (``None`` without one): each its own code objects, so that the graphs of one (a graph per
    parameter dtype and flags) stay within Dynamo's limit of 8 per code object."""
    key = (exp_avg_format, correction_dtype)
    if key not in _COMPILED:
        suffix = "__".join(map(variant_name, key)).replace("-", "_")
        _COMPILED[key] = FactoredFunctions(
            statistics=torch.compile(
                with_own_code_object(second_moment_means, f"second_moment_means__{suffix}"), dynamic=False),
            update=torch.compile(
                with_own_code_object(factored_adamw_step, f"factored_adamw_step__{suffix}"), dynamic=False),
        )
    return _COMPILED[key]


def compiled_graph_count(exp_avg_format: QuantFormat) -> int:
    """How many graphs Dynamo holds for the factored step's two functions together, over every
    correction dtype."""
    return sum(compiled_graph_count_of(function) for (fmt, _), functions in _COMPILED.items()
               if fmt == exp_avg_format for function in functions)


def _statistics(entry):
    """A factored entry's second moment (``state.factored.FactoredState``)."""
    return entry.moments[1]


class FactoredParams:
    """The factored parameters of one ``rule_step.RulePlan``, stepped together in place with
    ``"compile"``, ``"eager"`` or the C++ kernel: every parameter's statistics pass first, then, for FSDP2
    shards, one all-reduce of all their column means' shares per set of process groups (each
    rank holds other rows: ``sharding.sum_across_shards``), then every update pass.

    ``entries``: ``(index, rule_step.RuleEntry)`` of this rank's tensors, indices into the plan's
    gradient list; ``params``: the parameters as the optimizer holds them (DTensors under
    FSDP2), which say across which ranks the rows are split and how many there are in all.
    ``kernel``: per entry, whether the C++ CPU kernel takes it (``dispatch.factored_kernel_takes``
    decides, with ``backend="cpu"``): both of its passes then run there (``cpu_kernel_factored``), on
    the instruction set ``kernel_isa``.
    The column means and the normalised columns live in buffers kept from step to step.
    """

    def __init__(self, entries: list, params: list[torch.Tensor], kernel: list[bool] | None = None,
                 kernel_isa: str | None = None):
        self.entries = entries
        self.kernel = kernel or [False] * len(entries)
        self.all_rows = [factor_shape(param.shape).rows for param in params]
        self.normalized_columns = [torch.empty_like(_statistics(entry).col) for _, entry in entries]
        buckets: dict[tuple, list[int]] = {}
        for position, ((_, entry), param) in enumerate(zip(entries, params)):
            key = (sharding.shard_groups(param), _statistics(entry).col.device)
            buckets.setdefault(key, []).append(position)
        self.column_means: list[torch.Tensor | None] = [None] * len(entries)
        self.reductions = []  # (flat column means, process groups) for sharded parameters
        for (groups, device), positions in buckets.items():
            lengths = [_statistics(entries[p][1]).col.numel() for p in positions]
            flat = torch.zeros(sum(lengths), device=device)
            for position, view in zip(positions, flat.split(lengths)):
                self.column_means[position] = view
            if groups:
                self.reductions.append((flat, groups))
        self.kernel_passes = None  # the kernel's passes, their argument lists made once
        if any(self.kernel):
            taken = [position for position, by_kernel in enumerate(self.kernel) if by_kernel]
            self.kernel_passes = cpu_kernel_factored.FactoredKernel(
                [entries[p] for p in taken], [self.column_means[p] for p in taken],
                [self.normalized_columns[p] for p in taken], [self.all_rows[p] for p in taken], kernel_isa)

    def run(self, backend: str, grads: list[torch.Tensor], hyper, scratch, *, maximize: bool,
            stochastic_round: bool, decoupled_weight_decay: bool) -> None:
        """One step of every factored parameter (``hyper``: the group's ``lr``, ``beta1``,
        ``beta2``, ``eps`` and ``weight_decay``, 0-d tensors; each entry has its own step)."""
        flags = dict(maximize=maximize, decoupled_weight_decay=decoupled_weight_decay)
        kernel = self.kernel
        for position, (index, entry) in enumerate(self.entries):
            if not kernel[position]:
                self._accumulate_statistics(backend, entry._replace(grad=grads[index]), hyper,
                                            self.column_means[position], self.all_rows[position], scratch,
                                            flags=flags)
        if any(kernel):
            self._kernel_statistics(kernel, grads, hyper, flags=flags)
        for flat, groups in self.reductions:
            sharding.sum_across_shards(flat, groups)
        others = [position for position, by_kernel in enumerate(kernel) if not by_kernel]
        if others:
            accumulate_statistics([_statistics(self.entries[p][1]).col for p in others], hyper.beta2,
                                  [self.column_means[p] for p in others])
        if any(kernel):
            self._kernel_columns(kernel, hyper)
        # The bias corrections and Adam's bound depend on the step count only, which the
        # parameters of a plan nearly always share: worked out once per count, not per
        # parameter (a dozen 0-d host operations each).
        step_scalars = {}
        for position in others:
            index, entry = self.entries[position]
            normalized_columns(_statistics(entry).col, out=self.normalized_columns[position])
            count = float(entry.step)
            if count not in step_scalars:
                step_scalars[count] = (*bias_corrections(hyper.beta1, hyper.beta2, entry.step),
                                       adam_ratio_bound(hyper.beta1, hyper.beta2, entry.step))
            self._update(backend, entry._replace(grad=grads[index]), hyper, step_scalars[count],
                         self.normalized_columns[position], scratch,
                         stochastic_round=stochastic_round, flags=flags)
        if any(kernel):
            self._kernel_update(kernel, grads, hyper, stochastic_round=stochastic_round, flags=flags)

    def _kernel_statistics(self, kernel: list[bool], grads, hyper, *, flags) -> None:
        """Pass 1 of the parameters the C++ kernel takes, in one call: ``_accumulate_statistics``'
        result, each statistic within one float32 ulp of it (docs/cpu_kernel.md)."""
        self.kernel_passes.statistics(grads, hyper, **flags)

    def _kernel_columns(self, kernel: list[bool], hyper) -> None:
        """The column statistics of the parameters the C++ kernel takes, accumulated and
        normalised in one call (three foreach operations and three per parameter otherwise)."""
        self.kernel_passes.columns(hyper)

    def _kernel_update(self, kernel: list[bool], grads, hyper, *, stochastic_round: bool, flags) -> None:
        """The update pass of the parameters the C++ kernel takes: one call per first-moment
        format, block size and presence of a master weight correction."""
        self.kernel_passes.update(grads, hyper, stochastic_round=stochastic_round, **flags)

    @staticmethod
    def _accumulate_statistics(backend, entry, hyper, column_means, all_rows: int, scratch, *,
                               flags) -> None:
        """Pass 1: this step's row statistics (in place), and this shard's share of the
        column means of ``(1 - beta2) * g**2`` (over ``all_rows`` rows) into
        ``column_means``, a bounded chunk of rows at a time."""

        compiled = backend == "compile"
        correction_dtype = correction_dtype_of(entry.weight_correction)
        exp_avg, factored = entry.moments
        statistics_step = (compiled_functions(exp_avg.format, correction_dtype).statistics if compiled
                           else second_moment_means)
        rows, columns = factored.row.numel(), factored.col.numel()
        param_matrix = entry.param.detach().reshape(rows, columns)  # read only (L2 weight decay)
        if entry.weight_correction is not None and not flags["decoupled_weight_decay"]:
            param_matrix = read_master(param_matrix, entry.weight_correction.reshape(rows, columns))
        grad_matrix = entry.grad.detach().reshape(rows, columns)
        # 0-d int64 inputs, filled in place: sizes as tensors, so no size is a guarded constant.
        columns_scalar = scratch.index_scalar("columns").fill_(columns)
        all_rows_scalar = scratch.index_scalar("all_rows").fill_(all_rows)
        column_means.zero_()
        chunk_rows = max(1, chunks.CHUNK_ELEMENTS // columns)
        for first in range(0, rows, chunk_rows):
            chunk = slice(first, min(first + chunk_rows, rows))
            param_rows, grad_rows = param_matrix[chunk], grad_matrix[chunk]
            dynamic = [(param_rows, (0, 1)), (grad_rows, (0, 1))]
            row_means, column_shares = call_step(statistics_step, compiled, dynamic, param_rows, grad_rows,
                                             hyper.beta2, hyper.weight_decay, columns_scalar,
                                             all_rows_scalar, **flags)
            accumulate_statistic(factored.row[chunk], hyper.beta2, row_means)
            column_means.add_(column_shares).clamp_(max=torch.finfo(torch.float32).max)

    @staticmethod
    def _update(backend, entry, hyper, step_scalars, col_normalized, scratch, *, stochastic_round,
                flags) -> None:
        """Pass 2: the first moment and the parameter, a bounded chunk of whole quantization
        blocks at a time (``step_scalars``: the two bias corrections and Adam's bound)."""

        param, grad, (exp_avg, factored), _, weight_correction = entry
        compiled = backend == "compile"
        update_step = (compiled_functions(exp_avg.format, correction_dtype_of(weight_correction)).update
                       if compiled else factored_adamw_step)
        # 0-d int64 inputs of the compiled update, owned by the optimizer and filled in place:
        # no tensor is made per step, and no size becomes a guarded constant.
        columns_scalar = scratch.index_scalar("columns").fill_(factored.col.numel())
        first_element_scalar = scratch.index_scalar("first_element")
        options = dict(exp_avg_format=exp_avg.format, stochastic_round=stochastic_round, **flags)
        scalars = FactoredScalars(first_element_scalar, columns_scalar, hyper.lr, hyper.beta1, hyper.eps,
                                  hyper.weight_decay, *step_scalars)

        def update(param_blocks, grad_blocks, block_rows: slice, first_element: int, correction_blocks):
            first_element_scalar.fill_(first_element)
            blocks = FactoredBlocks(param_blocks, grad_blocks, exp_avg.codes[block_rows],
                                    exp_avg.scales[block_rows], factored.row, col_normalized)
            dynamic = [(tensor, (0,)) for tensor in blocks]
            master = {}
            if correction_blocks is not None:
                dynamic.append((correction_blocks, (0,)))
                master["weight_correction"] = correction_blocks
            call_step(update_step, compiled, dynamic, blocks, scalars, **options, **master)

        for_each_block_chunk(param, grad, exp_avg.block_size, scratch, update,
                             weight_correction=weight_correction)
