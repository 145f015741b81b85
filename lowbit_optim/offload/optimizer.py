"""``CPUOffloadOptimizer``: the model trains on the device; the optimizer state and the step
live on the host, in our low-bit formats (docs/offload.md).

torchao's signature (``CPUOffloadOptimizer(params, optimizer_class, *, offload_gradients,
**kwargs)``), so its users change one import. What overlaps with what:

1. **Backward / gradient download.** A ``register_post_accumulate_grad_hook`` on every trained
   parameter starts copying its gradient into a host buffer (pinned, on a side stream) as soon
   as autograd has finished accumulating it, while backward goes on with earlier layers.
2. **Host step.** At ``step()``, after waiting for the copies: one host optimizer (any of ours,
   or ``torch.optim.AdamW``) steps every host copy. The step is not started per parameter
   during backward because two things users rely on need the whole gradient first:
   clipping (the norm covers every gradient) and gradient accumulation (only the caller knows
   which backward is the last before ``step()``). One host optimizer also keeps our ordinary
   state dict and param groups, so schedulers and checkpoints work unchanged.
3. **Parameter upload.** The updated host copies go back on the side stream; the compute
   stream waits for them on the device, so the host is not blocked and the next forward
   starts as soon as they land. The next ``step()`` waits for them before touching the
   host copies again.

When the "device" is the CPU all of this runs with plain synchronous copies between distinct
tensors (same hooks, same bookkeeping), which is how the tests check it bit for bit against
the optimizer without offload. See docs/offload.md.

Gradients are authoritative on the device (``offload_gradients=False``): a device gradient
changed after its copy (clipping, zeroing, ``p.grad = ...``) is noticed by its version
counter and copied again at ``step()``. A device parameter written from outside (for example
``model.load_state_dict``) is noticed the same way and its host copy refreshed.
"""

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch.optim import Optimizer

from lowbit_optim.offload import numbering
from lowbit_optim.offload.gradient import HostGradient
from lowbit_optim.offload.release import OffloadedSteps
from lowbit_optim.offload.transfers import Transfers
from lowbit_optim.optim.adamw import AdamW8bit
from lowbit_optim.optim.muon import Muon4bit, Muon8bit
from lowbit_optim.optim.muon_split import muon_param_groups


@dataclass(eq=False)
class _Offloaded:
    """One trained parameter: its host copy, the host gradient buffer and the copy in flight."""

    device_param: torch.Tensor
    host_param: torch.Tensor
    host_grad: torch.Tensor  # attached as host_param.grad while a gradient is held
    param_version: int  # device_param._version after our last write to it
    staging: torch.Tensor | None = None  # offload_gradients=True: a micro-batch waiting to be added
    pending: object = None  # the copy into host_grad or staging in flight (None: landed)
    staged: bool = False  # staging holds a gradient to add into host_grad once it lands
    copied_grad: weakref.ref | None = None  # offload_gradients=False: the device gradient copied ...
    copied_version: int = -1  # ... and its version then
    placeholder: HostGradient | None = None  # offload_gradients=True: device_param.grad once copied
    accumulator: object = None  # offload_gradients=True: the parameter's AccumulateGrad node


