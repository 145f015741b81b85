"""Triton kernels for the quantized step of any update rule (CUDA; CPU only under ``TRITON_INTERPRET=1``).

Importing this package imports Triton. ``lowbit_optim.step.rule_step`` imports it only when the
``"triton"`` backend is in use, so the rest of the package works without Triton. Importing
``ops`` registers the torch op, ``torch.ops.lowbit_optim.triton_rule_step`` (not imported here:
the op takes a rule by name from ``step.rules``, which sit above the step that imports this
package). Set ``TRITON_INTERPRET=1`` before ``lowbit_optim`` is first imported to run the
kernels on CPU tensors (Triton reads it when a kernel, or a rule's piece, is defined).
"""

from lowbit_optim.step.kernels.encoders import encode_normalized
from lowbit_optim.step.kernels.group_plan import KernelGroupPlan, stochastic_round_seed
from lowbit_optim.step.kernels.launcher import KernelUpdate, is_interpreted, launch

__all__ = ["KernelGroupPlan", "KernelUpdate", "encode_normalized", "is_interpreted", "launch",
           "stochastic_round_seed"]
