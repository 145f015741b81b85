"""The main benchmark with AdamWFactored4bit's clamp at Adam's bound turned off.

``lowbit_optim.step.factored`` clamps each element's ``exp_avg / denom`` at Adam's own bound
(docs/design.md, "The factored second moment"). This runs ``python -m lowbit_optim.bench``
with that bound replaced by infinity, to measure what the clamp does to the loss: compare its
``lowbit_4bit_factored`` row with the same seed of an ordinary run. Arguments are the bench's,
e.g. ``PYTHONPATH=. python benchmarks/bench_factored_clamp.py --optimizers lowbit_4bit_factored
--seed 0 --out bench_out_no_clamp``.
"""

import sys

import torch

from lowbit_optim.bench.__main__ import main
from lowbit_optim.step import factored

clamped_bound = factored.adam_ratio_bound


def unbounded(beta1, beta2, step):
    return torch.full_like(clamped_bound(beta1, beta2, step), torch.inf)


if __name__ == "__main__":
    factored.adam_ratio_bound = unbounded
    sys.exit(main(sys.argv[1:]))
