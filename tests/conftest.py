"""Shared test setup: seeding, device parametrisation, the fast and slow tiers (``slow``, ``sweep``), compile
counters and error helpers."""

import contextlib
import importlib
import importlib.util
import os
import pathlib
import subprocess
import sys

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


# ``-n auto`` (README's test command, pytest-xdist): a worker per core, at most this many (each
# compiles and holds its own graphs, and whole files are handed out: more workers wait on the
# longest file). Most of a test's time is Python tracing and compiling graphs, on one core.
MAX_WORKERS = 8


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Each test file on one worker (xdist's ``--dist loadfile``, unless another mode is asked
    for), so that the graphs a file's tests share are compiled once."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadFileScheduling

    return LoadFileScheduling(config, log)


def pytest_configure(config):
    if is_the_xdist_controller(config):
        return  # it runs no test: the workers import and build what they use
    import_the_triton_kernels()
    config.stash[KERNEL_BUILD] = build_the_cpu_kernel_in_the_background()


def is_the_xdist_controller(config) -> bool:
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")


def import_the_triton_kernels():
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


KERNEL_BUILD = pytest.StashKey[subprocess.Popen | None]()


def build_the_cpu_kernel_in_the_background() -> subprocess.Popen | None:
    """Where the C++ CPU step is not built yet (a fresh clone or extensions cache: ~30 s on 2
    cores, then cached under ``TORCH_EXTENSIONS_DIR``), build it in a process of its own while
    pytest imports and collects the test modules, which keeps one core busy for ~15 s.
    Collection waits for it at its end (``pytest_collection_modifyitems``), so no test loads a
    library still being linked. Under xdist every worker starts one: the first builds, the
    others wait for its lock (``torch.utils.cpp_extension``) and load what it built."""
    from lowbit_optim.step import cpu_kernel

    if cpu_kernel.library_path().is_file():
        return None
    build = "from lowbit_optim.step import cpu_kernel; cpu_kernel.load()"
    return subprocess.Popen([sys.executable, "-c", build], cwd=pathlib.Path(__file__).parent.parent)


# Every backend, for behaviour decided in Python before the step dispatches (checks, refusals,
# conversions): the same on each, so the compiled step's runs, which compile new graphs, are in
# the slow tier. A test module that needs another set defines its own ``backend`` fixture.
BACKENDS = ["cpu", pytest.param("compile", marks=pytest.mark.slow), "eager", "triton"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """A backend name; ``"triton"`` runs under the interpreter."""
    if request.param == "triton":
        request.getfixturevalue("interpreter")
    return request.param


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


# tryfirst: the slow marks given here must be in place before ``-m`` selects the tier.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)
    mark_sweeps_slow_beyond_a_cover(items)
    # Last, so that the graphs the other tests compile are compiled once (a stable sort).
    items.sort(key=lambda item: item.get_closest_marker("resets_dynamo") is not None)
    build = config.stash.get(KERNEL_BUILD, None)
    if build is not None:
        build.wait()


def slow_except(values, *fast):
    """``values`` for ``parametrize``, those not in ``fast`` marked ``slow``: for sweeps whose
    every case costs a compile, where the fast tier keeps the named representatives."""
    return [value if value in fast else pytest.param(value, marks=pytest.mark.slow) for value in values]


def mark_sweeps_slow_beyond_a_cover(items) -> None:
    """Tests marked ``sweep`` keep in the fast tier only a few of their parametrised cases,
    chosen so that every value of every parameter is still in one of them (greedily: the case
    with the most values not yet covered first); the other cases are marked ``slow``.

    A sweep over formats x dtypes x flags x shapes then costs the fast tier as many cases as
    its longest list of values, while a defect in any one value's path still fails there and
    the slow tier runs the whole product.
    """
    sweeps: dict[tuple, list] = {}
    for item in items:
        # Cases marked slow in the test itself are no candidates: the cover is of the others.
        if (item.get_closest_marker("sweep") is not None and hasattr(item, "callspec")
                and item.get_closest_marker("slow") is None):
            sweeps.setdefault((item.path, item.cls, item.originalname), []).append(item)
    for cases in sweeps.values():
        values = {item: {(name, repr(value)) for name, value in item.callspec.params.items()}
                  for item in cases}
        uncovered = set().union(*values.values())
        remaining = list(cases)
        while uncovered:
            best = max(remaining, key=lambda item: len(values[item] & uncovered))
            uncovered -= values[best]
            remaining.remove(best)
        for item in remaining:
            item.add_marker(pytest.mark.slow)


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
