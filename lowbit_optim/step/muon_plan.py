"""Muon's step over one param group (``rules.muon.MuonRule.plan``), composed of the generic
rule step and the per-matrix part the generic step has no place for.

For each parameter, in order:

1. its momentum pass, a ``rule_step.RulePlan`` of that one parameter whose "parameter" is a
   zeroed direction buffer of the parameter's shape and dtype: the rule's ``update`` writes the
   Nesterov-mixed momentum there and advances ``momentum_buffer`` (quantized or float, on any
   backend: one fused pass in the C++ and Triton kernels). An element whose gradient is not
   finite keeps its momentum and, from the zeroed buffer, gets direction 0 (the shared
   policy); the buffer has no master weight and is rounded to nearest;
2. Newton-Schulz on the whole direction (``newton_schulz``, in bf16, as torch.optim.Muon; an
   FSDP2 shard's direction is gathered for it in bf16 first, ``muon_sharded``);
3. the parameter write, ``p <- p (1 - lr weight_decay) - adjusted_lr O``: in place with
   torch.optim.Muon's two operations for float32 and float64 parameters (so a float-momentum
   trajectory is torch's bit for bit), else computed in float32 from the parameter (or its
   master weight, ``master_weights``) and written back by rounding, stochastic rounding for
   bf16 with ``bf16_stochastic_round``, or through the master weight.

The direction buffers are views of one buffer per dtype and device, as large as the group's
largest Muon parameter, reused parameter after parameter: the step keeps the momentum's
bytes, not a float copy of every parameter. A bf16 direction loses nothing: Newton-Schulz
starts by rounding it to bf16. Hyperparameters are read from the group's 0-d tensors
(``hyperparams.GroupScalars``) at every step, so a schedule changes values, never graphs.
"""

import torch

from lowbit_optim.step.chunks import RuleEntry, TailScratch
from lowbit_optim.step.hyperparams import StepOptions
from lowbit_optim.step.master_weights import read_master, write_master
from lowbit_optim.step.math import write_param
from lowbit_optim.step.muon_sharded import orthogonalize
from lowbit_optim.step.newton_schulz import ADJUST_LR_FNS, adjusted_lr, zeropower_via_newtonschulz
from lowbit_optim.step.rule_step import RulePlan


class MuonPlan:
    """The Muon step of one param group's ``entries`` (module docstring); ``run`` as
    ``RulePlan.run``."""

    def __init__(self, rule, entries: list[RuleEntry], backend: str, params: list[torch.Tensor]):
        for entry in entries:
            if entry.param.dim() != 2:
                raise ValueError(f"{rule.name}: Muon steps 2-D parameters only, got one of shape "
                                 f"{tuple(entry.param.shape)}")
        sizes: dict[tuple, int] = {}
        for entry in entries:
            key = (entry.param.dtype, entry.param.device)
            sizes[key] = max(sizes.get(key, 0), entry.param.numel())
        buffers = {key: torch.empty(size, dtype=key[0], device=key[1]) for key, size in sizes.items()}
        self.parts = []
        for entry in entries:
            buffer = buffers[(entry.param.dtype, entry.param.device)]
            direction = buffer[:entry.param.numel()].view(entry.param.shape)
            momentum_pass = RulePlan(rule, [entry._replace(param=direction, weight_correction=None)], backend)
            self.parts.append((entry._replace(grad=None), direction, momentum_pass))
        # As the optimizer holds them: a DTensor (FSDP2) has its global shape, for the LR scale
        # and for the gather that Newton-Schulz of a shard needs (``muon_sharded``).
        self.params = params

    def run(self, grads: list[torch.Tensor], scalars, options: StepOptions, scratch: TailScratch) -> None:
        lr, weight_decay = float(scalars.lr), float(scalars.weight_decay)
        coefficients = (float(scalars.ns_a), float(scalars.ns_b), float(scalars.ns_c))
        ns_steps, eps = int(scalars.ns_steps), float(scalars.eps)
        adjust_lr_fn = ADJUST_LR_FNS[int(scalars.adjust_lr_fn)]
        direction_options = options._replace(stochastic_round=False)

        def newton_schulz(update: torch.Tensor) -> torch.Tensor:
            return zeropower_via_newtonschulz(update, coefficients, ns_steps, eps)

        for index, (entry, direction, momentum_pass) in enumerate(self.parts):
            direction.zero_()
            momentum_pass.run([grads[index]], scalars, direction_options, scratch)
            ortho = orthogonalize(direction, self.params[index], newton_schulz)
            write_muon_param(entry.param, entry.weight_correction, ortho, decay=1 - lr * weight_decay,
                             step_lr=adjusted_lr(lr, adjust_lr_fn, self.params[index].shape),
                             stochastic_round=options.stochastic_round)


def write_muon_param(param: torch.Tensor, weight_correction: torch.Tensor | None, ortho: torch.Tensor, *,
                     decay: float, step_lr: float, stochastic_round: bool) -> None:
    """``param <- param * decay - step_lr * ortho``, in place (module docstring, step 3)."""
    if weight_correction is None and param.dtype in (torch.float32, torch.float64):
        param.mul_(decay)
        param.add_(ortho, alpha=-step_lr)
        return
    master = param.float() if weight_correction is None else read_master(param, weight_correction)
    master.mul_(decay)
    master.add_(ortho, alpha=-step_lr)
    if weight_correction is None:
        write_param(param, master, stochastic_round=stochastic_round)
    else:
        write_master(param, weight_correction, master)
