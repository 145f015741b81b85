"""Gradient release: the optimizer step fused into backward.

``release_gradients(optimizer)`` registers a ``register_post_accumulate_grad_hook`` on every
trained parameter. As soon as autograd has finished a parameter's gradient, the hook steps
that parameter alone and frees its gradient, so a training step never holds more than the
gradients still being computed instead of all of them (PyTorch's tutorial "How to save
memory by fusing the optimizer step into the backward pass"; FlashOptim does the same).

What each step reads is what ordinary stepping reads, so released and ordinary training
give the same parameters and state bit for bit (tests/test_gradient_release.py):

* a parameter with quantized moments steps in its hook through the rule's functional entry
  point with a ``StepCache`` of its own, whose plan is built once and reused while it holds
  (``step.plan``: the same checks as a group's plan, for a list of one), so a hook costs a
  few list comparisons and the step's kernels, and the same compiled graphs serve;
* small parameters with float moments (norms, biases) wait for the end of the backward and
  step together, one flat step per group as in ``step()``: one by one each would cost ~40
  operations, and their gradients are small;
* the hyperparameters are checked once per backward, at its first hook (a callback queued on
  the autograd engine marks its end), and each step reads the group's current values into
  its 0-d tensors (``hyperparams.GroupScalars``), so an LR scheduler's new value reaches the
  next backward as it reaches the next ``step()``, with no recompile;
* each parameter's step count advances when it is stepped, as ``step()`` advances it.
* a hook that runs inside a reentrant checkpointing segment (``reentrant_backward``) may see a
  part of the gradient (a parameter shared by several segments): from then on every gradient
  of that backward is held and stepped at its end, or by ``step()`` when no hook ran in the
  outer backward to mark it.

While release is active:

* ``optimizer.step()`` steps nothing that backward already stepped: it ends the step by
  dropping the released gradients' placeholders, and steps (one by one, the same way) only
  gradients the hooks never saw (assigned by hand, or of parameters added afterwards).
  Stepping released parameters again would apply the update twice; raising would break
  every training loop that keeps calling ``step()``, LR schedulers' checks included.
* a released ``param.grad`` is a ``ReleasedGradient`` placeholder (``released_gradient``):
  clipping, ``GradScaler`` and accumulation over micro-batches are told, not silently wrong.
  ``zero_grad()`` works as usual (there is nothing left to zero).

``CPUOffloadOptimizer`` composes through its ``_gradient_release_steps`` (``offload.release``):
its own hook (registered first, so it runs first) starts the gradient's download; ours then
waits for it, steps the host copy with the host optimizer's per-parameter plan and uploads
it. See docs/gradient_release.md.
"""

import warnings
import weakref
from typing import NamedTuple

import torch

from lowbit_optim.optim.base import LowBitOptimizer
from lowbit_optim.optim.reentrant_backward import in_reentrant_backward
from lowbit_optim.optim.released_gradient import is_released, released_gradient
from lowbit_optim.state import sharding
from lowbit_optim.step import float_state
from lowbit_optim.step.functional import StepCache


class Position(NamedTuple):
    """Where a parameter is: its param group and its index in the group's list."""

    group: int
    index: int


