"""Memory-efficient AdamW with 8-bit and 4-bit optimizer state."""

from lowbit_optim.adamw import (
    Adam4bit,
    Adam8bit,
    AdamFp8,
    AdamW4bit,
    AdamW8bit,
    AdamWFactored4bit,
    AdamWFp8,
)
from lowbit_optim.factored_state import FactoredState
from lowbit_optim.master_weight_export import load_master_weights, master_weights_state_dict
from lowbit_optim.memory import state_bytes
from lowbit_optim.offload import CPUOffloadOptimizer
from lowbit_optim.optimizer import LowBitAdamW
from lowbit_optim.quant.formats import FORMATS, QuantFormat
from lowbit_optim.state import QuantizedState

__version__ = "0.1.0"

__all__ = [
    "Adam4bit",
    "Adam8bit",
    "AdamFp8",
    "AdamW4bit",
    "AdamW8bit",
    "AdamWFp8",
    "AdamWFactored4bit",
    "CPUOffloadOptimizer",
    "FactoredState",
    "FORMATS",
    "LowBitAdamW",
    "load_master_weights",
    "master_weights_state_dict",
    "QuantFormat",
    "QuantizedState",
    "state_bytes",
]
