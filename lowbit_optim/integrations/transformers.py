"""Hugging Face ``Trainer``: select our optimizers with ``optim="lowbit_adamw_4bit"``.

    from lowbit_optim.integrations.transformers import register
    register()
    args = TrainingArguments(..., optim="lowbit_adamw_4bit", optim_args="block_size=128")

``"lowbit_muon_8bit"`` and ``"lowbit_muon_4bit"`` (``Muon8bit``, ``Muon4bit``) split the model
themselves: Muon for the hidden 2-D weights, the low-bit AdamW for embeddings, the output head
and 1-D parameters (``muon_param_groups``), with Trainer's weight decay rule (none on biases and
norms) and one learning rate for both parts (``adjust_lr_fn="match_rms_adamw"``); their
``_offload`` variants step them on the host.

Each AdamW, Lion and AdEMAMix name has an ``_offload`` variant (``"lowbit_adamw_8bit_offload"``,
``"lowbit_adamw_4bit_offload"``, ``"lowbit_adamw_4bit_factored_offload"``,
``"lowbit_adamw_fp8_offload"``, ...) that trains with the state and the step on the host
(``CPUOffloadOptimizer``, docs/offload.md); their ``optim_args`` also take
``offload_gradients=true``.

transformers has no public registry of optimizer names. ``TrainingArguments`` converts
``optim`` into a member of the ``OptimizerNames`` enum (an unknown string raises), and
``Trainer.get_optimizer_cls_and_kwargs`` looks that member up in the handler table
``transformers.trainer_optimizer._OPTIMIZER_HANDLERS`` (added by huggingface/transformers#43738),
where each handler maps an ``OptimizerContext`` to ``(optimizer class, kwargs)``.
``register()`` touches exactly two things, both additively, and changes nothing already there:

1. ``transformers.training_args.OptimizerNames`` gets one member per name below, stored the
   way ``enum`` stores members it creates (``_member_map_``, ``_value2member_map_``,
   ``_member_names_`` and a class attribute), so ``OptimizerNames("lowbit_adamw_4bit")``,
   iteration (``HfArgumentParser``'s ``--optim`` choices) and ``TrainingArguments.to_dict()``
   treat it like a built-in name;
2. ``_OPTIMIZER_HANDLERS`` (the same dict object ``transformers.trainer`` imports) gets one
   handler per name.

Nothing is monkeypatched: no transformers function or class is replaced. On a transformers
without the handler table (before #43738) ``register()`` raises ``RuntimeError`` naming the
routes that need no registration (``Trainer(optimizer_cls_and_kwargs=...)``).
"""

import enum

from lowbit_optim.offload.optimizer import CPUOffloadOptimizer
from lowbit_optim.optim.adamw import AdamW4bit, AdamW8bit, AdamWFactored4bit, AdamWFp8
from lowbit_optim.optim.ademamix import AdEMAMix4bit, AdEMAMix8bit
from lowbit_optim.optim.lion import Lion4bit, Lion8bit
from lowbit_optim.optim.muon import Muon4bit, Muon8bit
from lowbit_optim.optim.muon_split import muon_param_groups

# optim name -> optimizer class. Names carry the "lowbit_" prefix: transformers already uses
# "adamw_8bit" (bitsandbytes) and "adamw_torch_4bit" (torchao).
OPTIMIZERS = {
    "lowbit_adamw_8bit": AdamW8bit,
    "lowbit_adamw_4bit": AdamW4bit,
    "lowbit_adamw_4bit_factored": AdamWFactored4bit,
    "lowbit_adamw_fp8": AdamWFp8,
    "lowbit_lion_8bit": Lion8bit,
    "lowbit_lion_4bit": Lion4bit,
    "lowbit_ademamix_8bit": AdEMAMix8bit,
    "lowbit_ademamix_4bit": AdEMAMix4bit,
}

# optim name -> the optimizer class that CPUOffloadOptimizer steps on the host: every class
# above, as "<name>_offload" (tests/test_offload.py checks each against the same class without
# offload, bit for bit).
OFFLOAD_OPTIMIZERS = {f"{name}_offload": optimizer_cls for name, optimizer_cls in OPTIMIZERS.items()}

