"""The optimizers: ``LowBitAdamW`` (``base``: arguments, state creation, ``step``,
``load_state_dict``) and the public classes that name its formats (``adamw``)."""

from lowbit_optim.optim.adamw import (
    Adam4bit,
    Adam8bit,
    AdamFp8,
    AdamW4bit,
    AdamW8bit,
    AdamWFactored4bit,
    AdamWFp8,
)
from lowbit_optim.optim.base import LowBitAdamW

__all__ = ["Adam4bit", "Adam8bit", "AdamFp8", "AdamW4bit", "AdamW8bit", "AdamWFactored4bit", "AdamWFp8",
           "LowBitAdamW"]
