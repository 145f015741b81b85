"""The C++ kernel's functors declare the host values they read, in their order (``kConstants`` in
``csrc/rules/<name>.h``, returned by ``cpu_functor_constants``); Python passes each rule's
``step_constants`` NamedTuple, and ``cpu_kernel.check_functor_constants`` refuses a tuple whose
fields are not the functor's, in its order, before anything is stepped. Likewise a moment's encoder:
Python builds the kernel's row of float32 slots by the field names, widths and enum names the
kernel gives (``cpu_encoder_layout``), and refuses a kernel whose fields are not ``EncoderRow``'s."""

import types
from typing import NamedTuple

import pytest
import torch

from lowbit_optim import QuantizedState
from lowbit_optim.formats.catalog import FORMATS
from lowbit_optim.step import cpu_kernel
from lowbit_optim.step.rules.adamw import ADAMW, AdamWConstants
from lowbit_optim.step.rules.ademamix import ADEMAMIX
from lowbit_optim.step.rules.lion import LION, LionConstants
from lowbit_optim.step.rules.muon import MUON

RULES = [ADAMW, LION, ADEMAMIX, MUON]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if not cpu_kernel.load():
        pytest.skip("the C++ CPU step could not be built here")


def step_constants_of(rule):
    scalars = types.SimpleNamespace(**{name: torch.tensor(0.5, dtype=torch.float64)
                                       for name in rule.scalar_names})
    return [variant.step_constants(scalars, torch.tensor(3.0)) for variant in rule.variants()]


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.name)
def test_every_rule_functor_reads_its_step_constants_fields_in_their_order(rule):
    expected = cpu_kernel.functor_constants(rule.cpu_functor)
    assert expected  # a functor that reads nothing would make the comparison vacuous
    for constants in step_constants_of(rule):
        assert type(constants)._fields == expected
        cpu_kernel.check_functor_constants(rule.cpu_functor, type(constants))


def test_the_factored_functor_reads_adamws_step_constants():
    assert cpu_kernel.functor_constants("adamw_factored") == AdamWConstants._fields


def reordered(fields: tuple[str, ...]) -> tuple[str, ...]:
    return (fields[1], fields[0], *fields[2:])


@pytest.mark.parametrize("change", ["swapped", "one_missing", "one_extra"])
def test_constants_out_of_the_functors_order_are_refused_naming_both_orders(change):
    fields = LionConstants._fields
    changes = {"swapped": reordered(fields), "one_missing": fields[:-1], "one_extra": (*fields, "extra")}
    changed = changes[change]
    tuple_type = NamedTuple("LionConstants", [(name, torch.Tensor) for name in changed])
    with pytest.raises(RuntimeError, match="functor 'lion' reads the host values") as refusal:
        cpu_kernel.check_functor_constants("lion", tuple_type)
    assert str(list(fields)) in str(refusal.value) and str(list(changed)) in str(refusal.value)


def test_a_step_with_reordered_constants_is_refused_before_any_change():
    fmt = FORMATS["dynamic8-signed"]
    param = torch.linspace(-1, 1, 512)
    grad = torch.linspace(1, -1, 512)
    state = QuantizedState.zeros(param.shape, fmt, 256)
    state.codes.random_(0, 256, generator=torch.Generator().manual_seed(0))
    state.scales.fill_(0.5)
    before = param.clone(), state.codes.clone(), state.scales.clone()
    swapped = NamedTuple("LionConstants", [(name, torch.Tensor) for name in reordered(LionConstants._fields)])
    values = swapped(*(torch.tensor(v, dtype=torch.float64) for v in (0.9, 1e-2, 0.99, 0.0)))
    with pytest.raises(RuntimeError, match="functor 'lion'"):
        cpu_kernel.cpu_rule_step(param, grad, (state,), values, functor="lion",
                                 options=cpu_kernel.KernelOptions(False, False))
    assert all(torch.equal(a, b) for a, b in zip(before, (param, state.codes, state.scales)))
    # The same values in the functor's order step (a control: the refusal above is the order's).
    ordered = LionConstants(**values._asdict())
    cpu_kernel.cpu_rule_step(param, grad, (state,), ordered, functor="lion",
                             options=cpu_kernel.KernelOptions(False, False))
    assert not torch.equal(param, before[0])


def test_an_unknown_functor_is_refused_naming_the_known_ones():
    with pytest.raises(RuntimeError, match="no functor 'muon_typo' \\(it has adamw, lion, ademamix"):
        cpu_kernel.functor_constants("muon_typo")


def test_an_encoder_row_fills_the_kernels_slots_by_name():
    layout = cpu_kernel.encoder_layout()
    assert layout.fields == cpu_kernel.EncoderRow._fields
    row = cpu_kernel.EncoderRow("small_table", True, 0.25, (-0.5, 0.5), "abs")
    slots = cpu_kernel.encoder_values(row, layout)
    offsets = dict(zip(layout.fields, [sum(layout.widths[:i]) for i in range(len(layout.widths))]))
    assert len(slots) == sum(layout.widths)
    assert slots[offsets["encoder"]] == layout.encoders.index("small_table")
    assert slots[offsets["cell_sign"]] == layout.cell_signs.index("abs")
    assert (slots[offsets["zero_free"]], slots[offsets["first_edge"]]) == (1.0, 0.25)
    width = layout.widths[layout.fields.index("midpoints")]
    midpoints = slots[offsets["midpoints"]:offsets["midpoints"] + width]
    assert midpoints[:2] == [-0.5, 0.5] and all(value == float("inf") for value in midpoints[2:])


def test_a_kernel_reading_other_encoder_fields_is_refused_naming_both(monkeypatch):
    fields, widths, encoders, cell_signs = torch.ops.lowbit_optim.cpu_encoder_layout()
    moved = [fields[1], fields[0], *fields[2:]]
    monkeypatch.setattr(torch.ops.lowbit_optim, "cpu_encoder_layout",
                        lambda: (moved, widths, encoders, cell_signs))
    with pytest.raises(RuntimeError, match="reads an encoder's fields") as refusal:
        cpu_kernel.encoder_layout.__wrapped__()
    assert str(moved) in str(refusal.value) and str(list(cpu_kernel.EncoderRow._fields)) in str(refusal.value)
