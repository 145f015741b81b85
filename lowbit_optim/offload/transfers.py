"""Copies between the device and the host for ``CPUOffloadOptimizer``.

On CUDA: host buffers are pinned (a pageable buffer turns ``non_blocking`` copies into
synchronous ones) and every copy runs on one side stream, so downloads overlap backward and
uploads overlap nothing on the compute stream. One stream keeps the copies in the order they
were issued, which the offload relies on: a later copy into a buffer lands after an earlier
one, and waiting for a copy's event means every copy issued before it has landed too.

On the CPU the copies are plain and synchronous: the same calls, in the same order, between
distinct tensors, which is what lets the tests run the whole offload logic without a GPU.
"""

import torch


class Transfers:
    def __init__(self, device: torch.device):
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"CPUOffloadOptimizer supports CUDA (and CPU, for testing) "
                             f"parameters, not {device.type}")
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.is_cuda else None
        self._uploads_done = None

    def host_empty(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.is_cuda)

    def download(self, host: torch.Tensor, device_tensor: torch.Tensor):
        """Start copying ``device_tensor`` into ``host``; returns what ``wait`` takes."""
        if not self.is_cuda:
            host.copy_(device_tensor)
            return None
        # The tensor was produced on the compute stream: order the copy after it on the
        # device, without blocking the host.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(device_tensor, non_blocking=True)
        return self.stream.record_event()

    def release(self, device_tensor: torch.Tensor) -> None:
        """``device_tensor`` may be freed before its copy has run: keep its memory until then."""
        if self.is_cuda:
            device_tensor.record_stream(self.stream)

    @staticmethod
    def wait(copy) -> None:
        if copy is not None:
            copy.synchronize()

    def upload(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each host tensor into its device tensor (``pairs`` of (device, host))."""
        if not self.is_cuda:
            for device_tensor, host in pairs:
                device_tensor.copy_(host)
            return
        compute = torch.cuda.current_stream(self.device)
        # Backward kernels still queued may read the parameters: overwrite them after.
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            for device_tensor, host in pairs:
                device_tensor.copy_(host, non_blocking=True)
        # The next forward waits for the new values on the device; the host goes on.
        compute.wait_stream(self.stream)
        self._uploads_done = self.stream.record_event()

    def wait_uploads(self) -> None:
        """Before the host copies change again, the last upload must have read them."""
        if self._uploads_done is not None:
            self._uploads_done.synchronize()
            self._uploads_done = None
