"""The quantization maps as the Triton kernel reads them, computed from the public tables
(``QuantFormat.table``, ``lowbit_optim.formats.maps``) and codecs: which encoder, what it reads
besides the values (bin edges or cell words), and their device copies."""

import functools

import torch

from lowbit_optim.formats import codecs, maps
from lowbit_optim.formats.catalog import QuantFormat
from lowbit_optim.step.kernels import top_bits

# The kernel's CODEC constexpr. LINEAR: (k + 1) / 2**bits, encoded and decoded by arithmetic;
# TABLE: binary search over the midpoints of a 16-entry map whose code 0 is the one nearest 0
# (unsigned maps); SIGNED_TABLE: the same where it is not, so NaN needs a select. 8-bit
# formats (dynamic maps, float8) encode by their cell table (top_bits): CELLS_CLAMPED where
# negative values encode as 0 does (zero-free maps), CELLS_ABS where -x encodes as x, and
# CELLS_SIGNED with a half of cells for negative values. All decode by a gather from the table.
LINEAR, TABLE, SIGNED_TABLE, CELLS_CLAMPED, CELLS_ABS, CELLS_SIGNED, CELLS_SIGNED_ZERO = range(7)
_CELL_KINDS = {top_bits.CLAMPED: CELLS_CLAMPED, top_bits.ABS: CELLS_ABS, top_bits.SIGNED: CELLS_SIGNED,
               top_bits.SIGNED_ZERO: CELLS_SIGNED_ZERO}


@functools.cache
def _cells(fmt: QuantFormat) -> tuple[torch.Tensor, int]:
    """(cell words, kernel kind) of an 8-bit format, built once per process (~0.1-1 s)."""
    words, sign = top_bits.cell_words(fmt.codec.encode, fmt.name)
    return words, _CELL_KINDS[sign]


def codec_kind(fmt: QuantFormat) -> int:
    """The kernel's encoder for ``fmt``, judged from its codec and map (``lowbit_optim.formats``)."""
    table = fmt.table
    if table.numel() != 1 << fmt.bits or fmt.bits not in (4, 8):
        raise ValueError(f"format {fmt.name!r} has no Triton encoder")
    if fmt.bits == 8:
        return _cells(fmt)[1]
    if torch.equal(table, maps.linear_nonzero_map(total_bits=fmt.bits)):
        return LINEAR
    if not bool((table[1:] > table[:-1]).all()):
        raise ValueError(f"format {fmt.name!r}: the binary-search encoder needs a strictly increasing map")
    zero_code = int((encoder_edges(fmt) < 0).sum())
    return TABLE if zero_code == 0 else SIGNED_TABLE


def encoder_edges(fmt: QuantFormat) -> torch.Tensor:
    """The bin edges a 16-entry map's search reads: ``(t[i] + t[i + 1]) / 2`` in float32,
    padded with +inf to the table's size (a zero-free codec's first edge is its own)."""
    table = fmt.table.float()
    edges = (table[1:] + table[:-1]) / 2
    if isinstance(fmt.codec, codecs.ZeroFreeCodec):
        edges[0] = fmt.codec.first_edge  # it need not be the midpoint (``keep_edges``)
    return torch.cat([edges, torch.tensor([float("inf")])])


def encoder_table(fmt: QuantFormat) -> torch.Tensor:
    """What the kernel's encoder reads: the cell words (8-bit formats) or the bin edges."""
    return _cells(fmt)[0] if fmt.bits == 8 else encoder_edges(fmt)


_DEVICE_TABLES: dict = {}


def device_tables(fmt: QuantFormat, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(decode table, encoder table) on ``device``: copied there once per process."""
    key = (fmt.name, device)
    if key not in _DEVICE_TABLES:
        _DEVICE_TABLES[key] = (fmt.table.float().to(device), encoder_table(fmt).to(device))
    return _DEVICE_TABLES[key]
