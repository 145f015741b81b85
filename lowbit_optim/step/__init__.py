"""How a step runs: the AdamW math written once (``math``), the implementations built on it
(``float_state``, ``quantized``, ``factored``, the Triton ``kernels``), the pieces they share
(``chunks``, ``hyperparams``), the entry point that picks one per parameter (``dispatch``)
and the per-group plan the optimizer keeps (``plan``). Imports ``formats`` and ``state``."""
