"""How an AdamW step runs: the backend choice (``resolve_backend``, for every rule) and
``AdamWPlan``, which sends each parameter of a param group to the implementation its state
needs: float moments to ``float_state``, quantized ones to ``quantized`` (compiled or eager),
the Triton kernels or the C++ CPU kernel, factored ones to ``factored``.
"""

import functools
import importlib.util
import os

import torch

from lowbit_optim.state.factored import FactoredState
from lowbit_optim.state.quantized import QuantizedState
from lowbit_optim.step import cpu_kernel
from lowbit_optim.step.chunks import ParamStep, PlannedStep, TailScratch
from lowbit_optim.step.factored import FactoredParams
from lowbit_optim.step.float_state import FloatStateStep, float_state_groups
from lowbit_optim.step.hyperparams import StepOptions
from lowbit_optim.step.math import StepScalars, adamw_update
from lowbit_optim.step.quantized import run_quantized_step

BACKENDS = ("compile", "eager", "triton", "cpu")

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
        triton_entries, floats, factored = [], [], []
        self.quantized: list[PlannedStep] = []  # stepped one by one
        kernel_entries: list[PlannedStep] = []  # by the C++ kernel, in batches
        for index, entry in enumerate(entries):
            if not isinstance(entry.exp_avg, QuantizedState):
                floats.append((index, entry))
            elif isinstance(entry.exp_avg_sq, FactoredState):
                factored.append(index)
            elif backend == "triton" and entry.param.dtype != torch.float64:
                triton_entries.append(index)  # master weights included
            elif (backend == "cpu"
                  and cpu_kernel.supports((entry.exp_avg.format, entry.exp_avg_sq.format),
                                          entry.exp_avg.block_size, entry.param, entry.grad)):
                # Master weights included; every case ``supports`` turns down takes the
                # compiled step.
                kernel_entries.append(PlannedStep(index, entry))
            else:
                self.quantized.append(PlannedStep(index, entry._replace(grad=None)))
        self.float_state = []
        for indices in float_state_groups(floats, moment_count=_adamw_moment_count):
            group = [entries[i] for i in indices]
            moments = [[e.exp_avg for e in group], [e.exp_avg_sq for e in group]]
            if group[0].max_exp_avg_sq is not None:
                moments.append([e.max_exp_avg_sq for e in group])
            master = group[0].weight_correction is not None
            self.float_state.append((indices, group[0].step, FloatStateStep(
                [e.param for e in group], moments, [e.weight_correction for e in group] if master else None)))
        # The Triton kernel has no factored variant: on CUDA these go through the compiled step;
        # on the CPU, with backend "cpu", through the C++ kernel where it takes them.
        kernel = [backend == "cpu" and cpu_kernel.supports((entry.exp_avg.format,), entry.exp_avg.block_size,
                                                           entry.param, entry.grad)
                  for entry in map(entries.__getitem__, factored)]
        kernel_isa = cpu_kernel.default_isa() if any(kernel) else None
        self.factored = None
        if factored:
            self.factored = FactoredParams([PlannedStep(i, entries[i]._replace(grad=None)) for i in factored],
                                           [params[i] for i in factored], kernel, kernel_isa)
        self.cpu_indices = [index for index, _ in kernel_entries]
        self.cpu_batches = cpu_kernel.kernel_batches(
            [cpu_kernel.BatchEntry(index, entry.param, _adamw_moments(entry), entry.step,
                                   entry.weight_correction) for index, entry in kernel_entries],
            "adamw", _adamw_kernel_formats)
        self.isa = cpu_kernel.default_isa() if kernel_entries else None
        self.triton_indices = triton_entries
        self.triton = None
        if triton_entries:
            from lowbit_optim.step import kernels  # imports Triton: only when the backend is in use

            self.triton = kernels.StepGroupPlan([entries[i] for i in triton_entries])

    def _compiled_step(self, entry, grad, scalars, scratch, options: StepOptions):
        """A quantized parameter through ``quantized_adamw_step`` (compiled unless the backend
        is ``"eager"``)."""
        run_quantized_step(
            "eager" if self.backend == "eager" else "compile", entry._replace(grad=grad), scalars, scratch,
            maximize=options.maximize, stochastic_round=options.stochastic_round,
            decoupled_weight_decay=options.decoupled_weight_decay,
        )

    def run(self, grads: list[torch.Tensor], hyper, options: StepOptions, scratch: TailScratch) -> None:
        """One AdamW step of every parameter with ``grads``, one per entry the plan was built
        from (``hyper``: the group's ``hyperparams.GroupScalars``)."""
        lr, beta1, beta2, eps, weight_decay = (hyper.lr, hyper.beta1, hyper.beta2, hyper.eps,
                                               hyper.weight_decay)
        flags = dict(maximize=options.maximize, stochastic_round=options.stochastic_round,
                     decoupled_weight_decay=options.decoupled_weight_decay)
        if self.factored is not None:
            self.factored.run(
                "eager" if self.backend == "eager" else "compile", grads,
                StepScalars(lr, beta1, beta2, eps, weight_decay, None), scratch, **flags)
        if self.cpu_batches:
            # AdamW's functor's values (csrc/rules/adamw.h): the group's, the step count, the decay's kind.
            shared, decoupled = (lr, beta1, beta2, eps, weight_decay), cpu_kernel.DECOUPLED[
                bool(options.decoupled_weight_decay)]
            kernel_options = cpu_kernel.KernelOptions(options.maximize, options.stochastic_round, self.isa)
            for batch in self.cpu_batches:
                batch.run(grads, lambda step: (*shared, step, decoupled), kernel_options)
        for index, entry in self.quantized:
            scalars = StepScalars(lr, beta1, beta2, eps, weight_decay, entry.step)
            self._compiled_step(entry, grads[index], scalars, scratch, options)
        for indices, step, float_state in self.float_state:
            update = functools.partial(
                _adamw_float_update, scalars=StepScalars(lr, beta1, beta2, eps, weight_decay, step),
                maximize=options.maximize, decoupled_weight_decay=options.decoupled_weight_decay)
            float_state.step([grads[i] for i in indices], update, stochastic_round=options.stochastic_round)
        if self.triton is not None:
            triton_grads = grads if len(self.triton_indices) == len(grads) else [
                grads[i] for i in self.triton_indices]
            self.triton.run(triton_grads, hyper, options)


