"""The Muon rule (Jordan et al., https://kellerjordan.github.io/posts/muon/; torch.optim.Muon):
one signed moment ``momentum_buffer``. Its per-element part is the momentum and the Nesterov
mix,

    B <- lerp(B, g, 1 - momentum)                      (momentum B + (1 - momentum) g)
    U <- lerp(g, B, momentum) if nesterov else B

and that part rides the machinery every rule shares (quantized or float moments, the C++ and
Triton kernels, the non-finite gradient policy): ``update`` returns ``U`` as its "new
parameter", which ``MuonPlan`` (``step.muon_plan``) has the generic step write into a scratch
buffer in place of the parameter. The rest is per matrix: Newton-Schulz on ``U`` and the
parameter write ``p <- p (1 - lr weight_decay) - adjusted_lr NS(U)``
(``step.newton_schulz``, ``step.muon_plan``).

``nesterov`` is a 0-d value (1 or 0) selecting between the mix and ``B``, not a compile-time
variant: ``lerp(g, B, 1)`` is ``B`` only up to the sign of a zero (and not at all where ``B - g``
overflows), so the select keeps ``U`` exactly torch's. The lerps are ``torch.lerp``, so the
float-moment step (eager) is ``torch.optim.Muon``'s op for op; the compiled step's lerp is
``w * (end - start) + start`` for ``|w| < 0.5`` and ``(w - 1) * (end - start) + end`` otherwise,
with no fused multiply-add (eager ATen fuses one), and ``muon_kernel_update`` and
``csrc/rules/muon.h`` write exactly that, so the kernels' codes and scales are the compiled
step's bit for bit.
"""

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: without it the rule has no kernel piece
    triton = None

from lowbit_optim.step.functional import StepCache, step_params
from lowbit_optim.step.hyperparams import StepOptions, as_float, check_learning_rate
from lowbit_optim.step.muon_plan import MuonPlan
from lowbit_optim.step.newton_schulz import ADJUST_LR_FNS
from lowbit_optim.step.rules.base import MomentSpec, UpdateRule


class MuonConstants(NamedTuple):
    """What ``update`` reads (0-d float64 CPU tensors): the momentum and 1.0 or 0.0 for
    ``nesterov``."""

    momentum: torch.Tensor
    nesterov: torch.Tensor


class MuonKernelConstants(NamedTuple):
    """``muon_kernel_update``'s constants (Python floats; the kernel rounds each to float32):
    each lerp as ``coefficient * (end - start) + (end if from_end else start)``."""

    momentum_coefficient: float  # the momentum lerp's weight, 1 - momentum, or that minus 1
    momentum_from_end: float  # 1.0 where |1 - momentum| >= 0.5
    nesterov_coefficient: float  # momentum, or momentum - 1
    nesterov_from_end: float
    nesterov: float


def lerp_coefficient(weight: float) -> tuple[float, float]:
    """``(coefficient, from_end)`` of ``lerp(start, end, weight)`` as the compiled step forms
    it, the weight rounded to float32 first (as ``update`` rounds it)."""
    weight = torch.tensor(weight, dtype=torch.float32)
    if float(weight.abs()) < 0.5:
        return float(weight), 0.0
    return float(weight - 1), 1.0  # exact in float32 (Sterbenz)


if triton is not None:
    @triton.jit
    def muon_kernel_update(param, grad, moments, constants, VARIANT: tl.constexpr, INTERPRETED: tl.constexpr):
        """``MuonRule.update`` on float32 values, for the step kernel (``step.kernels.step_kernel``);
        ``constants``: ``MuonKernelConstants``. ``param`` (the direction's old value) is unused."""
        momentum_coefficient, momentum_from_end, nesterov_coefficient, nesterov_from_end, nesterov = constants
        (buffer,) = moments
        new_buffer = (momentum_coefficient * (grad - buffer)
                      + tl.where(momentum_from_end != 0, grad, buffer))
        mixed = nesterov_coefficient * (new_buffer - grad) + tl.where(nesterov_from_end != 0, new_buffer,
                                                                      grad)
        return tl.where(nesterov != 0, mixed, new_buffer), (new_buffer,)
else:
    muon_kernel_update = None


