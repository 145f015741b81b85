"""Plain-PyTorch references: readable, unfused update rules that the optimized classes are
tested against (``muon``) and the momentum storage methods they compare (``momentum_codecs``).
Nothing here is on a training hot path."""
