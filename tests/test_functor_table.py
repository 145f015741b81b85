"""The C++ kernel's rule table (``csrc/cpu_step_args.h``'s ``RuleId`` and ``kRuleShapes``) is
read from the header itself; every rule that names a functor agrees with it."""

import types

import pytest
import torch

from lowbit_optim.step import cpu_kernel
from lowbit_optim.step.rules.adamw import ADAMW
from lowbit_optim.step.rules.ademamix import ADEMAMIX
from lowbit_optim.step.rules.lion import LION
from lowbit_optim.step.rules.muon import MUON

RULES = [ADAMW, LION, ADEMAMIX, MUON]


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.name)
def test_every_rule_functor_reads_as_many_values_as_its_step_constants_has_fields(rule):
    shape = cpu_kernel.FUNCTOR_SHAPES[rule.cpu_functor]
    scalars = types.SimpleNamespace(**{name: torch.tensor(0.5, dtype=torch.float64)
                                       for name in rule.scalar_names})
    for variant in rule.variants():
        constants = variant.step_constants(scalars, torch.tensor(3.0))
        assert len(constants) == shape.values, variant
    assert shape.min_moments <= len(rule.moment_keys({})) <= len(rule.all_moment_keys) <= shape.max_moments


def test_the_header_table_reads_ids_in_declaration_order():
    header = """
enum RuleId : int32_t { kFirst = 0, kSecondRule = 1 };
constexpr RuleShape kRuleShapes[] = {
    {3, 1, 2},    // kFirst
    {5, 0, 0},    // kSecondRule
};
"""
    shapes = cpu_kernel.functor_shapes(header)
    assert shapes == {"first": cpu_kernel.FunctorShape(0, 3, 1, 2),
                      "secondrule": cpu_kernel.FunctorShape(1, 5, 0, 0)}
    shapes = cpu_kernel.FUNCTOR_SHAPES
    assert cpu_kernel.RULE_FUNCTORS == {name: shape.rule_id for name, shape in shapes.items()}
    with pytest.raises(ImportError, match="RuleId"):
        cpu_kernel.functor_shapes("no table here")
