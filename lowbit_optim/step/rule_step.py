"""The step of any update rule that supplies its elementwise math (``rules.base.UpdateRule``):
``apply_rule`` wraps the rule's ``update`` in the policies every rule shares, and ``RulePlan``
runs it over a param group, quantized moments through ``quantized_rule_step`` (compiled once
per rule and formats, or eager) and float moments through ``float_state.FloatStateStep``.

Shared policies, so no rule writes them again: ``maximize`` negates the gradient; an element
whose gradient is NaN or ±inf keeps its parameter and its moments for that step (as
``math.adamw_update`` does); the update is computed in ``math.compute_dtype``; bf16 and fp16
parameters are written by rounding (bf16: or stochastic rounding) or through their master weight
(``master_weights``).

With ``backend="triton"`` the quantized parameters of a rule that supplies a Triton piece
(``UpdateRule.kernel_update``) go to the step kernel (``step.kernels``, imported only then),
and with ``backend="cpu"`` those of a rule that names a C++ functor (``UpdateRule.cpu_functor``)
go to the one-pass CPU kernel (``cpu_kernel``; not float64 parameters, nor blocks above 2048);
both apply the same policies. Everything else steps through the compiled step, which is also
the reference on every device.
"""

import functools
from typing import NamedTuple

import torch

from lowbit_optim.formats.catalog import QuantFormat
from lowbit_optim.state.quantized import QuantizedState
from lowbit_optim.step import cpu_kernel
from lowbit_optim.step.chunks import (
    CompiledVariants,
    TailScratch,
    call_step,
    correction_dtype_of,
    for_each_block_chunk,
    leading_dims,
)
from lowbit_optim.step.float_state import FloatStateStep, float_state_groups
from lowbit_optim.step.hyperparams import StepOptions
from lowbit_optim.step.master_weights import read_master
from lowbit_optim.step.math import compute_dtype, effective_gradient
from lowbit_optim.step.quantized import StoredMoment, store_blocks


class RuleEntry(NamedTuple):
    """One parameter's share of a rule's step: the tensors it updates (``moments`` in the
    rule's order, float tensors or ``QuantizedState``), its step count and a bfloat16 or
    float16 parameter's master weight correction, if it keeps one."""

    param: torch.Tensor
    grad: torch.Tensor | None
    moments: tuple
    step: torch.Tensor
    weight_correction: torch.Tensor | None = None


def apply_rule(rule, param, grad, moments: tuple, constants, *, maximize: bool):
    """``rule.update`` with the shared policies (module docstring): returns the new parameter
    and moments; the inputs are not modified."""
    finite, safe_grad = effective_gradient(param, grad, weight_decay=None, maximize=maximize,
                                           decoupled_weight_decay=True)
    new_param, new_moments = rule.update(param, safe_grad, moments, constants)
    kept = tuple(torch.where(finite, new, old) for new, old in zip(new_moments, moments))
    return torch.where(finite, new_param, param), kept


def quantized_rule_step(param, grad, moments: tuple[StoredMoment, ...], constants, *, rule,
                        formats: tuple[QuantFormat, ...], maximize: bool, stochastic_round: bool,
                        weight_correction: torch.Tensor | None = None) -> None:
    """``apply_rule`` on blocks: decode every moment, update, encode, in place.

    ``param`` and ``grad`` are ``(num_blocks, block_size)`` views, ``moments`` the stored
    tensors of the same rows of each quantized moment, in ``formats``. Each ``split`` slice
    (the two halves of a 4-bit block, whose codes share bytes) is updated on its own and
    only the packed bytes combine them, as in ``quantized.quantized_adamw_step``; every
    format of a rule's optimizer has the same bits, so they split alike.
    """
    dtype = compute_dtype(param)
    split = formats[0].split
    decoded = [fmt.decode_parts(*moment) for fmt, moment in zip(formats, moments)]
    param_parts, grad_parts = split(param), split(grad)
    correction_parts = None if weight_correction is None else split(weight_correction)
    new_params, new_moments = [], [[] for _ in moments]
    for index, param_part in enumerate(param_parts):
        if correction_parts is not None:
            param_part = read_master(param_part, correction_parts[index])
        new_param, updated = apply_rule(
            rule, param_part.to(dtype), grad_parts[index].to(dtype),
            tuple(parts[index].to(dtype) for parts in decoded), constants, maximize=maximize)
        new_params.append(new_param)
        for values, value in zip(new_moments, updated):
            values.append(value)
    store_blocks(list(zip(moments, formats, new_moments)), param_parts, new_params, correction_parts,
                 stochastic_round=stochastic_round)


# One compiled step per rule, formats, flags and correction dtype (``chunks.CompiledVariants``).
COMPILED_RULE_STEPS = CompiledVariants(quantized_rule_step, "quantized_step")


def rule_graph_count(rule, formats: tuple[QuantFormat, ...]) -> int:
    """How many graphs Dynamo holds for one rule's quantized step in ``formats`` (0 before its
    first call)."""
    return COMPILED_RULE_STEPS.graph_count(rule, *formats)