# optim name -> Muon class: its handler gives Trainer the model's Muon/AdamW split as ``params``.
MUON_OPTIMIZERS = {
    "lowbit_muon_8bit": Muon8bit,
    "lowbit_muon_4bit": Muon4bit,
}
# The same classes stepped on the host by CPUOffloadOptimizer (the split is made on the model's
# parameters before they are offloaded).
MUON_OFFLOAD_OPTIMIZERS = {f"{name}_offload": cls for name, cls in MUON_OPTIMIZERS.items()}
# Muon's step size scaled so that its update's RMS matches AdamW's: TrainingArguments has one
# learning_rate, and with this scale AdamW's suits both parts ("Muon is Scalable for LLM
# Training", arXiv 2502.16982, which trains Moonlight with one LR this way).
TRAINER_ADJUST_LR_FN = "match_rms_adamw"

_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


def _parse_int(value: str) -> int:
    return int(value, 10)


def _parse_bool(value: str) -> bool:
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ValueError(f"expected one of {_TRUE + _FALSE}")


def _parse_optional_string(value: str) -> str | None:
    return None if value.lower() == "none" else value


# The constructor options that TrainingArguments has no field for. lr, betas, eps and
# weight_decay come from learning_rate, adam_beta1/2, adam_epsilon and weight_decay.
OPTIM_ARGS = {
    "block_size": ("an int", _parse_int),
    "min_quant_size": ("an int", _parse_int),
    "bf16_stochastic_round": ("a bool (true/false)", _parse_bool),
    "master_weight_bits": ("24 or 32", _parse_int),
    "backend": ('"compile", "eager" or "none"', _parse_optional_string),
}
# Each update rule's own options, with transformers' names for bitsandbytes' AdEMAMix
# ("optim_args='beta3=0.9999,alpha=8,t_alpha=10000,t_beta3=10000'").
RULE_OPTIM_ARGS = {
    "adamw": {"amsgrad": ("a bool (true/false)", _parse_bool)},
    "lion": {},
    "ademamix": {"beta3": ("a float", float), "alpha": ("a float", float),
                 "t_alpha": ("an int", _parse_int), "t_beta3": ("an int", _parse_int)},
    # torch.optim.Muon's own; eps is Newton-Schulz's (adam_epsilon is the AdamW part's).
    "muon": {"momentum": ("a float", float), "nesterov": ("a bool (true/false)", _parse_bool),
             "ns_steps": ("an int", _parse_int), "eps": ("a float", float),
             "adjust_lr_fn": ('"original", "match_rms_adamw" or "none"', _parse_optional_string)},
}
OFFLOAD_OPTIM_ARGS = {**OPTIM_ARGS, "offload_gradients": ("a bool (true/false)", _parse_bool)}
# AdEMAMix's slow EMA when optim_args do not say (bitsandbytes' and transformers' default).
DEFAULT_BETA3 = 0.9999


def parse_optim_args(optim_args: dict[str, str], optim: str = "lowbit optimizer", *,
                     supported: dict = OPTIM_ARGS) -> dict:
    """Typed constructor kwargs from transformers' ``{key: string}`` parse of ``optim_args``.

    Raises ``ValueError`` naming the offending key (and value). Range checks (a block size
    that is not a power of two, ...) are the optimizer constructor's, with its wording.
    """
    kwargs = {}
    for key, value in optim_args.items():
        if key not in supported:
            raise ValueError(
                f"Unknown optim_args key {key!r} for optim={optim!r}; supported keys: "
                f"{', '.join(supported)}"
            )
        expected, parse = supported[key]
        try:
            kwargs[key] = parse(value)
        except ValueError as error:
            raise ValueError(
                f"Invalid optim_args value {key}={value!r} for optim={optim!r}: {expected} is needed"
            ) from error
    return kwargs


def _optimizer_kwargs(ctx, optimizer_cls, supported: dict) -> dict:
    """The constructor kwargs: lr, betas, eps and weight_decay as ``TrainingArguments`` gives
    them, in the shape the class's update rule takes (Lion: no eps; AdEMAMix: a third beta),
    then the typed ``optim_args``."""
    rule = optimizer_cls.rule.name
    kwargs = dict(ctx.optimizer_kwargs)  # {"lr": args.learning_rate}
    betas = (ctx.args.adam_beta1, ctx.args.adam_beta2)
    if rule == "adamw":
        kwargs.update(ctx.adam_kwargs)  # betas, eps
    elif rule == "lion":
        kwargs["betas"] = betas
    else:
        kwargs.update(betas=(*betas, DEFAULT_BETA3), eps=ctx.args.adam_epsilon)
    # Trainer's two param groups set their own weight_decay (args.weight_decay / 0.0);
    # this default serves callers that pass plain parameters.
    kwargs["weight_decay"] = ctx.args.weight_decay
    optim = getattr(ctx.args.optim, "value", ctx.args.optim)
    options = parse_optim_args(ctx.optim_args, optim, supported={**supported, **RULE_OPTIM_ARGS[rule]})
    if "beta3" in options:
        kwargs["betas"] = (*kwargs["betas"][:2], options.pop("beta3"))
    kwargs.update(options)
    return kwargs


