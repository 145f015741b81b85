"""How a step runs: the backend choice and the functional entry point ``adamw``, which
sends each parameter to the implementation its state needs (``AdamWPlan``: float moments to
``float_state``, quantized ones to ``quantized`` or the Triton kernels, factored ones to
``factored``).
"""

import importlib.util
import os

import torch

from lowbit_optim.state.factored import FactoredState
from lowbit_optim.state.quantized import QuantizedState
from lowbit_optim.step import cpu_kernel
from lowbit_optim.step.chunks import ParamStep, PlannedStep, TailScratch
from lowbit_optim.step.factored import FactoredParams
from lowbit_optim.step.float_state import FloatStateStep
from lowbit_optim.step.math import StepScalars
from lowbit_optim.step.quantized import run_quantized_step

BACKENDS = ("compile", "eager", "triton", "cpu")

# Parameters with float moments and fewer elements than this (norms, biases) are stepped
# together as one flat tensor; larger ones (a raised min_quant_size) alone, so that no
# parameter-sized copy is made of them.
FLAT_FLOAT_STATE_BELOW = 1 << 16


def _triton_interpreter_on() -> bool:
    # Triton's own parsing of the variable (lowbit_optim.step.kernels is defined by it).
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def resolve_backend(backend: str | None, devices=()) -> str:
    """``None`` picks the fastest backend available for the parameters' ``devices``:
    ``"triton"`` when they are all CUDA and Triton is installed, ``"cpu"`` (the C++ kernel,
    ``step.cpu_kernel``) when they are all on the CPU and the kernel builds, else
    ``"compile"``.

    ``"triton"`` on CPU tensors runs only under the Triton interpreter (tests): without
    ``TRITON_INTERPRET=1`` a CPU launch fails with "0 active drivers", so it is refused here.
    ``"cpu"`` where the kernel cannot be built falls back to ``"compile"`` (``cpu_kernel.load``
    has warned once).
    """
    devices = {torch.device(d).type for d in devices}
    has_triton = importlib.util.find_spec("triton") is not None
    if backend is None:
        if devices == {"cuda"} and has_triton:
            return "triton"
        return "cpu" if devices == {"cpu"} and cpu_kernel.load() else "compile"
    if backend not in BACKENDS:
        raise ValueError(f"Invalid backend: {backend!r} (choose one of {BACKENDS} or None)")
    if backend == "cpu":
        if devices - {"cpu"}:
            raise ValueError(f"backend='cpu' needs CPU parameters (got {sorted(devices)})")
        return "cpu" if cpu_kernel.load() else "compile"
    if backend == "triton":
        if not has_triton:
            raise ValueError("backend='triton' needs Triton: pip install triton")
        not_cuda = devices - {"cuda"}
        if not_cuda and not (not_cuda == {"cpu"} and _triton_interpreter_on()):
            raise ValueError(
                f"backend='triton' needs CUDA parameters (got {sorted(devices)}); on CPU it runs "
                "only under the Triton interpreter (TRITON_INTERPRET=1, for tests)"
            )
    return backend


def adamw(entries: list[ParamStep], *, lr: torch.Tensor, beta1: torch.Tensor, beta2: torch.Tensor,
          eps: torch.Tensor, weight_decay: torch.Tensor, maximize: bool, stochastic_round: bool,
          backend: str, scratch: TailScratch, rounding_stream: int | None = None,
          decoupled_weight_decay: bool = True) -> None:
    """The functional AdamW step over one param group's parameters, in place
    (``decoupled_weight_decay=False``: ``torch.optim.Adam``'s L2 weight decay instead).

    Hyperparameters are 0-d CPU tensors (``hyperparams.GroupScalars``). Each parameter goes to
    the implementation its state needs: float moments to ``FloatStateStep`` (small
    ones together, a fixed number of kernels for any number of them); quantized ones one by
    one to the compiled (or eager) step, or, with ``backend="triton"``, all together to the
    Triton kernel (one launch per kind), except float64 parameters, which the kernel does not
    take and the compiled step does. ``rounding_stream``: see ``kernels.step_group``.
    ``AdamWPlan`` is the same step with the dispatch worked out once.
    """
    AdamWPlan(entries, backend).run(
        [entry.grad for entry in entries], lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, maximize=maximize, stochastic_round=stochastic_round, scratch=scratch,
        rounding_stream=rounding_stream, decoupled_weight_decay=decoupled_weight_decay)


