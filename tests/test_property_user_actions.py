"""Random sequences of what users do with an optimizer, on one class per rule family: backward,
``step()``, ``zero_grad()`` (either way), ``add_param_group`` (valid or not), edits of a
group's options (valid or not), casts of the model, ``state_dict`` saved with ``torch.save``
and loaded into an identically built optimizer or into one with other master weights, and
gradient release turned on and off.

The property, after every action: either it raised, and the parameters, their gradients, the
optimizer (every state tensor: codes, scales, factors, float moments, corrections, step counts;
``param_groups``) and the object the caller passed are exactly as before; or it did what a
reference did through another path. The reference is a twin world rebuilt before each
backward from the world's ``state_dict`` (through ``torch.save`` and ``torch.load``) that
repeats the same actions with ordinary stepping, and is compared bit for bit with the world
after each step (a released backward is one); a loaded optimizer must equal the one it was
saved from. A step that succeeded must also have stepped with options the class accepts.

Backends ``cpu`` (the C++ kernel) and ``eager``: nothing compiles, tiny shapes, so each example
takes milliseconds and the module runs in the fast tier.
"""

import copy
import io

import pytest
import torch
from torch import nn

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lowbit_optim import (  # noqa: E402
    Adam8bit,
    AdamW4bit,
    AdamW8bit,
    AdamWFactored4bit,
    AdamWFp8,
    AdEMAMix4bit,
    FactoredState,
    Lion8bit,
    QuantizedState,
    release_gradients,
)
from lowbit_optim.optim.released_gradient import is_released  # noqa: E402

CLASSES = [AdamW8bit, AdamW4bit, AdamWFp8, AdamWFactored4bit, Adam8bit, Lion8bit, AdEMAMix4bit]
BACKENDS = ["cpu", "eager"]
# The 24 x 8 and 4 x 24 weights (192 and 96 elements: partial blocks) are quantized, the
# biases keep float moments.
OPTIONS = dict(lr=1e-2, weight_decay=1e-2, min_quant_size=64)
EXAMPLES = 30
ACTIONS = 10

# Group edits: (key, value) a user may write into ``param_groups[i]``; valid and invalid.
COMMON_EDITS = [("lr", 3e-3), ("lr", 0.0), ("lr", -1.0), ("weight_decay", 0.0), ("weight_decay", 0.1),
                ("weight_decay", -0.1), ("maximize", True), ("maximize", "yes"), ("block_size", 64),
                ("block_size", 100), ("block_size", 256), ("min_quant_size", 10**9)]
RULE_EDITS = {
    "adam": [("betas", (0.8, 0.99)), ("betas", (1.0, 0.999)), ("betas", (0.9, 1.5)), ("eps", 1e-6),
             ("eps", -1.0), ("amsgrad", True)],
    "lion": [("betas", (0.95, 0.98)), ("betas", (1.5, 0.99))],
    "ademamix": [("betas", (0.8, 0.99, 0.999)), ("betas", (0.9, 0.999)), ("alpha", 2.0), ("alpha", -1.0)],
}


def rule_family(cls) -> str:
    if cls is Lion8bit:
        return "lion"
    return "ademamix" if cls is AdEMAMix4bit else "adam"


# --- the world: a model, parameters added later, the optimizer, the release handle ----------
class World:
    def __init__(self, cls, options: dict, dtype: torch.dtype):
        torch.manual_seed(0)
        self.cls, self.options = cls, options
        self.model = nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 4)).to(dtype)
        self.added: list[tuple[list[nn.Parameter], dict]] = []  # groups added after construction
        self.optimizer = self.build()
        self.release = None
        self.hooked: set[int] = set()  # ids of the parameters release hooks (those at its start)
        self.backwards = 0

    def params(self) -> list[nn.Parameter]:
        return [*self.model.parameters(), *(param for params, _ in self.added for param in params)]

    def build(self, **overrides):
        """An optimizer built as this world's was, over its parameters now."""
        optimizer = self.cls(self.model.parameters(), **{**self.options, **overrides})
        for params, options in self.added:
            optimizer.add_param_group({"params": params, **options})
        return optimizer

    def loss(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.backwards)
        dtype = self.model[0].weight.dtype
        inputs = torch.randn(3, 8, generator=generator).to(dtype)
        loss = self.model(inputs).float().square().mean()
        for params, _ in self.added:
            loss = loss + sum((param.float() * 0.5).square().sum() for param in params)
        return loss


