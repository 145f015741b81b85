"""The per-group step plan (``lowbit_optim.step.plan``) never serves anything stale.

Each scenario runs two optimizers side by side on identical parameters and gradients: one
keeps its plans between steps (what every user gets), the other has them discarded before
every step, so it plans from scratch each time (layouts built anew, kinds sorted anew). After
every change a user can make between steps (new gradients at new addresses, a gradient
that becomes None, a replaced parameter, ``param.data``, a replaced moment or state dict, a step count
changed in place, ``load_state_dict``, ``add_param_group``, ``copy.deepcopy``, a dtype
change, misaligned gradients) the two must agree bit for bit: the same kernels on the same
inputs, so any difference is a stale pointer or a stale kind. The Triton kernel runs under
the interpreter (``TRITON_INTERPRET=1``, small shapes); the float-state parameters run for
real; AdamWFactored4bit's C++ CPU kernel, which keeps its operators' argument lists with the
plan, runs the same changes. Counting tests stub the launch and count plans, layout builds and
host-to-device copies per step.
"""

import copy

import pytest
import torch

from lowbit_optim import AdamW4bit, AdamW8bit, AdamWFactored4bit, FactoredState, QuantizedState
from lowbit_optim.step.kernels import launcher
from lowbit_optim.step.kernels import layout as layouts

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")

# Two quantized parameters of aligned sizes, one of odd size (split: whole blocks aligned,
# last block unaligned), a transposed (non-contiguous) one and two small float-state ones.
SHAPES = [(16, 64), (1024,), (1041,), (48, 40), (30,), (7, 3)]
MIN_QUANT_SIZE = 512


