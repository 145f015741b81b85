"""The main benchmark with AdamWFactored4bit's clamp at Adam's bound turned off.

The factored rule (``lowbit_optim.step.rules.adamw.AdamWFactoredRule``) clamps each element's
``exp_avg / denom`` at Adam's own bound (docs/design.md, "The factored second moment"). This
runs ``python -m lowbit_optim.bench`` with that bound removed, to measure what the clamp does
to the loss: compare its ``lowbit_4bit_factored_compile`` row with the same seed of an ordinary
run (the C++ kernel, ``lowbit_4bit_factored`` on CPU, forms its own bound and keeps it).
Arguments are the bench's, e.g. ``PYTHONPATH=. python benchmarks/bench_factored_clamp.py
--optimizers lowbit_4bit_factored_compile --seed 0 --out bench_out_no_clamp``.
"""

import sys

from lowbit_optim.bench.__main__ import main
from lowbit_optim.step.rules.adamw import AdamWFactoredRule

clamped = AdamWFactoredRule.corrections_and_bound


def unbounded(rule, param, constants):
    corrections, _ = clamped(rule, param, constants)
    return corrections, None


if __name__ == "__main__":
    AdamWFactoredRule.corrections_and_bound = unbounded
    sys.exit(main(sys.argv[1:]))
