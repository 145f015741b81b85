"""``AdamWFactored4bit``'s step in the C++ CPU kernel (``cpu_kernel``): its two passes.

``factored_statistics`` is ``factored.second_moment_means`` followed by the accumulation of the
row statistics and of the column means' shares, for a whole parameter
(``csrc/factored_statistics.h``): the same float64 terms, summed in another order
(docs/cpu_kernel.md: at most one float32 ulp per statistic apart from the compiled step's).
``factored_step`` is ``factored.factored_adamw_step`` over every block of the parameter in one
pass (``csrc/rules/adamw_factored.h``, on the kernel's block step with its policies and master
weights): bit for bit the compiled step's for the same statistics.
"""

import torch

from lowbit_optim.step import chunks
from lowbit_optim.step.cpu_kernel import DECOUPLED, ISAS, default_isa, format_constants
from lowbit_optim.step.math import StepScalars


def factored_statistics(param_matrix: torch.Tensor, grad_matrix: torch.Tensor, row: torch.Tensor,
                        column_means: torch.Tensor, *, beta2: torch.Tensor, weight_decay: torch.Tensor,
                        all_rows: int, maximize: bool, decoupled_weight_decay: bool,
                        isa: str | None = None) -> None:
    """Pass 1 for a ``(rows, columns)`` gradient: each row's mean of ``(1 - beta2) * g**2``
    accumulated into the row statistics ``row`` (``factored.accumulate_statistic``), and
    ``column_means`` set to this shard's share of the column means over ``all_rows`` rows, a
    chunk of rows (``chunks.CHUNK_ELEMENTS``) at a time as the compiled pass adds them (float32,
    saturated at the largest float32). ``param_matrix``: read under L2 decay only (the
    gradient's dtype, or a float32 master weight)."""
    rows, columns = grad_matrix.shape
    chunk_rows = max(1, chunks.CHUNK_ELEMENTS // columns)
    torch.ops.lowbit_optim.cpu_factored_statistics(
        param_matrix.detach().contiguous(), grad_matrix.detach().contiguous(), row, column_means,
        [beta2, weight_decay], all_rows, chunk_rows, maximize, decoupled_weight_decay,
        ISAS[isa or default_isa()])


def factored_step(param, grad, exp_avg, row: torch.Tensor, col_normalized: torch.Tensor,
                  scalars: StepScalars, *, maximize: bool, stochastic_round: bool,
                  decoupled_weight_decay: bool, isa: str | None = None,
                  weight_correction: torch.Tensor | None = None) -> None:
    """One factored parameter's update pass, in place: its first moment ``exp_avg`` (a 4-bit
    ``QuantizedState``) and the parameter (and its master weight ``weight_correction``, if
    any), with this step's ``row`` statistics and ``col_normalized`` (``col / mean(col)``).
    ``scalars``: 0-d CPU tensors, ``step`` the parameter's count (the kernel forms the bias
    corrections and Adam's bound from it, as ``cpu_kernel.cpu_adamw_step`` does)."""
    constants = format_constants((exp_avg.format,))
    works = [param.detach()] + ([] if weight_correction is None else [weight_correction])
    contiguous = [work if work.is_contiguous() else work.contiguous() for work in works]
    torch.ops.lowbit_optim.cpu_factored_step(
        contiguous[0], grad.detach().contiguous(), [exp_avg.codes], [exp_avg.scales],
        None if weight_correction is None else contiguous[1], row, col_normalized, constants.tables,
        constants.encoders, constants.cells, [*scalars, DECOUPLED[bool(decoupled_weight_decay)]],
        constants.kind, exp_avg.block_size, maximize, stochastic_round, ISAS[isa or default_isa()],
    )
    for work, copy in zip(works, contiguous):
        if copy is not work:
            work.copy_(copy)
