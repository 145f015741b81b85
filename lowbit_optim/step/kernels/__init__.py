"""Triton kernels for the quantized AdamW step (CUDA; CPU only under ``TRITON_INTERPRET=1``).

Importing this package imports Triton and registers ``torch.ops.lowbit_optim.adamw_lowbit_step``.
``lowbit_optim.step.dispatch`` imports it only when the ``"triton"`` backend is in use, so the rest
of the package works without Triton. Set ``TRITON_INTERPRET=1`` before this package is first
imported to run the kernels on CPU tensors (Triton reads it when a kernel is defined).
"""

from lowbit_optim.step.kernels.adamw_lowbit import is_interpreted, launch
from lowbit_optim.step.kernels.encoders import encode_normalized
from lowbit_optim.step.kernels.ops import StepGroupPlan, adamw_lowbit_step, step_group, stochastic_round_seed

__all__ = ["StepGroupPlan", "adamw_lowbit_step", "encode_normalized", "is_interpreted", "launch",
           "step_group", "stochastic_round_seed"]
