"""The torch-facing side of the Triton kernel for AdamW: a ``torch.library`` op and the group step.

``torch.ops.lowbit_optim.adamw_lowbit_step`` updates lists of parameters and their quantized
moments in place with one kernel launch. Being a library op with a fake implementation, it
can sit inside ``torch.compile``d code: the compiler sees an opaque in-place op instead of
tracing into Triton's launcher. Its shape is torch's ``_fused_adamw_``: the tensor lists
positional, everything else keyword-only. Hyperparameters are 0-d CPU tensors, read on the
host with ``.item()`` (no device sync: they never left the CPU) and passed to the kernel as
runtime scalars, so a schedule neither recompiles anything nor copies anything to the device.

``step_group`` steps the quantized parameters of a param group: it sorts them into kinds
(``group_plan.KernelGroupPlan``) and makes one launch per kind. ``StepGroupPlan`` is the same
with the sorting, the launches' split and their layouts worked out once: what
``LowBitAdamW`` keeps between steps (``lowbit_optim.step.plan``).
"""

import torch
from torch import Tensor

from lowbit_optim.formats.catalog import get_format
from lowbit_optim.step.chunks import ParamStep
from lowbit_optim.step.hyperparams import StepOptions
from lowbit_optim.step.kernels import launcher
from lowbit_optim.step.kernels.group_plan import (
    KernelEntry,
    KernelGroupPlan,
    host_float,
    kind_seed,
)
from lowbit_optim.step.math import ADAMW_L2_DECAY, StepScalars, adamw_kernel_constants, adamw_kernel_update

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


def adamw_update(decoupled_weight_decay: bool, weight_decay: float) -> launcher.KernelUpdate:
    """AdamW's piece for the kernel; torch.optim.Adam's L2 weight decay is its variant."""
    l2 = not decoupled_weight_decay and weight_decay != 0
    return launcher.KernelUpdate(adamw_kernel_update, ADAMW_L2_DECAY if l2 else 0)


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
    update = adamw_update(decoupled_weight_decay, values[4])
    launcher.launch(
        params, grads, pairs, adamw_kernel_constants(*values, l2_decay=bool(update.variant)),
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


def _kernel_entry(entry: ParamStep) -> KernelEntry:
    maximum = () if entry.max_exp_avg_sq is None else (entry.max_exp_avg_sq,)
    moments = (entry.exp_avg, entry.exp_avg_sq) + maximum
    return KernelEntry(entry.param, entry.grad, moments, entry.step, entry.weight_correction)


class StepGroupPlan(KernelGroupPlan):
    """``step_group`` for a fixed list of parameters and states, sorted into kinds once.

    Built from entries as ``step_group`` takes them; ``run`` steps them with the gradients
    given (one per entry, in order, same shapes and dtypes as when planned). The optimizer
    keeps one per param group while its parameters, states and step counts stay as they were
    (``lowbit_optim.step.plan``).
    """

    def __init__(self, entries: list[tuple]):
        super().__init__([_kernel_entry(ParamStep(*entry)) for entry in entries])

    def run(self, grads: list[Tensor], hyper, options: StepOptions) -> None:
        """``step_group``'s step with these gradients: ``hyper`` the group's hyperparameters
        (``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay``: 0-d tensors or numbers, as
        ``hyperparams.GroupScalars`` holds them), ``options`` its flags."""
        values = [host_float(name, getattr(hyper, name)) for name in _HYPERPARAMETERS]
        update = adamw_update(options.decoupled_weight_decay, values[4])

        def constants_of(step: Tensor):
            return adamw_kernel_constants(*values, host_float("step", step), l2_decay=bool(update.variant))

        super().run(grads, constants_of, update=update, maximize=options.maximize,
                    stochastic_round=options.stochastic_round, rounding_stream=options.rounding_stream)


_HYPERPARAMETERS = ("lr", "beta1", "beta2", "eps", "weight_decay")


def step_group(entries: list[tuple], lr: Tensor, beta1: Tensor, beta2: Tensor, eps: Tensor,
               weight_decay: Tensor, *, maximize: bool, stochastic_round: bool,
               rounding_stream: int | None = None, decoupled_weight_decay: bool = True) -> None:
    """Step quantized parameters of one param group, one launch per kind.

    ``entries``: ``(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq or None, step)`` with
    ``QuantizedState`` moments and ``step`` the parameter's 0-d step count (already advanced),
    and optionally a bfloat16 or float16 parameter's master weight correction
    (``chunks.ParamStep``).
    Kinds: formats, block size, parameter and gradient dtype, device, step count, amsgrad,
    correction dtype.
    ``rounding_stream`` (bfloat16 stochastic rounding): when given, each kind's noise seed is
    ``stochastic_round_seed(its step count, stream)`` with ``stream`` made of
    ``rounding_stream`` and the kind's index: a pure function of what the optimizer saves, so a
    resumed run draws the same noise and torch's random stream is never touched. ``None``:
    drawn from torch's CPU generator.

    Eager (the optimizer's step is a graph break) this plans and runs a ``StepGroupPlan``;
    under ``torch.compile`` each kind is one call of the op, which the compiler sees.
    """
    if not entries:
        return
    entries = [ParamStep(*entry) for entry in entries]
    options = dict(maximize=maximize, stochastic_round=stochastic_round,
                   decoupled_weight_decay=decoupled_weight_decay)
    plan = StepGroupPlan(entries)
    if not torch.compiler.is_compiling():
        plan.run([e.grad for e in entries], StepScalars(lr, beta1, beta2, eps, weight_decay, None),
                 StepOptions(**options, rounding_stream=rounding_stream))
        return
    for index, kind in enumerate(plan.kinds):
        kind_entries = entries if kind.indices is None else [entries[i] for i in kind.indices]
        seed = None if rounding_stream is None else kind_seed(float(kind.step), index, rounding_stream)
        for tensor, work in kind.copies:
            work.copy_(tensor)
        maxima = [] if kind_entries[0].max_exp_avg_sq is None else [e.max_exp_avg_sq for e in kind_entries]
        torch.ops.lowbit_optim.adamw_lowbit_step(
            kind.work, [e.grad.contiguous() for e in kind_entries],
            stored_tensors(e.exp_avg for e in kind_entries),
            stored_tensors(e.exp_avg_sq for e in kind_entries), stored_tensors(maxima),
            kind.corrections or [],
            lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=kind.step,
            exp_avg_format=kind_entries[0].exp_avg.format_name,
            exp_avg_sq_format=kind_entries[0].exp_avg_sq.format_name, seed=seed, **options)
        for tensor, work in kind.copies:
            tensor.copy_(work)
