"""Optimizer checkpoints: checking a state dict before it is loaded (``validate``), loading it
(``load``), converting between ``torch.optim.AdamW``'s (and ``torch.optim.Muon``'s) state
dicts and ours (``convert``), reading torchao's checkpoints without torchao (``torchao``), and
a bfloat16 or float16 model's float32 master weights out and back in (``master_weights``).
See docs/checkpoints.md."""

from lowbit_optim.checkpoint.convert import from_torch_adamw, to_torch_adamw, to_torch_muon
from lowbit_optim.checkpoint.master_weights import load_master_weights, master_weights_state_dict
from lowbit_optim.checkpoint.torchao import load_torchao_optimizer_state
from lowbit_optim.checkpoint.validate import validate_state_dict

__all__ = [
    "from_torch_adamw", "load_master_weights", "load_torchao_optimizer_state", "master_weights_state_dict",
    "to_torch_adamw", "to_torch_muon", "validate_state_dict",
]
