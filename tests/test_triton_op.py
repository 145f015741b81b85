"""``torch.ops.lowbit_optim.triton_rule_step``, the Triton kernel family's op, under the
interpreter on CPU: each rule by name against the optimizer's compiled step, the op inside a
compiled function, and what it refuses.

Bounds (tests/kernel_helpers.py, tests/test_triton_rules.py): block scales identical, a code
one map step at most and only next to a bin edge; parameters bit for bit where the rule's
piece computes them operation for operation as its ``update`` (Lion), else within the
kernel's documented bounds (AdamW/Adam: one ulp plus ``UPDATE_RELATIVE`` of the update;
AdEMAMix: ``AdEMAMIX_CHANGE_RMSE``).
"""

import pytest
import torch
from conftest import relative_rmse, slow_except

from lowbit_optim import QuantizedState
from lowbit_optim.formats.catalog import get_format
from lowbit_optim.step.chunks import RuleEntry, TailScratch
from lowbit_optim.step.hyperparams import GroupScalars, StepOptions
from lowbit_optim.step.rule_step import RulePlan
from lowbit_optim.step.rules import RULES
from lowbit_optim.step.rules.lion import LION

pytest.importorskip("triton")
from kernel_helpers import (  # noqa: E402
    AdEMAMIX_CHANGE_RMSE,
    assert_params_close,
    assert_states_equal,
    gradient,
    hyper_tensors,
    kernel_step,
    make_case,
    op_keywords,
)

from lowbit_optim.step.kernels.ops import stored_tensors  # noqa: E402

# NaN gradients (the non-finite policy) flow into the interpreter's numpy division before the
# kernel's selects put the old values back.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")

SIGNED, UNSIGNED = get_format("dynamic8-signed"), get_format("dynamic8-unsigned-nonzero")
# Per rule: a param group's values at each of two steps (the second changes the LR and betas:
# the kernel's constants, never its variant). Adam runs with amsgrad: its third moment.
GROUPS = {
    "adamw": [dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1),
              dict(lr=5e-3, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1)],
    "adam": [dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, amsgrad=True),
             dict(lr=5e-3, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=True)],
    "lion": [dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1),
             dict(lr=5e-3, betas=(0.8, 0.95), weight_decay=0.1)],
    "ademamix": [dict(lr=1e-2, betas=(0.9, 0.99, 0.999), alpha=5.0, eps=1e-8, weight_decay=0.1, t_alpha=2,
                      t_beta3=2),
                 dict(lr=5e-3, betas=(0.8, 0.95, 0.99), alpha=4.0, eps=1e-8, weight_decay=0.1, t_alpha=2,
                      t_beta3=2)],
}


def rule_entries(rule, keys, numels):
    """Float32 parameters with random 8-bit moments ``keys`` (of ``rule``), one step count."""
    step, entries = torch.zeros(()), []
    for numel in numels:
        moments = tuple(QuantizedState.from_float(
            torch.randn(numel) * 0.1 if rule.moment(key).signed else torch.rand(numel) * 0.01,
            SIGNED if rule.moment(key).signed else UNSIGNED, 256) for key in keys)
        entries.append(RuleEntry(torch.randn(numel), None, moments, step))
    return entries


@pytest.mark.usefixtures("interpreter")
# AdamW and Lion in the fast tier: Adam (amsgrad) and AdEMAMix compile graphs of their own.
@pytest.mark.parametrize("name", slow_except(list(GROUPS), "adamw", "lion"))
def test_op_steps_each_rule_by_name_as_the_compiled_step(name):
    """Two steps of two parameters (300: an aligned body and a tail; 100: one partial block),
    NaN and inf gradients, the op against the optimizer's compiled step from equal states."""
    rule = RULES[name]
    keys = rule.moment_keys(GROUPS[name][0])
    entries = rule_entries(rule, keys, (300, 100))
    reference_count = entries[0].step.clone()
    reference = [RuleEntry(e.param.clone(), None, tuple(m.clone() for m in e.moments), reference_count)
                 for e in entries]
    compiled = RulePlan(rule, reference, "compile")
    scalars = GroupScalars(rule)
    options = StepOptions(False, False, decoupled_weight_decay=name != "adam")
    for step, group in enumerate(GROUPS[name], start=1):
        scalars.refresh({key: value for key, value in group.items() if key != "amsgrad"})
        entries[0].step.fill_(step)  # every entry's
        reference_count.fill_(step)
        grads = [gradient(e.param.numel(), torch.float32) for e in entries]
        before = [e.param.clone() for e in reference]
        moments = stored_tensors(m for e in entries for m in e.moments)
        torch.ops.lowbit_optim.triton_rule_step(
            [e.param for e in entries], grads, moments, [],
            rule=name, scalars=[getattr(scalars, key) for key in rule.scalar_names], step=entries[0].step,
            formats=[m.format_name for m in entries[0].moments])
        compiled.run(grads, scalars, options, TailScratch())
        for index, (entry, ref, start) in enumerate(zip(entries, reference, before)):
            label = f"{name}, param {index}, step {step}"
            assert_states_equal(entry.moments, ref.moments, label)
            if name == "lion":
                assert torch.equal(entry.param, ref.param), label
            elif name == "ademamix":
                change = relative_rmse(entry.param - start, ref.param - start)
                assert change < AdEMAMIX_CHANGE_RMSE, f"{label}: relative RMSE of the change {change:.3g}"
            else:
                decay = 1 - group["lr"] * group["weight_decay"] if name == "adamw" else 1.0
                update = ref.param.double() - start.double() * decay
                assert_params_close(entry.param, ref.param, label, update=update)
            assert not torch.equal(entry.param, start), f"{label}: nothing moved"
        # From equal states at the next step, so one code at a bin edge does not compound.
        for entry, ref in zip(entries, reference):
            entry.param.copy_(ref.param)
            for moment, ref_moment in zip(entry.moments, ref.moments):
                moment.codes.copy_(ref_moment.codes)
                moment.scales.copy_(ref_moment.scales)


