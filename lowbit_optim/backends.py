"""How a step runs: backend choice, the functional entry point ``adamw`` that sends each
parameter to its implementation, the compiled functions, the block layout.

``torch.compile`` sees every parameter as a ``(num_blocks, block_size)`` view with only
``num_blocks`` dynamic. On this kind of CPU that keeps one graph for every size at close to
static-shape speed, whereas a flat 1-D tensor with a dynamic length compiles to code ~3.5x
slower (shared FINDINGS: the static block dimension is what vectorises). A parameter whose
size is not a multiple of the block size runs its whole blocks in place, in chunks of at most
``CHUNK_ELEMENTS`` (bounding the step's temporaries), and its last, partial block through a
one-block scratch buffer, all reusing the same graph.
"""

import functools
import importlib.util
import os
import types
from typing import NamedTuple

import torch
import torch._dynamo
import torch.fx.experimental._config as fx_config

from lowbit_optim import cpu_kernel
from lowbit_optim.factored import FactoredParams
from lowbit_optim.factored_state import FactoredState
from lowbit_optim.functional import FloatStateStep, StepScalars, StoredMoment, quantized_adamw_step
from lowbit_optim.state import QuantizedState

BACKENDS = ("compile", "eager", "triton", "cpu")

# The most elements one call of the compiled (or eager) step updates. Its generated code keeps
# buffers of its input's size between passes (~23 bytes per element for 4-bit before issue 14;
# shared FINDINGS), so a 50M-element embedding stepped whole allocated ~1.2 GB of temporaries,
# 3x fp32 AdamW's entire state. In chunks of 2**20 elements the temporaries stay at a few
# dozen MiB whatever the parameter's size; one chunk is still large enough that the per-call
# overhead (~0.1 ms) is negligible (docs/benchmarks.md, "Transient memory of one step").
CHUNK_ELEMENTS = 1 << 20

# Parameters with float moments and fewer elements than this (norms, biases) are stepped
# together as one flat tensor; larger ones (a raised min_quant_size) alone, so that no
# parameter-sized copy is made of them.
FLAT_FLOAT_STATE_BELOW = 1 << 16


def _triton_interpreter_on() -> bool:
    # Triton's own parsing of the variable (lowbit_optim.kernels is defined by it).
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def resolve_backend(backend: str | None, devices=()) -> str:
    """``None`` picks the fastest backend available for the parameters' ``devices``:
    ``"triton"`` when they are all CUDA and Triton is installed, ``"cpu"`` (the C++ kernel,
    ``lowbit_optim.cpu_kernel``) when they are all on the CPU and the kernel builds, else
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


class ParamStep(NamedTuple):
    """One parameter's share of a step: the tensors it updates and its step count."""

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    max_exp_avg_sq: torch.Tensor | None
    step: torch.Tensor


