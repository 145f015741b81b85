"""The update rules (``base.UpdateRule``): AdamW/Adam (``adamw``), Lion (``lion``) and
AdEMAMix (``ademamix``), each its moments, hyperparameters and math in one module."""
