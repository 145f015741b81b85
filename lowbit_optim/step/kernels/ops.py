"""The torch-facing side of the Triton kernel: a ``torch.library`` custom op and the group step.

``torch.ops.lowbit_optim.adamw_lowbit_step`` updates lists of parameters and their quantized
moments in place with one kernel launch. Being a custom op with a fake implementation, it
can sit inside ``torch.compile``d code: the compiler sees an opaque in-place op instead of
tracing into Triton's launcher. Hyperparameters are 0-d CPU tensors, read on the host with
``.item()`` (no device sync: they never left the CPU) and passed to the kernel as runtime
scalars, so a schedule neither recompiles anything nor copies anything to the device.

``step_group`` steps the quantized parameters of a param group: it sorts them into kinds
(formats, block size, dtypes, device, step count, amsgrad) and makes one launch per kind, so
the number of launches does not grow with the number of parameters. ``StepGroupPlan`` is the
same with the sorting, the launches' split and their layouts worked out once: what
``LowBitAdamW`` keeps between steps (``lowbit_optim.step.plan``).
"""

from typing import NamedTuple

import torch
from torch import Tensor

from lowbit_optim.formats.catalog import get_format
from lowbit_optim.step.chunks import KIND_STREAM_BITS, ParamStep
from lowbit_optim.step.kernels import adamw_lowbit
from lowbit_optim.step.kernels.plan import KindPlan

_MUTATED = ("params", "exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales",
            "max_exp_avg_sq_codes", "max_exp_avg_sq_scales", "weight_corrections")


def _host_float(name: str, value: Tensor) -> float:
    if value.device.type != "cpu" or value.numel() != 1:
        raise ValueError(
            f"{name} must be a 1-element CPU tensor (got device {value.device}, shape "
            f"{tuple(value.shape)}): reading a device scalar would synchronise every step"
        )
    return value.item()


@torch.library.custom_op("lowbit_optim::adamw_lowbit_step", mutates_args=_MUTATED)
def adamw_lowbit_step(
    params: list[Tensor], grads: list[Tensor], exp_avg_codes: list[Tensor], exp_avg_scales: list[Tensor],
    exp_avg_sq_codes: list[Tensor], exp_avg_sq_scales: list[Tensor], max_exp_avg_sq_codes: list[Tensor],
    max_exp_avg_sq_scales: list[Tensor], weight_corrections: list[Tensor], lr: Tensor, beta1: Tensor,
    beta2: Tensor, eps: Tensor, weight_decay: Tensor, step: Tensor, *, exp_avg_format: str,
    exp_avg_sq_format: str, maximize: bool, stochastic_round: bool, seed: int | None = None,
    decoupled_weight_decay: bool = True,
) -> None:
    """One quantized AdamW step for every parameter given, in place, in one launch
    (``decoupled_weight_decay=False``: torch.optim.Adam's L2 weight decay).

    ``params`` (contiguous, one dtype) and ``grads`` (one dtype) pair up with the moments'
    codes and scales (``QuantizedState.codes``/``.scales``); the ``max_exp_avg_sq`` lists are
    empty unless amsgrad is on, ``weight_corrections`` unless the parameters keep master
    weights (bfloat16 or float16 parameters' corrections, ``step.master_weights``: contiguous,
    all int8 or all int16; the step updates parameter and correction together). All
    parameters share ``step``. ``seed`` (bfloat16 stochastic rounding only): the noise seed, e.g. from
    ``stochastic_round_seed`` and a counter the caller keeps; ``None`` draws one from torch's
    CPU generator (which that consumes).
    """
    exp_avg_fmt, exp_avg_sq_fmt = get_format(exp_avg_format), get_format(exp_avg_sq_format)
    amsgrad = bool(max_exp_avg_sq_codes)
    lists = [grads, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales]
    if amsgrad:
        lists += [max_exp_avg_sq_codes, max_exp_avg_sq_scales]
    elif max_exp_avg_sq_scales:
        raise ValueError("max_exp_avg_sq_codes and max_exp_avg_sq_scales must both be given or both empty")
    if any(len(tensors) != len(params) for tensors in lists):
        raise ValueError("every tensor list must have one entry per parameter")
    if not params:
        return
    block_size = exp_avg_codes[0].shape[-1] * exp_avg_fmt.codes_per_byte
    for param, codes_and_scales in zip(params, zip(*lists[1:])):
        _check_state(param, codes_and_scales, block_size, exp_avg_fmt, exp_avg_sq_fmt)
    if any(not p.is_contiguous() for p in params):
        raise ValueError("params must be contiguous (step_group handles non-contiguous ones)")
    names = ("lr", "beta1", "beta2", "eps", "weight_decay", "step")
    values = [_host_float(n, v) for n, v in zip(names, (lr, beta1, beta2, eps, weight_decay, step))]
    if not (stochastic_round and params[0].dtype == torch.bfloat16):
        seed = 0
    elif seed is None:
        # From torch's CPU generator, so torch.manual_seed makes runs repeatable.
        seed = int(torch.randint(2**31 - 1, ()))
    elif not 0 <= seed < 2**31:
        raise ValueError(f"seed must be in [0, 2**31) (got {seed})")

    def pairs(codes, scales):
        return list(zip(codes, scales))

    adamw_lowbit.launch(
        params, grads, pairs(exp_avg_codes, exp_avg_scales), pairs(exp_avg_sq_codes, exp_avg_sq_scales),
        pairs(max_exp_avg_sq_codes, max_exp_avg_sq_scales) if amsgrad else None,
        adamw_lowbit.host_scalars(*values, decoupled_weight_decay=decoupled_weight_decay),
        exp_avg_format=exp_avg_fmt, exp_avg_sq_format=exp_avg_sq_fmt, block_size=block_size,
        maximize=maximize, stochastic_round=stochastic_round, seed=seed,
        weight_corrections=weight_corrections or None,
    )