def saved_and_loaded(state_dict: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def twin_of(world: World) -> World:
    """The same model and gradients, its optimizer built alike and loaded from the world's
    ``state_dict`` through ``torch.save``/``torch.load``; ordinary stepping."""
    twin = World.__new__(World)
    twin.cls, twin.options, twin.release, twin.hooked = world.cls, world.options, None, set()
    twin.backwards = world.backwards
    twin.model = copy.deepcopy(world.model)
    twin.added = [([nn.Parameter(param.detach().clone()) for param in params], dict(options))
                  for params, options in world.added]
    for source, param in zip(world.params(), twin.params(), strict=True):
        grad = source.grad
        param.grad = None if grad is None or is_released(grad) else grad.clone()
    twin.optimizer = twin.build()
    twin.optimizer.load_state_dict(saved_and_loaded(world.optimizer.state_dict()))
    return twin


# --- snapshots compared bit for bit ---------------------------------------------------------
def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits (NaN equal to the same NaN)."""
    tensor = tensor.detach().contiguous()
    if tensor.is_floating_point():
        integers = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        return tensor.view(integers[tensor.element_size()])
    return tensor


def frozen(value):
    """A deep copy of ``value`` in which tensors are (kind, dtype, shape, bits). Of a quantized
    or factored moment, what is stored and what a step reads: not the dtype it presents as,
    which a cast of the model leaves at the old dtype and a load sets to the parameter's."""
    if isinstance(value, QuantizedState):
        return ("quantized", value.format_name, tuple(value.shape), bits(value.codes).clone(),
                bits(value.scales).clone())
    if isinstance(value, FactoredState):
        return ("factored", tuple(value.shape), bits(value.row).clone(), bits(value.col).clone())
    if isinstance(value, torch.Tensor):
        if is_released(value):
            return ("released", tuple(value.shape), value.dtype)
        return ("tensor", value.dtype, tuple(value.shape), bits(value).clone())
    if isinstance(value, dict):
        return {key: frozen(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(frozen(item) for item in value)
    return copy.deepcopy(value)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def optimizer_snapshot(optimizer, params) -> dict:
    index = {id(param): position for position, param in enumerate(params)}
    return {
        "state": {index[id(param)]: frozen(state) for param, state in optimizer.state.items()},
        "groups": [{**frozen({key: value for key, value in group.items() if key != "params"}),
                    "params": [index[id(param)] for param in group["params"]]}
                   for group in optimizer.param_groups],
    }


def snapshot(world: World) -> dict:
    params = world.params()
    return {"params": [frozen(param.detach()) for param in params],
            "grads": [frozen(param.grad) for param in params],
            **optimizer_snapshot(world.optimizer, params)}


def assert_same(expected: dict, actual: dict, what: str) -> None:
    for key in expected:
        assert same(expected[key], actual[key]), f"{what}: {key} differ"


# --- the actions ----------------------------------------------------------------------------
def actions(cls):
    edits = COMMON_EDITS + RULE_EDITS[rule_family(cls)]
    # Backward and step drawn more often than the rest: most other actions show only at them.
    return st.lists(st.one_of(
        *[st.just(("backward",)), st.just(("step",))] * 3,
        st.tuples(st.just("zero_grad"), st.booleans()),
        st.tuples(st.just("edit"), st.integers(0, 3), st.sampled_from(edits)),
        st.tuples(st.just("add_param_group"), st.sampled_from([(5,), (3, 40)]),
                  st.sampled_from([{}, {"lr": 1e-3}, {"lr": -1.0}, {"block_size": 100}])),
        st.tuples(st.just("cast"), st.sampled_from([torch.float32, torch.bfloat16])),
        st.just(("save_load",)),
        st.tuples(st.just("load_into"), st.sampled_from([None, 24, 32])),
        st.just(("release",)),
        st.just(("remove_release",)),
    ), min_size=1, max_size=ACTIONS)


def backward(world: World) -> None:
    world.loss().backward()
    world.backwards += 1


def released_step(twin: World, hooked: set) -> None:
    """What a released backward does, by ordinary stepping: the hooked parameters step and
    their gradients go; the others keep theirs for ``step()``."""
    kept = {param: param.grad for param in twin.params() if id(param) not in hooked}
    for param in kept:
        param.grad = None
    twin.optimizer.step()
    for param, grad in kept.items():
        param.grad = grad
    for param in twin.params():
        if id(param) in hooked:
            param.grad = None


def twin_hooked(world: World, twin: World) -> set:
    return {id(mirror) for param, mirror in zip(world.params(), twin.params(), strict=True)
            if id(param) in world.hooked}


def assert_options_accepted(world: World) -> None:
    """Every group a step accepted holds options the class accepts for a new group."""
    scratch = world.cls([nn.Parameter(torch.zeros(2))], **world.options)
    for index, group in enumerate(world.optimizer.param_groups):
        options = {key: value for key, value in group.items() if key != "params"}
        try:
            scratch.add_param_group({"params": [nn.Parameter(torch.zeros(2))], **options})
        except (ValueError, TypeError) as error:
            raise AssertionError(f"step() accepted param group {index} holding options the class "
                                 f"refuses: {error}") from error


def run(world: World, action: tuple, twin):
    """Do ``action`` on ``world`` (and on ``twin``, the reference, where it applies); check
    the property. ``twin``: ``None`` until the next backward or step, or the exception that
    building it raised. Returns the twin to go on with."""
    kind = action[0]
    if kind in ("backward", "step") and twin is None:
        try:
            twin = twin_of(world)
        except (ValueError, TypeError, RuntimeError) as error:
            twin = error  # fails the property if the world then steps
    before = snapshot(world)
    passed = None  # the caller's object the action takes, and its frozen copy
    try:
        if kind == "backward":
            backward(world)
        elif kind == "step":
            world.optimizer.step()
        elif kind == "zero_grad":
            world.optimizer.zero_grad(set_to_none=action[1])
        elif kind == "edit":
            groups = world.optimizer.param_groups
            key, value = action[2]
            groups[action[1] % len(groups)][key] = value
        elif kind == "add_param_group":
            torch.manual_seed(len(world.added) + 1)
            group = {"params": [nn.Parameter(torch.randn(*action[1]))], **action[2]}
            passed = (group, frozen(group))
            world.optimizer.add_param_group(group)
            world.added.append((group["params"], action[2]))
        elif kind == "cast":
            world.model.to(action[1])
        elif kind == "save_load":
            loaded = saved_and_loaded(world.optimizer.state_dict())
            passed = (loaded, frozen(loaded))
            fresh = world.build()
            fresh.load_state_dict(loaded)
            assert_same(optimizer_snapshot(world.optimizer, world.params()),
                        optimizer_snapshot(fresh, world.params()), "loaded optimizer")
            if world.release is not None:
                world.release.remove()
                world.release = release_gradients(fresh)
                world.hooked = {id(param) for param in world.params() if param.requires_grad}
            world.optimizer = fresh
        elif kind == "load_into":
            loaded = saved_and_loaded(world.optimizer.state_dict())
            passed = (loaded, frozen(loaded))
            other = world.build(master_weight_bits=action[1])
            empty = optimizer_snapshot(other, world.params())
            try:
                other.load_state_dict(loaded)
            except (ValueError, TypeError, RuntimeError):
                assert_same(empty, optimizer_snapshot(other, world.params()),
                            "optimizer after a refused load")
            else:
                # What loads also saves and reloads.
                again = world.build(master_weight_bits=action[1])
                again.load_state_dict(saved_and_loaded(other.state_dict()))
                assert_same(optimizer_snapshot(other, world.params()),
                            optimizer_snapshot(again, world.params()), "reloaded optimizer")
        elif kind == "release":
            world.release = release_gradients(world.optimizer)
            world.hooked = {id(param) for param in world.params() if param.requires_grad}
        elif kind == "remove_release":
            if world.release is not None:
                world.release.remove()
                world.release, world.hooked = None, set()
    except (ValueError, TypeError, RuntimeError) as error:
        after = snapshot(world)
        if kind == "backward":  # a refused released step: backward has made gradients
            del before["grads"], after["grads"]
        assert_same(before, after, f"after {action} raised {error!r}")
        if passed is not None:
            assert same(passed[1], frozen(passed[0])), f"{action} raised and changed the caller's object"
        return twin
    if passed is not None:
        assert same(passed[1], frozen(passed[0])), f"{action} changed the caller's object"
    if kind == "edit" and isinstance(twin, Exception):
        return None  # the value that kept the state from loading may be gone: rebuilt at the step

    stepped = kind == "step" or (kind == "backward" and world.release is not None)
    if isinstance(twin, Exception):
        assert not stepped, (f"{action} stepped, but the optimizer's state_dict before it did not "
                             f"load into an identically built optimizer: {twin!r}")
        return twin
    if twin is None:
        return None
    # The reference repeats what the world did.
    if kind == "backward":
        backward(twin)
        if world.release is not None:
            released_step(twin, twin_hooked(world, twin))
    elif kind == "step":
        twin.optimizer.step()
    elif kind == "zero_grad":
        twin.optimizer.zero_grad(set_to_none=action[1])
    elif kind == "edit":
        groups = twin.optimizer.param_groups
        groups[action[1] % len(groups)][action[2][0]] = action[2][1]
    elif kind == "add_param_group":
        params = [nn.Parameter(param.detach().clone()) for param in world.added[-1][0]]
        twin.optimizer.add_param_group({"params": params, **action[2]})
        twin.added.append((params, action[2]))
    elif kind == "cast":
        twin.model.to(action[1])
    if stepped:
        assert_options_accepted(world)
        expected, actual = snapshot(twin), snapshot(world)
        del expected["grads"], actual["grads"]
        assert_same(expected, actual, f"after {action}, against the reference")
        return None
    return twin


def configurations(cls):
    return st.one_of(
        st.tuples(st.sampled_from(BACKENDS), st.sampled_from([torch.float32, torch.bfloat16]), st.none()),
        st.tuples(st.sampled_from(BACKENDS), st.just(torch.bfloat16), st.sampled_from([24, 32])))


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
# No shrinking: a failing sequence is short enough to read as drawn, and shrinking one takes
# minutes.
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors])
@given(data=st.data())
def test_every_user_action_matches_a_reference_or_is_refused_before_any_change(cls, data):
    backend, dtype, master_weight_bits = data.draw(configurations(cls),
                                                   label="backend, dtype, master weights")
    world = World(cls, {**OPTIONS, "backend": backend, "master_weight_bits": master_weight_bits}, dtype)
    twin = None
    for action in data.draw(actions(cls), label="actions"):
        twin = run(world, action, twin)
