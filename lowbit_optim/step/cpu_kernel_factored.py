"""``AdamWFactored4bit``'s step in the C++ CPU kernel (``cpu_kernel``): its two passes, each one
call for every parameter it steps (as ``cpu_kernel.KernelBatch``: the per-call cost from Python
is paid once per step, not once per parameter).

``factored_statistics`` is ``factored.second_moment_means`` followed by the accumulation of the
row statistics and of the column means' shares, for whole parameters
(``csrc/factored_statistics.h``): the same float64 terms, summed in another order
(docs/cpu_kernel.md: at most one float32 ulp per statistic apart from the compiled step's).
``factored_columns`` accumulates and normalises the column statistics between the passes.
``factored_step`` is ``factored.factored_adamw_step`` over every block of the parameters in one
pass (``csrc/rules/adamw_factored.h``, on the kernel's block step with its policies and master
weights): bit for bit the compiled step's for the same statistics.
"""

from typing import NamedTuple

import torch

from lowbit_optim.step import chunks
from lowbit_optim.step.cpu_kernel import DECOUPLED, ISAS, default_isa, format_constants


class StatisticsInputs(NamedTuple):
    """One parameter's share of the statistics pass: its ``(rows, columns)`` gradient, the
    parameter read under L2 decay (the gradient's dtype, or a float32 master weight), its row
    statistics (updated in place), the buffer its column means' share goes to, and how many
    rows the whole parameter has (an FSDP2 shard holds some of them)."""

    param_matrix: torch.Tensor
    grad_matrix: torch.Tensor
    row: torch.Tensor
    column_means: torch.Tensor
    all_rows: int


def factored_statistics(inputs: list[StatisticsInputs], *, beta2: torch.Tensor, weight_decay: torch.Tensor,
                        maximize: bool, decoupled_weight_decay: bool, isa: str | None = None) -> None:
    """Pass 1 for each parameter: each row's mean of ``(1 - beta2) * g**2`` accumulated into its
    row statistics (``factored.accumulate_statistic``), and its column means' share set, over
    ``all_rows`` rows, a chunk of rows (``chunks.CHUNK_ELEMENTS``) at a time as the compiled
    pass adds them (float32, saturated at the largest float32)."""
    torch.ops.lowbit_optim.cpu_factored_statistics(
        [i.param_matrix.detach() for i in inputs], [i.grad_matrix.detach() for i in inputs],
        [i.row for i in inputs], [i.column_means for i in inputs], [beta2, weight_decay],
        [i.all_rows for i in inputs],
        [max(1, chunks.CHUNK_ELEMENTS // i.grad_matrix.shape[1]) for i in inputs], maximize,
        decoupled_weight_decay, ISAS[isa or default_isa()])


def factored_columns(cols: list[torch.Tensor], column_means: list[torch.Tensor],
                     col_normalized: list[torch.Tensor], *, beta2: torch.Tensor) -> None:
    """Between the passes, each parameter's column statistic accumulated in place
    (``factored.accumulate_statistics``, the same float32 operations) and normalised into its
    ``col_normalized`` buffer (``state.factored.normalized_columns``, the mean summed in index
    order: within one float32 ulp of torch's, docs/cpu_kernel.md), in one call."""
    torch.ops.lowbit_optim.cpu_factored_columns(cols, column_means, col_normalized, beta2)


class UpdateInputs(NamedTuple):
    """One parameter's share of the update pass: the parameter and its gradient, its first
    moment (a 4-bit ``QuantizedState``), this step's row statistics and normalised columns
    (``col / mean(col)``), its step count and its master weight correction (or None)."""

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: object
    row: torch.Tensor
    col_normalized: torch.Tensor
    step: torch.Tensor
    weight_correction: torch.Tensor | None


def factored_step(inputs: list[UpdateInputs], scalars: tuple, *, maximize: bool, stochastic_round: bool,
                  decoupled_weight_decay: bool, isa: str | None = None) -> None:
    """The update pass of parameters whose first moments share a format and block size, and
    which all have a master weight correction or none, in place. ``scalars``: the group's lr,
    beta1, beta2, eps and weight_decay (0-d CPU tensors); the kernel forms each parameter's
    bias corrections and Adam's bound from its step count, as ``cpu_kernel.cpu_adamw_step``
    does."""
    exp_avgs = [i.exp_avg for i in inputs]
    constants = format_constants((exp_avgs[0].format,))
    decoupled = DECOUPLED[bool(decoupled_weight_decay)]
    corrections = [i.weight_correction for i in inputs]
    torch.ops.lowbit_optim.cpu_factored_step(
        [i.param.detach() for i in inputs], [i.grad.detach() for i in inputs], [m.codes for m in exp_avgs],
        [m.scales for m in exp_avgs], [] if corrections[0] is None else corrections, [i.row for i in inputs],
        [i.col_normalized for i in inputs], constants.tables, constants.encoders, constants.cells,
        [value for i in inputs for value in (*scalars, i.step, decoupled)], constants.kind,
        exp_avgs[0].block_size, maximize, stochastic_round, ISAS[isa or default_isa()],
    )
