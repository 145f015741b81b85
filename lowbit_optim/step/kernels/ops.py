"""The Triton kernel family's torch op: ``torch.ops.lowbit_optim.triton_rule_step``, one quantized
step of any update rule that supplies a Triton piece (``rules.base.UpdateRule.kernel_update``),
in place, in one launch (two where some tensors are not 16-byte aligned). Importing this module
registers it (``step.kernels`` does not import it: the op takes a rule by name from
``step.rules.RULES``, and the rules import the step machinery that imports ``step.kernels``).

Being a library op with a fake implementation, it can sit inside ``torch.compile``d code: the
compiler sees an opaque in-place op instead of tracing into Triton's launcher. Its shape is
torch's ``_fused_adamw_``: the tensor lists positional, everything else keyword-only. The
rule's hyperparameters are 0-d CPU tensors, read on the host with ``.item()`` (no device sync:
they never left the CPU) and passed to the kernel as runtime scalars, so a schedule neither
recompiles anything nor copies anything to the device.

The optimizer's own step does not call the op: ``rule_step.RulePlan`` keeps a
``group_plan.KernelGroupPlan`` between steps, which works the launches out once. The op works
them out at every call (layouts cached by address, ``layout.get_layout``), for callers that
step their own tensors from their own compiled code (docs/triton.md).
"""

import types

import torch
from torch import Tensor

from lowbit_optim.formats.catalog import QuantFormat, get_format
from lowbit_optim.step.hyperparams import HYPER_DTYPE
from lowbit_optim.step.kernels import launcher
from lowbit_optim.step.kernels.group_plan import host_float
from lowbit_optim.step.rules import rule_named
from lowbit_optim.step.rules.base import UpdateRule

# The op's schema (torch.library.custom_op refuses keyword-only tensors, so it is defined from
# its schema). ``moments`` holds, per parameter in turn, each of its moments' codes and scales
# in the rule's order: ``[codes, scales of param 0's moment 0, codes, scales of its moment 1,
# ..., then param 1's]`` (``stored_tensors``). Only non-mutated tensors are keyword-only:
# Inductor (torch 2.13) passes keyword-only mutated lists positionally when it calls the op.
_SCHEMA = (
    "triton_rule_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] moments, "
    "Tensor(c!)[] weight_corrections, *, str rule, Tensor[] scalars, Tensor step, str[] formats, "
    "bool maximize=False, bool stochastic_round=False, int? seed=None) -> ()"
)
_LIBRARY = torch.library.Library("lowbit_optim", "FRAGMENT")
_LIBRARY.define(_SCHEMA)


def stored_tensors(states) -> list[Tensor]:
    """The op's ``moments`` list from ``QuantizedState``s given per parameter in turn, each
    parameter's in its rule's order: every state's codes and scales in turn."""
    return [tensor for state in states for tensor in (state.codes, state.scales)]


def _kernel_rule(name: str) -> UpdateRule:
    """The rule ``rules.RULES`` names ``name``, refused unless it has a Triton piece."""
    rule = rule_named(name)
    if rule.kernel_update is None:
        raise ValueError(f"the {name!r} update rule has no Triton piece (UpdateRule.kernel_update): "
                         "its quantized step runs through the compiled step only")
    return rule


def _moment_formats(rule: UpdateRule, name: str, formats: list[str]) -> tuple[QuantFormat, ...]:
    """``formats`` (one per moment the parameters keep, in the rule's order) as formats, refused
    unless they are as many as the rule's moments (with or without its amsgrad-only ones)."""
    keys = rule.all_moment_keys
    always = tuple(spec.key for spec in rule.moments if not spec.amsgrad_only)
    if len(formats) not in (len(always), len(keys)):
        expected = " or ".join(dict.fromkeys(f"{len(k)} ({', '.join(k)})" for k in (always, keys)))
        raise ValueError(f"the {name!r} rule keeps {expected} moments: got {len(formats)} formats "
                         f"{list(formats)}")
    return tuple(map(get_format, formats))


def _rule_scalars(rule: UpdateRule, name: str, scalars: list[Tensor]) -> types.SimpleNamespace:
    """``scalars`` (the rule's ``scalar_names``' values, in that order) under those names, as
    float64 0-d CPU tensors: the optimizer's ``hyperparams.GroupScalars``, which the rule's
    ``step_constants`` reads."""
    names = rule.scalar_names
    if len(scalars) != len(names):
        raise ValueError(f"the {name!r} rule takes {len(names)} scalars ({', '.join(names)}): got "
                         f"{len(scalars)}")
    for scalar_name, value in zip(names, scalars):
        host_float(scalar_name, value)  # refuses a device or multi-element tensor
    return types.SimpleNamespace(**{scalar_name: value.detach().reshape(()).to(HYPER_DTYPE)
                                    for scalar_name, value in zip(names, scalars)})


