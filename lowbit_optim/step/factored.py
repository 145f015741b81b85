"""The factored layout of a second moment (``AdamWFactored4bit``): what its step adds to the
generic one of ``rule_step``.

A factored parameter's step is a statistics pass, then the generic element pass over the rule's
``update`` (``rules.adamw.AdamWFactoredRule``), each in bounded chunks
(``chunks.CHUNK_ELEMENTS``), so no parameter-sized float32 temporary is ever made:

1. ``second_moment_means``: per chunk of rows of the ``(rows, columns)`` view, the means over
   columns and (this chunk's share of) over rows of ``(1 - beta2) * g**2``
   (``math.squared_gradient_term``). They update the statistics as Adafactor does:
   ``row = beta2 * row + mean_j(...)``, ``col = beta2 * col + mean_i(...)``. Each term is
   divided before it is summed: a sum of terms torch's AdamW keeps finite (a gradient of
   1e20 gives 1e37) would overflow float32 over a few dozen columns, and the statistics would
   become inf, the parameter NaN. Under FSDP2 the column means' shares are summed across the
   ranks that hold the other rows.
2. ``rule_step.quantized_rule_step`` over the 4-bit first moment, which it decodes, updates and
   re-encodes, with the second moment the rule reads supplied by this layout instead of a
   decoded stored one: ``FactoredMoment``, each element's ``row[i] * col[j] / mean(col)``
   (``state.factored.reconstruct``) found from its flat index.

Elements with a non-finite gradient keep their parameter value and first moment (the shared
policy of ``rule_step.apply_rule``), and add 0 to the statistics. Every compiled function takes
tensors only (hyperparameters and indices as 0-d tensors), so one graph serves every shape and
schedule. With ``backend="cpu"`` both passes run in the C++ kernel (``cpu_kernel_factored``).
"""

from typing import NamedTuple

import torch

from lowbit_optim.formats.catalog import QuantFormat
from lowbit_optim.state import sharding
from lowbit_optim.state.factored import factor_shape, normalized_columns
from lowbit_optim.step import chunks, cpu_kernel_factored
from lowbit_optim.step.chunks import CompiledVariants, call_step, correction_dtype_of
from lowbit_optim.step.master_weights import read_master
from lowbit_optim.step.math import effective_gradient, squared_gradient_term


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


class FactoredMoment(NamedTuple):
    """A factored second moment as the generic element pass reads it
    (``rule_step.quantized_rule_step``, which takes it read only): the tensors of one chunk
    of whole blocks starting at flat element ``first_element``. The compiled step treats
    the statistics' lengths as dynamic and reads the indices as 0-d inputs, so one graph
    serves every shape and chunk."""

    row: torch.Tensor  # this step's row statistics
    col_normalized: torch.Tensor  # col / mean(col)
    first_element: torch.Tensor  # 0-d int64: the chunk's first element in the flat parameter
    columns: torch.Tensor  # 0-d int64: the length of the last dimension

    def parts(self, blocks: torch.Tensor, count: int) -> list[torch.Tensor]:
        """The second moment of each element of ``blocks`` (the chunk, ``(n, block_size)``)
        in the ``count`` slices of consecutive elements a format's ``split`` makes: the
        element at flat index ``f`` reads ``row[i] * col_normalized[j]``, ``i = f // columns``
        (clamped to the last row: the zero padding of a partial last block reads it),
        ``j = f - i * columns`` (``state.factored.reconstruct`` element by element)."""
        block_count, block_size = blocks.shape
        width = block_size // count
        device, last_row = blocks.device, self.row.shape[0] - 1
        block_starts = self.first_element + torch.arange(block_count, device=device)[:, None] * block_size
        values = []
        for index in range(count):
            flat = block_starts + (index * width + torch.arange(width, device=device))
            row_index = flat // self.columns
            col_index = flat - row_index * self.columns
            values.append(self.row[row_index.clamp(max=last_row)] * self.col_normalized[col_index])
        return values


# The statistics pass compiled once per first-moment format, master weight correction dtype and
# flags (``chunks.CompiledVariants``): the first two keep the graphs of one optimizer class
# apart, as the element pass's variants are.
COMPILED_STATISTICS = CompiledVariants(second_moment_means, "second_moment_means")


