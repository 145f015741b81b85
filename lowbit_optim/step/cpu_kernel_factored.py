"""``AdamWFactored4bit``'s step in the C++ CPU kernel (``cpu_kernel``): ``FactoredKernel`` runs its
two passes and the column statistics between them, each one call for every parameter it steps
(as ``cpu_kernel.KernelBatch``: the per-call cost from Python is paid once per step, not once per
parameter, and the lists each call passes are made once per plan).

``FactoredKernel.statistics`` is ``factored.second_moment_means`` followed by the accumulation of the
row statistics and of the column means' shares, for whole parameters
(``csrc/factored_statistics.h``): the same float64 terms, summed in another order
(docs/cpu_kernel.md: at most one float32 ulp per statistic apart from the compiled step's).
``FactoredKernel.columns`` accumulates and normalises the column statistics between the passes.
``FactoredKernel.update`` is the element pass (``rule_step.quantized_rule_step`` over
``rules.adamw.AdamWFactoredRule``) over every block of the parameters in one pass
(``csrc/rules/adamw_factored.h``, on the kernel's block step with its policies and master
weights): bit for bit the compiled step's for the same statistics.
"""

import operator
from typing import NamedTuple

import torch

from lowbit_optim.step import chunks
from lowbit_optim.step.cpu_kernel import check_functor_constants, default_isa, format_constants
from lowbit_optim.step.master_weights import read_master

# The kernel's functor of the update pass (csrc/rules/adamw_factored.h): AdamW's values.
_FUNCTOR = "adamw_factored"
_CODES = operator.attrgetter("codes")
_SCALES = operator.attrgetter("scales")
_ROW = operator.attrgetter("row")
_COL = operator.attrgetter("col")


class _UpdateCall(NamedTuple):
    """The parameters one ``cpu_factored_step`` call updates: their first moments share a
    format and block size, and all have a master weight correction or none."""

    indices: list[int]
    params: list[torch.Tensor]
    exp_avgs: list
    exp_avg_sqs: list
    col_normalized: list[torch.Tensor]
    steps: list[torch.Tensor]
    corrections: list[torch.Tensor]


class FactoredKernel:
    """The kernel's passes over a plan's factored parameters (``entries``: ``(index in the
    step's gradient list, rule_step.RuleEntry)``, the moments a 4-bit ``QuantizedState`` and a
    ``FactoredState``; per entry, the buffers its column means' share and its normalised columns
    go to and how many rows the whole parameter has: an FSDP2 shard holds some), on the instruction
    set ``isa`` (one of ``cpu_kernel.ISAS``; None: ``cpu_kernel.default_isa()``). The
    operators read the parameters, gradients and statistics as flat contiguous tensors of
    ``rows * columns`` elements (the row and column statistics give the shape). The lists hold
    the plan's tensors and state objects, which live as long as the plan
    (``plan.GroupPlan.matches``)."""

    def __init__(self, entries: list[tuple], column_means: list[torch.Tensor],
                 col_normalized: list[torch.Tensor], all_rows: list[int], isa: str | None = None):
        self.isa = isa or default_isa()
        self.indices = [index for index, _ in entries]
        self.params = [entry.param.detach() for _, entry in entries]
        self.corrections = [entry.weight_correction for _, entry in entries]
        self.exp_avg_sqs = [entry.moments[1] for _, entry in entries]
        self.column_means, self.col_normalized, self.all_rows = column_means, col_normalized, all_rows
        calls: dict[tuple, list[int]] = {}
        exp_avgs = [entry.moments[0] for _, entry in entries]
        for position, (exp_avg, correction) in enumerate(zip(exp_avgs, self.corrections)):
            calls.setdefault((exp_avg.format, exp_avg.block_size, correction is None), []).append(position)
        self.update_calls = [
            _UpdateCall([entries[p][0] for p in positions], [self.params[p] for p in positions],
                        [exp_avgs[p] for p in positions], [self.exp_avg_sqs[p] for p in positions],
                        [col_normalized[p] for p in positions], [entries[p][1].step for p in positions],
                        [] if key[2] else [self.corrections[p] for p in positions])
            for key, positions in calls.items()
        ]

    def statistics(self, grads: list[torch.Tensor], hyper, *, maximize: bool,
                   decoupled_weight_decay: bool) -> None:
        """Pass 1 for each parameter: each row's mean of ``(1 - beta2) * g**2`` accumulated into
        its row statistics (``factored.accumulate_statistic``), and its column means' share set,
        over ``all_rows`` rows, a chunk of rows (``chunks.CHUNK_ELEMENTS``) at a time as the
        compiled pass adds them (float32, saturated at the largest float32). Under L2 decay a
        parameter with a master weight correction is read as its float32 master weight."""
        params = self.params
        if not decoupled_weight_decay:
            params = [param if correction is None else read_master(param, correction)
                      for param, correction in zip(params, self.corrections)]
        columns = [col.numel() for col in map(_COL, self.exp_avg_sqs)]
        torch.ops.lowbit_optim.cpu_factored_statistics(
            params, [grads[i] for i in self.indices], [*map(_ROW, self.exp_avg_sqs)], self.column_means,
            beta2=hyper.beta2, weight_decay=hyper.weight_decay, all_rows=self.all_rows,
            chunk_rows=[max(1, chunks.CHUNK_ELEMENTS // count) for count in columns], maximize=maximize,
            decoupled=decoupled_weight_decay, isa=self.isa)

    def columns(self, hyper) -> None:
        """Between the passes, each parameter's column statistic accumulated in place
        (``factored.accumulate_statistics``, the same float32 operations) and normalised into
        its ``col_normalized`` buffer (``state.factored.normalized_columns``, the mean summed in
        index order: within one float32 ulp of torch's, docs/cpu_kernel.md)."""
        torch.ops.lowbit_optim.cpu_factored_columns([*map(_COL, self.exp_avg_sqs)], self.column_means,
                                                    self.col_normalized, beta2=hyper.beta2)

    def update(self, grads: list[torch.Tensor], constants_of, *, maximize: bool,
               stochastic_round: bool) -> None:
        """The update pass, in place: one call per first-moment format, block size and presence
        of a master weight correction. Each parameter's values are ``constants_of(step)``, the
        plan's rule's ``step_constants`` at its step count (AdamW's: the functor's order); the
        kernel forms the bias corrections from them."""
        for call in self.update_calls:
            constants = [constants_of(step) for step in call.steps]
            check_functor_constants(_FUNCTOR, type(constants[0]))
            values = [value for step_values in constants for value in step_values]
            torch.ops.lowbit_optim.cpu_factored_step(
                call.params, [grads[i] for i in call.indices], [*map(_CODES, call.exp_avgs)],
                [*map(_SCALES, call.exp_avgs)], call.corrections, values, rows=[*map(_ROW, call.exp_avg_sqs)],
                col_normalized=call.col_normalized, **format_constants((call.exp_avgs[0].format,)),
                block_size=call.exp_avgs[0].block_size, maximize=maximize, stochastic_round=stochastic_round,
                isa=self.isa,
            )