class RulePlan:
    """A rule's step over one param group's parameters, sorted once: quantized ones one by one
    (compiled unless ``backend="eager"``), float ones together per ``float_state_groups``.
    ``run`` steps them with the gradients given, one per entry, in order; the plan holds no
    gradient. Built by ``rules.base.UpdateRule.plan``."""

    def __init__(self, rule, entries: list[RuleEntry], backend: str):
        self.rule = rule
        self.compiled = backend != "eager"
        quantized = [index for index, entry in enumerate(entries)
                     if isinstance(entry.moments[0], QuantizedState)]
        # The kernel's: quantized parameters of a rule with a Triton piece (float64 ones have
        # no kernel variant).
        self.kernel_indices = [i for i in quantized if backend == "triton" and rule.kernel_update is not None
                               and entries[i].param.dtype != torch.float64]
        self.kernel = None
        if self.kernel_indices:
            from lowbit_optim.step import kernels  # imports Triton: only when the backend is in use

            self.kernel = kernels.KernelGroupPlan([kernels.KernelEntry(*entries[i])
                                                   for i in self.kernel_indices])
            self.kernel_update = kernels.KernelUpdate(rule.kernel_update)
        # The C++ CPU kernel's (in batches): quantized parameters of a rule with a functor that
        # the kernel takes.
        self.cpu_indices = [index for index in quantized
                            if backend == "cpu" and _cpu_kernel_takes(rule, entries[index])]
        self.cpu_batches = cpu_kernel.kernel_batches(
            [cpu_kernel.BatchEntry(index, entries[index].param, entries[index].moments, entries[index].step,
                                   entries[index].weight_correction) for index in self.cpu_indices],
            rule.cpu_functor, lambda entry: tuple(moment.format for moment in entry.moments))
        self.isa = cpu_kernel.default_isa() if self.cpu_indices else None
        taken = {*self.kernel_indices, *self.cpu_indices}
        self.quantized = [(index, entries[index]._replace(grad=None)) for index in quantized
                          if index not in taken]
        self.float_state = []
        floats = [(index, entry) for index, entry in enumerate(entries)
                  if not isinstance(entry.moments[0], QuantizedState)]
        for indices in float_state_groups(floats, moment_count=lambda entry: len(entry.moments)):
            group = [entries[i] for i in indices]
            master = group[0].weight_correction is not None
            self.float_state.append((indices, group[0].step, FloatStateStep(
                [e.param for e in group], [list(moments) for moments in zip(*(e.moments for e in group))],
                [e.weight_correction for e in group] if master else None)))

    def run(self, grads: list[torch.Tensor], scalars, options: StepOptions, scratch: TailScratch) -> None:
        """One step of every parameter (``scalars``: the group's ``hyperparams.GroupScalars``)."""
        constants_of = _ConstantsPerStep(self.rule, scalars)
        kernel_options = cpu_kernel.KernelOptions(options.maximize, options.stochastic_round, self.isa)
        for batch in self.cpu_batches:
            batch.run(grads, constants_of, kernel_options)
        for index, entry in self.quantized:
            self._quantized(entry._replace(grad=grads[index]), constants_of(entry.step), options, scratch)
        for indices, step, float_step in self.float_state:
            update = functools.partial(apply_rule, self.rule, constants=constants_of(step),
                                       maximize=options.maximize)
            float_step.step([grads[i] for i in indices], update, stochastic_round=options.stochastic_round)
        if self.kernel is not None:
            self.kernel.run([grads[i] for i in self.kernel_indices],
                            lambda step: self.rule.kernel_constants(constants_of(step)),
                            update=self.kernel_update,
                            maximize=options.maximize, stochastic_round=options.stochastic_round,
                            rounding_stream=options.rounding_stream)

    def _quantized(self, entry: RuleEntry, constants, options: StepOptions, scratch: TailScratch) -> None:
        formats = tuple(moment.format for moment in entry.moments)
        variant = (self.rule, *formats, options.maximize, options.stochastic_round,
                   correction_dtype_of(entry.weight_correction))
        step = COMPILED_RULE_STEPS.get(variant) if self.compiled else quantized_rule_step
        flags = dict(rule=self.rule, formats=formats, maximize=options.maximize,
                     stochastic_round=options.stochastic_round)

        def update(param_blocks, grad_blocks, block_rows: slice, first_element: int, correction_blocks):
            stored = tuple(StoredMoment(m.codes[block_rows], m.scales[block_rows]) for m in entry.moments)
            master = {} if correction_blocks is None else {"weight_correction": correction_blocks}
            tensors = (param_blocks, grad_blocks, correction_blocks, *(t for m in stored for t in m))
            call_step(step, self.compiled, leading_dims(tensors), param_blocks, grad_blocks, stored,
                      constants, **flags, **master)

        for_each_block_chunk(entry.param, entry.grad, entry.moments[0].block_size, scratch, update,
                             weight_correction=entry.weight_correction)


def _cpu_kernel_takes(rule, entry: RuleEntry) -> bool:
    """Whether the C++ CPU kernel steps this quantized entry: the rule has a functor and the
    kernel the parameter and formats (``cpu_kernel.supports``)."""
    formats = tuple(moment.format for moment in entry.moments)
    return rule.cpu_functor is not None and cpu_kernel.supports(formats, entry.moments[0].block_size,
                                                                entry.param, entry.grad)


class _ConstantsPerStep:
    """``rule.step_constants`` once per step count: the parameters of a group nearly always
    share it, and the constants are a dozen 0-d host operations."""

    def __init__(self, rule, scalars):
        self.rule, self.scalars, self.known = rule, scalars, {}

    def __call__(self, step: torch.Tensor):
        count = float(step)
        if count not in self.known:
            self.known[count] = self.rule.step_constants(self.scalars, step)
        return self.known[count]