def _make_handler(optimizer_cls):
    def handler(ctx):
        """transformers' handler protocol: ``OptimizerContext -> (class, kwargs)``."""
        return optimizer_cls, _optimizer_kwargs(ctx, optimizer_cls, OPTIM_ARGS)

    handler.__name__ = handler.__qualname__ = f"lowbit_optim_{optimizer_cls.__name__}_handler"
    handler.lowbit_optim_handler = True
    return handler


def _trainer_muon_groups(model, weight_decay: float) -> list[dict]:
    """The model's parameters that require gradients, in Trainer's two weight-decay groups
    (``weight_decay`` for the names ``Trainer.get_decay_parameter_names`` gives, 0.0 for the
    rest: biases and norms), each split into a Muon and an AdamW part by ``muon_param_groups``
    (which needs the module: embeddings and the head are 2-D too)."""
    from transformers import Trainer

    muon_ids = {id(param) for group in muon_param_groups(model) if group["use_muon"]
                for param in group["params"]}
    # A method that reads only its model argument (transformers 5.x): Trainer's own rule.
    decay_names = set(Trainer.get_decay_parameter_names(None, model))
    groups = []
    for decays in (True, False):
        for use_muon in (True, False):
            params = [param for name, param in model.named_parameters() if param.requires_grad
                      and (name in decay_names) == decays and (id(param) in muon_ids) == use_muon]
            if params:
                groups.append({"params": params, "use_muon": use_muon,
                               "weight_decay": weight_decay if decays else 0.0})
    return groups


def _make_muon_handler(optimizer_cls, *, offload: bool):
    def handler(ctx):
        """As the plain (or offload) handler, with the model's Muon/AdamW split as ``params``
        (which Trainer uses instead of its own groups)."""
        optim = getattr(ctx.args.optim, "value", ctx.args.optim)
        if ctx.model is None:
            raise ValueError(f"optim={optim!r} splits the model's parameters between Muon and AdamW, so it "
                             "needs the model: Trainer.get_optimizer_cls_and_kwargs(args, model)")
        args = ctx.args
        kwargs = dict(lr=args.learning_rate, weight_decay=args.weight_decay,
                      adjust_lr_fn=TRAINER_ADJUST_LR_FN, adamw_betas=(args.adam_beta1, args.adam_beta2),
                      adamw_eps=args.adam_epsilon)
        supported = {**(OFFLOAD_OPTIM_ARGS if offload else OPTIM_ARGS), **RULE_OPTIM_ARGS["muon"]}
        kwargs.update(parse_optim_args(ctx.optim_args, optim, supported=supported))
        kwargs["params"] = _trainer_muon_groups(ctx.model, args.weight_decay)
        if offload:
            return CPUOffloadOptimizer, {"optimizer_class": optimizer_cls, **kwargs}
        return optimizer_cls, kwargs

    kind = "offload_" if offload else ""
    handler.__name__ = handler.__qualname__ = f"lowbit_optim_{kind}{optimizer_cls.__name__}_handler"
    handler.lowbit_optim_handler = True
    return handler


def _make_offload_handler(optimizer_cls):
    def handler(ctx):
        """As the plain handler, with ``CPUOffloadOptimizer`` stepping ``optimizer_cls``."""
        kwargs = _optimizer_kwargs(ctx, optimizer_cls, OFFLOAD_OPTIM_ARGS)
        return CPUOffloadOptimizer, {"optimizer_class": optimizer_cls, **kwargs}

    handler.__name__ = handler.__qualname__ = f"lowbit_optim_offload_{optimizer_cls.__name__}_handler"
    handler.lowbit_optim_handler = True
    return handler


