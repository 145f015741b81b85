"""The optimizer step gives the same bits at any thread count.

Why it matters: the exact comparisons in tests/test_distributed.py replay a worker's
gradients (the worker at 1 thread) in this process (at its own count), and a checkpoint
resumed on a machine with another core count must continue the same run. Both hold only if
the step has no thread-dependent arithmetic: its only reduction is each block's absmax, a max,
which is exact in any order, and everything else is elementwise.

What could break it: ATen splits an elementwise op or a reduction over more than 32768
elements (``at::internal::GRAIN_SIZE``) into one chunk per thread, and each chunk ends in a
scalar tail after its vectorised loop; an op whose vector and scalar code round differently
(a fused multiply-add in one of them, another ``exp``), or a sum reduced in per-thread
partials, then changes bits with the thread count (a global ``sum`` over a tensor of this
size differs between 1 and 3 threads, and a step that adds one fails this test). The quantized
parameter has 90601 elements; its whole blocks (90368 in 8-bit, 90496 in 4-bit) split at 3
threads into chunks of 30123 and 30166 elements, no multiple of the 16-float vector width,
so the tails fall on other elements than at 1 thread.

The compiled step keeps the thread count it was compiled with (Inductor writes it into its
C++, and Dynamo does not recompile when it changes), so here it checks that changing
``torch.set_num_threads`` mid-run leaves it alone; code compiled for different thread counts
is compared in tests/test_distributed.py (a 1-thread worker's compiled steps, replayed here).
"""

import pytest
import torch
from conftest import num_threads

from lowbit_optim import AdamW4bit, AdamW8bit, AdamWFactored4bit, FactoredState, QuantizedState

SHAPES = [(301, 301), (33,)]  # quantized (whole blocks and a partial one); float32 state
STEPS = 3


def run(cls, backend: str, threads: int) -> list[torch.Tensor]:
    """Parameters, codes and scales after ``STEPS`` steps on fixed gradients at ``threads``."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]
    grads = [[torch.randn(shape, generator=generator) for shape in SHAPES] for _ in range(STEPS)]
    optimizer = cls(params, lr=1e-2, weight_decay=0.1, backend=backend)
    with num_threads(threads):
        for step_grads in grads:
            for param, grad in zip(params, step_grads):
                param.grad = grad
            optimizer.step()
    assert isinstance(optimizer.state[params[0]]["exp_avg"], QuantizedState)
    results = [param.detach() for param in params]
    for param in params:
        for key in ("exp_avg", "exp_avg_sq"):
            moment = optimizer.state[param][key]
            if isinstance(moment, QuantizedState):
                results += [moment.codes, moment.scales]
            elif isinstance(moment, FactoredState):
                results += [moment.row, moment.col]
            else:
                results.append(moment)
    return results


# The compiled case compiles a graph per thread count (Inductor bakes it in): slow tier, and
# only the factored class, whose statistics pass is the one with sums over a tensor; that the
# compiled code ignores a thread count set after it was built is the same for every graph.
CASES = [(AdamW8bit, "eager"), (AdamW4bit, "eager"), (AdamWFactored4bit, "eager"),
         pytest.param(AdamWFactored4bit, "compile", marks=pytest.mark.slow)]


@pytest.mark.parametrize("cls, backend", CASES, ids=lambda v: getattr(v, "__name__", v))
def test_step_is_bit_identical_at_one_and_three_threads(cls, backend):
    if backend == "compile":
        run(cls, backend, torch.get_num_threads())  # compiled here at this process's count
    one, three = run(cls, backend, 1), run(cls, backend, 3)
    for index, (a, b) in enumerate(zip(one, three)):
        assert torch.equal(a, b), f"tensor {index} differs between 1 and 3 threads"