def make_params(seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    values = [torch.randn(shape, generator=generator) for shape in SHAPES]
    values[3] = values[3].t().contiguous().t()  # same values, transposed strides
    return [torch.nn.Parameter(v.to(dtype)) for v in values]


class Pair:
    """A planning optimizer and one that plans from scratch at every step, kept in lockstep."""

    def __init__(self, cls, backend="triton", **options):
        self.params = {"cached": make_params(), "fresh": make_params()}
        self.optimizers = {name: cls(params, min_quant_size=MIN_QUANT_SIZE, backend=backend, **options)
                           for name, params in self.params.items()}
        self.generator = torch.Generator().manual_seed(1)

    def apply(self, change):
        """``change(optimizer, params)`` applied to both."""
        for name in self.params:
            change(self.optimizers[name], self.params[name])

    def step(self, *, new_grads=True):
        grads = [torch.randn(p.shape, generator=self.generator).to(p.dtype) for p in self.params["cached"]]
        for name, params in self.params.items():
            for param, grad in zip(params, grads):
                if param.grad is None or new_grads:
                    param.grad = grad.clone()
            if name == "fresh":
                self.optimizers[name]._caches.clear()
            self.optimizers[name].step()
        self.assert_equal()

    def assert_equal(self):
        cached, fresh = self.optimizers["cached"], self.optimizers["fresh"]
        for index, (a, b) in enumerate(zip(self.params["cached"], self.params["fresh"])):
            assert torch.equal(a, b), f"param {index} differs"
            state_a, state_b = cached.state.get(a, {}), fresh.state.get(b, {})
            assert state_a.keys() == state_b.keys()
            for key in state_a:
                x, y = state_a[key], state_b[key]
                if isinstance(x, QuantizedState):
                    assert torch.equal(x.codes, y.codes) and torch.equal(x.scales, y.scales), (index, key)
                elif isinstance(x, FactoredState):
                    assert torch.equal(x.row, y.row) and torch.equal(x.col, y.col), (index, key)
                else:
                    assert torch.equal(x, y), (index, key)


def _grad_to_none(optimizer, params):
    params[1].grad = None


def _replace_param_in_group(optimizer, params):
    replacement = torch.nn.Parameter(params[0].detach().clone() + 1)
    optimizer.param_groups[0]["params"][0] = replacement
    params[0] = replacement


def _new_param_storage(optimizer, params):
    for index in (0, 4):
        params[index].data = params[index].detach().clone() * 0.5


def _replace_moment(optimizer, params):
    state = optimizer.state[params[1]]
    state["exp_avg"] = state["exp_avg"].clone()


def _replace_state_dict(optimizer, params):
    optimizer.state[params[4]] = {key: value.clone() for key, value in optimizer.state[params[4]].items()}


def _step_count_in_place(optimizer, params):
    optimizer.state[params[0]]["step"].fill_(1.0)  # now unlike its kind's others


def _load_state_dict(optimizer, params):
    saved = copy.deepcopy(optimizer.state_dict())
    optimizer.load_state_dict(saved)


def _add_param_group(optimizer, params):
    extra = torch.nn.Parameter(torch.linspace(-1, 1, 640))
    optimizer.add_param_group({"params": [extra], "lr": 3e-3})
    params.append(extra)


def _to_bfloat16(optimizer, params):
    for param in params:
        param.data = param.detach().bfloat16()
        param.grad = None


def _misaligned_grads(optimizer, params):
    for param in params[:2]:
        buffer = torch.empty(param.numel() + 1)
        view = buffer[1:].view(param.shape)  # 4 bytes past a 16-byte boundary
        view.copy_(torch.ones(param.shape))
        param.grad = view


CHANGES = {
    "grad becomes None": _grad_to_none,
    "param replaced in its group": _replace_param_in_group,
    "param.data replaced": _new_param_storage,
    # Apart: each is seen by its own check (a state's values; the state dicts themselves).
    "a moment replaced": _replace_moment,
    "a state dict replaced": _replace_state_dict,
    "step count changed in place": _step_count_in_place,
    "load_state_dict": _load_state_dict,
    "add_param_group": _add_param_group,
    "dtype changed": _to_bfloat16,
}


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("change", list(CHANGES), ids=str)
def test_a_change_between_steps_is_never_served_stale(change):
    # Both formats are covered, alternately: the plan does not depend on the format, and each
    # scenario runs the interpreted kernel ~16 times.
    cls = (AdamW8bit, AdamW4bit)[list(CHANGES).index(change) % 2]
    pair = Pair(cls, lr=1e-2)
    pair.step()
    pair.step()  # the plan is reused here
    pair.apply(CHANGES[change])
    pair.step(new_grads=False)
    pair.step()


@pytest.mark.parametrize("change", list(CHANGES), ids=str)
def test_a_change_between_steps_is_never_served_stale_by_the_factored_cpu_kernel(change):
    """AdamWFactored4bit in the C++ CPU kernel keeps its operators' argument lists with its plan
    (``cpu_kernel_factored.FactoredKernel``): after each change the plan is rebuilt, or the
    lists still hold what it steps."""
    pair = Pair(AdamWFactored4bit, backend="cpu", lr=1e-2)
    pair.step()
    factored = pair.optimizers["cached"]._caches[0].plan.rule_plan.factored
    assert factored.kernel == [True, True]  # (16, 64) and (48, 40)
    pair.step()
    pair.apply(CHANGES[change])
    pair.step(new_grads=False)
    pair.step()


@pytest.mark.usefixtures("interpreter")
def test_gradients_kept_or_new_misaligned_or_not():
    """Gradients kept (the layout is reused), new at other addresses each step, then views
    that break the aligned launch's alignment (the kind is split again), then new again."""
    pair = Pair(AdamW8bit, lr=1e-2)
    for _ in range(2):
        pair.step(new_grads=False)
    for _ in range(2):
        pair.step()
    pair.apply(_misaligned_grads)
    pair.step(new_grads=False)
    pair.step()


@pytest.mark.usefixtures("interpreter")
def test_deepcopy_steps_like_the_original():
    """A deep copy's plans are rebuilt for its own tensors: stepping the copy leaves the
    original alone, and both then step as a fresh optimizer would."""
    pair = Pair(AdamW4bit, lr=1e-2)
    pair.step()
    clones = {name: copy.deepcopy((pair.optimizers[name], pair.params[name])) for name in pair.params}
    before = [p.detach().clone() for p in pair.params["cached"]]
    for optimizer, params in clones.values():
        for param in params:
            param.grad = torch.ones_like(param)
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(pair.params["cached"], before))
    pair.step()
    for name, (optimizer, params) in clones.items():
        pair.optimizers[name], pair.params[name] = optimizer, params
    pair.step()


