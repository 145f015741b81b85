"""Which implementation steps what, in one place: ``resolve_backend`` turns the backend a caller
asks for into the one a param group uses, and ``implementation`` picks, for each parameter, the
implementation of that backend its rule and state layout have (rule x layout x device ->
implementation), saying once why a parameter falls back to the compiled step.
"""

import importlib.util
import os

import torch

from lowbit_optim.state.factored import FactoredState
from lowbit_optim.state.quantized import QuantizedState
from lowbit_optim.step import cpu_kernel

BACKENDS = ("compile", "eager", "triton", "cpu")
# What ``implementation`` returns: the float-state step (``float_state``), the factored layout's
# statistics pass then the quantized step over the rule's factored variant (``factored``), the
# Triton step kernel (``kernels``), the C++ CPU kernel (``cpu_kernel``) and the compiled or eager
# quantized step (``rule_step.quantized_rule_step``).
FLOAT, FACTORED, TRITON, CPU, COMPILE, EAGER = "float", "factored", "triton", "cpu", "compile", "eager"

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


def implementation(rule, moments: tuple, param: torch.Tensor, grad: torch.Tensor, backend: str) -> str:
    """The implementation that steps one parameter of ``rule`` with ``moments`` (its state, in the
    rule's order) under the resolved ``backend``:

    ==================  =============================================================
    float moments       ``FLOAT`` on every backend (exact arithmetic, many parameters at once)
    factored 2nd moment ``FACTORED`` (its passes compiled or eager; with ``"cpu"`` in the C++
                        kernel where ``cpu_kernel.supports`` takes the first moment)
    quantized           ``TRITON`` with ``"triton"`` for a rule with a Triton piece;
                        ``CPU`` with ``"cpu"`` for a rule with a C++ functor
    ==================  =============================================================

    Everything else is ``COMPILE`` (``EAGER`` with ``"eager"``), the reference on every device:
    float64 parameters (which the kernels do not update in float64), and with ``"cpu"`` what
    ``cpu_kernel.supports`` turns down (its docstring says what: dtypes, widths, block sizes).
    """
    if not isinstance(moments[0], QuantizedState):
        return FLOAT
    if any(isinstance(moment, FactoredState) for moment in moments):
        return FACTORED
    if backend == TRITON and rule.kernel_update is not None and param.dtype != torch.float64:
        return TRITON
    if (backend == CPU and rule.cpu_functor is not None
            and cpu_kernel.supports(tuple(moment.format for moment in moments), moments[0].block_size,
                                    param, grad)):
        return CPU
    return EAGER if backend == EAGER else COMPILE


def factored_kernel_takes(exp_avg, param: torch.Tensor, grad: torch.Tensor, backend: str) -> bool:
    """Whether the C++ kernel runs a ``FACTORED`` parameter's passes (``backend="cpu"``; the
    Triton kernel has no factored variant, so on CUDA they are compiled)."""
    return backend == CPU and cpu_kernel.supports((exp_avg.format,), exp_avg.block_size, param, grad)
