"""The torch-facing side of the Triton kernel: a ``torch.library`` custom op and the group step.

``torch.ops.lowbit_optim.adamw_lowbit_step`` updates lists of parameters and their quantized
moments in place with one kernel launch. Being a custom op with a fake implementation, it
can sit inside ``torch.compile``d code: the compiler sees an opaque in-place op instead of
tracing into Triton's launcher. Hyperparameters are 0-d CPU tensors, read on the host with
``.item()`` (no device sync: they never left the CPU) and passed to the kernel as runtime
scalars, so a schedule neither recompiles anything nor copies anything to the device.

``step_group`` is what ``LowBitAdamW`` calls with every quantized parameter of a param
group: it sorts them into kinds (formats, block size, dtypes, device, step count, amsgrad)
and makes one launch per kind, so the number of launches does not grow with the number of
parameters.
"""

import torch
from torch import Tensor

from lowbit_optim.kernels import adamw_lowbit
from lowbit_optim.quant.formats import get_format

_MUTATED = ("params", "exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales",
            "max_exp_avg_sq_codes", "max_exp_avg_sq_scales")


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
    max_exp_avg_sq_scales: list[Tensor], lr: Tensor, beta1: Tensor, beta2: Tensor, eps: Tensor,
    weight_decay: Tensor, step: Tensor, *, exp_avg_format: str, exp_avg_sq_format: str, maximize: bool,
    stochastic_round: bool, seed: int | None = None, decoupled_weight_decay: bool = True,
) -> None:
    """One quantized AdamW step for every parameter given, in place, in one launch
    (``decoupled_weight_decay=False``: torch.optim.Adam's L2 weight decay).

    ``params`` (contiguous, one dtype) and ``grads`` (one dtype) pair up with the moments'
    codes and scales (``QuantizedState.codes``/``.scales``); the ``max_exp_avg_sq`` lists are
    empty unless amsgrad is on. All parameters share ``step``. ``seed`` (bfloat16 stochastic
    rounding only): the noise seed, e.g. from ``stochastic_round_seed`` and a counter the
    caller keeps; ``None`` draws one from torch's CPU generator (which that consumes).
    """
    _step_lists(params, grads, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales,
                max_exp_avg_sq_codes, max_exp_avg_sq_scales, lr, beta1, beta2, eps, weight_decay, step,
                exp_avg_format=exp_avg_format, exp_avg_sq_format=exp_avg_sq_format, maximize=maximize,
                stochastic_round=stochastic_round, seed=seed, check_states=True,
                decoupled_weight_decay=decoupled_weight_decay)


def _step_lists(params, grads, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales,
                max_exp_avg_sq_codes, max_exp_avg_sq_scales, lr, beta1, beta2, eps, weight_decay, step, *,
                exp_avg_format: str, exp_avg_sq_format: str, maximize: bool, stochastic_round: bool,
                seed: int | None, check_states: bool, decoupled_weight_decay: bool = True) -> None:
    """The op's implementation. ``check_states=False`` skips the per-parameter shape checks of
    codes and scales: ``step_group`` passes the optimizer's own states, made by
    ``QuantizedState.zeros`` and checked by ``load_state_dict``, and the checks cost ~3 us per
    parameter per step (benchmarks/bench_host_overhead.py)."""
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
    if check_states:
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
    )


@adamw_lowbit_step.register_fake
def _(params, grads, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales,
      max_exp_avg_sq_codes, max_exp_avg_sq_scales, lr, beta1, beta2, eps, weight_decay, step, *,
      exp_avg_format, exp_avg_sq_format, maximize, stochastic_round, seed=None,
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


def step_group(entries: list[tuple], lr: Tensor, beta1: Tensor, beta2: Tensor, eps: Tensor,
               weight_decay: Tensor, *, maximize: bool, stochastic_round: bool,
               rounding_stream: int | None = None, decoupled_weight_decay: bool = True) -> None:
    """Step quantized parameters of one param group, one launch per kind.

    ``entries``: ``(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq or None, step)`` with
    ``QuantizedState`` moments and ``step`` the parameter's 0-d step count (already advanced).
    ``rounding_stream`` (bfloat16 stochastic rounding): when given, each kind's noise seed is
    ``stochastic_round_seed(its step count, stream)`` with ``stream`` made of
    ``rounding_stream`` and the kind's index: a pure function of what the optimizer saves, so a
    resumed run draws the same noise and torch's random stream is never touched. ``None``:
    drawn from torch's CPU generator.
    """
    kinds: dict[tuple, list[tuple]] = {}
    for entry in entries:
        param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step = entry
        key = (exp_avg.format_name, exp_avg_sq.format_name, exp_avg.block_size, param.dtype, grad.dtype,
               param.device, float(step), max_exp_avg_sq is not None)
        kinds.setdefault(key, []).append(entry)
    for index, kind in enumerate(kinds.values()):
        params = [e[0] for e in kind]  # stepped under no_grad: no autograd to detach from
        # The kernel needs contiguous memory; a non-contiguous parameter steps a copy.
        work = [p if p.is_contiguous() else p.contiguous() for p in params]
        amsgrad = kind[0][4] is not None
        moments = [[e[i] for e in kind] for i in (2, 3, 4)]

        def inner(states):
            if states[0] is None:
                return [], []
            return [s.codes for s in states], [s.scales for s in states]

        arguments = (
            work, [e[1].contiguous() for e in kind], *inner(moments[0]), *inner(moments[1]),
            *inner(moments[2] if amsgrad else [None]), lr, beta1, beta2, eps, weight_decay, kind[0][5],
        )
        options = dict(
            exp_avg_format=kind[0][2].format_name, exp_avg_sq_format=kind[0][3].format_name,
            maximize=maximize, stochastic_round=stochastic_round,
            decoupled_weight_decay=decoupled_weight_decay,
            seed=None if rounding_stream is None
            else stochastic_round_seed(int(float(kind[0][5])), (rounding_stream << 10) | index),
        )
        if torch.compiler.is_compiling():
            torch.ops.lowbit_optim.adamw_lowbit_step(*arguments, **options)
        else:
            # Eager (the optimizer's step is a graph break): the op's implementation without
            # the dispatcher's per-tensor bookkeeping, which cost ~5 us per parameter. Only the
            # parameters are visible to autograd, so only their version counters move.
            _step_lists(*arguments, **options, check_states=False)
            torch._C._increment_version(work)
        for param, copy in zip(params, work):
            if copy is not param:
                param.copy_(copy)