class AdamWPlan:
    """``adamw``'s dispatch for a fixed list of parameters and states, worked out once.

    Built from the entries (with their current gradients, which decide only how the Triton
    kernel's launches split); ``run`` steps them with the gradients given, one per entry,
    in order. Holds no gradient, so ``zero_grad(set_to_none=True)`` frees them. The optimizer
    keeps one per param group while nothing it was built from changes (``step.plan``).
    ``params``: the parameters as the optimizer holds them, when the entries hold FSDP2
    shards of them (the factored step reduces over the ranks that hold the other rows).
    """

    def __init__(self, entries: list[ParamStep], backend: str, params: list[torch.Tensor] | None = None):
        self.backend = backend
        params = params or [entry.param for entry in entries]
        triton_entries, float_state, factored = [], {}, []
        self.quantized: list[PlannedStep] = []  # stepped one by one
        self.cpu_kernel: list[PlannedStep] = []  # by the C++ kernel, one by one
        for index, entry in enumerate(entries):
            if not isinstance(entry.exp_avg, QuantizedState):
                # Small ones share one flat step per (device, dtype, step count, amsgrad); a big
                # one (min_quant_size raised) steps alone rather than be copied into the flat one.
                if entry.param.numel() < FLAT_FLOAT_STATE_BELOW:
                    key = (entry.param.device, entry.param.dtype, float(entry.step),
                           entry.max_exp_avg_sq is not None,
                           None if entry.weight_correction is None else entry.weight_correction.dtype)
                else:
                    key = id(entry.param)
                float_state.setdefault(key, []).append(index)
            elif isinstance(entry.exp_avg_sq, FactoredState):
                factored.append(index)
            elif (backend == "triton" and entry.param.dtype != torch.float64
                  and entry.weight_correction is None):
                # The kernel has no master weight variant: those take the compiled step.
                triton_entries.append(index)
            elif (backend == "cpu"
                  and cpu_kernel.supports(entry.exp_avg.format, entry.exp_avg_sq.format,
                                          entry.exp_avg.block_size, entry.param, entry.grad)):
                # Master weights included; every case ``supports`` turns down takes the
                # compiled step.
                self.cpu_kernel.append(PlannedStep(index, entry._replace(grad=None)))
            else:
                self.quantized.append(PlannedStep(index, entry._replace(grad=None)))
        self.float_state = []
        for indices in float_state.values():
            group = [entries[i] for i in indices]
            amsgrad = group[0].max_exp_avg_sq is not None
            master = group[0].weight_correction is not None
            self.float_state.append((indices, group[0].step, FloatStateStep(
                [e.param for e in group], [e.exp_avg for e in group], [e.exp_avg_sq for e in group],
                [e.max_exp_avg_sq for e in group] if amsgrad else None,
                [e.weight_correction for e in group] if master else None)))
        # The Triton kernel has no factored variant: these go through the compiled step.
        self.factored = FactoredParams([PlannedStep(i, entries[i]._replace(grad=None)) for i in factored],
                                       [params[i] for i in factored]) if factored else None
        self.isa = cpu_kernel.default_isa() if self.cpu_kernel else None
        self.triton_indices = triton_entries
        self.triton = None
        if triton_entries:
            from lowbit_optim.step import kernels  # imports Triton: only when the backend is in use

            self.triton = kernels.StepGroupPlan([entries[i] for i in triton_entries])

    def _compiled_step(self, entry, grad, scalars, scratch, *, maximize, stochastic_round,
                       decoupled_weight_decay):
        """A quantized parameter through ``quantized_adamw_step`` (compiled unless the backend
        is ``"eager"``)."""
        run_quantized_step(
            "eager" if self.backend == "eager" else "compile", entry._replace(grad=grad), scalars, scratch,
            maximize=maximize, stochastic_round=stochastic_round,
            decoupled_weight_decay=decoupled_weight_decay,
        )

    def run(self, grads: list[torch.Tensor], *, lr: torch.Tensor, beta1: torch.Tensor, beta2: torch.Tensor,
            eps: torch.Tensor, weight_decay: torch.Tensor, maximize: bool, stochastic_round: bool,
            scratch: TailScratch, rounding_stream: int | None = None,
            decoupled_weight_decay: bool = True) -> None:
        """``adamw``'s step (see there) with ``grads``, one per entry the plan was built from."""
        if self.factored is not None:
            self.factored.run(
                "eager" if self.backend == "eager" else "compile", grads,
                StepScalars(lr, beta1, beta2, eps, weight_decay, None), scratch,
                maximize=maximize, stochastic_round=stochastic_round,
                decoupled_weight_decay=decoupled_weight_decay,
            )
        for index, entry in self.cpu_kernel:
            grad = grads[index]
            scalars = StepScalars(lr, beta1, beta2, eps, weight_decay, entry.step)
            if grad.dtype != entry.param.dtype:  # planned with a gradient of the parameter's dtype
                self._compiled_step(entry, grad, scalars, scratch, maximize=maximize,
                                    stochastic_round=stochastic_round,
                                    decoupled_weight_decay=decoupled_weight_decay)
                continue
            cpu_kernel.cpu_adamw_step(
                entry.param, grad, entry.exp_avg, entry.exp_avg_sq, entry.max_exp_avg_sq, scalars,
                maximize=maximize, stochastic_round=stochastic_round,
                decoupled_weight_decay=decoupled_weight_decay, isa=self.isa,
                weight_correction=entry.weight_correction,
            )
        for index, entry in self.quantized:
            self._compiled_step(entry, grads[index],
                                StepScalars(lr, beta1, beta2, eps, weight_decay, entry.step),
                                scratch, maximize=maximize, stochastic_round=stochastic_round,
                                decoupled_weight_decay=decoupled_weight_decay)
        for indices, step, float_state in self.float_state:
            float_state.step(
                [grads[i] for i in indices], lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                weight_decay=weight_decay, step=step, maximize=maximize, stochastic_round=stochastic_round,
                decoupled_weight_decay=decoupled_weight_decay,
            )
        if self.triton is not None:
            triton_grads = grads if len(self.triton_indices) == len(grads) else [
                grads[i] for i in self.triton_indices]
            self.triton.run(triton_grads, lr, beta1, beta2, eps, weight_decay, maximize=maximize,
                            stochastic_round=stochastic_round, rounding_stream=rounding_stream,
                            decoupled_weight_decay=decoupled_weight_decay)
