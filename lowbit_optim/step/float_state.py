"""The step of parameters whose moments are kept in float (those below
``min_quant_size``): ``FloatStateStep`` computes many of them as one flat tensor, with any
update rule's math (``float_state_groups`` says which go together).
"""

import torch

from lowbit_optim.step.master_weights import read_master, split_master
from lowbit_optim.step.math import compute_dtype, round_to_bfloat16_stochastic


class _Flat:
    """A list of tensors as one flat tensor, to compute on and write back.

    Tensors that already are consecutive views of one 1-D tensor (the float moments of small
    parameters, which ``step.plan`` lays out so) are used in place, as is a single contiguous
    tensor (a large parameter stepped alone is not copied); others are gathered into a
    buffer, with a view of it shaped like each tensor made once.
    """

    def __init__(self, tensors: list[torch.Tensor]):
        self.views = None
        if len(tensors) == 1 and tensors[0].is_contiguous():
            self.flat = tensors[0].view(-1)
            return
        self.flat = consecutive_views(tensors)
        if self.flat is None:
            sizes = [t.numel() for t in tensors]
            self.flat = torch.empty(sum(sizes), dtype=tensors[0].dtype, device=tensors[0].device)
            self.views = [piece.view(t.shape) for piece, t in zip(self.flat.split(sizes), tensors)]

    def gather(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if self.views is not None:
            torch._foreach_copy_(self.views, tensors)
        return self.flat

    def scatter(self, tensors: list[torch.Tensor], values: torch.Tensor) -> None:
        self.flat.copy_(values)
        if self.views is not None:
            torch._foreach_copy_(tensors, self.views)


def consecutive_views(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D tensor that ``tensors`` are contiguous, consecutive views of, in order, or None."""
    base = tensors[0]._base
    if base is None or base.dim() != 1 or not base.is_contiguous():
        return None
    offset = start = tensors[0].storage_offset()
    for tensor in tensors:
        if tensor._base is not base or not tensor.is_contiguous() or tensor.storage_offset() != offset:
            return None
        offset += tensor.numel()
    return base[start - base.storage_offset():offset - base.storage_offset()]


# Parameters with float moments and fewer elements than this (norms, biases) are stepped
# together as one flat tensor; larger ones (a raised min_quant_size) alone, so that no
# parameter-sized copy is made of them.
FLAT_FLOAT_STATE_BELOW = 1 << 16


def float_state_groups(entries: list[tuple[int, object]], *, moment_count) -> list[list[int]]:
    """The indices of ``entries`` (``(index, entry)``, entries with float moments), grouped
    into the ``FloatStateStep``s that step them: small parameters together per device, dtype,
    step count, number of moments (``moment_count(entry)``: amsgrad's third) and correction
    dtype; each large one alone, rather than copied into a flat tensor."""
    groups: dict[object, list[int]] = {}
    for index, entry in entries:
        param = entry.param
        if param.numel() < FLAT_FLOAT_STATE_BELOW:
            correction = entry.weight_correction
            key = (param.device, param.dtype, float(entry.step), moment_count(entry),
                   None if correction is None else correction.dtype)
        else:
            key = id(param)
        groups.setdefault(key, []).append(index)
    return list(groups.values())


class FloatStateStep:
    """The step for parameters with float moments (below ``min_quant_size``), in place,
    set up once for a fixed list of them (the update rule's plan keeps it between steps).

    Parameters of one device and dtype with the same step count are computed as one flat
    tensor, so the number of kernels does not grow with their number (measured: one by one,
    each norm or bias cost ~40 ops, ~25 launches on a GPU), with no Python work per parameter
    (a ``cat``, a ``split`` and a ``view`` per tensor cost ~2.5 ms per step for 160 norms on
    CPU): parameters and gradients are gathered with one
    ``torch._foreach_copy_`` each into buffers kept here and the parameters written back with
    one; moments laid out as consecutive views of one tensor (``step.plan`` does that) are
    updated in place, others gathered and written back the same way (``_Flat``).
    ``moments``: one list per moment (the rule's order), of ``compute_dtype`` tensors (float32;
    float64 for float64 parameters). ``weight_corrections``: the bfloat16 or float16
    parameters' master weight corrections (``master_weights``), or ``None`` without master
    weights.
    """

    def __init__(self, params, moments, weight_corrections=None):
        self.params = list(params)
        self.moments = [list(tensors) for tensors in moments]
        self.param_flat = _Flat(self.params)
        self.moment_flats = [_Flat(tensors) for tensors in self.moments]
        self.weight_corrections = None if weight_corrections is None else list(weight_corrections)
        self.weight_correction_flat = None if weight_corrections is None else _Flat(self.weight_corrections)
        # Gradients are new tensors at every step: only a buffer for them is kept.
        self.grad_buffer = None if len(self.params) == 1 else _Flat(self.params)

    def step(self, grads, update, *, stochastic_round: bool) -> None:
        """``update(param, grad, moments) -> (new_param, new_moments)`` on the flat tensors, in
        the compute dtype; the results are written back in place."""
        dtype = compute_dtype(self.params[0])
        grad = grads[0].reshape(-1) if self.grad_buffer is None else self.grad_buffer.gather(grads)
        moments = [flat.gather(tensors) for flat, tensors in zip(self.moment_flats, self.moments)]
        param = self.param_flat.gather(self.params)
        if self.weight_corrections is not None:
            param = read_master(param, self.weight_correction_flat.gather(self.weight_corrections))
        new_param, new_moments = update(param.to(dtype), grad.to(dtype), tuple(moments))
        for flat, tensors, values in zip(self.moment_flats, self.moments, new_moments):
            flat.scatter(tensors, values)
        if self.weight_corrections is not None:
            rounded, remainder = split_master(new_param, self.params[0].dtype,
                                              self.weight_corrections[0].dtype)
            self.param_flat.scatter(self.params, rounded)
            self.weight_correction_flat.scatter(self.weight_corrections, remainder)
            return
        if stochastic_round and self.params[0].dtype == torch.bfloat16:
            new_param = round_to_bfloat16_stochastic(new_param)
        self.param_flat.scatter(self.params, new_param)
