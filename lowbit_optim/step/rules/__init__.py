"""The update rules (``base.UpdateRule``): AdamW/Adam (``adamw``), Lion (``lion``), AdEMAMix
(``ademamix``) and Muon (``muon``), each its moments, hyperparameters and math in one module.

``RULES`` names each rule whose element-wise step is a whole step, for whatever takes a rule by
name (the Triton op, ``step.kernels.ops``): a new rule adds its line here. Muon is not one: its
element-wise piece writes the Nesterov direction, and Newton-Schulz over the whole matrix
(``step.muon_plan``) makes the step.
"""

from lowbit_optim.step.rules.adamw import ADAMW
from lowbit_optim.step.rules.ademamix import ADEMAMIX
from lowbit_optim.step.rules.base import UpdateRule
from lowbit_optim.step.rules.lion import LION

# "adam" is AdamW's variant with torch.optim.Adam's L2 weight decay (``decoupled_weight_decay=False``).
RULES: dict[str, UpdateRule] = {"adamw": ADAMW, "adam": ADAMW.for_decay(False), "lion": LION,
                                "ademamix": ADEMAMIX}


def rule_named(name: str) -> UpdateRule:
    """The rule ``RULES`` names ``name``, or ``ValueError`` naming it and the known ones."""
    try:
        return RULES[name]
    except KeyError:
        raise ValueError(f"Unknown update rule {name!r}; known: {sorted(RULES)}") from None