class MuonRule(UpdateRule):
    name = "muon"
    moments = (MomentSpec("momentum_buffer", signed=True),)
    # Besides ``update``'s two, what ``MuonPlan`` reads per step on the host: ``nesterov`` and
    # ``adjust_lr_fn`` as numbers (``scalar_values``), so that all of them are refreshed from the
    # group at every step.
    scalar_names = ("momentum", "nesterov", "lr", "weight_decay", "ns_a", "ns_b", "ns_c", "ns_steps", "eps",
                    "adjust_lr_fn")
    kernel_update = muon_kernel_update
    cpu_functor = "muon"  # step/csrc/rules/muon.h

    def check_hyperparameters(self, group: dict) -> None:
        """``torch.optim.Muon``'s checks, in its words, and those its step makes later (the
        Newton-Schulz coefficients and steps) made here, before anything changes."""
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= as_float("lr", lr):
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        check_learning_rate(lr)  # finite, too (torch checks only lr >= 0)
        if not 0.0 <= as_float("momentum", group["momentum"]) < float("inf"):
            raise ValueError(f"momentum should be >= 0 but is: {group['momentum']}")
        if not 0.0 <= as_float("weight_decay", group["weight_decay"]) < float("inf"):
            raise ValueError(f"weight decay should be >= 0 but is: {group['weight_decay']}")
        if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
            raise ValueError(f"Adjust learning rate function {group['adjust_lr_fn']} is not supported")
        if not isinstance(group["nesterov"], bool):
            raise ValueError(f"Invalid nesterov: {group['nesterov']!r} (a bool is needed)")
        coefficients = group["ns_coefficients"]
        if not isinstance(coefficients, (tuple, list)) or len(coefficients) != 3:
            raise ValueError("Coefficients must be a tuple of exactly 3 values")
        for index, value in enumerate(coefficients):
            as_float(f"ns_coefficients[{index}]", value)
        steps = group["ns_steps"]
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise ValueError(f"Invalid ns_steps: {steps!r} (an int >= 0 is needed)")
        if steps >= 100:
            raise ValueError("Number of steps must be less than 100 for computational efficiency")
        if not 0.0 <= as_float("eps", group["eps"]) < float("inf"):
            raise ValueError(f"Invalid epsilon value: {group['eps']}")

    def scalar_values(self, group: dict) -> dict:
        a, b, c = group["ns_coefficients"]
        return dict(momentum=group["momentum"], nesterov=float(group["nesterov"]), lr=group["lr"],
                    weight_decay=group["weight_decay"], ns_a=a, ns_b=b, ns_c=c,
                    ns_steps=float(group["ns_steps"]), eps=group["eps"],
                    adjust_lr_fn=float(ADJUST_LR_FNS.index(group["adjust_lr_fn"])))

    def keywords(self, group: dict) -> dict:
        return {key: group[key] for key in ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients",
                                            "eps", "ns_steps", "adjust_lr_fn")}

    def step(self, params, grads, states, **keywords) -> None:
        muon(params, grads, states, **keywords)

    def step_constants(self, scalars, step: torch.Tensor) -> MuonConstants:
        return MuonConstants(scalars.momentum, scalars.nesterov)

    def update(self, param, grad, moments: tuple, constants: MuonConstants):
        momentum, nesterov = constants
        (buffer,) = moments
        # Weights of the moment's dtype, as torch rounds a Python float weight.
        new_buffer = buffer.lerp(grad, (1 - momentum).to(buffer.dtype))
        mixed = grad.lerp(new_buffer, momentum.to(buffer.dtype))
        return torch.where(nesterov != 0, mixed, new_buffer), (new_buffer,)

    def kernel_constants(self, constants: MuonConstants) -> MuonKernelConstants:
        momentum = float(constants.momentum)
        return MuonKernelConstants(*lerp_coefficient(1 - momentum), *lerp_coefficient(momentum),
                                   float(constants.nesterov))

    def plan(self, entries, backend: str, params):
        return MuonPlan(self, entries, backend, params)


MUON = MuonRule()


def muon(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict], *, lr, weight_decay,
         momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn, maximize: bool = False,
         stochastic_round: bool = False, rounding_stream: int = 0, backend: str | None = None,
         cache: StepCache | None = None) -> None:
    """One Muon step of the 2-D ``params``, in place; ``states``: one dict per parameter
    (``step``, ``momentum_buffer``). The hyperparameters are ``torch.optim.Muon``'s, the options
    ``rules.adamw.adamw``'s."""
    step_params(MUON, params, grads, states,
                dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                     ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn),
                options=StepOptions(maximize, stochastic_round, rounding_stream),
                backend=backend, cache=cache)
