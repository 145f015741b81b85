"""Optimizer checkpoints: checking a state dict before it is loaded, (``validate``), converting between
``torch.optim.AdamW``'s state dicts and ours (``convert``), loading one into an optimizer
(``load``), and reading torchao's checkpoints
without torchao (``torchao``). See docs/checkpoints.md."""

from lowbit_optim.checkpoint.convert import from_torch_adamw, to_torch_adamw
from lowbit_optim.checkpoint.torchao import load_torchao_optimizer_state
from lowbit_optim.checkpoint.validate import validate_state_dict

__all__ = ["from_torch_adamw", "load_torchao_optimizer_state", "to_torch_adamw", "validate_state_dict"]
