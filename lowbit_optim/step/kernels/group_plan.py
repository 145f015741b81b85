"""A param group's quantized parameters through the step kernel, for any update rule:
``KernelGroupPlan`` sorts them into kinds once (the moments' formats, block size, parameter and
gradient dtypes, device, step count, master weight correction dtype) and makes one launch per
kind at each step, so the number of launches does not grow with the number of parameters.

What the optimizer keeps between steps (``lowbit_optim.step.plan``, through the rule's plan):
a step does per parameter only what depends on the gradients, their addresses
(``kernels.plan.KindPlan``). Non-contiguous parameters (and master weight corrections) step
through contiguous buffers kept here, so their addresses stay put too.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from lowbit_optim.step.chunks import KIND_STREAM_BITS
from lowbit_optim.step.kernels.launcher import KernelUpdate
from lowbit_optim.step.kernels.plan import KindPlan


def host_float(name: str, value: Tensor) -> float:
    """A 0-d CPU hyperparameter as a Python float (no device sync: it never left the CPU)."""
    if value.device.type != "cpu" or value.numel() != 1:
        raise ValueError(
            f"{name} must be a 1-element CPU tensor (got device {value.device}, shape "
            f"{tuple(value.shape)}): reading a device scalar would synchronise every step"
        )
    return value.item()


def stochastic_round_seed(counter: int, stream: int = 0) -> int:
    """A 31-bit noise seed from a counter (the splitmix64 finaliser), for callers that keep
    their own counter (per optimizer, saved with its state) instead of drawing from torch's
    global CPU generator. ``stream`` separates independent users of one counter."""
    x = (counter * 0x9E3779B97F4A7C15 + stream * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return (x ^ (x >> 31)) % 2**31


def kind_seed(step: float, kind_index: int, rounding_stream: int | None) -> int:
    """A kind's noise seed for bfloat16 stochastic rounding: from torch's CPU generator when
    no stream is given (so torch.manual_seed makes runs repeatable), else a pure function of
    the step count, the stream and the kind."""
    if rounding_stream is None:
        return int(torch.randint(2**31 - 1, ()))
    return stochastic_round_seed(int(step), (rounding_stream << KIND_STREAM_BITS) | kind_index)


class KernelGroupPlan:
    """The kernel's step for a fixed list of ``rule_step.RuleEntry`` (quantized moments, in the
    rule's order; the step counts already advanced), sorted into kinds once; ``run`` steps them
    with the gradients given (one per entry, in order, same shapes and dtypes as when planned)."""

    def __init__(self, entries: list):
        kinds: dict[tuple, list[int]] = {}
        steps = torch.stack([entry.step for entry in entries]).tolist() if entries else []
        for index, (entry, step) in enumerate(zip(entries, steps)):
            correction = entry.weight_correction
            key = (tuple(moment.format_name for moment in entry.moments), entry.moments[0].block_size,
                   entry.param.dtype, entry.grad.dtype, entry.param.device, step,
                   None if correction is None else correction.dtype)
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
        first = kind[0]
        moments = [[(e.moments[i].codes, e.moments[i].scales) for e in kind]
                   for i in range(len(first.moments))]
        plan = KindPlan(work, [e.grad.contiguous() for e in kind], moments,
                        formats=tuple(moment.format for moment in first.moments),
                        block_size=first.moments[0].block_size, weight_corrections=work_corrections)
        every = indices == list(range(len(entries)))
        return _Kind(None if every else indices, first.step, work, work_corrections, copies, plan)

    def run(self, grads: list[Tensor], constants_of: Callable[[Tensor], tuple[float, ...]], *,
            update: KernelUpdate, maximize: bool, stochastic_round: bool,
            rounding_stream: int | None = None) -> None:
        """One step of every kind by the rule's ``update``, with ``constants_of(step)`` its
        constants for a kind's 0-d step count. ``rounding_stream``: see ``kind_seed``."""
        for index, kind in enumerate(self.kinds):
            kind_grads = grads if kind.indices is None else [grads[i] for i in kind.indices]
            if not all(map(Tensor.is_contiguous, kind_grads)):
                kind_grads = [grad.contiguous() for grad in kind_grads]
            seed = 0
            if stochastic_round and kind.work[0].dtype == torch.bfloat16:
                seed = kind_seed(host_float("step", kind.step), index, rounding_stream)
            for tensor, work in kind.copies:
                work.copy_(tensor)
            kind.plan.run(kind_grads, constants_of(kind.step), update=update, maximize=maximize,
                          stochastic_round=stochastic_round, seed=seed)
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