# Built once, so that a repeated register() puts back the very same functions.
_HANDLERS = {name: _make_handler(optimizer_cls) for name, optimizer_cls in OPTIMIZERS.items()}
_HANDLERS.update({name: _make_offload_handler(optimizer_cls)
                  for name, optimizer_cls in OFFLOAD_OPTIMIZERS.items()})
_HANDLERS.update({name: _make_muon_handler(optimizer_cls, offload=False)
                  for name, optimizer_cls in MUON_OPTIMIZERS.items()})
_HANDLERS.update({name: _make_muon_handler(optimizer_cls, offload=True)
                  for name, optimizer_cls in MUON_OFFLOAD_OPTIMIZERS.items()})


def _transformers_parts():
    """(OptimizerNames, handler table) of the installed transformers, or a clear error."""
    try:
        import transformers
        from transformers import trainer, trainer_optimizer
        from transformers.training_args import OptimizerNames
    except ImportError as error:
        raise ImportError(
            "lowbit_optim.integrations.transformers needs transformers: "
            "pip install 'lowbit-optim[hf]'"
        ) from error
    handlers = getattr(trainer_optimizer, "_OPTIMIZER_HANDLERS", None)
    problems = []
    if not isinstance(handlers, dict) or not hasattr(trainer_optimizer, "OptimizerContext"):
        problems.append("transformers.trainer_optimizer has no _OPTIMIZER_HANDLERS table")
    elif getattr(trainer, "_OPTIMIZER_HANDLERS", None) is not handlers:
        problems.append("Trainer does not read transformers.trainer_optimizer._OPTIMIZER_HANDLERS")
    enum_parts = ("_member_map_", "_value2member_map_", "_member_names_", "_member_type_")
    is_enum = isinstance(OptimizerNames, enum.EnumMeta)
    if not (is_enum and all(hasattr(OptimizerNames, part) for part in enum_parts)):
        problems.append("transformers.training_args.OptimizerNames is not a standard Enum")
    if problems:
        raise RuntimeError(
            f"lowbit_optim.integrations.transformers.register() cannot work with transformers "
            f"{transformers.__version__}: {'; '.join(problems)}. It needs the optimizer handler "
            "table that transformers.trainer_optimizer has since huggingface/transformers#43738 "
            "(tested with 5.24.0). Without registering, pass the optimizer yourself: "
            "Trainer(..., optimizer_cls_and_kwargs=(AdamW4bit, {'lr': ...})) or "
            "Trainer(..., optimizers=(optimizer, scheduler)); see docs/huggingface.md."
        )
    return OptimizerNames, handlers


def _add_member(enum_cls, name: str, value: str):
    """Add ``name = value`` to ``enum_cls`` as ``enum`` adds a member at class creation;
    return the existing member if the value is already there."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = enum_cls._member_type_.__new__(enum_cls, value)
    member._value_ = value
    member._name_ = name
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    # EnumMeta.__setattr__ refuses names already in _member_map_, so the attribute goes first.
    setattr(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def register() -> tuple[str, ...]:
    """Make ``TrainingArguments(optim=...)`` accept the names of ``OPTIMIZERS``
    (``"lowbit_adamw_8bit"``, ``"lowbit_adamw_4bit"``, ...) and the ``_offload`` variants
    (``OFFLOAD_OPTIMIZERS``) and the Muon names (``MUON_OPTIMIZERS``, ``MUON_OFFLOAD_OPTIMIZERS``).
    Idempotent; imports transformers. Call it before building ``TrainingArguments`` or an
    ``HfArgumentParser`` (the parser reads its ``--optim`` choices when it is built). Returns
    the names of ``OPTIMIZERS``; the other names are registered with them."""
    optimizer_names, handlers = _transformers_parts()
    for value in (*OPTIMIZERS, *OFFLOAD_OPTIMIZERS, *MUON_OPTIMIZERS, *MUON_OFFLOAD_OPTIMIZERS):
        existing = optimizer_names._value2member_map_.get(value)
        if existing is not None and existing in handlers and not getattr(
            handlers[existing], "lowbit_optim_handler", False
        ):
            raise RuntimeError(
                f"transformers already has an optimizer named {value!r}; not replacing it"
            )
        member = _add_member(optimizer_names, value.upper(), value)
        handlers[member] = _HANDLERS[value]
    return tuple(OPTIMIZERS)
