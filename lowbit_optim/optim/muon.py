"""Muon with low-bit momentum (``step.rules.muon``): ``Muon8bit`` and ``Muon4bit``, one optimizer
for a whole model, with ``torch.optim.Muon``'s arguments and defaults. Each param group runs
either the Muon rule (``use_muon=True``: 2-D hidden weights) or the low-bit AdamW rule
(embeddings, the output head, 1-D and other parameters), as ``muon_split.muon_param_groups``
splits them by default. docs/muon.md has the formats' measured accuracy and the split."""

import torch

from lowbit_optim.formats.catalog import (
    DYNAMIC_4BIT_SIGNED,
    DYNAMIC_8BIT_SIGNED,
    DYNAMIC_8BIT_UNSIGNED_NONZERO,
    LINEAR_4BIT_NONZERO,
    NORMAL_4BIT_SIGNED,
    QuantFormat,
)
from lowbit_optim.optim.base import LowBitOptimizer
from lowbit_optim.optim.muon_split import muon_param_groups
from lowbit_optim.step.newton_schulz import NS_COEFFICIENTS
from lowbit_optim.step.rules.adamw import ADAMW
from lowbit_optim.step.rules.muon import MUON

# The hyperparameters an AdamW group holds; a group's ``adamw_<key>`` stands for them.
ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")


class _LowBitMuon(LowBitOptimizer):
    rule = MUON
    momentum_format: QuantFormat

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=NS_COEFFICIENTS, *, eps=1e-7, ns_steps=5, adjust_lr_fn=None,
                 adamw_lr=None, adamw_betas=(0.9, 0.95), adamw_eps=1e-8, adamw_weight_decay=None,
                 maximize=False, block_size=None, min_quant_size=4096, bf16_stochastic_round=False,
                 master_weight_bits=None, backend=None):
        # ``block_size=None``: each part's own default, the momentum format's for Muon groups
        # (Muon4bit: 64, which its accuracy needs) and the AdamW formats' for the rest.
        self.muon_defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                  ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                                  adjust_lr_fn=adjust_lr_fn,
                                  block_size=self.momentum_format.default_block_size if block_size is None
                                  else block_size)
        self.adamw_defaults = dict(
            lr=lr if adamw_lr is None else adamw_lr, betas=adamw_betas, eps=adamw_eps,
            weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay)
        # Both checked before any group is made, so a bad value is refused by name even where
        # no group takes that rule.
        MUON.check_hyperparameters(self.muon_defaults)
        ADAMW.check_hyperparameters(self.adamw_defaults)
        defaults = self._defaults({}, maximize=maximize, block_size=block_size, min_quant_size=min_quant_size,
                                  bf16_stochastic_round=bf16_stochastic_round,
                                  master_weight_bits=master_weight_bits)
        super().__init__(muon_param_groups(params), defaults, backend=backend)

    def __getstate__(self):
        return {**super().__getstate__(), "muon_defaults": self.muon_defaults,
                "adamw_defaults": self.adamw_defaults}

    # --- groups: each takes one rule ------------------------------------------------------
    @classmethod
    def rule_of(cls, group: dict):
        return MUON if group.get("use_muon", True) else ADAMW

    @classmethod
    def all_moment_keys(cls) -> tuple[str, ...]:
        return MUON.all_moment_keys + ADAMW.all_moment_keys

    @classmethod
    def moment_format(cls, key: str) -> QuantFormat:
        if key == "momentum_buffer":
            return cls.momentum_format
        return cls.signed_format if ADAMW.moment(key).signed else cls.unsigned_format

    def _group_with_defaults(self, group: dict) -> dict:
        """``group`` (with ``use_muon``) completed with its rule's defaults. An AdamW group's
        ``adamw_lr``, ``adamw_betas``, ``adamw_eps``, ``adamw_weight_decay`` (a group split from
        one that had them) stand for its ``lr``, ``betas``, ``eps``, ``weight_decay``; a Muon
        group drops them."""
        own = {k: v for k, v in group.items() if not k.startswith("adamw_")}
        if group["use_muon"]:
            return {**self.muon_defaults, **own}
        renamed = {key: group[f"adamw_{key}"] for key in ADAMW_KEYS if f"adamw_{key}" in group}
        return {**self.adamw_defaults, **own, **renamed}

    def add_param_group(self, param_group: dict) -> None:
        """A group with ``use_muon`` joins as given (completed with its rule's defaults); one
        without it is split first (``muon_param_groups``). Every part is checked before any
        joins; ``use_muon=True`` with a parameter that is not 2-D is refused, as
        torch.optim.Muon refuses it."""
        parts = [self._group_with_defaults(part) for part in muon_param_groups([param_group])]
        for part in parts:
            self._check_group({**self.defaults, **part})
            for entry in part["params"]:
                param = entry[1] if isinstance(entry, tuple) else entry
                if not isinstance(param, torch.Tensor):
                    continue  # torch refuses it, with its own message
                self._check_param(param)
                if part["use_muon"] and param.dim() != 2:
                    name = f" ({entry[0]!r})" if isinstance(entry, tuple) else ""
                    raise ValueError(f"Muon only supports 2D parameters whereas we found a parameter"
                                     f"{name} with size: {param.size()} (give it use_muon=False)")
        self._refuse_duplicates([entry for part in parts for entry in part["params"]])
        for part in parts:
            super().add_param_group(part)

    def _fill_group_options(self, group: dict) -> None:
        super()._fill_group_options(group)
        group.setdefault("use_muon", "momentum" in group)

    def _check_group(self, group: dict) -> None:
        if not isinstance(group.get("use_muon"), bool):
            raise ValueError(f"Invalid use_muon: {group.get('use_muon')!r} (a bool is needed)")
        super()._check_group(group)


