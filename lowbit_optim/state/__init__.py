"""How optimizer moments are stored: tensor subclasses that look like the parameter but hold
blockwise codes and scales (``QuantizedState``) or row and column statistics
(``FactoredState``), their DTensor (FSDP2) helpers (``sharding``) and their size in bytes
(``memory``). Imports only ``lowbit_optim.formats``."""

from lowbit_optim.state.factored import FactoredState
from lowbit_optim.state.memory import state_bytes
from lowbit_optim.state.quantized import MOMENT_KEYS, QuantizedState

__all__ = ["MOMENT_KEYS", "FactoredState", "QuantizedState", "state_bytes"]
