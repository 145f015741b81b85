"""The step of any update rule that supplies its elementwise math (``rules.base.UpdateRule``):
``apply_rule`` wraps the rule's ``update`` in the policies every rule shares, and ``RulePlan``
runs it over a param group, quantized moments through ``quantized_rule_step`` (compiled once
per rule and formats, or eager) and float moments through ``float_state.FloatStateStep``.

Shared policies, so no rule writes them again: ``maximize`` negates the gradient; an element
whose gradient is NaN or ±inf keeps its parameter and its moments for that step (as
``math.adamw_update`` does); the update is computed in ``math.compute_dtype``; bf16 and fp16
parameters are written by rounding (bf16: or stochastic rounding) or through their master weight
(``master_weights``).

Which implementation steps each parameter is ``dispatch.implementation``'s choice: the Triton
step kernel (``step.kernels``, imported only then) for a rule that supplies a Triton piece
(``UpdateRule.kernel_update``), the one-pass C++ CPU kernel (``cpu_kernel``) for a rule that
names a functor (``UpdateRule.cpu_functor``), and for a factored second moment the statistics
pass of its layout (``factored``) followed by this module's quantized step over the rule's
factored variant (``UpdateRule.for_factored``), reading the layout's second moment; all apply
the same policies. Everything else steps through the compiled step, which is also the
reference on every device.
"""

import functools
from typing import NamedTuple

import torch

from lowbit_optim.formats.catalog import QuantFormat
from lowbit_optim.step import cpu_kernel, dispatch
from lowbit_optim.step.chunks import (
    CompiledVariants,
    RuleEntry,
    TailScratch,
    call_step,
    correction_dtype_of,
    for_each_block_chunk,
    leading_dims,
)
from lowbit_optim.step.factored import FactoredParams
from lowbit_optim.step.float_state import FloatStateStep, float_state_groups
from lowbit_optim.step.hyperparams import StepOptions
from lowbit_optim.step.master_weights import read_master, write_master
from lowbit_optim.step.math import compute_dtype, effective_gradient, write_param


class StoredMoment(NamedTuple):
    """The tensors a quantized moment is stored in (``QuantizedState.codes``/``.scales``), or
    a view of some of its blocks: what the compiled step reads and overwrites."""

    codes: torch.Tensor
    scales: torch.Tensor


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
                        weight_correction: torch.Tensor | None = None, read_moments: tuple = ()) -> None:
    """``apply_rule`` on blocks: decode every moment, update, encode, in place.

    ``param`` and ``grad`` are ``(num_blocks, block_size)`` views, ``moments`` the stored
    tensors of the same rows of each quantized moment, in ``formats``; ``weight_correction``:
    the same blocks of a bfloat16 or float16 parameter's master weight correction
    (``master_weights``), whose master weight is read and written instead of the parameter.
    ``read_moments``: moments the rule reads after those and does not return, which a layout
    supplies for these blocks instead of a stored moment (``factored.FactoredMoment``: its
    ``parts(param, count)`` are the values of the ``count`` slices ``split`` makes).
    Only tensors are taken, so ``torch.compile`` traces it once per rule, formats, flags,
    parameter dtype and correction dtype, whatever the parameter's shape.
    """
    # Each ``split`` slice of the blocks (the low and high halves for 4-bit, whose codes share
    # bytes; the whole block for 8-bit) is decoded, updated and encoded on its own and only
    # the packed bytes combine them: Inductor then computes both nibbles of a byte in the loop
    # that writes it instead of materialising unpacked codes and whole-block float buffers.
    # Every format of a rule's optimizer has the same bits, so they split alike. float64
    # parameters are updated in float64 (their moments are quantized all the same).
    dtype = compute_dtype(param)
    split = formats[0].split
    decoded = [fmt.decode_parts(*moment) for fmt, moment in zip(formats, moments)]
    param_parts, grad_parts = split(param), split(grad)
    decoded += [moment.parts(param, len(param_parts)) for moment in read_moments]
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