class Muon8bit(_LowBitMuon):
    """``torch.optim.Muon`` for a whole model, with 8-bit state: Muon's momentum in the signed
    8-bit dynamic map, blocks of 256 (1.016 bytes/param), and ``AdamW8bit`` (2 bytes/param)
    for the parameters Muon is not for.

    ``Muon8bit(params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
    ns_coefficients=(3.4445, -4.775, 2.0315), *, eps=1e-7, ns_steps=5, adjust_lr_fn=None,
    adamw_lr=None, adamw_betas=(0.9, 0.95), adamw_eps=1e-8, adamw_weight_decay=None,
    maximize=False, block_size=256, min_quant_size=4096, bf16_stochastic_round=False,
    master_weight_bits=None, backend=None)``: torch.optim.Muon's arguments and defaults (its
    last three keyword-only here: the package's functions take at most six positional
    arguments), then the AdamW part's (``None``: the same as ``lr``, ``weight_decay``) and the
    storage options every class of the package takes.

    ``params``: a module, ``named_parameters()``, parameters or param-group dicts. A group
    with ``use_muon`` runs the rule it says (``True`` needs 2-D parameters); everything else is
    split by ``lowbit_optim.muon_param_groups``: 2-D parameters take Muon except embeddings
    (and weights tied to them) and the output head (Linear layers named ``lm_head``, ``head``,
    ``output``, ``classifier``, ``score``), which take AdamW with the 1-D ones. Bare parameters
    are split by their number of dimensions only: pass the module or its named parameters for
    the embedding and head split. Muon groups hold torch.optim.Muon's keys, AdamW groups
    ``lr``, ``betas``, ``eps``, ``weight_decay``: an AdamW part takes its group's ``adamw_lr``
    (``adamw_betas``, ...) if given, else the group's ``lr`` (...), else the constructor's
    ``adamw_*`` values; a Muon part takes its group's values, else the constructor's. One
    scheduler drives both (each group's ``lr``). State: ``momentum_buffer`` (Muon) or
    ``exp_avg``/``exp_avg_sq`` (AdamW), and ``step``, quantized from ``min_quant_size``
    elements up, float32 below.
    """

    momentum_format = DYNAMIC_8BIT_SIGNED
    signed_format = DYNAMIC_8BIT_SIGNED
    unsigned_format = DYNAMIC_8BIT_UNSIGNED_NONZERO


class Muon4bit(_LowBitMuon):
    """``Muon8bit`` with 4-bit state: Muon's momentum in NF4 (normal quantiles), blocks of 64
    (0.5625 bytes/param), and ``AdamW4bit`` (blocks of 128) for the rest. Same arguments;
    ``block_size`` given sets both parts' blocks."""

    momentum_format = NORMAL_4BIT_SIGNED
    signed_format = DYNAMIC_4BIT_SIGNED
    unsigned_format = LINEAR_4BIT_NONZERO
