"""The Triton kernel's encoders against the reference codecs, value by value.

Encoding is a comparison, so the kernel must give exactly ``codec.encode``'s code for every
normalised value, ties at bin edges included (the 8-bit cell tables' argument is in
``lowbit_optim/formats/cell_tables.py``). ``encode_normalized`` runs the kernel's own encoder
(``moment_codes.encode``): under the interpreter here, compiled in tests/test_cuda.py.
"""

import pytest
import torch

pytest.importorskip("triton")
from lowbit_optim.formats import cell_tables  # noqa: E402
from lowbit_optim.formats.catalog import FORMATS  # noqa: E402
from lowbit_optim.step import kernels  # noqa: E402

ONE_BITS = 0x3F800000


def _neighbours(anchors: torch.Tensor, ulps: int) -> torch.Tensor:
    """Every float32 within ``ulps`` of each non-negative anchor (bit patterns are ordered)."""
    keys = anchors.float().abs().view(torch.int32).long()
    keys = (keys[:, None] + torch.arange(-ulps, ulps + 1)).reshape(-1).clamp(0, ONE_BITS + 4 * ulps)
    return keys.to(torch.int32).view(torch.float32)


def hard_values(fmt) -> torch.Tensor:
    """Magnitudes where an encoder can go wrong, then each with both signs, and the specials."""
    table = fmt.table.float()
    midpoints = (table[1:] + table[:-1]) / 2
    cell_starts = torch.tensor([2.0**binade * (1 + k / 2**cell_tables.INDEX_BITS)
                                for binade in range(cell_tables.FLOOR_BINADE - 1, 1)
                                for k in range(2**cell_tables.INDEX_BITS)])
    powers_of_ten = torch.tensor([10.0**-k for k in range(10)])
    zero_free_edge = torch.tensor([getattr(fmt.codec, "first_edge", 0.0)])
    magnitudes = torch.cat([
        # The table's values and float32 midpoints: every bin edge of every codec lies within a
        # few ulps of a midpoint (the dynamic maps' float32 arithmetic: within 2**-19 relative).
        _neighbours(torch.cat([table, midpoints, zero_free_edge, powers_of_ten]), 300),
        _neighbours(cell_starts, 4),  # where the cell index changes
        torch.arange(0, 1 << 23, 997, dtype=torch.int32).view(torch.float32),  # subnormals
        torch.arange(0, ONE_BITS + 1, 4099, dtype=torch.int32).view(torch.float32),  # all of [0, 1]
    ])
    specials = torch.tensor([0.0, float("inf"), float("nan"), 1.5, 2.0, 3.0e38])
    values = torch.cat([magnitudes, specials])
    return torch.cat([values, -values])


def reference_codes(fmt, values: torch.Tensor) -> torch.Tensor:
    """The reference's normalisation (NaN -> 0, clamped to [-1, 1]), then the codec."""
    return fmt.codec.encode(torch.where(values.isnan(), 0.0, values).clamp(-1.0, 1.0))


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_kernel_encoder_gives_the_codecs_codes(name):
    fmt = FORMATS[name]
    values = hard_values(fmt)
    expected = reference_codes(fmt, values)
    codes = kernels.encode_normalized(values, fmt)
    differ = (codes != expected).nonzero().view(-1)
    assert differ.numel() == 0, (
        f"{name}: {differ.numel()} of {values.numel()} codes differ, e.g. "
        + ", ".join(f"{float(values[i])!r} (bits {int(values[i:i + 1].view(torch.int32)):#010x}): "
                    f"kernel {int(codes[i])}, codec {int(expected[i])}" for i in differ[:5]))


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_cuda_kernel_encoder_gives_the_codecs_codes(name):
    """The compiled encoders (the cell tables read through inline PTX, hardware max/min and
    integer operations) against the CPU codec, on the same values."""
    fmt = FORMATS[name]
    values = hard_values(fmt)
    codes = kernels.encode_normalized(values.cuda(), fmt).cpu()
    assert torch.equal(codes, reference_codes(fmt, values))


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("name", ["float8-e4m3", "dynamic8-signed"])
def test_kernel_encoder_signed_zero_and_nan_signs(name):
    """float8's -0.0 has a code of its own (0x80) while NaN, whichever its sign bit, encodes as
    +0.0 does; the signed dynamic map gives both zeros its zero code."""
    fmt = FORMATS[name]
    nans = torch.tensor([0x7FC00000, -0x00400000, 0x7FFFFFFF, -1], dtype=torch.int32).view(torch.float32)
    values = torch.cat([torch.tensor([0.0, -0.0, -1e-45, 1e-45]), nans])
    assert torch.equal(kernels.encode_normalized(values, fmt), reference_codes(fmt, values))


@pytest.mark.parametrize("name", [n for n in sorted(FORMATS) if FORMATS[n].bits == 8])
def test_cell_tables_have_one_edge_per_cell(name):
    """Every 8-bit format we ship fits the cell layout the kernel assumes (one edge per cell
    at most, nothing below the floor), and the sign handling is the codec's: the table builder
    refuses a format otherwise."""
    fmt = FORMATS[name]
    words, sign = cell_tables.cell_words(fmt.codec.encode, name)
    expected_sign = {"dynamic8-signed": cell_tables.SIGNED, "float8-e4m3": cell_tables.SIGNED_ZERO,
                     "dynamic8-unsigned": cell_tables.ABS}.get(name, cell_tables.CLAMPED)
    assert sign == expected_sign
    halves = 2 if sign in (cell_tables.SIGNED, cell_tables.SIGNED_ZERO) else 1
    assert words.numel() == (cell_tables.SIGNED_POSITIVE_START + cell_tables.CELLS_PER_HALF
                             if halves == 2 else cell_tables.CELLS_PER_HALF)


def test_cell_table_refuses_edges_closer_than_a_cell():
    """A codec with two edges in one cell (a map finer than 2**-7 of a binade) is refused
    with the reason, rather than encoded wrongly."""
    def fine(values):  # two edges 2**-10 apart in [0.5, 1), whose cells are 2**-8 wide
        return (values > 0.5 + 2**-9).to(torch.uint8) + (values > 0.5 + 2**-8 - 2**-10).to(torch.uint8)
    with pytest.raises(ValueError, match="more than one bin edge"):
        cell_tables.cell_words(fine, "fine")