@adamw_lowbit_step.register_fake
def _(params, grads, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales,
      max_exp_avg_sq_codes, max_exp_avg_sq_scales, weight_corrections, lr, beta1, beta2, eps, weight_decay,
      step, *, exp_avg_format, exp_avg_sq_format, maximize, stochastic_round, seed=None,
      decoupled_weight_decay=True):
    return None


def stochastic_round_seed(counter: int, stream: int = 0) -> int:
    """A 31-bit noise seed from a counter (the splitmix64 finaliser), for callers that keep
    their own counter (per optimizer, saved with its state) instead of drawing from torch's
    global CPU generator. ``stream`` separates independent users of one counter."""
    x = (counter * 0x9E3779B97F4A7C15 + stream * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return (x ^ (x >> 31)) % 2**31


def _check_state(param, codes_and_scales, block_size, exp_avg_fmt, exp_avg_sq_fmt) -> None:
    num_blocks = -(-param.numel() // block_size)
    formats = [exp_avg_fmt, exp_avg_fmt] + [exp_avg_sq_fmt] * (len(codes_and_scales) - 2)
    for index in range(0, len(codes_and_scales), 2):
        codes, scales = codes_and_scales[index], codes_and_scales[index + 1]
        fmt = formats[index]
        expected = (num_blocks, block_size // fmt.codes_per_byte)
        if tuple(codes.shape) != expected or codes.dtype != torch.uint8:
            raise ValueError(f"codes of shape {tuple(codes.shape)} ({codes.dtype}) do not fit a parameter "
                             f"of {param.numel()} elements: {expected} uint8 expected")
        if tuple(scales.shape) != (num_blocks,) or scales.dtype != torch.float32:
            raise ValueError(f"scales of shape {tuple(scales.shape)} ({scales.dtype}) do not fit: "
                             f"({num_blocks},) float32 expected")
        if codes.device != param.device or scales.device != param.device:
            raise ValueError(f"state on {codes.device} does not match parameter on {param.device}")


class StepGroupPlan:
    """``step_group`` for a fixed list of parameters and states, sorted into kinds once.

    Built from entries as ``step_group`` takes them; ``run`` steps them with the gradients
    given (one per entry, in order, same shapes and dtypes as when planned). The optimizer
    keeps one per param group while its parameters, states and step counts stay as they were
    (``lowbit_optim.step.plan``), so a step does per parameter only what depends on the
    gradients: their addresses (``kernels.plan.KindPlan``). Non-contiguous parameters (and
    master weight corrections) step through contiguous buffers kept here, so their addresses
    stay put too.
    """

    def __init__(self, entries: list[tuple]):
        entries = [ParamStep(*entry) for entry in entries]
        kinds: dict[tuple, list[int]] = {}
        steps = torch.stack([entry.step for entry in entries]).tolist() if entries else []
        for index, (entry, step) in enumerate(zip(entries, steps)):
            correction = entry.weight_correction
            key = (entry.exp_avg.format_name, entry.exp_avg_sq.format_name, entry.exp_avg.block_size,
                   entry.param.dtype, entry.grad.dtype, entry.param.device, step,
                   entry.max_exp_avg_sq is not None, None if correction is None else correction.dtype)
            kinds.setdefault(key, []).append(index)
        self.kinds = [self._kind(entries, indices) for indices in kinds.values()]

    @staticmethod
    def _kind(entries, indices):
        kind = [entries[i] for i in indices]
        params = [e.param for e in kind]  # stepped under no_grad: no autograd to detach from
        corrections = None if kind[0].weight_correction is None else [e.weight_correction for e in kind]
        # The kernel needs contiguous memory: a non-contiguous parameter steps a buffer.
        work = [_contiguous_buffer(p) for p in params]
        work_corrections = None if corrections is None else [_contiguous_buffer(c) for c in corrections]
        copies = [(t, w) for t, w in zip(params + (corrections or []), work + (work_corrections or []))
                  if w is not t]

        def pairs(states):
            return None if states[0] is None else [(s.codes, s.scales) for s in states]

        first = kind[0]
        plan = KindPlan(work, [e.grad.contiguous() for e in kind], pairs([e.exp_avg for e in kind]),
                        pairs([e.exp_avg_sq for e in kind]), pairs([e.max_exp_avg_sq for e in kind]),
                        exp_avg_format=first.exp_avg.format, exp_avg_sq_format=first.exp_avg_sq.format,
                        block_size=first.exp_avg.block_size, weight_corrections=work_corrections)
        every = indices == list(range(len(entries)))
        return _Kind(None if every else indices, first.step, work, work_corrections, copies, plan)

    def run(self, grads: list[Tensor], lr: Tensor, beta1: Tensor, beta2: Tensor, eps: Tensor,
            weight_decay: Tensor, *, maximize: bool, stochastic_round: bool,
            rounding_stream: int | None = None, decoupled_weight_decay: bool = True) -> None:
        """``step_group``'s step with these gradients (see there for the arguments)."""
        hyper = [_host_float(n, v) for n, v in zip(("lr", "beta1", "beta2", "eps", "weight_decay"),
                                                   (lr, beta1, beta2, eps, weight_decay))]
        for index, kind in enumerate(self.kinds):
            kind_grads = grads if kind.indices is None else [grads[i] for i in kind.indices]
            if not all(map(Tensor.is_contiguous, kind_grads)):
                kind_grads = [grad.contiguous() for grad in kind_grads]
            step = _host_float("step", kind.step)
            if stochastic_round and kind.work[0].dtype == torch.bfloat16:
                # From torch's CPU generator when no stream is given, so torch.manual_seed
                # makes runs repeatable.
                seed = (int(torch.randint(2**31 - 1, ())) if rounding_stream is None
                        else stochastic_round_seed(int(step), (rounding_stream << KIND_STREAM_BITS) | index))
            else:
                seed = 0
            for tensor, work in kind.copies:
                work.copy_(tensor)
            kind.plan.run(kind_grads, adamw_lowbit.host_scalars(*hyper, step,
                                                                decoupled_weight_decay=decoupled_weight_decay),
                          maximize=maximize, stochastic_round=stochastic_round, seed=seed)
            # Only the parameters are visible to autograd, so only their version counters move
            # (a buffer's copy back moves its parameter's).
            torch._C._increment_version(kind.work)
            for tensor, work in kind.copies:
                tensor.copy_(work)


def _contiguous_buffer(tensor: Tensor) -> Tensor:
    """``tensor`` itself if contiguous, else a contiguous buffer of its shape to step."""
    if tensor.is_contiguous():
        return tensor
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


class _Kind(NamedTuple):
    indices: list[int] | None  # the kind's entries; None: all of them, in order
    step: Tensor  # the kind's 0-d step count (every entry of a kind has the same)
    work: list[Tensor]  # the parameters, or their contiguous buffers
    corrections: list[Tensor] | None  # their master weight corrections (or buffers), or None
    copies: list[tuple[Tensor, Tensor]]  # (non-contiguous parameter or correction, its buffer)
    plan: KindPlan


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
    under ``torch.compile`` each kind is one call of the custom op, which the compiler sees.
    """
    if not entries:
        return
    entries = [ParamStep(*entry) for entry in entries]
    options = dict(maximize=maximize, stochastic_round=stochastic_round,
                   decoupled_weight_decay=decoupled_weight_decay)
    plan = StepGroupPlan(entries)
    if not torch.compiler.is_compiling():
        plan.run([e.grad for e in entries], lr, beta1, beta2, eps, weight_decay,
                 rounding_stream=rounding_stream, **options)
        return
    for index, kind in enumerate(plan.kinds):
        kind_entries = entries if kind.indices is None else [entries[i] for i in kind.indices]

        def inner(states):
            if states[0] is None:
                return [], []
            return [s.codes for s in states], [s.scales for s in states]

        seed = None if rounding_stream is None else stochastic_round_seed(
            int(float(kind.step)), (rounding_stream << KIND_STREAM_BITS) | index)
        for tensor, work in kind.copies:
            work.copy_(tensor)
        torch.ops.lowbit_optim.adamw_lowbit_step(
            kind.work, [e.grad.contiguous() for e in kind_entries], *inner([e.exp_avg for e in kind_entries]),
            *inner([e.exp_avg_sq for e in kind_entries]), *inner([e.max_exp_avg_sq for e in kind_entries]),
            kind.corrections or [], lr, beta1, beta2, eps, weight_decay, kind.step,
            exp_avg_format=kind_entries[0].exp_avg.format_name,
            exp_avg_sq_format=kind_entries[0].exp_avg_sq.format_name, seed=seed, **options)
        for tensor, work in kind.copies:
            tensor.copy_(work)