@pytest.mark.usefixtures("interpreter")
def test_op_in_a_compiled_function_takes_a_new_learning_rate_without_recompiling(compile_counter):
    """The fake implementation lets a compiled function (fullgraph, Inductor) call the op; the
    hyperparameters are 0-d CPU tensors, so a new LR is new data for the one graph. Each call
    equals the eager op's bit for bit, and Inductor re-inplaces the op's mutations: a call
    clones nothing (aot_eager's functionalised graph cloned the parameter, codes and scales)."""
    param, states = make_case(700, "8bit", torch.float32)
    eager_param, eager_states = param.clone(), [s.clone() for s in states]
    formats = [s.format_name for s in states]

    def step(param, grad, moments, scalars, step_count):
        torch.ops.lowbit_optim.triton_rule_step([param], [grad], moments, [], rule="adamw", scalars=scalars,
                                                step=step_count, formats=formats)

    compiled = torch.compile(step, fullgraph=True)
    with compile_counter() as counter:
        for step_count, lr in enumerate((1e-3, 3e-3), start=1):
            grad = gradient(700, torch.float32)
            hyper = hyper_tensors(lr, (0.9, 0.999), 0.01, step_count)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                compiled(param, grad, stored_tensors(states), list(hyper[:5]), hyper[5])
            kernel_step([(eager_param, grad, eager_states)], hyper)
            assert torch.equal(param, eager_param), f"step {step_count}"
            for state, eager_state in zip(states, eager_states):
                assert torch.equal(state.codes, eager_state.codes)
                assert torch.equal(state.scales, eager_state.scales)
            if step_count == 2:
                assert not any(event.name == "aten::clone" for event in prof.events())
    assert counter.graphs == 1


def test_op_refuses_bad_input_before_any_change(monkeypatch):
    param, states = make_case(300, "8bit", torch.float32)
    grad = torch.randn(300)
    hyper = hyper_tensors(1e-3, (0.9, 0.999), 0.0, 1)
    keywords = op_keywords(hyper, [s.format for s in states])
    moments = stored_tensors(states)
    before = [param.clone(), *(t.clone() for t in moments)]
    op = torch.ops.lowbit_optim.triton_rule_step

    def refused(match, params=(param,), grads=(grad,), tensors=moments, **changed):
        with pytest.raises(ValueError, match=match):
            op(list(params), list(grads), list(tensors), [], **(keywords | changed))

    refused("Unknown update rule 'sgd'", rule="sgd")
    formats = keywords["formats"]
    refused("the 'ademamix' rule takes 9 scalars", rule="ademamix", formats=[formats[0], *formats])
    lion = dict(rule="lion", formats=formats[:1], scalars=[hyper[0], hyper[1], hyper[2], hyper[4]])
    refused("the 'lion' rule keeps 1 \\(exp_avg\\) moments: got 2 formats", **(lion | dict(formats=formats)))
    refused("the 'adamw' rule keeps 2 .* or 3 .* moments: got 1 formats", formats=formats[:1])
    refused("Unknown quantization format 'dynamic9'", formats=["dynamic9", formats[1]])
    refused("must be a 1-element CPU tensor", scalars=[torch.tensor([1e-3, 2e-3]), *hyper[1:5]])
    refused("step must be a 1-element CPU tensor", step=torch.ones(2))
    refused("do not fit a parameter", params=[torch.zeros(600)])
    refused("one entry per parameter", grads=[])
    refused("one entry per parameter", tensors=moments[:3])
    refused("must be contiguous", params=[torch.zeros(2, 150).t()])
    monkeypatch.setattr(LION, "kernel_update", None)
    refused("the 'lion' update rule has no Triton piece", tensors=moments[:2], **lion)
    # Built around QuantizedState's own check, which refuses block size 48 too: the op is
    # public and checks what reaches it (with the one block-size rule, formats.catalog).
    odd = [QuantizedState(torch.zeros(7, 48 // fmt.codes_per_byte, dtype=torch.uint8), torch.zeros(7),
                          fmt.name, torch.Size([300]), torch.float32) for fmt in (SIGNED, UNSIGNED)]
    refused("Invalid block_size: 48", tensors=stored_tensors(odd))
    for tensor, saved in zip([param, *moments], before):
        assert torch.equal(tensor, saved)


def test_op_schema_takes_tensor_lists_positionally_and_the_rest_by_keyword():
    """torch's ``_fused_adamw_`` shape: at most six positional arguments, all tensor lists, the
    mutated ones among them (Inductor passes keyword-only mutated lists positionally)."""
    arguments = torch.ops.lowbit_optim.triton_rule_step.default._schema.arguments
    positional = [a for a in arguments if not a.kwarg_only]
    assert [a.name for a in positional] == ["params", "grads", "moments", "weight_corrections"]
    assert all(str(a.type) == "List[Tensor]" for a in positional)
    assert all(a.alias_info is None or not a.alias_info.is_write for a in arguments if a.kwarg_only)
