"""The optimizers: ``LowBitOptimizer`` (``base``: arguments, state creation, ``step``,
``load_state_dict``, for any update rule), ``LowBitAdamW`` and the public classes, each naming
its rule and formats: AdamW/Adam (``adamw``), Lion (``lion``), AdEMAMix (``ademamix``), Muon
(``muon``, with AdamW for the parameters Muon is not for)."""

from lowbit_optim.optim.adamw import (
    Adam4bit,
    Adam8bit,
    AdamFp8,
    AdamW4bit,
    AdamW8bit,
    AdamWFactored4bit,
    AdamWFp8,
    LowBitAdamW,
)
from lowbit_optim.optim.ademamix import AdEMAMix4bit, AdEMAMix8bit
from lowbit_optim.optim.base import LowBitOptimizer
from lowbit_optim.optim.lion import Lion4bit, Lion8bit
from lowbit_optim.optim.muon import Muon4bit, Muon8bit
from lowbit_optim.optim.muon_split import muon_param_groups

__all__ = ["Adam4bit", "Adam8bit", "AdamFp8", "AdamW4bit", "AdamW8bit", "AdamWFactored4bit", "AdamWFp8",
           "AdEMAMix4bit", "AdEMAMix8bit", "Lion4bit", "Lion8bit", "LowBitAdamW", "LowBitOptimizer",
           "Muon4bit", "Muon8bit", "muon_param_groups"]
