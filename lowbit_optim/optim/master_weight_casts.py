"""Keeping each master weight correction right for its parameter as the parameter is now.

A correction means something only with the parameter dtype it was made for
(``step.master_weights``: bfloat16's bit split, float16's scaled residual), and that dtype
can change under the optimizer: ``model.half()``, ``model.bfloat16()`` and ``model.float()``
give the same ``Parameter`` new data. ``MasterWeightCasts`` remembers, per parameter, the
dtype its correction was made for (with the correction, by weak reference: a correction
replaced since, by ``load_state_dict``, is the new one's and made for the parameter as it
is), and before a step reads the corrections (and before ``master_weights_state_dict`` and
``load_master_weights``) brings every state in line with its parameter and its group's
``master_weight_bits``:

* a bfloat16 or float16 parameter with ``master_weight_bits`` whose state has no correction
  (it was float32 when its state was made: an fp32 warm-up, then ``model.bfloat16()``; or
  the option was set into the group later) gets a zero one: the parameter is its master weight;
* ``master_weight_bits`` changed between 24 and 32: the correction is widened (exactly) or
  narrowed (``convert_correction``); set to ``None``: the correction is dropped;
* a cast to float32 or float64: the parameter becomes its master weight (parameter and
  correction read with the old dtype's encoding) and the correction is dropped;
* bfloat16 -> float16: the master weight (read from the parameter cast back, exact where the
  float16 cast was: from ``2**-17`` in magnitude up to 65280) is split again into the float16
  parameter and a correction in float16's encoding;
* float16 -> bfloat16: the cast rounded the parameter to bfloat16 before the optimizer could
  see it, and the float16 parameter the correction completes is gone; the master weight
  restarts from the bfloat16 parameter (zero correction), with a warning that says how to
  carry it over exactly.

The rest of the optimizer keeps the records current: a state made with a correction and
every state loaded are remembered as made for the parameter's dtype then.
"""

import warnings
import weakref

import torch

from lowbit_optim.state import sharding
from lowbit_optim.step.master_weights import (
    CORRECTED_DTYPES,
    CORRECTION_KEY,
    convert_correction,
    correction_dtype,
    needs_correction,
    read_master,
    split_master,
    zeros_correction,
)


class MasterWeightCasts:
    """Per parameter, the dtype its correction was made for (module docstring)."""

    def __init__(self):
        self._made_for: dict[torch.Tensor, tuple[weakref.ref, torch.dtype]] = {}

    def remember(self, param: torch.Tensor, state: dict) -> None:
        """``state``'s correction, if any, is made for ``param`` as it is now."""
        correction = state.get(CORRECTION_KEY)
        if correction is not None and param.dtype in CORRECTED_DTYPES:
            self._made_for[param] = (weakref.ref(correction), param.dtype)

    def remember_all(self, param_groups: list[dict], states) -> None:
        for group in param_groups:
            for param in group["params"]:
                if param in states:
                    self.remember(param, states[param])

    def made_for(self, param: torch.Tensor, correction: torch.Tensor) -> torch.dtype:
        """The parameter dtype ``correction`` encodes (unknown: the parameter's own)."""
        record = self._made_for.get(param)
        if record is not None and record[0]() is correction:
            return record[1]
        return param.dtype

    def changes(self, owner: str, params, states, bits) -> list:
        """What bringing the states of ``params`` in line takes, as calls that do it, one per
        parameter that needs one (and a last one that warns, if any master weight restarts);
        nothing is modified. ``bits``: their group's ``master_weight_bits``."""
        actions, restarted = [], 0
        for param in params:
            state = states.get(param)
            if not state:
                continue
            correction = state.get(CORRECTION_KEY)
            wanted = needs_correction(param, bits)
            if correction is None:
                if wanted:
                    actions.append(lambda p=param, s=state: self._set(p, s, zeros_correction(p, bits)))
                continue
            made_for = self.made_for(param, correction)
            if made_for == param.dtype:
                if not wanted:
                    actions.append(lambda p=param, s=state: self._set(p, s, None))
                elif sharding.local(correction).dtype != correction_dtype(bits):
                    actions.append(lambda p=param, s=state, c=correction: self._set(
                        p, s, convert_correction(c, p.dtype, correction_dtype(bits))))
                else:
                    self.remember(param, state)
                continue
            restart = made_for == torch.float16 and param.dtype == torch.bfloat16
            restarted += restart
            actions.append(lambda p=param, s=state, c=correction, old=made_for, r=restart:
                           self._recast(p, s, c, old, bits, restart=r))
        if restarted:
            actions.append(lambda: warnings.warn(
                f"{owner}: {restarted} parameter(s) with master weights were cast from torch.float16 to "
                "torch.bfloat16; the cast rounded them to bfloat16 before the optimizer saw them, so "
                "their master weights restart from the bfloat16 values (their float16 corrections are "
                "dropped). To carry master weights across this cast exactly, take "
                "lowbit_optim.master_weights_state_dict(model, optimizer) before it and "
                "lowbit_optim.load_master_weights(model, optimizer, weights) after it",
                stacklevel=4))
        return actions

    def _set(self, param: torch.Tensor, state: dict, correction) -> None:
        if correction is None:
            del state[CORRECTION_KEY]
            self._made_for.pop(param, None)
        else:
            state[CORRECTION_KEY] = correction
            self.remember(param, state)

    def _recast(self, param: torch.Tensor, state: dict, correction, old: torch.dtype, bits, *,
                restart: bool) -> None:
        """``param`` was cast from ``old``: its master weight carried over (module docstring)."""
        shard = sharding.local(param)
        wanted = needs_correction(param, bits)
        if restart:
            self._set(param, state, zeros_correction(param, bits) if wanted else None)
            return
        master = read_master(shard.to(old), sharding.local(correction))
        if wanted:
            rounded, remainder = split_master(master, shard.dtype, correction_dtype(bits))
            new_correction = sharding.wrap_like(remainder, param) if sharding.is_dtensor(param) else remainder
        else:
            rounded, new_correction = master.to(shard.dtype), None
        shard.copy_(rounded)
        self._set(param, state, new_correction)
