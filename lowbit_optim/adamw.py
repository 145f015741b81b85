"""The public optimizers: each names the formats of its two moments, nothing more."""

from lowbit_optim.optimizer import LowBitAdamW
from lowbit_optim.quant.formats import (
    DYNAMIC_4BIT_SIGNED,
    DYNAMIC_8BIT_SIGNED,
    DYNAMIC_8BIT_UNSIGNED_NONZERO,
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
