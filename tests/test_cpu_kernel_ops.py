"""The C++ kernel's operators have torch's ``_fused_adamw_`` shape: at most six positional
arguments, all tensor lists (every list the operator writes among them: Inductor passes mutated
lists positionally), everything else keyword-only and named; functors and instruction sets go
by name, and a wrong name is refused saying which names exist."""

import pytest
import torch

from lowbit_optim import QuantizedState
from lowbit_optim.formats.catalog import FORMATS
from lowbit_optim.step import cpu_kernel
from lowbit_optim.step.rules.lion import LionConstants

OPS = ["cpu_rule_step", "cpu_factored_step", "cpu_factored_statistics", "cpu_factored_columns"]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if not cpu_kernel.load():
        pytest.skip("the C++ CPU step could not be built here")


@pytest.mark.parametrize("name", OPS)
def test_every_kernel_op_takes_at_most_six_positional_tensor_lists_and_names_the_rest(name):
    arguments = getattr(torch.ops.lowbit_optim, name).default._schema.arguments
    positional = [argument for argument in arguments if not argument.kwarg_only]
    assert 1 <= len(positional) <= 6
    assert all(str(argument.type) == "List[Tensor]" for argument in positional), positional
    written = [argument.name for argument in arguments
               if argument.alias_info is not None and argument.alias_info.is_write]
    assert written and set(written) <= {argument.name for argument in positional}


def lion_case():
    fmt = FORMATS["dynamic8-signed"]
    param = torch.linspace(-1, 1, 1000)
    grad = torch.cos(torch.arange(1000.0))
    state = QuantizedState.zeros(param.shape, fmt, 256)
    values = LionConstants(*(torch.tensor(v, dtype=torch.float64) for v in (1e-2, 0.9, 0.99, 0.1)))
    return param, grad, state, values


def lion_call(param, grad, state, values, **changes):
    keywords = dict(functor="lion", **cpu_kernel.format_constants((state.format,)), block_size=256,
                    maximize=False, stochastic_round=False, isa="scalar")
    keywords.update(changes)
    torch.ops.lowbit_optim.cpu_rule_step([param], [grad], [state.codes], [state.scales], [], list(values),
                                         **keywords)


@pytest.mark.parametrize("change, message", [
    (dict(isa="sse9"), "unknown instruction set 'sse9' \\(scalar, avx2 or avx512\\)"),
    (dict(functor="lions"), "no functor 'lions' \\(it has adamw, lion"),
    (dict(functor="adamw_factored"), "functor 'adamw_factored' has an operator of its own"),
    (dict(bits=6), "moments of 6 bits \\(4 or 8\\)"),
])
def test_a_wrong_name_or_width_is_refused_by_name_before_any_change(change, message):
    param, grad, state, values = lion_case()
    before = param.clone(), state.codes.clone(), state.scales.clone()
    with pytest.raises(RuntimeError, match=message):
        lion_call(param, grad, state, values, **change)
    assert all(torch.equal(a, b) for a, b in zip(before, (param, state.codes, state.scales)))


@pytest.mark.slow
def test_a_kernel_op_called_from_compiled_code_steps_as_the_eager_call():
    """The package calls the operators from uncompiled code (the optimizer's step is a graph
    break); a caller that compiles around one gets the same result (its fake implementation
    and schema let Inductor call it, passing the mutated lists positionally)."""
    eager, compiled = lion_case(), lion_case()
    lion_call(*eager)
    keywords = dict(functor="lion", **cpu_kernel.format_constants((FORMATS["dynamic8-signed"],)),
                    block_size=256, maximize=False, stochastic_round=False, isa="scalar")

    @torch.compile(fullgraph=True, dynamic=False)
    def step(param, grad, codes, scales, values):
        torch.ops.lowbit_optim.cpu_rule_step([param], [grad], [codes], [scales], [], values, **keywords)

    param, grad, state, values = compiled
    step(param, grad, state.codes, state.scales, list(values))
    assert torch.equal(param, eager[0]) and not torch.equal(param, lion_case()[0])
    assert torch.equal(state.codes, eager[2].codes) and torch.equal(state.scales, eager[2].scales)
