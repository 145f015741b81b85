"""Whether autograd is running a backward nested in a node of another backward: what
reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``) does.

Each reentrant segment recomputes its forward inside the outer backward and differentiates it
with a ``torch.autograd.backward`` call of its own, a separate graph task whose
post-accumulate-grad hooks fire at the end of that segment alone: a parameter used in
several segments (a shared layer) gets its gradient in several parts, each firing the hook.
Nothing in the graph task says it is nested (its end callbacks, too, run before the outer
backward resumes), so this looks at the Python stack: the engine's entry point
(``_engine_run_backward``) called from within a custom autograd function's backward
(``BackwardCFunction.apply``, which the engine calls to run a Python node). Hooks called from
a function's backward without a backward of their own (FSDP2's post-backward calls the
sharded parameters' hooks itself) are not nested: the engine's entry point must come after.
"""

import sys

from torch.autograd import function, graph

_NODE_BACKWARD = function.BackwardCFunction.apply.__code__
_ENGINE_ENTRY = graph._engine_run_backward.__code__


def in_reentrant_backward() -> bool:
    """Whether the caller runs inside a backward started from another backward's node."""
    frame = sys._getframe(1)
    entered_engine = False
    while frame is not None:
        if frame.f_code is _ENGINE_ENTRY:
            entered_engine = True
        elif frame.f_code is _NODE_BACKWARD and entered_engine:
            return True
        frame = frame.f_back
    return False
