"""The public optimizers: each names the formats of its two moments (and, for the Adam
classes, that weight decay is L2), nothing more."""

from lowbit_optim.optimizer import LowBitAdamW
from lowbit_optim.quant.formats import (
    DYNAMIC_4BIT_SIGNED,
    DYNAMIC_8BIT_SIGNED,
    DYNAMIC_8BIT_UNSIGNED_NONZERO,
    FLOAT8,
    FLOAT8_NONZERO,
    LINEAR_4BIT_NONZERO,
)


class AdamW8bit(LowBitAdamW):
    """AdamW with 8-bit moments: bitsandbytes' dynamic-tree maps, blocks of 256 (~2 bytes/param);
    the second moment's map has no zero code (``codecs.ZeroFreeCodec``, issue 16).

    Drop-in for ``torch.optim.AdamW``:
    ``AdamW8bit(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
    amsgrad=False, *, maximize=False, block_size=256, min_quant_size=4096,
    bf16_stochastic_round=False, backend=None)``.
    """

    exp_avg_format = DYNAMIC_8BIT_SIGNED
    exp_avg_sq_format = DYNAMIC_8BIT_UNSIGNED_NONZERO


class AdamW4bit(LowBitAdamW):
    """AdamW with 4-bit moments (lpmm): dynamic-exponent first moment, zero-free linear
    second moment, blocks of 128 (~1 byte/param). Same arguments as ``AdamW8bit``, with
    ``block_size=128`` by default."""

    exp_avg_format = DYNAMIC_4BIT_SIGNED
    exp_avg_sq_format = LINEAR_4BIT_NONZERO


class AdamWFp8(LowBitAdamW):
    """AdamW with float8 e4m3fn moments, one float32 scale per block of 256 (torchao's
    ``AdamWFp8`` layout, ~2.03 bytes/param); the second moment's code 0 stands for half the
    smallest positive value instead of 0 (``codecs.ZeroFreeCodec``, issue 16). Same
    arguments as ``AdamW8bit``."""

    exp_avg_format = FLOAT8
    exp_avg_sq_format = FLOAT8_NONZERO


class _L2WeightDecay:
    """torch.optim.Adam's semantics for the class it is mixed into: weight decay added to the
    gradient, and ``weight_decay=0`` by default (torchao's ``Adam8bit``/``Adam4bit``/``AdamFp8``
    take the same arguments)."""

    decoupled_weight_decay = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, **options):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **options)


class Adam8bit(_L2WeightDecay, LowBitAdamW):
    """``torch.optim.Adam`` (L2 weight decay) with ``AdamW8bit``'s state formats."""

    exp_avg_format = AdamW8bit.exp_avg_format
    exp_avg_sq_format = AdamW8bit.exp_avg_sq_format


class Adam4bit(_L2WeightDecay, LowBitAdamW):
    """``torch.optim.Adam`` (L2 weight decay) with ``AdamW4bit``'s state formats."""

    exp_avg_format = AdamW4bit.exp_avg_format
    exp_avg_sq_format = AdamW4bit.exp_avg_sq_format


class AdamFp8(_L2WeightDecay, LowBitAdamW):
    """``torch.optim.Adam`` (L2 weight decay) with ``AdamWFp8``'s state formats."""

    exp_avg_format = AdamWFp8.exp_avg_format
    exp_avg_sq_format = AdamWFp8.exp_avg_sq_format
