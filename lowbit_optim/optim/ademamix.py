"""AdEMAMix with low-bit state (``step.rules.ademamix``): ``AdEMAMix8bit`` and
``AdEMAMix4bit``, with ``bitsandbytes.optim.AdEMAMix8bit``'s arguments and defaults."""

from lowbit_optim.formats.catalog import (
    DYNAMIC_4BIT_SIGNED,
    DYNAMIC_8BIT_SIGNED,
    DYNAMIC_8BIT_UNSIGNED_NONZERO,
    LINEAR_4BIT_NONZERO,
)
from lowbit_optim.optim.base import LowBitOptimizer
from lowbit_optim.optim.bitsandbytes_args import min_quant_size_from
from lowbit_optim.step.rules.ademamix import ADEMAMIX


class _LowBitAdEMAMix(LowBitOptimizer):
    rule = ADEMAMIX

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None, t_beta3=None,
                 *, eps=1e-8, weight_decay=1e-2, min_8bit_size=None, is_paged=False, maximize=False,
                 block_size=None, min_quant_size=None, bf16_stochastic_round=False,
                 master_weight_bits=None, backend=None):
        min_quant_size = min_quant_size_from(
            min_8bit_size=min_8bit_size, min_quant_size=min_quant_size, args=None,
            percentile_clipping=100, block_wise=True, is_paged=is_paged)
        hyperparameters = dict(lr=lr, betas=betas, alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3, eps=eps,
                               weight_decay=weight_decay)
        defaults = self._defaults(hyperparameters, maximize=maximize, block_size=block_size,
                                  min_quant_size=min_quant_size, bf16_stochastic_round=bf16_stochastic_round,
                                  master_weight_bits=master_weight_bits)
        super().__init__(params, defaults, backend=backend)


class AdEMAMix8bit(_LowBitAdEMAMix):
    """AdEMAMix with its three moments in bitsandbytes' 8-bit dynamic maps (the second
    moment's without a zero code, as ``AdamW8bit``'s), blocks of 256: ~3.05 bytes/param
    against fp32's 12.

    ``AdEMAMix8bit(params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None,
    t_beta3=None, *, eps=1e-8, weight_decay=1e-2, min_8bit_size=None, is_paged=False,
    maximize=False, block_size=256, min_quant_size=None, bf16_stochastic_round=False,
    master_weight_bits=None, backend=None)``: bitsandbytes' arguments (``eps`` and
    ``weight_decay`` by keyword), ``is_paged=True`` refused; ``t_alpha``/``t_beta3`` turn on
    the paper's warm-ups of ``alpha`` and ``beta3``.
    """

    signed_format = DYNAMIC_8BIT_SIGNED
    unsigned_format = DYNAMIC_8BIT_UNSIGNED_NONZERO


class AdEMAMix4bit(_LowBitAdEMAMix):
    """AdEMAMix with ``AdamW4bit``'s formats for its three moments, blocks of 128: ~1.6
    bytes/param. Same arguments as ``AdEMAMix8bit``, with ``block_size=128`` by default."""

    signed_format = DYNAMIC_4BIT_SIGNED
    unsigned_format = LINEAR_4BIT_NONZERO
