"""Gradient release (``optim.release``) for ``CPUOffloadOptimizer``: each parameter is stepped
from its gradient's hook as the optimizer's ``step()`` steps them all, download (already
started by the optimizer's own hook, which runs first), host step, upload."""

import torch

from lowbit_optim.optim.base import LowBitOptimizer
from lowbit_optim.optim.release import ParameterSteps


class OffloadedSteps:
    """Steps ``CPUOffloadOptimizer``'s parameters one at a time: download (already started by
    its own hook), host step, upload, as its ``step()`` does for all of them together."""

    def __init__(self, optimizer):
        if not isinstance(optimizer.host_optimizer, LowBitOptimizer):
            raise TypeError(
                "release_gradients needs CPUOffloadOptimizer's host optimizer to be one of "
                f"lowbit_optim's (got {type(optimizer.host_optimizer).__name__}): only those "
                "can step one parameter at a time with their ordinary state")
        self.offload = optimizer
        self.host = ParameterSteps(optimizer.host_optimizer)

    def trained_params(self) -> list[torch.Tensor]:
        return list(self.offload._offloaded)

    def refresh(self) -> None:
        self.host.refresh()

    def is_small(self, param: torch.Tensor) -> bool:
        return False  # each parameter's upload starts as soon as it is stepped

    def order_state(self) -> None:
        self.host.order_state()

    def step(self, param: torch.Tensor) -> None:
        offload = self.offload
        item = offload._offloaded[param]
        offload.transfers.wait_uploads()  # the host copies are read by the last upload
        offload._sync_gradient(item)
        if item.host_param.grad is None:
            return
        if item.device_param._version != item.param_version:
            item.host_param.copy_(item.device_param)  # written from outside since our upload
        self.host.step(item.host_param)
        item.host_param.grad = None
        item.copied_grad = None
        offload.transfers.upload([(item.device_param, item.host_param)])
        item.param_version = item.device_param._version
