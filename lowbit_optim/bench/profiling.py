"""Profiler helpers: a quiet ``torch.profiler.profile`` and the allocation peak of a call."""

import contextlib
import os
import sys
import tempfile

from torch.profiler import ProfilerActivity, profile

# Kineto, the profiler's C++ backend, writes a "USDT:<time> <pid>:<tid>
# SyncActivityProfilerHandler.cpp:52] profiler_start" line (and one for profiler_stop) to
# stderr at every start and stop, which landed between the progress bar and the table. They
# are logged at a level above ERROR, so KINETO_LOG_LEVEL cannot hide them without hiding
# errors; instead stderr is captured at the file-descriptor level around the start and the
# stop only, and everything else written there is passed on.
KINETO_MARKER = "USDT:"


@contextlib.contextmanager
def without_kineto_markers():
    """Drop kineto's ``USDT:`` lines from what is written to stderr (fd 2) inside the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not line.startswith(KINETO_MARKER))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()


@contextlib.contextmanager
def quiet_profile(**options):
    """``torch.profiler.profile(**options)`` without kineto's start and stop markers."""
    prof = profile(**options)
    with without_kineto_markers():
        prof.__enter__()
    try:
        yield prof
    finally:
        with without_kineto_markers():
            prof.__exit__(None, None, None)


def allocation_peak_bytes(fn) -> int:
    """The highest point, above what was live before, of the CPU allocations made while
    ``fn()`` runs: the transient memory of a step (the tensors it frees again included),
    recorded by the profiler's allocator hooks."""
    with quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    running = highest = 0
    for event in events:
        running += event.nbytes()
        highest = max(highest, running)
    return highest
