"""Shared test setup: seeding, device parametrisation, compile counters and error helpers."""

import contextlib
import importlib
import importlib.util
import os

import pytest
import torch

# No torch.set_num_threads here: the suite must pass at any thread count, so it runs
# at torch's default (the machine's cores, or OMP_NUM_THREADS). Tests that need a given count
# set it for their own duration with ``num_threads``.

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    """Import the Triton kernels once, before any test module, under the interpreter when
    there is no GPU: Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so this is
    the one moment it can be chosen. The variable is restored right after, so that nothing
    else in the run is interpreted; tests that launch the kernels on CPU tensors ask for the
    ``interpreter`` fixture. With a GPU the kernel is compiled and only CUDA tests use it."""
    if importlib.util.find_spec("triton") is None:
        return
    saved = os.environ.get("TRITON_INTERPRET")
    if not HAS_CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        importlib.import_module("lowbit_optim.step.kernels")
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


@pytest.fixture
def interpreter(monkeypatch):
    """CPU tensors through the interpreted kernel; ``backend="triton"`` accepted on CPU."""
    if HAS_CUDA:
        pytest.skip("the kernel is compiled for CUDA here; the interpreter tests run in CPU CI")
    kernels = pytest.importorskip("lowbit_optim.step.kernels")
    if not kernels.is_interpreted():
        pytest.fail("lowbit_optim.step.kernels was imported before TRITON_INTERPRET=1 was set in "
                    "this process")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)


@contextlib.contextmanager
def num_threads(count: int):
    """``torch.set_num_threads(count)`` for the duration of the block, then the previous count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def relative_rmse(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| (the measure used for quantized values)."""
    expected = expected.detach().double()
    diff = (actual.detach().double() - expected).norm()
    return float(diff / expected.norm().clamp_min(1e-30))


def assert_close_verbose(actual, expected, *, rtol, atol, name="tensor", show=5):
    """``torch.testing.assert_close`` that also prints the worst mismatches."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    excess = (actual - expected).abs() - (atol + rtol * expected.abs())
    if (excess > 0).any():
        worst = excess.flatten().topk(min(show, excess.numel())).indices
        rows = [
            f"  [{int(i)}] actual={actual.flatten()[i]:.8g} expected={expected.flatten()[i]:.8g}"
            for i in worst
        ]
        count = int((excess > 0).sum())
        raise AssertionError(f"{name}: {count} of {excess.numel()} elements out of tolerance\n"
                             + "\n".join(rows))


class CompileCounter:
    """Counts Dynamo frame compilations (first compiles and recompiles) while active."""

    def __enter__(self):
        from torch._dynamo.utils import counters

        self._counters = counters
        self._start = dict(counters["stats"])
        return self

    @property
    def graphs(self) -> int:
        now = self._counters["stats"].get("unique_graphs", 0)
        return now - self._start.get("unique_graphs", 0)

    def __exit__(self, *exc):
        return False


@pytest.fixture
def compile_counter():
    return CompileCounter
