"""The quantization maps as the Triton kernel reads them, computed from the public tables
(``QuantFormat.table``, ``lowbit_optim.quant.maps``): which encoder, the float32 bin edges,
and their device copies."""

import torch

from lowbit_optim.quant import maps
from lowbit_optim.quant.formats import QuantFormat

# The kernel's CODEC constexpr. LINEAR: (k + 1) / 2**bits, encoded and decoded by arithmetic;
# TABLE: binary search over the midpoints of a map whose code 0 is the one nearest 0
# (unsigned maps); SIGNED_TABLE: the same where it is not, so NaN needs a select.
LINEAR, TABLE, SIGNED_TABLE = 0, 1, 2


def codec_kind(fmt: QuantFormat) -> int:
    """The kernel's encoder for ``fmt``, judged from its map (``lowbit_optim.quant.maps``)."""
    table = fmt.table
    if table.numel() != 1 << fmt.bits or fmt.bits not in (4, 8):
        raise ValueError(f"format {fmt.name!r} has no Triton encoder")
    if torch.equal(table, maps.linear_nonzero_map(total_bits=fmt.bits)):
        return LINEAR
    if not bool((table[1:] > table[:-1]).all()):
        raise ValueError(f"format {fmt.name!r}: the binary-search encoder needs a strictly increasing map")
    zero_code = int((codec_midpoints(fmt) < 0).sum())
    return TABLE if zero_code == 0 else SIGNED_TABLE


def codec_midpoints(fmt: QuantFormat) -> torch.Tensor:
    """The bin edges ``(t[i] + t[i + 1]) / 2`` in float32, padded with +inf to the table's size."""
    table = fmt.table.float()
    return torch.cat([(table[1:] + table[:-1]) / 2, torch.tensor([float("inf")])])


_DEVICE_TABLES: dict = {}


def device_tables(fmt: QuantFormat, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(decode table, midpoints) on ``device``: copied there once per process."""
    key = (fmt.name, device)
    if key not in _DEVICE_TABLES:
        _DEVICE_TABLES[key] = (fmt.table.float().to(device), codec_midpoints(fmt).to(device))
    return _DEVICE_TABLES[key]