def compiled_graph_count(exp_avg_format: QuantFormat) -> int:
    """How many graphs Dynamo holds for the statistics pass of parameters whose first moment
    is in ``exp_avg_format`` (the element pass's are ``rule_step.rule_graph_count``'s for
    ``rules.adamw.ADAMW_FACTORED``)."""
    return COMPILED_STATISTICS.graph_count(exp_avg_format)


def _statistics(entry):
    """A factored entry's second moment (``state.factored.FactoredState``)."""
    return entry.moments[1]


class FactoredParams:
    """The factored parameters of one ``rule_step.RulePlan``, stepped together in place with
    ``"compile"``, ``"eager"`` or the C++ kernel: every parameter's statistics pass first, then, for FSDP2
    shards, one all-reduce of all their column means' shares per set of process groups (each
    rank holds other rows: ``sharding.sum_across_shards``), then every element pass.

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

    def run(self, backend: str, grads: list[torch.Tensor], hyper, scratch, step_elements, *, constants_of,
            maximize: bool, stochastic_round: bool, decoupled_weight_decay: bool) -> None:
        """One step of every factored parameter (``hyper``: the group's ``lr``, ``beta1``,
        ``beta2``, ``eps`` and ``weight_decay``, 0-d tensors; each entry has its own step):
        the statistics pass, then the element pass: the C++ kernel's for the parameters it
        takes, ``step_elements(entry, read_moments)`` for the others, the generic quantized
        step of ``rule_step.RulePlan`` over the entry's first moment, with
        ``read_moments(first_element)`` the second moment it reads for the chunk of blocks
        from that element (``FactoredMoment``); ``constants_of(step)``: the rule's
        ``step_constants`` at a step count, which the kernel's element pass reads."""
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
        for position in others:
            index, entry = self.entries[position]
            exp_avg, factored = entry.moments
            col_normalized = normalized_columns(factored.col, out=self.normalized_columns[position])
            step_elements(entry._replace(grad=grads[index], moments=(exp_avg,)),
                          self._read_moments(factored.row, col_normalized, scratch))
        if any(kernel):
            self.kernel_passes.update(grads, constants_of, maximize=maximize,
                                      stochastic_round=stochastic_round)

    def _kernel_statistics(self, kernel: list[bool], grads, hyper, *, flags) -> None:
        """Pass 1 of the parameters the C++ kernel takes, in one call: ``_accumulate_statistics``'
        result, each statistic within one float32 ulp of it (docs/cpu_kernel.md)."""
        self.kernel_passes.statistics(grads, hyper, **flags)

    def _kernel_columns(self, kernel: list[bool], hyper) -> None:
        """The column statistics of the parameters the C++ kernel takes, accumulated and
        normalised in one call (three foreach operations and three per parameter otherwise)."""
        self.kernel_passes.columns(hyper)

    @staticmethod
    def _accumulate_statistics(backend, entry, hyper, column_means, all_rows: int, scratch, *,
                               flags) -> None:
        """Pass 1: this step's row statistics (in place), and this shard's share of the
        column means of ``(1 - beta2) * g**2`` (over ``all_rows`` rows) into
        ``column_means``, a bounded chunk of rows at a time."""

        compiled = backend == "compile"
        correction_dtype = correction_dtype_of(entry.weight_correction)
        exp_avg, factored = entry.moments
        variant = (exp_avg.format, correction_dtype, flags["maximize"], flags["decoupled_weight_decay"])
        statistics_step = COMPILED_STATISTICS.get(variant) if compiled else second_moment_means
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
    def _read_moments(row: torch.Tensor, col_normalized: torch.Tensor, scratch):
        """``run``'s ``read_moments`` of one parameter. Its indices are 0-d int64 inputs owned
        by the optimizer and filled in place: no tensor is made per chunk, and no size becomes
        a guarded constant."""
        columns = scratch.index_scalar("columns").fill_(col_normalized.numel())
        first_element = scratch.index_scalar("first_element")

        def read_moments(first: int) -> tuple[FactoredMoment]:
            first_element.fill_(first)
            return (FactoredMoment(row, col_normalized, first_element, columns),)

        return read_moments
