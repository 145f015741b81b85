"""Lion with low-bit state (``step.rules.lion``): ``Lion8bit`` and ``Lion4bit``, with
``bitsandbytes.optim.Lion8bit``'s arguments and defaults."""

from lowbit_optim.formats.catalog import (
    DYNAMIC_4BIT_SIGNED,
    DYNAMIC_8BIT_SIGNED,
    DYNAMIC_8BIT_UNSIGNED_NONZERO,
    LINEAR_4BIT_NONZERO,
)
from lowbit_optim.optim.base import LowBitOptimizer
from lowbit_optim.optim.bitsandbytes_args import min_quant_size_from
from lowbit_optim.step.rules.lion import LION


class _LowBitLion(LowBitOptimizer):
    rule = LION

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, args=None, min_8bit_size=None,
                 *, percentile_clipping=100, block_wise=True, is_paged=False, maximize=False,
                 block_size=None, min_quant_size=None, bf16_stochastic_round=False,
                 master_weight_bits=None, backend=None):
        min_quant_size = min_quant_size_from(
            min_8bit_size=min_8bit_size, min_quant_size=min_quant_size, args=args,
            percentile_clipping=percentile_clipping, block_wise=block_wise, is_paged=is_paged)
        defaults = self._defaults(dict(lr=lr, betas=betas, weight_decay=weight_decay), maximize=maximize,
                                  block_size=block_size, min_quant_size=min_quant_size,
                                  bf16_stochastic_round=bf16_stochastic_round,
                                  master_weight_bits=master_weight_bits)
        super().__init__(params, defaults, backend=backend)


class Lion8bit(_LowBitLion):
    """Lion with its one moment in bitsandbytes' signed 8-bit dynamic map, blocks of 256
    (~1 byte/param; fp32 Lion keeps 4).

    ``Lion8bit(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0, args=None,
    min_8bit_size=None, *, percentile_clipping=100, block_wise=True, is_paged=False,
    maximize=False, block_size=256, min_quant_size=None, bf16_stochastic_round=False,
    master_weight_bits=None, backend=None)``: bitsandbytes' arguments, the options it has and
    we do not refused (``bitsandbytes_args``); ``min_quant_size`` is ``min_8bit_size``'s other
    name. Lion wants a learning rate 3-10x smaller than AdamW's (the paper).
    """

    signed_format = DYNAMIC_8BIT_SIGNED
    unsigned_format = DYNAMIC_8BIT_UNSIGNED_NONZERO


class Lion4bit(_LowBitLion):
    """Lion with its one moment in the 4-bit dynamic-exponent map, blocks of 128 (~0.5
    byte/param). Same arguments as ``Lion8bit``, with ``block_size=128`` by default."""

    signed_format = DYNAMIC_4BIT_SIGNED
    unsigned_format = LINEAR_4BIT_NONZERO