class ParameterSteps:
    """Steps the parameters of a ``LowBitOptimizer`` one at a time, each with its own cached
    plan, or a group's small float-state parameters together (``step_together``)."""

    def __init__(self, optimizer: LowBitOptimizer):
        self.optimizer = optimizer
        self.caches: dict[torch.Tensor, StepCache] = {}  # one parameter's planned step
        self.together_caches: dict[int, StepCache] = {}  # per group index
        self.positions: dict[torch.Tensor, Position] = {}
        self.small: dict[torch.Tensor, bool] = {}  # is_small, worked out once
        self.created_state = False  # since the last ``order_state``

    def trained_params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]

    def refresh(self) -> None:
        """Check every group's options (raising for a bad one) before backward steps any
        parameter, as ``step()`` does (``LowBitOptimizer._check_groups``)."""
        self.optimizer._check_groups()

    def position(self, param: torch.Tensor) -> Position:
        if param not in self.positions:  # first use, or a group added since
            self.positions = {p: Position(group_index, index)
                              for group_index, group in enumerate(self.optimizer.param_groups)
                              for index, p in enumerate(group["params"])}
        if param not in self.positions:
            raise ValueError(f"a parameter of shape {tuple(param.shape)} is in none of the "
                             f"{type(self.optimizer).__name__}'s param groups")
        return self.positions[param]

    def is_small(self, param: torch.Tensor) -> bool:
        """Float moments and few elements (norms, biases): ``step()`` steps such parameters
        of a group as one flat tensor (``step.float_state.FloatStateStep``), a fixed number of
        kernels for any number of them, where one by one each costs ~40 operations."""
        small = self.small.get(param)
        if small is None:
            group = self.optimizer.param_groups[self.position(param).group]
            small = self.small[param] = (param.numel() < float_state.FLAT_FLOAT_STATE_BELOW
                                         and not self.optimizer.is_quantized(param, group))
        return small

    def step(self, param: torch.Tensor) -> None:
        """``step()``'s update of ``param`` alone, with the gradient it holds now."""
        cache = self.caches.get(param)
        if cache is None:
            cache = self.caches[param] = StepCache(self.optimizer._tail_scratch)
        self._run([param], cache)

    def step_together(self, params: list[torch.Tensor]) -> None:
        """``step()``'s update of ``params`` with the gradients they hold now, each group's
        together (in group order, so that the same parameters find the same plan)."""
        by_group: dict[int, list] = {}
        for param in sorted(params, key=self.position):
            by_group.setdefault(self.position(param).group, []).append(param)
        for group_index, members in by_group.items():
            cache = self.together_caches.get(group_index)
            if cache is None:
                cache = self.together_caches[group_index] = StepCache(self.optimizer._tail_scratch)
            self._run(members, cache)

    def _run(self, params: list[torch.Tensor], cache: StepCache) -> None:
        """Step ``params`` (of one group, each with a gradient), their states created on
        first use, keeping the planned step in ``cache``."""
        optimizer = self.optimizer
        optimizer._refuse_graph_capture()
        grads = [param.grad for param in params]
        optimizer._check_grads(params, grads)
        state = optimizer.state
        self.created_state |= not all(map(state.__contains__, params))
        optimizer._step_params(self.position(params[0]).group, params, grads, cache=cache)

    def order_state(self) -> None:
        """Put ``optimizer.state`` in parameter order, as ordinary stepping creates it:
        backward creates states last layer first, and ``state_dict()`` lists them in this
        dict's order. Reordered in place (plans compare the mapping by identity)."""
        if not self.created_state:
            return
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if param in state:
                    state[param] = state.pop(param)
        self.created_state = False


