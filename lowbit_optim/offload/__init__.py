"""``CPUOffloadOptimizer``: parameters on the GPU, optimizer state and step on the CPU
(``optimizer``), with the host-device copies of ``transfers``. See docs/offload.md."""

from lowbit_optim.offload.optimizer import CPUOffloadOptimizer

__all__ = ["CPUOffloadOptimizer"]
