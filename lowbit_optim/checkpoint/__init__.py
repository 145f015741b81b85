"""Optimizer checkpoints: checking a state dict before it is loaded, converting between
``torch.optim.AdamW``'s state dicts and ours (``load``), and reading torchao's checkpoints
without torchao (``torchao``). See docs/checkpoints.md."""

from lowbit_optim.checkpoint.load import from_torch_adamw, to_torch_adamw, validate_state_dict
from lowbit_optim.checkpoint.torchao import load_torchao_optimizer_state

__all__ = ["from_torch_adamw", "load_torchao_optimizer_state", "to_torch_adamw", "validate_state_dict"]