class CPUOffloadOptimizer(Optimizer):
    """Step on the host with ``optimizer_class`` (default ``AdamW8bit``) while the model trains
    on the device.

    Args:
        params: parameters or param groups, as for any ``torch.optim`` optimizer. Parameters
            with ``requires_grad=False`` are skipped (no host copy, no state).
        optimizer_class: ``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``, ``AdamWFactored4bit``
            (any ``LowBitAdamW`` subclass) or ``torch.optim.AdamW`` (which gets ``fused=True``
            unless told otherwise, as in torchao: the fused CPU kernel is the fast one).
        offload_gradients: free each device gradient once it is copied. The host buffer then
            holds the gradient: micro-batches are summed on the host, and the device
            parameter's ``.grad`` becomes a storage-less ``HostGradient`` through which
            ``torch.nn.utils.clip_grad_norm_`` clips the host gradient (other operations on
            it raise). Setting ``.grad`` to None (``model.zero_grad()``) drops the host one.
        kwargs: the host optimizer's own (``lr``, ``weight_decay``, ``block_size``, ...).

    ``param_groups``, ``state`` and ``defaults`` are the host optimizer's (its groups hold the
    host copies), so LR schedulers write straight into them. ``state_dict()`` is the host
    optimizer's, numbered like the parameters given here, frozen ones included: it loads into
    the same optimizer without offload and back.
    """

    _gradient_release = None  # the active optim.release.GradientRelease, if any

    def __init__(self, params, optimizer_class=AdamW8bit, *, offload_gradients=False, **kwargs):
        if "minimal_size" in kwargs:
            raise TypeError(
                "CPUOffloadOptimizer offloads every trained parameter (torchao's minimal_size "
                "kept small ones on the device with a second optimizer); drop minimal_size"
            )
        if optimizer_class is torch.optim.AdamW and "fused" not in kwargs and "foreach" not in kwargs:
            kwargs["fused"] = True
        # What torch.optim.Optimizer.__init__ sets up for step hooks and profiling (OrderedDicts:
        # hook handles hold weak references to them); its param_groups/state/defaults are the
        # host optimizer's (properties below).
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

        if isinstance(params, torch.nn.Module):
            # Muon splits a module by its structure (embeddings, head), which the host copies
            # no longer have: split the device parameters here, as Muon8bit(module) would.
            if not issubclass(optimizer_class, (Muon8bit, Muon4bit)):
                raise TypeError(f"CPUOffloadOptimizer takes a module only for Muon8bit/Muon4bit; pass "
                                f"{type(params).__name__}.parameters() for {optimizer_class.__name__}")
            params = muon_param_groups(params)
        if isinstance(params, torch.Tensor):
            raise TypeError("params argument given to the optimizer should be an iterable of "
                            f"Tensors or dicts, but got {torch.typename(params)}")
        groups = list(params)
        if not groups:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.offload_gradients = offload_gradients
        self.transfers: Transfers | None = None
        self._offloaded: dict[torch.Tensor, _Offloaded] = {}  # device param -> its host side
        self._given_groups: list[list[torch.Tensor]] = []  # as given, frozen parameters included
        self._given_names: list[list[str] | None] = []  # their names, for named_parameters() groups
        self._hooks = []
        prepared = []
        for group in groups:
            prepared.append(self._host_group(group, [item for _, _, new in prepared for item in new]))
        self.host_optimizer = optimizer_class([host_group for host_group, _, _ in prepared], **kwargs)
        for _, given, new in prepared:
            self._adopt(*given, new)

    # --- what schedulers, Trainer and users read ----------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.host_optimizer.param_groups

    @property
    def state(self):
        return self.host_optimizer.state

    @property
    def defaults(self) -> dict:
        return self.host_optimizer.defaults

    def _gradient_release_steps(self) -> OffloadedSteps:
        """How ``release_gradients`` steps this optimizer's parameters one at a time."""
        return OffloadedSteps(self)

    def host_param(self, param: torch.Tensor) -> torch.Tensor:
        """The host copy that the host optimizer steps (and keys its state by)."""
        return self._offloaded[param].host_param

    def add_param_group(self, param_group: dict) -> None:
        host_group, given, new = self._host_group(param_group)
        self.host_optimizer.add_param_group(host_group)
        self._adopt(*given, new)

    def _host_group(self, group: dict, earlier=()) -> tuple[dict, tuple, list[_Offloaded]]:
        """The host optimizer's group for ``group``, its parameters (and names) as given and
        their new host copies (not live until ``_adopt``, so a group the host optimizer
        refuses leaves nothing behind). ``earlier``: copies prepared for other groups."""
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        names = None
        if params and all(isinstance(item, tuple) and len(item) == 2 for item in params):
            names, params = [name for name, _ in params], [param for _, param in params]  # named_parameters()
        new = []
        for param in params:
            if not isinstance(param, torch.Tensor) or not param.is_leaf:
                raise TypeError(f"optimizer can only optimize leaf Tensors, got {type(param).__name__}")
            if param in self._offloaded or any(param is item.device_param for item in (*earlier, *new)):
                raise ValueError("some parameters appear in more than one parameter group")
            if not param.requires_grad:
                continue
            new.append(self._offload(param))
        host_group = {key: value for key, value in group.items() if key != "params"}
        host_group["params"] = [item.host_param for item in new]
        if names is not None:
            trained_names = [name for name, param in zip(names, params) if param.requires_grad]
            host_group["params"] = list(zip(trained_names, host_group["params"], strict=True))
        return host_group, (params, names), new

    def _offload(self, param: torch.Tensor) -> _Offloaded:
        if hasattr(param, "device_mesh"):
            raise ValueError(
                "CPUOffloadOptimizer steps whole tensors; for FSDP2 (DTensor) parameters use "
                "FSDP2's own CPUOffloadPolicy with the optimizer directly (docs/offload.md)"
            )
        if self.transfers is None:
            self.transfers = Transfers(param.device)
        elif param.device != self.transfers.device:
            raise ValueError(f"all trained parameters must be on one device: {self.transfers.device} "
                             f"and {param.device}")
        host_param = self.transfers.host_empty(param)
        host_param.copy_(param.detach())
        return _Offloaded(param, host_param, self.transfers.host_empty(param), param._version)

    def _adopt(self, given: list, names: list[str] | None, new: list[_Offloaded]) -> None:
        """Make host copies live once the host optimizer has accepted their group."""
        self._given_groups.append(given)
        self._given_names.append(names)
        optimizer_ref = weakref.ref(self)  # the hooks must not keep the optimizer alive

        def on_gradient_ready(param):
            optimizer = optimizer_ref()
            if optimizer is not None and param in optimizer._offloaded:
                optimizer._gradient_ready(optimizer._offloaded[param])

        def before_accumulation(param):
            optimizer = optimizer_ref()
            if optimizer is not None and param in optimizer._offloaded:
                optimizer._gradient_arriving(optimizer._offloaded[param])

        for item in new:
            self._offloaded[item.device_param] = item
            self._hooks.append(item.device_param.register_post_accumulate_grad_hook(on_gradient_ready))
            if self.offload_gradients:
                # A pre-hook on the parameter's AccumulateGrad node, not a tensor hook: that one
                # also runs for torch.autograd.grad, which accumulates nothing. The node is held
                # here because the parameter only keeps a weak reference to it.
                param_ref = weakref.ref(item.device_param)
                item.accumulator = item.device_param.view_as(item.device_param).grad_fn.next_functions[0][0]
                self._hooks.append(item.accumulator.register_prehook(
                    lambda grad_outputs, param_ref=param_ref: before_accumulation(param_ref())))
                item.placeholder = self._host_gradient_placeholder(item)

    def _host_gradient_placeholder(self, item: _Offloaded) -> HostGradient:
        optimizer_ref, item_ref = weakref.ref(self), weakref.ref(item)  # no cycle through .grad

        def landed_host_gradient():
            optimizer, landed = optimizer_ref(), item_ref()
            if optimizer is None or landed is None or landed.host_param.grad is None:
                raise RuntimeError("this HostGradient's CPUOffloadOptimizer no longer holds its gradient")
            optimizer._land(landed)
            return landed.host_grad

        return HostGradient(item.device_param, landed_host_gradient)

    def __del__(self):
        for handle in getattr(self, "_hooks", ()):
            handle.remove()

    # --- gradients ----------------------------------------------------------------------
    def _gradient_arriving(self, item: _Offloaded) -> None:
        """offload_gradients=True, before autograd accumulates a new device gradient: our
        placeholder means "keep summing on the host" and must not be added to; no gradient at
        all means the user cleared it (``model.zero_grad()``), so the host sum is dropped as
        the device one would have been."""
        if item.device_param.grad is item.placeholder:
            item.device_param.grad = None
        elif item.device_param.grad is None and item.host_param.grad is not None:
            self._land(item)
            item.host_param.grad = None

    def _gradient_ready(self, item: _Offloaded) -> None:
        """A device gradient is complete (the hook, or found at ``step()``): start its copy."""
        grad = item.device_param.grad
        if grad is None:
            return
        if not self.offload_gradients:
            # The last copy wins: with accumulation on the device, each micro-batch's hook
            # copies the running sum, and the copies land in the order they were issued.
            item.pending = self.transfers.download(item.host_grad, grad)
            item.copied_grad, item.copied_version = weakref.ref(grad), grad._version
        elif item.host_param.grad is None:
            item.pending = self.transfers.download(item.host_grad, grad)
            item.host_param.grad = item.host_grad
        else:
            # Accumulating on the host: the device sum was freed, so this micro-batch lands
            # beside the running sum and is added once it has landed (the sum the device
            # would have formed, in the same order, so the same bits).
            self._land(item)
            if item.staging is None:
                item.staging = self.transfers.host_empty(grad)
            item.pending = self.transfers.download(item.staging, grad)
            item.staged = True
        # Whoever frees the device gradient (us now, or zero_grad, or the user) must not let
        # its memory be reused before the copy has read it.
        self.transfers.release(grad)
        if self.offload_gradients:
            item.device_param.grad = item.placeholder

    def _land(self, item: _Offloaded) -> None:
        """Wait for the copy in flight; fold a staged micro-batch into the host sum."""
        self.transfers.wait(item.pending)
        item.pending = None
        if item.staged:
            item.host_grad.add_(item.staging)
            item.staged = False

    def _sync_gradient(self, item: _Offloaded) -> None:
        """Make the host gradient what the optimizer without offload would step with now."""
        grad = item.device_param.grad
        if self.offload_gradients:
            if grad is None and item.host_param.grad is not None:  # cleared by the user
                self._gradient_arriving(item)
            elif grad is not None and grad is not item.placeholder:  # assigned by hand, or
                self._gradient_ready(item)  # made without accumulation hooks
        elif grad is None:
            item.host_param.grad = None
        else:
            copied = item.copied_grad() if item.copied_grad is not None else None
            if copied is not grad or item.copied_version != grad._version:
                self._gradient_ready(item)  # changed after its copy: clipped, zeroed, assigned
            item.host_param.grad = item.host_grad
        self._land(item)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the host gradients; returns the total norm
        (a CPU tensor). With ``offload_gradients=True`` torch's own call on the device
        parameters gives the same (through ``HostGradient``); with it off, clipping the device
        gradients works too but costs one more copy of each at ``step()``."""
        for item in self._offloaded.values():
            self._sync_gradient(item)
        return torch.nn.utils.clip_grad_norm_(
            [item.host_param for item in self._offloaded.values()], max_norm,
            norm_type=norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach,
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        for item in self._offloaded.values():
            self._land(item)
            item.copied_grad = None
            grad = item.device_param.grad
            if set_to_none:
                item.device_param.grad = None
                item.host_param.grad = None
                continue
            if grad is not None and grad is not item.placeholder:  # torch.optim.Optimizer's in-place branch
                if grad.grad_fn is not None:
                    grad.detach_()
                else:
                    grad.requires_grad_(False)
                grad.zero_()
            if item.host_param.grad is not None:
                item.host_grad.zero_()

    # --- the step -----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.transfers is None:  # every parameter frozen
            return loss
        if self._gradient_release is not None:  # backward stepped them (optim.release)
            self._gradient_release.end_step()
            return loss
        self.transfers.wait_uploads()
        for item in self._offloaded.values():
            self._sync_gradient(item)
            if item.device_param._version != item.param_version:
                # Written from outside since our last upload (model.load_state_dict, ...).
                item.host_param.copy_(item.device_param)
                item.param_version = item.device_param._version
        self.host_optimizer.step()
        stepped = [item for item in self._offloaded.values() if item.host_param.grad is not None]
        self.transfers.upload([(item.device_param, item.host_param) for item in stepped])
        for item in stepped:
            item.param_version = item.device_param._version
        return loss

    # --- checkpoints: the host optimizer's, numbered as the parameters given here ----------
    def state_dict(self) -> dict:
        """The host optimizer's state dict, numbered as the parameters given here: the same
        dict the optimizer without offload saves (same keys, same formats)."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = numbering.as_given(self.host_optimizer.state_dict(), self._given_groups,
                                        self._given_names, self._offloaded)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            state_dict = post_hook(self, state_dict) or state_dict
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this optimizer, or of ``optimizer_class`` without offload
        built over the same parameters. State saved for parameters frozen here is dropped:
        this optimizer never steps them."""
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre_hook(self, state_dict) or state_dict
        host = numbering.as_host(state_dict, self._given_groups, self._offloaded)
        self.host_optimizer.load_state_dict(host)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