@torch.library.impl("lowbit_optim::triton_rule_step", "CompositeExplicitAutograd", lib=_LIBRARY)
def triton_rule_step(
    params: list[Tensor], grads: list[Tensor], moments: list[Tensor], weight_corrections: list[Tensor], *,
    rule: str, scalars: list[Tensor], step: Tensor, formats: list[str], maximize: bool = False,
    stochastic_round: bool = False, seed: int | None = None,
) -> None:
    """One quantized step of the update rule named ``rule`` (``rules.RULES``: ``"adamw"``,
    ``"adam"`` for torch.optim.Adam's L2 weight decay, ``"lion"``, ``"ademamix"``) for every
    parameter given, in place.

    ``params`` (contiguous, one dtype) and ``grads`` (one dtype) pair up with their moments'
    codes and scales in ``moments`` (per parameter in turn, each moment in the rule's order:
    ``stored_tensors``), stored in ``formats`` (format names, one per moment: AdamW's third,
    ``max_exp_avg_sq``, turns amsgrad on); ``weight_corrections`` is empty unless the
    parameters keep master weights (bfloat16 or float16 parameters' corrections,
    ``step.master_weights``: contiguous, all int8 or all int16; the step updates parameter and
    correction together). ``scalars``: the rule's ``scalar_names`` values (AdamW's ``lr``,
    ``beta1``, ``beta2``, ``eps``, ``weight_decay``), 1-element CPU tensors, read as float64.
    All parameters share the step count ``step`` (already advanced). ``seed`` (bfloat16
    stochastic rounding only): the noise seed, e.g. from ``stochastic_round_seed`` and a
    counter the caller keeps; ``None`` draws one from torch's CPU generator (which that
    consumes). Bad input is refused before anything is written.
    """
    update_rule = _kernel_rule(rule)
    fmts = _moment_formats(update_rule, rule, formats)
    group_scalars = _rule_scalars(update_rule, rule, scalars)
    host_float("step", step)
    count = len(fmts)
    if (len(grads) != len(params) or len(moments) != 2 * count * len(params)
            or len(weight_corrections) not in (0, len(params))):
        raise ValueError(
            f"every tensor list must have one entry per parameter ({len(params)}; moments: codes and scales "
            f"of each of the {count} moments per parameter; weight_corrections: none or one per parameter): "
            f"got {len(grads)} grads, {len(moments)} moment tensors, {len(weight_corrections)} corrections")
    if not params:
        return
    pairs = [[(moments[2 * (index * count + slot)], moments[2 * (index * count + slot) + 1])
              for index in range(len(params))] for slot in range(count)]
    block_size = pairs[0][0][0].shape[-1] * fmts[0].codes_per_byte
    for index, param in enumerate(params):
        _check_state(param, [pair[index] for pair in pairs], block_size, fmts)
    if any(not p.is_contiguous() for p in params):
        raise ValueError("params must be contiguous (the optimizer steps non-contiguous ones through "
                         "contiguous buffers, group_plan.KernelGroupPlan)")
    if not (stochastic_round and params[0].dtype == torch.bfloat16):
        seed = 0
    elif seed is None:
        # From torch's CPU generator, so torch.manual_seed makes runs repeatable.
        seed = int(torch.randint(2**31 - 1, ()))
    elif not 0 <= seed < 2**31:
        raise ValueError(f"seed must be in [0, 2**31) (got {seed})")
    constants = update_rule.kernel_constants(update_rule.step_constants(group_scalars, step.reshape(())))
    update = launcher.KernelUpdate(update_rule.kernel_update, update_rule.kernel_variant(group_scalars))
    launcher.launch(
        params, grads, pairs, tuple(constants), update=update, formats=fmts, block_size=block_size,
        maximize=maximize, stochastic_round=stochastic_round, seed=seed,
        weight_corrections=weight_corrections or None,
    )


@torch.library.register_fake("lowbit_optim::triton_rule_step", lib=_LIBRARY)
def _(params, grads, moments, weight_corrections, **options):
    return None


def _check_state(param, codes_and_scales, block_size, formats) -> None:
    num_blocks = -(-param.numel() // block_size)
    for (codes, scales), fmt in zip(codes_and_scales, formats):
        expected = (num_blocks, block_size // fmt.codes_per_byte)
        if tuple(codes.shape) != expected or codes.dtype != torch.uint8:
            raise ValueError(f"codes of shape {tuple(codes.shape)} ({codes.dtype}) do not fit a parameter "
                             f"of {param.numel()} elements in {fmt.name}: {expected} uint8 expected")
        if tuple(scales.shape) != (num_blocks,) or scales.dtype != torch.float32:
            raise ValueError(f"scales of shape {tuple(scales.shape)} ({scales.dtype}) do not fit: "
                             f"({num_blocks},) float32 expected")
        if codes.device != param.device or scales.device != param.device:
            raise ValueError(f"state on {codes.device} does not match parameter on {param.device}")
