"""What one param group's step reuses between steps, and the checks that say it still may.

A step used to redo per parameter, every time: find its state, build its entry, sort it into a
kind, check and read the addresses of its eight tensors, key a layout cache, ~13-25 us per
parameter of Python (docs/benchmarks.md, "Host cost of the Triton path"). Nearly all of it
depends on things that stay the same from one step to the next: which parameters the group
holds, which of them have a gradient, their states, their data pointers, dtypes and shapes,
the step counts kept equal within a kind. ``GroupPlan`` keeps what was worked out (the
update rule's plan, ``rule_step.RulePlan``, with, for the Triton backend, each kind's
launches and layouts) together with exactly those facts, and ``matches`` compares
them with the group as it is now using C-level map/compare over lists (no Python loop per
parameter), so a stale plan is never used:

* the parameters stepped (those with a gradient), by identity; each parameter's state dict
  and every value in it, by identity (``load_state_dict``, a replaced moment or step count);
  the backend;
* each parameter's data pointer, dtype and shape (``param.data = ...``, ``model.half()``);
* each gradient's dtype and shape against its parameter's and that it is dense: anything
  else goes to ``functional.check_gradients``, which refuses it before anything changes;
* the step counts, before they are advanced, against what the plan last left them at (one
  ``torch.equal``): a count changed in place may no longer share its kind.

The plan lays out its parameters' step counts as 0-d views of one tensor, so that one add
advances them all, and the float moments of small parameters as views of one tensor per
moment, so that the flat float-state step updates them in place. Values, shapes and dtypes
are unchanged: state dicts, checkpoints and ``torch.optim`` see the tensors they saw before.

Gradients' addresses are not part of it: new gradients at new addresses are what every step
with ``zero_grad(set_to_none=True)`` brings, and the Triton kinds follow them cheaply
(``kernels.plan``). Holding no gradient, a plan never keeps a freed gradient's memory alive.
"""

from itertools import chain
from operator import attrgetter, is_not

import torch

from lowbit_optim.state import sharding
from lowbit_optim.step import float_state
from lowbit_optim.step.chunks import TailScratch
from lowbit_optim.step.float_state import consecutive_views
from lowbit_optim.step.hyperparams import GroupScalars, StepOptions
from lowbit_optim.step.master_weights import CORRECTION_KEY
from lowbit_optim.step.rule_step import RuleEntry

# Read with C-level getters in one pass per list: a parameter's dtype and shape as one tuple,
# a gradient's with ``is_sparse`` (planned as False), so that a single list comparison checks
# a gradient against its parameter's planned dtype and shape and that it is dense.
_PARAM_FACTS = attrgetter("dtype", "shape")
_GRAD_FACTS = attrgetter("dtype", "shape", "is_sparse")
# The unbound method: ~3x cheaper per call than ``methodcaller("data_ptr")`` (~0.06 against
# ~0.2 us, timeit), and the same method, as no parameter class overrides it in Python.
_DATA_PTR = torch.Tensor.data_ptr


def _flatten_float_moments(state_dicts: list[dict], moment_keys: tuple[str, ...]) -> None:
    """Make the float moments of small parameters (those ``float_state_groups`` steps together) views of
    one tensor per moment, dtype and device, consecutive in parameter order (values, shapes
    and dtypes unchanged): the flat step then updates them in place instead of gathering and
    scattering them (``float_state.FloatStateStep``)."""
    groups: dict[tuple, list[dict]] = {}
    for state_dict in state_dicts:
        for key in moment_keys:
            moment = state_dict.get(key)
            if type(moment) is torch.Tensor and moment.numel() < float_state.FLAT_FLOAT_STATE_BELOW:
                groups.setdefault((key, moment.dtype, moment.device), []).append(state_dict)
    for (key, _, _), group in groups.items():
        moments = [state_dict[key] for state_dict in group]
        if len(moments) < 2 or consecutive_views(moments) is not None:
            continue
        flat = torch.cat([moment.reshape(-1) for moment in moments])
        pieces = flat.split([moment.numel() for moment in moments])
        for state_dict, piece, moment in zip(group, pieces, moments):
            state_dict[key] = piece.view(moment.shape)


