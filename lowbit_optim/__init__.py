"""Memory-efficient AdamW with 8-bit and 4-bit optimizer state."""

from lowbit_optim.formats.catalog import FORMATS, QuantFormat
from lowbit_optim.offload import CPUOffloadOptimizer
from lowbit_optim.optim import (
    Adam4bit,
    Adam8bit,
    AdamFp8,
    AdamW4bit,
    AdamW8bit,
    AdamWFactored4bit,
    AdamWFp8,
    LowBitAdamW,
)
from lowbit_optim.state import FactoredState, QuantizedState, state_bytes

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
    "QuantFormat",
    "QuantizedState",
    "state_bytes",
]