def adamw(entries: list[ParamStep], *, lr: torch.Tensor, beta1: torch.Tensor, beta2: torch.Tensor,
          eps: torch.Tensor, weight_decay: torch.Tensor, maximize: bool, stochastic_round: bool,
          backend: str, scratch: "TailScratch", rounding_stream: int | None = None,
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
    keeps one per param group while nothing it was built from changes (``step_plan``).
    ``params``: the parameters as the optimizer holds them, when the entries hold FSDP2
    shards of them (the factored step reduces over the ranks that hold the other rows).
    """

    def __init__(self, entries: list[ParamStep], backend: str, params: list[torch.Tensor] | None = None):
        self.backend = backend
        params = params or [entry.param for entry in entries]
        triton_entries, float_state, factored = [], {}, []
        self.quantized: list[tuple[int, ParamStep]] = []  # stepped one by one
        self.cpu_kernel: list[tuple[int, ParamStep]] = []  # by the C++ kernel, one by one
        for index, entry in enumerate(entries):
            if not isinstance(entry.exp_avg, QuantizedState):
                # Small ones share one flat step per (device, dtype, step count, amsgrad); a big
                # one (min_quant_size raised) steps alone rather than be copied into the flat one.
                if entry.param.numel() < FLAT_FLOAT_STATE_BELOW:
                    key = (entry.param.device, entry.param.dtype, float(entry.step),
                           entry.max_exp_avg_sq is not None)
                else:
                    key = id(entry.param)
                float_state.setdefault(key, []).append(index)
            elif isinstance(entry.exp_avg_sq, FactoredState):
                factored.append(index)
            elif backend == "triton" and entry.param.dtype != torch.float64:
                triton_entries.append(index)
            elif backend == "cpu" and cpu_kernel.supports(entry.exp_avg.format, entry.exp_avg_sq.format,
                                                          entry.exp_avg.block_size, entry.param, entry.grad):
                self.cpu_kernel.append((index, entry._replace(grad=None)))
            else:
                self.quantized.append((index, entry._replace(grad=None)))
        self.float_state = []
        for indices in float_state.values():
            group = [entries[i] for i in indices]
            amsgrad = group[0].max_exp_avg_sq is not None
            self.float_state.append((indices, group[0].step, FloatStateStep(
                [e.param for e in group], [e.exp_avg for e in group], [e.exp_avg_sq for e in group],
                [e.max_exp_avg_sq for e in group] if amsgrad else None)))
        # The Triton kernel has no factored variant: these go through the compiled step.
        self.factored = FactoredParams([(i, entries[i]._replace(grad=None)) for i in factored],
                                       [params[i] for i in factored]) if factored else None
        self.isa = cpu_kernel.default_isa() if self.cpu_kernel else None
        self.triton_indices = triton_entries
        self.triton = None
        if triton_entries:
            from lowbit_optim import kernels  # imports Triton: only when the backend is in use

            self.triton = kernels.StepGroupPlan([entries[i] for i in triton_entries])

    def _compiled_step(self, entry, grad, scalars, scratch, maximize, stochastic_round,
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
            scratch: "TailScratch", rounding_stream: int | None = None,
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
            if grad.dtype != entry.param.dtype:  # planned with a gradient of the parameter's dtype
                self._compiled_step(entry, grad, StepScalars(lr, beta1, beta2, eps, weight_decay, entry.step),
                                    scratch, maximize, stochastic_round, decoupled_weight_decay)
                continue
            cpu_kernel.cpu_adamw_step(
                entry.param, grad, entry.exp_avg, entry.exp_avg_sq, entry.max_exp_avg_sq,
                StepScalars(lr, beta1, beta2, eps, weight_decay, entry.step),
                maximize=maximize, stochastic_round=stochastic_round,
                decoupled_weight_decay=decoupled_weight_decay, isa=self.isa,
            )
        for index, entry in self.quantized:
            self._compiled_step(entry, grads[index],
                                StepScalars(lr, beta1, beta2, eps, weight_decay, entry.step),
                                scratch, maximize, stochastic_round, decoupled_weight_decay)
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


def with_own_code_object(fn, name: str):
    """A copy of ``fn`` whose code object is its own.

    Dynamo keeps compiled graphs, and counts them against ``recompile_limit``, per code
    object. One copy per state kind means the 8-bit and 4-bit steps each get their own
    budget of graphs (one per parameter dtype and flag combination), instead of sharing one.
    """
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return functools.update_wrapper(
        types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__), fn
    )


@functools.cache
def compiled_step(exp_avg_format, exp_avg_sq_format):
    """The compiled ``quantized_adamw_step`` for one state kind, built once per process."""
    name = f"quantized_adamw_step__{exp_avg_format.name}__{exp_avg_sq_format.name}"
    name = name.replace("-", "_")
    # Compiled as a plain function (formats and flags are passed as keyword arguments at the
    # call): torch.compile wraps a functools.partial in a shared helper whose code object
    # would again be common to every state kind.
    return torch.compile(with_own_code_object(quantized_adamw_step, name), dynamic=False)


def compiled_graph_count(exp_avg_format, exp_avg_sq_format) -> int:
    """How many graphs Dynamo holds for one state kind's step (0 before its first call)."""
    code = compiled_step(exp_avg_format, exp_avg_sq_format)._torchdynamo_orig_callable.__code__
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code))


class TailScratch:
    """Reusable one-block buffers for the last, partial block of each parameter.

    Allocated once per (device, dtype, block size), so a steady-state step allocates nothing.
    """

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}

    def get(self, like: torch.Tensor, block_size: int, role: str) -> torch.Tensor:
        key = (like.device, like.dtype, block_size, role)
        if key not in self._buffers:
            self._buffers[key] = torch.zeros(1, block_size, dtype=like.dtype, device=like.device)
        return self._buffers[key]

    def index_scalar(self, role: str) -> torch.Tensor:
        """A 0-d int64 CPU tensor for an index the compiled step reads (``factored``)."""
        key = ("index", role)
        if key not in self._buffers:
            self._buffers[key] = torch.zeros((), dtype=torch.int64)
        return self._buffers[key]


