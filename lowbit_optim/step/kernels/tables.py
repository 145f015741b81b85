"""The quantization maps as the Triton kernel reads them, computed from the public tables
(``QuantFormat.table``, ``lowbit_optim.formats.maps``) and codecs: which encoder, what it reads
besides the values (the float32 bin edges), and their device copies."""

import torch

from lowbit_optim.formats import codecs, maps
from lowbit_optim.formats.catalog import QuantFormat

# The kernel's CODEC constexpr. LINEAR: (k + 1) / 2**bits, encoded and decoded by arithmetic;
# TABLE: binary search over the midpoints of a map whose code 0 is the one nearest 0
# (unsigned maps); SIGNED_TABLE: the same where it is not, so NaN needs a select; FLOAT8:
# e4m3fn bits by integer arithmetic (codecs.e4m3fn_bits), decoded by the table.
LINEAR, TABLE, SIGNED_TABLE, FLOAT8 = 0, 1, 2, 3


def _is_float8(fmt: QuantFormat) -> bool:
    codec = fmt.codec
    inner = codec.inner if isinstance(codec, codecs.ZeroFreeCodec) else codec
    return isinstance(inner, codecs.Float8Codec)


def codec_kind(fmt: QuantFormat) -> int:
    """The kernel's encoder for ``fmt``, judged from its codec and map (``lowbit_optim.formats``)."""
    table = fmt.table
    if table.numel() != 1 << fmt.bits or fmt.bits not in (4, 8):
        raise ValueError(f"format {fmt.name!r} has no Triton encoder")
    if _is_float8(fmt):
        return FLOAT8
    if torch.equal(table, maps.linear_nonzero_map(total_bits=fmt.bits)):
        return LINEAR
    if not bool((table[1:] > table[:-1]).all()):
        raise ValueError(f"format {fmt.name!r}: the binary-search encoder needs a strictly increasing map")
    zero_code = int((encoder_edges(fmt) < 0).sum())
    return TABLE if zero_code == 0 else SIGNED_TABLE


def encoder_edges(fmt: QuantFormat) -> torch.Tensor:
    """The bin edges the encoder reads. A table map: ``(t[i] + t[i + 1]) / 2`` in float32,
    padded with +inf to the table's size. Float8, whose edges are arithmetic: one, the
    zero-free floor (``ZeroFreeCodec.first_edge``: below it, code 0), -inf for the plain codec."""
    if _is_float8(fmt):
        floor = fmt.codec.first_edge if isinstance(fmt.codec, codecs.ZeroFreeCodec) else float("-inf")
        return torch.tensor([floor], dtype=torch.float32)
    table = fmt.table.float()
    return torch.cat([(table[1:] + table[:-1]) / 2, torch.tensor([float("inf")])])


_DEVICE_TABLES: dict = {}


def device_tables(fmt: QuantFormat, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(decode table, encoder edges) on ``device``: copied there once per process."""
    key = (fmt.name, device)
    if key not in _DEVICE_TABLES:
        _DEVICE_TABLES[key] = (fmt.table.float().to(device), encoder_edges(fmt).to(device))
    return _DEVICE_TABLES[key]
