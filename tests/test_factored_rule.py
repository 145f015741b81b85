"""The factored step's two pieces on their own, without a compile: the rule's ``update``
(``AdamWFactoredRule``, the AdamW variant for a factored second moment) against AdamW's
update written out in float64, and the factored layout's per-element second moment
(``FactoredMoment.parts``) against ``state.factored.reconstruct``."""

import pytest
import torch
from helpers import make_scalars

from lowbit_optim.state.factored import normalized_columns, reconstruct
from lowbit_optim.step.factored import FactoredMoment
from lowbit_optim.step.hyperparams import StepOptions
from lowbit_optim.step.math import adam_ratio_bound
from lowbit_optim.step.rules.adamw import ADAMW, AdamWFactoredRule

BETAS = (0.9, 0.999)


def reference_update(param, grad, exp_avg, second_moment, *, lr, eps, weight_decay, step, decoupled):
    """AdamW's (Adam's, L2) update from a given second moment, in float64, the ratio clamped
    at Adam's bound."""
    beta1, beta2 = BETAS
    param, grad, exp_avg, second_moment = (t.double() for t in (param, grad, exp_avg, second_moment))
    if not decoupled:
        grad = grad + weight_decay * param
    new_exp_avg = beta1 * exp_avg + (1 - beta1) * grad
    denom = second_moment.sqrt() / (1 - beta2**step) ** 0.5 + eps
    bound = float(adam_ratio_bound(*(torch.tensor(float(value), dtype=torch.float64)
                                     for value in (beta1, beta2, step))))
    ratio = (new_exp_avg / denom).clamp(-bound, bound)
    decayed = param * (1 - lr * weight_decay) if decoupled else param
    return decayed - lr / (1 - beta1**step) * ratio, new_exp_avg


@pytest.mark.parametrize("decoupled", [True, False], ids=["decoupled", "l2"])
def test_factored_rule_updates_the_first_moment_and_only_reads_the_second(decoupled):
    rule = ADAMW.for_factored(StepOptions(False, False, decoupled_weight_decay=decoupled))
    assert isinstance(rule, AdamWFactoredRule) and rule.decoupled_weight_decay == decoupled
    generator = torch.Generator().manual_seed(0)
    param, grad, exp_avg = (torch.randn(7, 33, generator=generator) for _ in range(3))
    # Small second moments for some elements: the clamp at Adam's bound binds there.
    tiny = torch.where(torch.arange(33) % 5 == 0, 1e-12, 1.0)
    second_moment = torch.rand(7, 33, generator=generator) * tiny
    given = second_moment.clone()
    hyper = dict(lr=1e-2, eps=1e-8, weight_decay=0.1, step=3)
    scalars = make_scalars(lr=hyper["lr"], betas=BETAS, eps=hyper["eps"], weight_decay=hyper["weight_decay"],
                           step=hyper["step"])
    new_param, new_moments = rule.update(param, grad, (exp_avg, second_moment),
                                         rule.step_constants(scalars, scalars.step))
    assert len(new_moments) == 1 and torch.equal(second_moment, given)
    expected_param, expected_exp_avg = reference_update(param, grad, exp_avg, second_moment,
                                                        decoupled=decoupled, **hyper)
    torch.testing.assert_close(new_moments[0].double(), expected_exp_avg, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(new_param.double(), expected_param, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("shape, block_size, count",
                         [((33, 70), 128, 2), ((5, 300), 64, 1), ((40, 3), 16, 2)],
                         ids=["blocks-across-rows", "rows-across-blocks", "narrow"])
def test_factored_moment_reads_row_times_normalized_column_at_each_flat_index(shape, block_size, count):
    rows, columns = shape
    generator = torch.Generator().manual_seed(1)
    row, col = torch.rand(rows, generator=generator), torch.rand(columns, generator=generator)
    expected = reconstruct(row, col).flatten()
    whole_blocks = expected.numel() // block_size
    first_block = whole_blocks // 2
    blocks = torch.empty(whole_blocks - first_block + 1, block_size)  # to the end, with a padded tail
    moment = FactoredMoment(row, normalized_columns(col), torch.tensor(first_block * block_size),
                            torch.tensor(columns))
    values = torch.cat(moment.parts(blocks, count), dim=1).flatten()
    start = first_block * block_size
    assert torch.equal(values[:expected.numel() - start], expected[start:])
    # The padding past the parameter's end reads the last row.
    padding = values[expected.numel() - start:]
    tail = torch.arange(expected.numel(), start + values.numel()) % columns
    assert torch.equal(padding, row[-1] * normalized_columns(col)[tail])
