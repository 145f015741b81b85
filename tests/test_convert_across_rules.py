"""Converting state dicts between ``torch.optim.AdamW`` and optimizers of other update rules
(``lowbit_optim.checkpoint.convert``): an AdamW state has no Lion or AdEMAMix equivalent, nor
the reverse, so each converter refuses, naming what is missing, and changes nothing."""

import copy

import pytest
import torch
from helpers import assert_same_state

from lowbit_optim import AdamW8bit, AdEMAMix4bit, AdEMAMix8bit, Lion4bit, Lion8bit
from lowbit_optim.checkpoint import from_torch_adamw, to_torch_adamw


def trained(cls, **options):
    """A parameter and its optimizer after one step."""
    param = torch.nn.Parameter(torch.randn(64, 80))
    optimizer = cls([param], **options)
    param.grad = torch.randn_like(param)
    optimizer.step()
    return param, optimizer


def group_options(optimizer) -> list[dict]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


@pytest.mark.parametrize("cls, message", [
    (Lion8bit, r"parameter group 0 has no eps"),
    (Lion4bit, r"parameter group 0 has no eps"),
    (AdEMAMix8bit, r"parameter group 0 has 3 betas"),
    (AdEMAMix4bit, r"parameter group 0 has 3 betas"),
], ids=["Lion8bit", "Lion4bit", "AdEMAMix8bit", "AdEMAMix4bit"])
def test_to_torch_adamw_of_a_lion_or_ademamix_state_dict_is_refused(cls, message):
    """Converted, a Lion state dict would load into torch.optim.AdamW and fail at its step
    with ``KeyError: 'exp_avg_sq'``; an AdEMAMix one there on its three betas."""
    _, optimizer = trained(cls)
    state_dict = optimizer.state_dict()
    before = copy.deepcopy(state_dict)
    with pytest.raises(ValueError, match=rf"to_torch_adamw: {message}.*not an AdamW or Adam state dict"):
        to_torch_adamw(state_dict)
    assert_same_state(state_dict, before)


def test_to_torch_adamw_of_a_state_without_exp_avg_sq_is_refused():
    """A state dict whose groups look like AdamW's but whose state lacks the second moment
    (a Lion state under AdamW's options) is refused by its moments, naming the missing one."""
    _, optimizer = trained(Lion8bit)
    state_dict = optimizer.state_dict()
    for group in state_dict["param_groups"]:
        group["eps"] = 1e-8
    with pytest.raises(ValueError, match=r"state of parameter 0 has no exp_avg_sq \(it has step, exp_avg;"):
        to_torch_adamw(state_dict)


def test_to_torch_adamw_of_an_adamw_state_dict_loads_and_steps_in_torch():
    """The control: an AdamW8bit state dict converts, and torch.optim.AdamW steps from it."""
    param, optimizer = trained(AdamW8bit)
    plain = to_torch_adamw(optimizer.state_dict())
    reference = torch.optim.AdamW([param])
    reference.load_state_dict(plain)
    param.grad = torch.randn_like(param)
    reference.step()
    assert float(reference.state[param]["step"]) == 2.0


@pytest.mark.parametrize("cls, message", [
    (Lion8bit, r"the loaded state has exp_avg_sq, which Lion8bit does not keep \(lion rule: exp_avg\)"),
    (AdEMAMix8bit, r"the loaded state has no exp_avg_slow, which AdEMAMix8bit needs"),
], ids=["Lion8bit", "AdEMAMix8bit"])
def test_torch_adamw_state_dict_into_a_lion_or_ademamix_optimizer_is_refused(cls, message):
    """``from_torch_adamw`` (and ``load_state_dict``, which calls it) refuse a torch AdamW state
    for an optimizer of another rule, naming the moment; the loading optimizer stays empty."""
    param, saving = trained(torch.optim.AdamW)
    state_dict = saving.state_dict()
    loading = cls([torch.nn.Parameter(param.detach().clone())])
    with pytest.raises(ValueError, match=message):
        from_torch_adamw(loading, state_dict)
    with pytest.raises(ValueError, match=message):
        loading.load_state_dict(state_dict)
    assert not loading.state


@pytest.mark.parametrize("cls, options", [(Lion8bit, "eps, amsgrad"), (AdEMAMix8bit, "amsgrad")],
                         ids=["Lion8bit", "AdEMAMix8bit"])
def test_torch_adamw_state_dict_without_state_into_a_lion_or_ademamix_optimizer_is_refused(cls, options):
    """Before any step a torch AdamW state dict has no moments; its groups' AdamW options still
    say what it is (loaded, they would leave eps and amsgrad in a Lion optimizer's groups)."""
    param = torch.nn.Parameter(torch.randn(64, 80))
    state_dict = torch.optim.AdamW([param]).state_dict()
    loading = cls([param])
    options_before = group_options(loading)
    with pytest.raises(ValueError, match=rf"parameter group 0 of the loaded state dict has {options}: a "
                                         r"torch.optim.AdamW state dict"):
        loading.load_state_dict(state_dict)
    assert group_options(loading) == options_before
    assert loading.param_groups[0]["params"][0] is param and not loading.state
