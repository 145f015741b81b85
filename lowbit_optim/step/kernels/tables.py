"""The quantization maps as the Triton kernel reads them, computed from the public tables
(``QuantFormat.table``, ``lowbit_optim.formats.maps``) and codecs: which encoder, what it reads
besides the values (cell words), and their device copies."""

import functools

import torch

from lowbit_optim.formats import cell_tables, maps
from lowbit_optim.formats.catalog import QuantFormat

# The kernel's CODEC constexpr. LINEAR: (k + 1) / 2**bits, encoded and decoded by arithmetic.
# Every other map encodes by its cell table (``formats.cell_tables``): CELLS_CLAMPED where negative values
# encode as 0 does (zero-free maps), CELLS_ABS where -x encodes as x, CELLS_SIGNED with a half
# of cells for negative values, CELLS_SIGNED_ZERO the same where -0.0 has a code of its own
# (float8); all of them decode by a gather from the map's table.
LINEAR, CELLS_CLAMPED, CELLS_ABS, CELLS_SIGNED, CELLS_SIGNED_ZERO = range(5)
_CELL_KINDS = {cell_tables.CLAMPED: CELLS_CLAMPED, cell_tables.ABS: CELLS_ABS,
               cell_tables.SIGNED: CELLS_SIGNED, cell_tables.SIGNED_ZERO: CELLS_SIGNED_ZERO}


@functools.cache
def _cells(fmt: QuantFormat) -> tuple[torch.Tensor, int]:
    """(cell words, kernel kind) of a table map, built once per process (0.1-2 s)."""
    words, sign = cell_tables.cell_words(fmt.codec.encode, fmt.name)
    return words, _CELL_KINDS[sign]


def codec_kind(fmt: QuantFormat) -> int:
    """The kernel's encoder for ``fmt``, judged from its map (``lowbit_optim.formats``)."""
    if fmt.table.numel() != 1 << fmt.bits or fmt.bits not in (4, 8):
        raise ValueError(f"format {fmt.name!r} has no Triton encoder")
    if torch.equal(fmt.table, maps.linear_nonzero_map(total_bits=fmt.bits)):
        return LINEAR
    return _cells(fmt)[1]


def encoder_table(fmt: QuantFormat) -> torch.Tensor:
    """What the kernel's encoder reads: the cell words (none for the linear map)."""
    if codec_kind(fmt) == LINEAR:
        return torch.zeros(1, dtype=torch.int32)
    return _cells(fmt)[0]


_DEVICE_TABLES: dict = {}


def device_tables(fmt: QuantFormat, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(decode table, encoder table) on ``device``: copied there once per process."""
    key = (fmt.name, device)
    if key not in _DEVICE_TABLES:
        _DEVICE_TABLES[key] = (fmt.table.float().to(device), encoder_table(fmt).to(device))
    return _DEVICE_TABLES[key]