def _state_values(state_dicts: list[dict]) -> list:
    """Every value of the state dicts, in order. The plan holds them and compares by identity
    (``is``): ids alone could match a new tensor at a freed one's address."""
    return [*chain.from_iterable(map(dict.values, state_dicts))]


class GroupPlan:
    """The step of ``params`` (those of a param group that have a gradient) with their
    (already created) ``states``, planned once; see the module docstring for when it is
    reused. ``rule``: the update rule (``step.rules``), whose ``plan`` steps them;
    ``moment_keys``: the moments each parameter keeps, in the rule's order."""

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
                 backend: str, rule, moment_keys: tuple[str, ...]):
        self.rule = rule
        self.moment_keys = moment_keys
        self.param_ids = [*map(id, params)]
        self.backend = backend
        self.addresses = [*map(_DATA_PTR, params)]
        self.param_facts = [*map(_PARAM_FACTS, params)]
        self.grad_facts = [(dtype, shape, False) for dtype, shape in self.param_facts]
        self.state_dicts = list(states)
        # The step counts become 0-d views of one tensor, so one add advances them all: a
        # foreach add over separate 0-d CPU tensors is a loop of dispatcher calls, ~1.6 us per
        # parameter (benchmarks/bench_host_overhead.py). Their values and dtype stay as they were.
        self.step_counts = None
        if self.state_dicts:
            self.step_counts = torch.stack([state_dict["step"] for state_dict in self.state_dicts])
            for state_dict, count in zip(self.state_dicts, self.step_counts):
                state_dict["step"] = count
            self.expected_steps = self.step_counts.clone()
        _flatten_float_moments(self.state_dicts, moment_keys)
        self.state_values = _state_values(self.state_dicts)
        self.has_dtensor = any(map(sharding.is_dtensor, params))
        local = sharding.local  # FSDP2: each rank steps its own shards
        entries = [
            RuleEntry(local(param), local(grad), tuple(local(s[key]) for key in moment_keys), s["step"],
                      local(s.get(CORRECTION_KEY)))
            for param, grad, s in zip(params, grads, self.state_dicts)
        ]
        self.rule_plan = rule.plan(entries, backend, params)

    def matches(self, params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
                backend: str) -> bool:
        """Whether this plan still steps ``params`` with ``grads`` and ``states``: nothing it
        depends on has changed and every gradient fits its parameter as planned (else the
        caller checks the gradients properly and plans again)."""
        if backend != self.backend or [*map(id, params)] != self.param_ids:
            return False
        if ([*map(_DATA_PTR, params)] != self.addresses
                or [*map(_PARAM_FACTS, params)] != self.param_facts
                or [*map(_GRAD_FACTS, grads)] != self.grad_facts):
            return False
        if len(states) != len(self.state_dicts) or any(map(is_not, states, self.state_dicts)):
            return False
        # By identity (``==`` on tensors would compare values); the length first, as ``map``
        # stops at the shorter list and a key added at the end would go unseen.
        values = _state_values(self.state_dicts)
        return len(values) == len(self.state_values) and not any(map(is_not, values, self.state_values))

    def steps_unchanged(self) -> bool:
        """Whether the step counts are where this plan's last step left them (one changed in
        place may no longer share its kind's)."""
        return self.step_counts is None or torch.equal(self.step_counts, self.expected_steps)

    def step(self, grads: list[torch.Tensor], scalars: GroupScalars, options: StepOptions,
             scratch: TailScratch) -> None:
        """Advance the step counts and step every parameter (the rule's plan) with ``grads``."""
        if self.step_counts is None:
            return
        if self.has_dtensor:
            grads = [*map(sharding.local, grads)]
        self.step_counts += 1
        self.expected_steps += 1
        self.rule_plan.run(grads, scalars, options, scratch)
