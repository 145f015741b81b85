"""A param group added after ``load_state_dict`` gets the options a group added before it
gets: torch's ``Optimizer.__setstate__`` adds its own step's ``differentiable`` option to the
defaults of a class that lacks it."""

import pytest
import torch
from torch import nn

from lowbit_optim import AdamW8bit, Lion8bit


@pytest.mark.parametrize("cls", [Lion8bit, AdamW8bit], ids=lambda c: c.__name__)
def test_param_group_added_after_load_state_dict_has_the_options_of_one_added_before(cls):
    optimizers = []
    for load in (False, True):
        optimizer = cls([nn.Parameter(torch.ones(4))], lr=1e-3)
        if load:
            optimizer.load_state_dict(cls([nn.Parameter(torch.ones(4))], lr=1e-3).state_dict())
        optimizer.add_param_group({"params": [nn.Parameter(torch.ones(3))], "lr": 1e-2})
        optimizers.append(optimizer)
    plain, loaded = ([{key: value for key, value in group.items() if key != "params"}
                      for group in optimizer.param_groups] for optimizer in optimizers)
    assert loaded == plain
    assert optimizers[1].defaults == optimizers[0].defaults