def store_blocks(moments: list[tuple], param_parts, new_params, correction_parts, *,
                 stochastic_round: bool) -> None:
    """The end of a quantized step, in place: each ``(stored moment, format, new values per
    slice)`` of ``moments`` encoded into its codes and scales, and each slice's new parameter
    written (through its master weight correction, ``correction_parts``, if it keeps one)."""
    for target, fmt, values in moments:
        codes, scales = fmt.encode_parts(values)
        target.codes.copy_(codes)
        target.scales.copy_(scales)
    # Written slice by slice: a torch.cat here made Inductor materialise its inputs.
    for index, (param_part, new_param) in enumerate(zip(param_parts, new_params)):
        if correction_parts is not None:
            write_master(param_part, correction_parts[index], new_param)
        else:
            write_param(param_part, new_param, stochastic_round=stochastic_round)


# One compiled step per rule, formats, flags and correction dtype (``chunks.CompiledVariants``).
COMPILED_RULE_STEPS = CompiledVariants(quantized_rule_step, "quantized_step")


def rule_graph_count(rule, formats: tuple[QuantFormat, ...]) -> int:
    """How many graphs Dynamo holds for one rule's quantized step in ``formats`` (and, with
    amsgrad, one more moment), over the rule's variants (0 before its first call)."""
    return sum(COMPILED_RULE_STEPS.graph_count(variant, *formats) for variant in rule.variants())


