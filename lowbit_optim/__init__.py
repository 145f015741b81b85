"""Memory-efficient optimizers (AdamW, Adam, Lion, AdEMAMix, Muon) with 8-bit and 4-bit state."""

from lowbit_optim import functional
from lowbit_optim.checkpoint.master_weights import load_master_weights, master_weights_state_dict
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
    AdEMAMix4bit,
    AdEMAMix8bit,
    Lion4bit,
    Lion8bit,
    LowBitAdamW,
    LowBitOptimizer,
    Muon4bit,
    Muon8bit,
    muon_param_groups,
)
from lowbit_optim.optim.release import GradientRelease, release_gradients
from lowbit_optim.optim.rounding_guard import (
    LostUpdates,
    RoundingLossWarning,
    lost_updates,
    warn_on_lost_updates,
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
    "AdEMAMix4bit",
    "AdEMAMix8bit",
    "CPUOffloadOptimizer",
    "FactoredState",
    "functional",
    "FORMATS",
    "GradientRelease",
    "Lion4bit",
    "Lion8bit",
    "LostUpdates",
    "LowBitAdamW",
    "LowBitOptimizer",
    "load_master_weights",
    "master_weights_state_dict",
    "Muon4bit",
    "Muon8bit",
    "muon_param_groups",
    "QuantFormat",
    "QuantizedState",
    "RoundingLossWarning",
    "lost_updates",
    "release_gradients",
    "state_bytes",
    "warn_on_lost_updates",
]
