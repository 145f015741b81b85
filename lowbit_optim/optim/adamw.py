"""``LowBitAdamW``, the drop-in ``torch.optim.AdamW`` (its arguments and group options over
``LowBitOptimizer``), and the public AdamW and Adam classes: each names the formats of its
two moments (and, for the Adam classes, that weight decay is L2; for the factored one, which
second moments are factored), nothing more."""

from lowbit_optim.checkpoint.validate import TORCH_ADAMW_GROUP_OPTIONS
from lowbit_optim.formats.catalog import (
    DYNAMIC_4BIT_SIGNED,
    DYNAMIC_8BIT_SIGNED,
    DYNAMIC_8BIT_UNSIGNED_NONZERO,
    FLOAT8,
    FLOAT8_NONZERO,
    LINEAR_4BIT_NONZERO,
    QuantFormat,
)
from lowbit_optim.optim.base import LowBitOptimizer
from lowbit_optim.state.factored import factor_shape
from lowbit_optim.state.sharding import check_rows_sharded
from lowbit_optim.step.rules.adamw import ADAMW


class LowBitAdamW(LowBitOptimizer):
    """``torch.optim.AdamW`` (``Adam`` with ``decoupled_weight_decay = False``) with
    blockwise-quantized moments. Subclasses set the two formats."""

    rule = ADAMW
    exp_avg_format: QuantFormat
    exp_avg_sq_format: QuantFormat
    # AdamW's decoupled weight decay; the Adam classes add it to the gradient (L2) instead.
    # Every group records it (as torch.optim.Adam's groups do), so state dicts say which.
    decoupled_weight_decay = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, block_size=None, min_quant_size=4096,
                 bf16_stochastic_round=False, master_weight_bits=None, backend=None):
        """``foreach``, ``capturable``, ``differentiable`` and ``fused`` are
        ``torch.optim.AdamW``'s implementation choices, taken so that code written for it
        runs unchanged, and kept in the param groups as torch keeps them. The step is always
        one fused pass per kind of state, so ``fused`` and ``foreach`` (None, True or False)
        change nothing. ``capturable=True`` and ``differentiable=True`` are refused
        (``_check_group`` says why)."""
        hyperparameters = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
            decoupled_weight_decay=self.decoupled_weight_decay)
        defaults = self._defaults(hyperparameters, maximize=maximize, block_size=block_size,
                                  min_quant_size=min_quant_size, bf16_stochastic_round=bf16_stochastic_round,
                                  master_weight_bits=master_weight_bits)
        super().__init__(params, defaults, backend=backend)

    def __init_subclass__(cls, **kwargs):
        # The rule's signed moment is exp_avg and its unsigned ones the squares: a class that
        # names the two formats names them for the generic base, as class attributes.
        super().__init_subclass__(**kwargs)
        if "exp_avg_format" in cls.__dict__:
            cls.signed_format = cls.exp_avg_format
        if "exp_avg_sq_format" in cls.__dict__:
            cls.unsigned_format = cls.exp_avg_sq_format

    def _fill_group_options(self, group: dict) -> None:
        super()._fill_group_options(group)
        group.setdefault("amsgrad", False)
        group.setdefault("decoupled_weight_decay", self.decoupled_weight_decay)
        for key, value in TORCH_ADAMW_GROUP_OPTIONS.items():
            group.setdefault(key, value)

    def _check_group(self, group: dict) -> None:
        super()._check_group(group)
        if not isinstance(group["decoupled_weight_decay"], bool):
            raise ValueError(
                f"Invalid decoupled_weight_decay: {group['decoupled_weight_decay']!r} (a bool is needed)"
            )
        for key in ("foreach", "fused"):
            if not (group[key] is None or isinstance(group[key], bool)):
                raise ValueError(f"Invalid {key}: {group[key]!r} (None, True or False is needed)")
        if group["capturable"] is not False:
            raise ValueError(
                f"Invalid capturable: {group['capturable']!r} ({type(self).__name__} cannot be "
                "captured in a CUDA graph: its step reads the learning rate and step count on the "
                "host at every launch, so a replay would repeat the captured values; use "
                "capturable=False)"
            )
        if group["differentiable"] is not False:
            raise ValueError(
                f"Invalid differentiable: {group['differentiable']!r} ({type(self).__name__}'s step "
                "is not differentiable: autograd cannot pass through quantized moments; use "
                "differentiable=False)"
            )


class AdamW8bit(LowBitAdamW):
    """AdamW with 8-bit moments: bitsandbytes' dynamic-tree maps, blocks of 256 (~2 bytes/param);
    the second moment's map has no zero code (``codecs.ZeroFreeCodec``, docs/design.md).

    Drop-in for ``torch.optim.AdamW``:
    ``AdamW8bit(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
    amsgrad=False, *, maximize=False, foreach=None, capturable=False, differentiable=False,
    fused=None, block_size=256, min_quant_size=4096, bf16_stochastic_round=False,
    master_weight_bits=None, backend=None)``: ``fused``/``foreach`` change nothing (the step
    is always fused), ``capturable=True``/``differentiable=True`` are refused.
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
    smallest positive value instead of 0 (``codecs.ZeroFreeCodec``, docs/design.md). Same
    arguments as ``AdamW8bit``."""

    exp_avg_format = FLOAT8
    exp_avg_sq_format = FLOAT8_NONZERO
class AdamWFactored4bit(LowBitAdamW):
    """AdamW with a 4-bit first moment and, for parameters with at least two dimensions, a
    factored second moment (lpmm's "4-bit Factor"): per-row and per-column float32
    statistics of the ``(rows, last dim)`` view, as Adafactor keeps (``FactoredState``,
    ``lowbit_optim.step.factored``), about half a byte per parameter. One-dimensional parameters,
    and those whose factors would cost more than half a byte per element, keep
    ``AdamW4bit``'s 4-bit second moment. Same arguments as ``AdamW4bit``; ``amsgrad`` is not
    supported (the maximum of a factored moment is not the factored maximum). Under FSDP2 each
    rank keeps its rows' statistics and every column's, the columns summed across ranks each
    step (docs/distributed.md). See docs/usage.md for when not to use it.
    """

    exp_avg_format = AdamW4bit.exp_avg_format
    exp_avg_sq_format = AdamW4bit.exp_avg_sq_format

    @classmethod
    def is_factored(cls, param, group, key):
        if key != "exp_avg_sq" or param.dim() < 2 or not cls.is_quantized(param, group):
            return False
        rows, columns = factor_shape(param.shape)
        # The factors cost 4 * (rows + columns) bytes; worth it only below the 4-bit map's
        # half byte per element (a conv weight's last dim of 3 would cost 1.3 bytes/element).
        return 8 * (rows + columns) <= param.numel()

    @classmethod
    def amsgrad_refusal(cls):
        return "the maximum of a factored second moment is not itself factored"

    def _check_group(self, group):
        super()._check_group(group)
        if group["amsgrad"]:
            raise ValueError(
                f"Invalid amsgrad: True ({type(self).__name__} does not support amsgrad: "
                f"{self.amsgrad_refusal()})"
            )

    def _check_param(self, param):
        super()._check_param(param)
        check_rows_sharded(param, type(self).__name__)


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
