"""Parameters with float moments (norms, biases) are stepped together."""

import collections

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lowbit_optim import AdamW4bit, AdamW8bit
from lowbit_optim.step import float_state
from lowbit_optim.step.math import adamw_update


def small_params(count: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(7 + i % 5, 3 + i % 4) if i % 2 else (11 + i,) for i in range(count)]
    return [torch.nn.Parameter(torch.randn(*shape, generator=generator)) for shape in shapes]


# Views make no kernel, and the per-tensor copy_ is the CPU fallback of _foreach_copy_ (one
# multi-tensor launch per list on CUDA).
NOT_KERNELS = {"aten::view", "aten::reshape", "aten::as_strided", "aten::copy_"}


def tensor_ops_in_step(optimizer) -> collections.Counter:
    """aten ops of one step on tensors with at least one dimension (0-d CPU scalars, such as
    the step counters, make no device kernel), views and foreach fallbacks aside."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        optimizer.step()
    return collections.Counter(
        event.name for event in prof.events()
        if event.name.startswith("aten::") and event.name not in NOT_KERNELS
        and (event.name.startswith("aten::_foreach") or event.input_shapes[:1] not in ([], [[]]))
    )


def test_many_small_parameters_cost_a_fixed_number_of_ops():
    """One by one, each small parameter cost ~40 ops (~25 launches on a GPU); together, the
    tensor ops of a step are the same for 10 and for 60 of them: two multi-tensor copies
    gather parameters and gradients into flat buffers kept between steps, one writes the
    parameters back, and the moments (laid out as views of one tensor each) are updated in
    place."""
    counts = {}
    for count in (10, 60):
        params = small_params(count)
        optimizer = AdamW8bit(params, backend="eager")
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer.step()  # creates the state
        counts[count] = tensor_ops_in_step(optimizer)
    assert counts[10] == counts[60], counts
    assert counts[60]["aten::_foreach_copy_"] == 3 and sum(counts[60].values()) < 60


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("cls", [AdamW8bit, AdamW4bit], ids=lambda c: c.__name__)
def test_small_parameters_stepped_together_equal_the_reference_one_by_one(cls, amsgrad):
    """The flat step is elementwise: each parameter gets exactly what ``adamw_update`` gives
    it alone, including a transposed (non-contiguous) one and one with a non-finite grad."""
    params = small_params(9)
    params.append(torch.nn.Parameter(torch.randn(6, 5).t()))
    optimizer = cls(params, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, backend="eager")
    expected = [(p.detach().clone(), torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p))
                for p in params]
    for step in range(1, 4):
        grads = [torch.randn_like(p) for p in params]
        grads[3].view(-1)[0] = float("nan")
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        optimizer.step()
        scalars = optimizer._caches[0].scalars
        for index, (grad, (value, exp_avg, exp_avg_sq, max_sq)) in enumerate(zip(grads, expected)):
            expected[index] = adamw_update(
                value, grad, exp_avg, exp_avg_sq, max_sq if amsgrad else None,
                lr=scalars.lr, beta1=scalars.beta1, beta2=scalars.beta2, eps=scalars.eps,
                weight_decay=scalars.weight_decay, step=torch.tensor(float(step)), maximize=False,
            )
            if not amsgrad:
                expected[index] = (*expected[index][:3], torch.zeros_like(value))
    for param, (value, exp_avg, exp_avg_sq, _) in zip(params, expected):
        assert torch.equal(param, value)
        assert torch.equal(optimizer.state[param]["exp_avg"], exp_avg)
        assert torch.equal(optimizer.state[param]["exp_avg_sq"], exp_avg_sq)


def test_a_big_float_state_parameter_is_not_copied_into_the_flat_step(monkeypatch):
    """With ``min_quant_size`` raised, a big parameter keeps float moments; it steps alone
    (nothing parameter-sized is gathered or concatenated), while the small ones beside it
    still share one step."""
    monkeypatch.setattr(float_state, "FLAT_FLOAT_STATE_BELOW", 1000)
    big = torch.nn.Parameter(torch.randn(5000))
    params = [big, *small_params(4)]
    optimizer = AdamW8bit(params, min_quant_size=10**9, backend="eager")
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        optimizer.step()
    names = [event.name for event in prof.events()]
    assert "aten::_foreach_copy_" in names and "aten::cat" not in names, "the small ones are gathered"
    # Parameter-sized copies (not inside another op, as masked_fill's clone is): only the
    # results written into the parameter and its two moments.
    big_copies = [event for event in prof.events()
                  if event.name == "aten::copy_" and event.input_shapes[:1] == [[5000]]
                  and not (event.cpu_parent and event.cpu_parent.name.startswith("aten::"))]
    assert len(big_copies) == 3, [event.input_shapes for event in big_copies]
