"""The torch-facing side of the Triton kernel for the AdamW rule: a ``torch.library`` op and the
group step, both built on the rule (``rules.adamw``: its piece and constants) and the generic
``group_plan.KernelGroupPlan``.

``torch.ops.lowbit_optim.adamw_lowbit_step`` updates lists of parameters and their quantized
moments in place with one kernel launch. Being a library op with a fake implementation, it
can sit inside ``torch.compile``d code: the compiler sees an opaque in-place op instead of
tracing into Triton's launcher. Its shape is torch's ``_fused_adamw_``: the tensor lists
positional, everything else keyword-only. Hyperparameters are 0-d CPU tensors, read on the
host with ``.item()`` (no device sync: they never left the CPU) and passed to the kernel as
runtime scalars, so a schedule neither recompiles anything nor copies anything to the device.

``step_group`` steps the quantized parameters of a param group: it sorts them into kinds
(``group_plan.KernelGroupPlan``, what an optimizer keeps between steps through
``rule_step.RulePlan``) and makes one launch per kind.
"""

import torch
from torch import Tensor

from lowbit_optim.formats.catalog import get_format
from lowbit_optim.step.chunks import RuleEntry
from lowbit_optim.step.kernels import launcher
from lowbit_optim.step.kernels.group_plan import KernelGroupPlan, host_float, kind_seed
from lowbit_optim.step.math import adamw_kernel_constants, adamw_kernel_update, adamw_kernel_variant

# The op's schema (torch.library.custom_op refuses keyword-only tensors, so it is defined from
# its schema). Each moment list holds every parameter's codes and scales in turn:
# ``[codes_0, scales_0, codes_1, scales_1, ...]``. Only non-mutated tensors are keyword-only:
# Inductor (torch 2.13) passes keyword-only mutated lists positionally when it calls the op.
_SCHEMA = (
    "adamw_lowbit_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
    "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] weight_corrections, *, Tensor lr, Tensor beta1, "
    "Tensor beta2, Tensor eps, Tensor weight_decay, Tensor step, str exp_avg_format, str exp_avg_sq_format, "
    "bool maximize=False, bool stochastic_round=False, int? seed=None, bool decoupled_weight_decay=True) "
    "-> ()"
)
_LIBRARY = torch.library.Library("lowbit_optim", "FRAGMENT")
_LIBRARY.define(_SCHEMA)


def _adamw_piece(decoupled_weight_decay: bool, values: list[float]) -> tuple:
    """The AdamW rule's piece for the kernel (torch.optim.Adam's L2 weight decay is its
    variant) and its constants at step count ``step`` from the group's ``values`` (``lr``,
    the betas, ``eps``, ``weight_decay``: ``rules.adamw.AdamWRule.kernel_constants``' arithmetic)."""
    variant = adamw_kernel_variant(decoupled_weight_decay, values[4])

    def constants(step: float):
        return adamw_kernel_constants(*values, step, l2_decay=bool(variant))

    return launcher.KernelUpdate(adamw_kernel_update, variant), constants


def stored_tensors(states) -> list[Tensor]:
    """A moment list of the op: each ``QuantizedState``'s codes and scales in turn."""
    return [tensor for state in states for tensor in (state.codes, state.scales)]


@torch.library.impl("lowbit_optim::adamw_lowbit_step", "CompositeExplicitAutograd", lib=_LIBRARY)
def adamw_lowbit_step(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor], weight_corrections: list[Tensor], *, lr: Tensor, beta1: Tensor,
    beta2: Tensor, eps: Tensor, weight_decay: Tensor, step: Tensor, exp_avg_format: str,
    exp_avg_sq_format: str, maximize: bool = False, stochastic_round: bool = False, seed: int | None = None,
    decoupled_weight_decay: bool = True,
) -> None:
    """One quantized AdamW step for every parameter given, in place, in one launch
    (``decoupled_weight_decay=False``: torch.optim.Adam's L2 weight decay).

    ``params`` (contiguous, one dtype) and ``grads`` (one dtype) pair up with the moments'
    codes and scales (``QuantizedState.codes``/``.scales``, in turn per parameter:
    ``stored_tensors``); ``max_exp_avg_sqs`` is empty unless amsgrad is on,
    ``weight_corrections`` unless the parameters keep master weights (bfloat16 or float16
    parameters' corrections, ``step.master_weights``: contiguous, all int8 or all int16; the
    step updates parameter and correction together). All parameters share ``step``. ``seed``
    (bfloat16 stochastic rounding only): the noise seed, e.g. from ``stochastic_round_seed``
    and a counter the caller keeps; ``None`` draws one from torch's CPU generator (which that
    consumes).
    """
    exp_avg_fmt, exp_avg_sq_fmt = get_format(exp_avg_format), get_format(exp_avg_sq_format)
    moments = [exp_avgs, exp_avg_sqs] + ([max_exp_avg_sqs] if max_exp_avg_sqs else [])
    if any(len(tensors) != 2 * len(params) for tensors in moments) or len(grads) != len(params):
        raise ValueError("every tensor list must have one entry per parameter (two, codes and scales, "
                         "for each moment)")
    if not params:
        return
    pairs = [list(zip(tensors[::2], tensors[1::2])) for tensors in moments]
    formats = (exp_avg_fmt, exp_avg_sq_fmt, exp_avg_sq_fmt)[:len(moments)]
    block_size = pairs[0][0][0].shape[-1] * exp_avg_fmt.codes_per_byte
    for index, param in enumerate(params):
        _check_state(param, [moment[index] for moment in pairs], block_size, formats)
    if any(not p.is_contiguous() for p in params):
        raise ValueError("params must be contiguous (step_group handles non-contiguous ones)")
    names = ("lr", "beta1", "beta2", "eps", "weight_decay", "step")
    values = [host_float(n, v) for n, v in zip(names, (lr, beta1, beta2, eps, weight_decay, step))]
    if not (stochastic_round and params[0].dtype == torch.bfloat16):
        seed = 0
    elif seed is None:
        # From torch's CPU generator, so torch.manual_seed makes runs repeatable.
        seed = int(torch.randint(2**31 - 1, ()))
    elif not 0 <= seed < 2**31:
        raise ValueError(f"seed must be in [0, 2**31) (got {seed})")
    update, constants = _adamw_piece(decoupled_weight_decay, values[:5])
    launcher.launch(
        params, grads, pairs, constants(values[5]),
        update=update, formats=formats, block_size=block_size, maximize=maximize,
        stochastic_round=stochastic_round, seed=seed, weight_corrections=weight_corrections or None,
    )


