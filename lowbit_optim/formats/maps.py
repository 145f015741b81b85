"""Quantization maps: the sorted tables of values a code can stand for.

Every table is a sorted 1-D float32 tensor on CPU, built once at import and shared by
every state tensor of that format (states hold a format name, never a copy of a table).

* 8-bit: the dynamic-tree maps of bitsandbytes ("8-bit Optimizers via Block-wise
  Quantization", Dettmers et al. 2022), signed for the first moment and unsigned for the
  second. They equal ``bitsandbytes.functional.create_dynamic_map(signed)`` bit for bit
  (tested).
* 4-bit: the signed dynamic-exponent map of lpmm ("Memory Efficient Optimizers with 4-bit
  States", Li et al. 2023, section 4) for the first moment, and the linear map without
  zero, (k + 1) / 16, for the second moment: a zero second moment would turn
  1 / sqrt(v) into a huge step (the paper's "zero-point problem", section 4.1); and NF4's
  normal quantiles (QLoRA) for Muon's 4-bit momentum (docs/muon.md has the comparison).
"""

import torch


def dynamic_exponent_map(*, signed: bool, total_bits: int) -> torch.Tensor:
    """The dynamic-tree map with the largest exponent field the bit budget allows.

    Decade ``i`` (values in ``[10**(i - E), 10**(i - E + 1))`` with ``E`` the exponent
    bits) holds ``2**i`` linearly spaced values per sign (``2**(i + 1)`` when unsigned, as
    the sign bit becomes a fraction bit); 0 and 1 complete the table. The products are
    formed in float32 exactly as bitsandbytes forms them, so the tables match bit for bit.
    """
    exponent_bits = total_bits - 1
    values = [torch.tensor([0.0, 1.0])]
    for decade in range(exponent_bits):
        count = 2 ** (decade if signed else decade + 1)
        edges = torch.linspace(0.1, 1, count + 1, dtype=torch.float32)
        magnitudes = (10 ** (decade - (exponent_bits - 1))) * ((edges[:-1] + edges[1:]) / 2.0)
        values.append(magnitudes)
        if signed:
            values.append(-magnitudes)
    table = torch.cat(values).sort().values
    assert table.numel() == 2**total_bits
    return table


def linear_nonzero_map(*, total_bits: int) -> torch.Tensor:
    """``(k + 1) / 2**bits`` for ``k = 0 .. 2**bits - 1``: linear, no zero, tops out at 1."""
    levels = 2**total_bits
    return torch.arange(1, levels + 1, dtype=torch.float32) / levels


def normal_quantile_map() -> torch.Tensor:
    """The 16 values of NF4 (QLoRA, Dettmers et al. 2023, appendix E): quantiles of a standard
    normal, 8 positive and 7 negative, plus an exact 0, scaled to [-1, 1]."""
    offset = 0.9677083  # the quantile NF4 maps to 1 (the mean of 1 - 1/(2*15) and 1 - 1/(2*16))
    positive = torch.special.ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat([positive, torch.zeros(1, dtype=torch.float64), negative])
    return (values / values.max()).sort().values.float()


SIGNED_8BIT = dynamic_exponent_map(signed=True, total_bits=8)
UNSIGNED_8BIT = dynamic_exponent_map(signed=False, total_bits=8)
SIGNED_4BIT = dynamic_exponent_map(signed=True, total_bits=4)
LINEAR_4BIT = linear_nonzero_map(total_bits=4)
NORMAL_4BIT = normal_quantile_map()
