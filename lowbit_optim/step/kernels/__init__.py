"""Triton kernels for the quantized step of any update rule (CUDA; CPU only under ``TRITON_INTERPRET=1``).

Importing this package imports Triton and registers ``torch.ops.lowbit_optim.adamw_lowbit_step``.
``lowbit_optim.step.rule_step`` imports it only when the
``"triton"`` backend is in use, so the rest of the package works without Triton. Set
``TRITON_INTERPRET=1`` before ``lowbit_optim`` is first imported to run the kernels on CPU
tensors (Triton reads it when a kernel, or a rule's piece, is defined).
"""

from lowbit_optim.step.kernels.encoders import encode_normalized
from lowbit_optim.step.kernels.group_plan import KernelGroupPlan, stochastic_round_seed
from lowbit_optim.step.kernels.launcher import KernelUpdate, is_interpreted, launch
from lowbit_optim.step.kernels.ops import adamw_lowbit_step, step_group, stored_tensors

__all__ = ["KernelGroupPlan", "KernelUpdate", "adamw_lowbit_step",
           "encode_normalized", "is_interpreted", "launch", "step_group", "stochastic_round_seed",
           "stored_tensors"]