@torch.library.register_fake("lowbit_optim::adamw_lowbit_step", lib=_LIBRARY)
def _(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, weight_corrections, **options):
    return None


def _check_state(param, codes_and_scales, block_size, formats) -> None:
    num_blocks = -(-param.numel() // block_size)
    for (codes, scales), fmt in zip(codes_and_scales, formats):
        expected = (num_blocks, block_size // fmt.codes_per_byte)
        if tuple(codes.shape) != expected or codes.dtype != torch.uint8:
            raise ValueError(f"codes of shape {tuple(codes.shape)} ({codes.dtype}) do not fit a parameter "
                             f"of {param.numel()} elements: {expected} uint8 expected")
        if tuple(scales.shape) != (num_blocks,) or scales.dtype != torch.float32:
            raise ValueError(f"scales of shape {tuple(scales.shape)} ({scales.dtype}) do not fit: "
                             f"({num_blocks},) float32 expected")
        if codes.device != param.device or scales.device != param.device:
            raise ValueError(f"state on {codes.device} does not match parameter on {param.device}")


def _rule_entry(entry: tuple) -> RuleEntry:
    """``step_group``'s ``(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq or None, step[,
    weight_correction])`` as the record every implementation reads."""
    param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, *correction = entry
    maximum = () if max_exp_avg_sq is None else (max_exp_avg_sq,)
    return RuleEntry(param, grad, (exp_avg, exp_avg_sq, *maximum), step, *correction)


def step_group(entries: list[tuple], lr: Tensor, beta1: Tensor, beta2: Tensor, eps: Tensor,
               weight_decay: Tensor, *, maximize: bool, stochastic_round: bool,
               rounding_stream: int | None = None, decoupled_weight_decay: bool = True) -> None:
    """Step quantized parameters of one param group, one launch per kind.

    ``entries``: ``(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq or None, step)`` with
    ``QuantizedState`` moments and ``step`` the parameter's 0-d step count (already advanced),
    and optionally a bfloat16 or float16 parameter's master weight correction
    (``rule_step.RuleEntry``'s fields, the moments spelled out).
    Kinds: formats, block size, parameter and gradient dtype, device, step count, amsgrad,
    correction dtype.
    ``rounding_stream`` (bfloat16 stochastic rounding): when given, each kind's noise seed is
    ``stochastic_round_seed(its step count, stream)`` with ``stream`` made of
    ``rounding_stream`` and the kind's index: a pure function of what the optimizer saves, so a
    resumed run draws the same noise and torch's random stream is never touched. ``None``:
    drawn from torch's CPU generator.

    Eager (the optimizer's step is a graph break) this plans and runs a ``KernelGroupPlan``;
    under ``torch.compile`` each kind is one call of the op, which the compiler sees.
    """
    if not entries:
        return
    entries = [*map(_rule_entry, entries)]
    plan = KernelGroupPlan(entries)
    if not torch.compiler.is_compiling():
        names, given = ("lr", "beta1", "beta2", "eps", "weight_decay"), (lr, beta1, beta2, eps, weight_decay)
        values = [host_float(name, value) for name, value in zip(names, given)]
        update, constants = _adamw_piece(decoupled_weight_decay, values)
        plan.run([e.grad for e in entries], lambda step: constants(host_float("step", step)), update=update,
                 maximize=maximize, stochastic_round=stochastic_round, rounding_stream=rounding_stream)
        return
    options = dict(maximize=maximize, stochastic_round=stochastic_round,
                   decoupled_weight_decay=decoupled_weight_decay)
    for index, kind in enumerate(plan.kinds):
        kind_entries = entries if kind.indices is None else [entries[i] for i in kind.indices]
        seed = None if rounding_stream is None else kind_seed(float(kind.step), index, rounding_stream)
        for tensor, work in kind.copies:
            work.copy_(tensor)
        moments = [[entry.moments[position] for entry in kind_entries] for position in range(3)
                   if position < len(kind_entries[0].moments)]
        torch.ops.lowbit_optim.adamw_lowbit_step(
            kind.work, [e.grad.contiguous() for e in kind_entries], stored_tensors(moments[0]),
            stored_tensors(moments[1]), stored_tensors(moments[2]) if len(moments) == 3 else [],
            kind.corrections or [],
            lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=kind.step,
            exp_avg_format=moments[0][0].format_name, exp_avg_sq_format=moments[1][0].format_name,
            seed=seed, **options)
        for tensor, work in kind.copies:
            tensor.copy_(work)
