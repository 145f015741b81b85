"""How optimizer moments are stored: tensor subclasses that look like the parameter but hold
blockwise codes and scales (``QuantizedState``) or row and column statistics
(``FactoredState``), their DTensor (FSDP2) helpers (``sharding``) and their size in bytes
(``memory``); and the storage-less stand-in for a gradient the device no longer holds
(``placeholder``). Imports only ``lowbit_optim.formats``."""

from lowbit_optim.state.factored import FactoredState
from lowbit_optim.state.memory import state_bytes
from lowbit_optim.state.quantized import QuantizedState

__all__ = ["FactoredState", "QuantizedState", "state_bytes"]