def run_quantized_step(backend: str, entry: ParamStep, scalars: StepScalars, scratch: TailScratch,
                       *, maximize: bool, stochastic_round: bool,
                       decoupled_weight_decay: bool = True) -> None:
    """Update one parameter and its quantized moments in place with ``"compile"`` or
    ``"eager"``."""
    param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, _ = entry
    if backend == "compile":
        step = compiled_step(exp_avg.format, exp_avg_sq.format)
    else:
        step = quantized_adamw_step
    step = functools.partial(
        step, exp_avg_format=exp_avg.format, exp_avg_sq_format=exp_avg_sq.format,
        maximize=maximize, stochastic_round=stochastic_round,
        decoupled_weight_decay=decoupled_weight_decay,
    )

    moments = [exp_avg, exp_avg_sq] + ([max_exp_avg_sq] if max_exp_avg_sq is not None else [])

    def update(param_blocks, grad_blocks, block_rows: slice, first_element: int) -> None:
        stored = [StoredMoment(m.codes[block_rows], m.scales[block_rows]) for m in moments]
        if max_exp_avg_sq is None:
            stored.append(None)
        _call(step, backend, param_blocks, grad_blocks, stored, scalars)

    for_each_block_chunk(param, grad, exp_avg.block_size, scratch, update)


def for_each_block_chunk(param: torch.Tensor, grad: torch.Tensor, block_size: int,
                         scratch: TailScratch, update) -> None:
    """Run ``update(param_blocks, grad_blocks, block_rows, first_element)`` over ``param``'s
    blocks in place: its whole blocks a bounded chunk at a time (``CHUNK_ELEMENTS``; every
    chunk reuses the compiled graph), then its last, partial block through a zero-padded
    scratch block. ``block_rows`` are the chunk's rows of the block-shaped state and
    ``first_element`` its offset in the flattened parameter. A non-contiguous parameter
    steps a contiguous copy, written back at the end."""
    # Detached, so views of a leaf that requires grad and the scratch buffers look alike to
    # the compiled graph's guards.
    param = param.detach()
    work = param if param.is_contiguous() else param.contiguous()
    flat_param = work.view(-1)
    flat_grad = grad.detach().reshape(-1)
    whole_blocks, tail = divmod(flat_param.numel(), block_size)
    chunk_blocks = max(1, CHUNK_ELEMENTS // block_size)
    for first in range(0, whole_blocks, chunk_blocks):
        count = min(chunk_blocks, whole_blocks - first)
        elements = slice(first * block_size, (first + count) * block_size)
        update(flat_param[elements].view(count, block_size), flat_grad[elements].view(count, block_size),
               slice(first, first + count), first * block_size)
    if tail:
        start = whole_blocks * block_size
        param_block = scratch.get(flat_param, block_size, "param")
        grad_block = scratch.get(flat_grad, block_size, "grad")
        param_block[0, :tail].copy_(flat_param[start:])
        grad_block[0, :tail].copy_(flat_grad[start:])
        # The padding must be zeros, not the last parameter's values: its moments then stay
        # exactly 0 and never set the block's scale, so neither the parameter order nor a
        # resumed run's fresh buffers change the result (tests/test_checkpoint.py).
        param_block[0, tail:].zero_()
        grad_block[0, tail:].zero_()
        update(param_block, grad_block, slice(whole_blocks, None), start)
        flat_param[start:].copy_(param_block[0, :tail])
    if work is not param:
        param.copy_(work)


def _call(step, backend, param_blocks, grad_blocks, moments, scalars):
    if backend == "compile":
        for tensor in (param_blocks, grad_blocks, *(t for m in moments if m is not None for t in m)):
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
        # Without this, a one-block tensor (a small parameter, or a partial last block) is
        # specialised to size 1 and gets a graph of its own; size-oblivious reasoning lets the
        # single dynamic graph serve every block count, 1 included.
        with fx_config.patch(backed_size_oblivious=True):
            step(param_blocks, grad_blocks, *moments, scalars)
    else:
        step(param_blocks, grad_blocks, *moments, scalars)