class RulePlan:
    """A rule's step over one param group's parameters, sorted once by the implementation
    ``dispatch.implementation`` picks for each: the C++ kernel's in batches, the Triton
    kernel's in kinds, the compiled (or eager) step's one by one, float ones together per
    ``float_state_groups``, factored ones through ``factored.FactoredParams`` (its statistics
    pass, then this plan's quantized step of each over the rule's ``for_factored`` variant).
    ``run`` steps them with the gradients given, one per entry, in order; the plan holds no
    gradient.
    ``params``: the parameters as the optimizer holds them (FSDP2: the factored step reduces
    over the ranks that hold the other rows). Built by ``rules.base.UpdateRule.plan``."""

    def __init__(self, rule, entries: list[RuleEntry], backend: str,
                 params: list[torch.Tensor] | None = None):
        self.rule = rule
        self.compiled = backend != dispatch.EAGER
        chosen: dict[str, list[int]] = {}
        for index, entry in enumerate(entries):
            kind = dispatch.implementation(rule, entry.moments, entry.param, entry.grad, backend)
            chosen.setdefault(kind, []).append(index)
        self.triton_indices = chosen.get(dispatch.TRITON, [])
        self.kernel = None
        if self.triton_indices:
            from lowbit_optim.step import kernels  # imports Triton: only when the backend is in use

            self.kernel = kernels.KernelGroupPlan([entries[i] for i in self.triton_indices])
        self.cpu_indices = chosen.get(dispatch.CPU, [])
        self.cpu_batches = cpu_kernel.kernel_batches([(index, entries[index]) for index in self.cpu_indices],
                                                     rule.cpu_functor)
        self.isa = cpu_kernel.default_isa() if self.cpu_indices else None
        self.quantized = [(index, entries[index]._replace(grad=None))
                          for kind in (dispatch.COMPILE, dispatch.EAGER) for index in chosen.get(kind, [])]
        self.quantized.sort(key=lambda item: item[0])
        self.float_state = []
        floats = [(index, entries[index]) for index in chosen.get(dispatch.FLOAT, [])]
        for indices in float_state_groups(floats, moment_count=lambda entry: len(entry.moments)):
            group = [entries[i] for i in indices]
            master = group[0].weight_correction is not None
            self.float_state.append((indices, group[0].step, FloatStateStep(
                [e.param for e in group], [list(moments) for moments in zip(*(e.moments for e in group))],
                [e.weight_correction for e in group] if master else None)))
        factored = chosen.get(dispatch.FACTORED, [])
        self.factored = None
        if factored:
            params = params or [entry.param for entry in entries]
            by_kernel = [dispatch.factored_kernel_takes(entries[i].moments[0], entries[i].param,
                                                        entries[i].grad, backend) for i in factored]
            self.factored = FactoredParams([(i, entries[i]._replace(grad=None)) for i in factored],
                                           [params[i] for i in factored], by_kernel,
                                           cpu_kernel.default_isa() if any(by_kernel) else None)

    def run(self, grads: list[torch.Tensor], scalars, options: StepOptions, scratch: TailScratch) -> None:
        """One step of every parameter (``scalars``: the group's ``hyperparams.GroupScalars``)."""
        rule = self.rule.for_step(options, exact_moments=False)
        constants_of = _ConstantsPerStep(rule, scalars)
        if self.factored is not None:
            factored_rule = self.rule.for_factored(options)

            def step_elements(entry: RuleEntry, read_moments) -> None:
                self._quantized(factored_rule, entry, constants_of(entry.step), options, scratch,
                                read_moments=read_moments)

            self.factored.run(dispatch.COMPILE if self.compiled else dispatch.EAGER, grads, scalars, scratch,
                              step_elements, constants_of=constants_of, maximize=options.maximize,
                              stochastic_round=options.stochastic_round,
                              decoupled_weight_decay=options.decoupled_weight_decay)
        kernel_options = cpu_kernel.KernelOptions(options.maximize, options.stochastic_round, self.isa)
        for batch in self.cpu_batches:
            batch.run(grads, constants_of, kernel_options)
        for index, entry in self.quantized:
            self._quantized(rule, entry._replace(grad=grads[index]), constants_of(entry.step), options,
                            scratch)
        if self.float_state:
            # Float moments are exact: the rule's variant for them (the same constants).
            float_rule = self.rule.for_step(options, exact_moments=True)
            for indices, step, float_step in self.float_state:
                update = functools.partial(apply_rule, float_rule, constants=constants_of(step),
                                           maximize=options.maximize)
                float_step.step([grads[i] for i in indices], update,
                                stochastic_round=options.stochastic_round)
        if self.kernel is not None:
            from lowbit_optim.step import kernels

            self.kernel.run(grads if len(self.triton_indices) == len(grads) else
                            [grads[i] for i in self.triton_indices],
                            lambda step: rule.kernel_constants(constants_of(step)),
                            update=kernels.KernelUpdate(rule.kernel_update, rule.kernel_variant(scalars)),
                            maximize=options.maximize, stochastic_round=options.stochastic_round,
                            rounding_stream=options.rounding_stream)

    def _quantized(self, rule, entry: RuleEntry, constants, options: StepOptions, scratch: TailScratch,
                   read_moments=None) -> None:
        """``quantized_rule_step`` over the entry's blocks, a bounded chunk at a time.
        ``read_moments``: a layout's ``read_moments(first_element)``, the moments the rule also
        reads for the chunk from that element (``factored.FactoredParams.run``)."""
        formats = tuple(moment.format for moment in entry.moments)
        variant = (rule, *formats, options.maximize, options.stochastic_round,
                   correction_dtype_of(entry.weight_correction))
        step = COMPILED_RULE_STEPS.get(variant) if self.compiled else quantized_rule_step
        flags = dict(rule=rule, formats=formats, maximize=options.maximize,
                     stochastic_round=options.stochastic_round)

        def update(param_blocks, grad_blocks, block_rows: slice, first_element: int, correction_blocks):
            stored = tuple(StoredMoment(m.codes[block_rows], m.scales[block_rows]) for m in entry.moments)
            master = {} if correction_blocks is None else {"weight_correction": correction_blocks}
            read = {} if read_moments is None else {"read_moments": read_moments(first_element)}
            tensors = (param_blocks, grad_blocks, correction_blocks,
                       *(t for m in (*stored, *read.get("read_moments", ())) for t in m))
            call_step(step, self.compiled, leading_dims(tensors), param_blocks, grad_blocks, stored,
                      constants, **flags, **master, **read)

        for_each_block_chunk(entry.param, entry.grad, entry.moments[0].block_size, scratch, update,
                             weight_correction=entry.weight_correction)


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
