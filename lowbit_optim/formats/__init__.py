"""Blockwise quantization formats: the value maps (``maps``), the codecs that turn float32
blocks into codes and back (``codecs``), and the named formats the optimizers store their
moments in (``catalog``). Imports nothing else of the package."""