def _adamw_moments(entry: ParamStep) -> tuple:
    maximum = () if entry.max_exp_avg_sq is None else (entry.max_exp_avg_sq,)
    return (entry.exp_avg, entry.exp_avg_sq, *maximum)


def _adamw_kernel_formats(entry) -> tuple:
    """The formats the kernel decodes and encodes an AdamW parameter's moments with: amsgrad's
    maximum with the second moment's (``cpu_kernel.cpu_adamw_step``)."""
    exp_avg, exp_avg_sq, *maximum = entry.moments
    return (exp_avg.format, exp_avg_sq.format, exp_avg_sq.format)[:2 + len(maximum)]


def _adamw_moment_count(entry: ParamStep) -> int:
    return 2 if entry.max_exp_avg_sq is None else 3


def _adamw_float_update(param, grad, moments: tuple, *, scalars: StepScalars, maximize: bool,
                        decoupled_weight_decay: bool):
    """``math.adamw_update`` in ``FloatStateStep``'s shape: float moments are exact
    ``torch.optim.AdamW`` arithmetic, so no ratio clamp."""
    exp_avg, exp_avg_sq, *maximum = moments
    new_param, *new_moments = adamw_update(
        param, grad, exp_avg, exp_avg_sq, maximum[0] if maximum else None,
        lr=scalars.lr, beta1=scalars.beta1, beta2=scalars.beta2, eps=scalars.eps,
        weight_decay=scalars.weight_decay, step=scalars.step, maximize=maximize,
        decoupled_weight_decay=decoupled_weight_decay)
    return new_param, new_moments