class GradientRelease:
    """The handle ``release_gradients`` returns: ``remove()`` restores ordinary stepping."""

    def __init__(self, optimizer, steps):
        self.optimizer = optimizer
        self._steps = steps
        self._graph_task = None  # the graph task of the last hook: work out its kind once
        self._backward = None  # the outermost backward whose end is queued
        self._small: list[torch.Tensor] = []  # waiting for the end of this backward
        self._holding = False  # this backward has reentrant segments: step all at its end
        self._held: dict[torch.Tensor, None] = {}  # in firing order, each once
        self._told_reentrant = False
        self._params = steps.trained_params()
        release_ref = weakref.ref(self)  # the hooks must not keep the optimizer alive

        def on_gradient_ready(param):
            release = release_ref()
            if release is not None:
                release._on_gradient_ready(param)

        self._hooks = [param.register_post_accumulate_grad_hook(on_gradient_ready)
                       for param in self._params]

    @torch.no_grad()
    def _on_gradient_ready(self, param: torch.Tensor) -> None:
        graph_task = torch._C._current_graph_task_id()
        if graph_task != self._graph_task:
            self._enter(graph_task)
        if self._holding:
            # Its gradient may still grow (a later segment, or the outer backward, adds to it).
            self._held[param] = None
            return
        if graph_task == -1:  # called outside a backward pass: no end to wait for
            self._steps.refresh()
        elif self._steps.is_small(param):
            # Their gradients are small; stepped together at the end of this backward, they
            # cost one flat step instead of one each.
            self._small.append(param)
            return
        self._steps.step(param)
        param.grad = released_gradient(param)

    def _enter(self, graph_task: int) -> None:
        """The first hook of a graph task: an outermost backward's (check the hyperparameters
        once, queue its end) or a reentrant segment's (hold every gradient until the end)."""
        self._graph_task = graph_task
        if graph_task == -1:
            return
        if in_reentrant_backward():
            self._hold()
        elif graph_task != self._backward:
            self._backward = graph_task
            self._steps.refresh()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _hold(self) -> None:
        if not self._holding and not self._told_reentrant:
            self._told_reentrant = True
            warnings.warn(
                "gradient release under reentrant activation checkpointing "
                "(torch.utils.checkpoint with use_reentrant=True): each segment runs a backward "
                "of its own, so a parameter used in several segments gets its gradient in parts. "
                "Release holds every gradient of such a backward until its end (or until "
                "optimizer.step()) and steps them then: the result is exact, the memory saving "
                "is lost. Pass use_reentrant=False (one backward, each gradient complete when "
                "its hook runs) to free each gradient as it is ready (docs/gradient_release.md)",
                stacklevel=2)
        self._holding = True

    @torch.no_grad()
    def _end_backward(self) -> None:
        self._backward = self._graph_task = None
        self._step_waiting()
        self._steps.order_state()

    def _step_waiting(self) -> None:
        """Step what waits for the end of the backward: the small parameters, and every
        gradient held for reentrant segments (complete now), the small ones together."""
        small = dict.fromkeys(self._small)
        held, self._held, self._small, self._holding = self._held, {}, [], False
        if held:
            self._steps.refresh()
        for param in held:
            if param in small or param.grad is None or is_released(param.grad):
                continue
            if self._steps.is_small(param):
                small[param] = None
                continue
            self._steps.step(param)
            param.grad = released_gradient(param)
        if small:
            self._steps.step_together(list(small))
            for param in small:
                param.grad = released_gradient(param)

    @torch.no_grad()
    def end_step(self) -> None:
        """What ``optimizer.step()`` does while release is active (see the module docstring)."""
        # The groups are checked as step() checks them, before anything changes, even when
        # there is nothing left to step: the same values are refused with or without release.
        self._steps.refresh()
        # Gradients held for reentrant segments when no hook ran in the outer backward (whose
        # end then went unmarked) are complete now.
        self._backward = self._graph_task = None
        if self._held:
            self._step_waiting()
        self._holding = False
        # A backward that failed may have left its end unrun: its small parameters still
        # hold their gradients, which the loop below steps.
        self._small = []
        for param in self._steps.trained_params():  # with any added since, which have no hook
            grad = param.grad
            if grad is None:
                continue
            if is_released(grad):
                param.grad = None
                continue
            self._steps.step(param)
            param.grad = None
        self._steps.order_state()

    def remove(self) -> None:
        """Stop releasing: hooks removed, placeholders dropped, ``step()`` steps again."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._small = []
        self._held, self._holding = {}, False
        for param in self._params:
            if is_released(param.grad):
                param.grad = None
        self._steps.order_state()
        if self.optimizer._gradient_release is self:
            self.optimizer._gradient_release = None

    def __del__(self):
        # The optimizer is gone (it holds the only other reference): its hooks go with it.
        # Not through the handles: collected in a cycle with the optimizer, their weak
        # references to the hook dicts are already cleared; the parameters are held here.
        for param, handle in zip(getattr(self, "_params", ()), getattr(self, "_hooks", ())):
            param._post_accumulate_grad_hooks.pop(handle.id, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False


def _refuse_replicated_data_parallel(params: list[torch.Tensor]) -> None:
    """Under DDP (or any data parallelism whose gradients are plain tensors) the hook would
    step each rank's own gradient before it is averaged with the other ranks'."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    plain = [param for param in params if not sharding.is_dtensor(param)]
    if plain:
        raise ValueError(
            f"release_gradients under a {dist.get_world_size()}-rank process group needs "
            "FSDP2 (fully_shard) parameters, whose hooks fire on the reduce-scattered "
            f"gradient; got a plain tensor parameter of shape {tuple(plain[0].shape)}. Under "
            "DistributedDataParallel the hook would step each rank's gradient before it is "
            "averaged across ranks, so the replicas would diverge: use fully_shard, or "
            "ordinary stepping")


def release_gradients(optimizer) -> GradientRelease:
    """Step each parameter during backward, as soon as its gradient is ready, and free it.

    ``optimizer``: any of lowbit_optim's optimizers, or a ``CPUOffloadOptimizer`` over one.
    Returns a handle (also a context manager) whose ``remove()`` restores ordinary stepping.
    Keep calling ``optimizer.step()`` after each backward: it steps nothing that backward
    stepped and ends the step. Refused: DDP (plain parameters in a multi-rank process group).
    Told when used: clipping, ``GradScaler``, gradient accumulation (see docs/gradient_release.md).
    """
    if isinstance(optimizer, LowBitOptimizer):
        steps = ParameterSteps(optimizer)
    elif hasattr(optimizer, "_gradient_release_steps"):  # CPUOffloadOptimizer (a higher layer)
        steps = optimizer._gradient_release_steps()
    else:
        raise TypeError(
            f"release_gradients takes lowbit_optim's optimizers (or CPUOffloadOptimizer), not "
            f"{type(optimizer).__name__}: it steps one parameter at a time with the optimizer's "
            "own state")
    if optimizer._gradient_release is not None:
        raise RuntimeError("gradient release is already active on this optimizer; remove() "
                           "its handle first")
    _refuse_replicated_data_parallel(steps.trained_params())
    release = GradientRelease(optimizer, steps)
    optimizer._gradient_release = release
    return release