@pytest.mark.parametrize("cls", [AdamW8bit, AdamW4bit], ids=lambda c: c.__name__)
def test_bad_gradient_refused_before_anything_changes_with_a_plan(cls):
    """With a plan in place, a gradient of another dtype or shape (set through ``.data``, as
    ``p.grad = g`` would refuse) is still refused before any parameter, state or step count
    changes; the next good step then works."""
    params = make_params()
    optimizer = cls(params, min_quant_size=MIN_QUANT_SIZE, backend="eager")
    for _ in range(2):
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer.step()
    snapshot = copy.deepcopy((params, optimizer.state_dict()))
    for bad, message in ((torch.ones(1024, dtype=torch.float64), "must match its parameter's dtype"),
                         (torch.ones(32, 32), "does not match its parameter")):
        params[1].grad.data = bad
        with pytest.raises(RuntimeError, match=message):
            optimizer.step()
        assert all(torch.equal(a, b) for a, b in zip(params, snapshot[0]))
        state = optimizer.state_dict()["state"]
        for index, saved in snapshot[1]["state"].items():
            assert float(state[index]["step"]) == float(saved["step"]) == 2.0
            assert torch.equal(state[index]["exp_avg"], saved["exp_avg"])
    params[1].grad = torch.randn_like(params[1])
    optimizer.step()
    assert float(optimizer.state[params[1]]["step"]) == 3.0


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_param_viewed_through_data_at_the_same_address_is_refused(change):
    """``param.data`` set to a view of itself of another shape or dtype keeps its address and
    leaves its gradient as planned: only the plan's check of the parameters' own dtypes and
    shapes sees it, and the step then refuses the gradient that no longer fits."""
    params = make_params(dtype=torch.bfloat16)
    optimizer = AdamW8bit(params, min_quant_size=MIN_QUANT_SIZE, backend="eager")
    for _ in range(2):
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer.step()
    param = params[1]
    param.data = param.data.view(32, 32) if change == "shape" else param.data.view(torch.float16)
    message = "does not match its parameter" if change == "shape" else "must match its parameter's dtype"
    with pytest.raises(RuntimeError, match=message):
        optimizer.step()
    assert float(optimizer.state[param]["step"]) == 2.0


class Counts:
    """Counts plans built, layouts built from scratch, layouts with new gradient addresses,
    host-to-device table copies and kernel launches, with the launch stubbed."""

    def __init__(self, monkeypatch):
        self.plans = self.builds = self.gradient_updates = self.copies = self.launches = 0
        from lowbit_optim.step import plan as step_plan

        def counting(name, function):
            def wrapper(*args, **kwargs):
                setattr(self, name, getattr(self, name) + 1)
                return function(*args, **kwargs)
            return wrapper

        monkeypatch.setattr(step_plan.GroupPlan, "__init__", counting("plans", step_plan.GroupPlan.__init__))
        monkeypatch.setattr(layouts, "build_layout", counting("builds", layouts.build_layout))
        monkeypatch.setattr(layouts, "with_column", counting("gradient_updates", layouts.with_column))
        monkeypatch.setattr(layouts, "_to_device", counting("copies", layouts._to_device))
        counts = self

        class Stub:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    counts.launches += 1
                return launch

        monkeypatch.setattr(launcher, "lowbit_step_kernel", Stub())

    def take(self) -> dict:
        taken = dict(plans=self.plans, builds=self.builds, gradient_updates=self.gradient_updates,
                     copies=self.copies, launches=self.launches)
        self.plans = self.builds = self.gradient_updates = self.copies = self.launches = 0
        return taken


@pytest.mark.usefixtures("interpreter")
def test_steady_steps_plan_and_copy_nothing(monkeypatch):
    """Many quantized parameters of one kind (sizes multiples of 16: one aligned launch).
    Gradients kept: no plan, no layout and no host-to-device copy after the first step.
    ``zero_grad(set_to_none=True)`` and new gradients each step: still no plan and no layout
    build; the one launch's table gets the new gradient addresses (one table copied, the
    program map reused)."""
    counts = Counts(monkeypatch)
    params = [torch.nn.Parameter(torch.randn(64 + 16 * (i % 3), 64)) for i in range(40)]
    params += [torch.nn.Parameter(torch.randn(64)) for _ in range(10)]  # float state
    optimizer = AdamW8bit(params, min_quant_size=MIN_QUANT_SIZE, backend="triton")
    grads = [torch.randn_like(p) for p in params]
    for param, grad in zip(params, grads):
        param.grad = grad
    optimizer.step()
    first = counts.take()
    assert first["plans"] == 1 and first["builds"] == 1 and first["launches"] == 1
    for _ in range(3):
        optimizer.step()
        assert counts.take() == dict(plans=0, builds=0, gradient_updates=0, copies=0, launches=1)
    held = []
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        held.append([p.grad for p in params])  # the old gradients stay alive: new addresses
        optimizer.step()
        # One table copy (on CUDA through pinned memory, non-blocking); the program map stays.
        assert counts.take() == dict(plans=0, builds=0, gradient_updates=1, copies=1, launches=1)


@pytest.mark.usefixtures("interpreter")
def test_plan_holds_no_gradient(monkeypatch):
    """``zero_grad(set_to_none=True)`` must free the gradients: the plan keeps none alive."""
    import gc
    import weakref

    Counts(monkeypatch)
    params = make_params()
    optimizer = AdamW8bit(params, min_quant_size=MIN_QUANT_SIZE, backend="triton")
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()
    refs = [weakref.ref(param.grad) for param in params]
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    assert all(ref() is None for ref in refs)
