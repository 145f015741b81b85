"""The C++ kernel's encoders against the reference codecs at every bin edge: the cell-table
encoder of the 8-bit dynamic maps (``formats/cell_tables.py``) and float8's rounding by one
addition (``BlockEncoder<kE4M3>``).

Random moments almost never land within a few ulps of a bin edge, so the step tests alone
would not see an encoder that is off there. Here a moment is made to equal chosen values
exactly: Lion with ``beta2 = 0`` and a zero state gives ``m = 0 * 0 + g * 1 = g``, and a 1.0
in every block makes its scale 1, so the kernel encodes ``g`` itself. The values are every
float within a few ulps of every place where the codec's code changes, both signs; the codes
must equal ``codec.encode(g)``, on every instruction-set path.
"""

import pytest
import torch
from helpers import available_isas

from lowbit_optim import QuantizedState
from lowbit_optim.formats import cell_tables
from lowbit_optim.formats.catalog import FORMATS
from lowbit_optim.step import cpu_kernel

BLOCK = 256
CELL_FORMATS = ["dynamic8-signed", "dynamic8-unsigned", "dynamic8-unsigned-nonzero",
                "dynamic8-unsigned-nonzero-edges-kept"]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if not cpu_kernel.load():
        pytest.skip("the C++ CPU step could not be built here")


def edge_values(fmt) -> torch.Tensor:
    """Every float within 3 ulps of each code change of ``fmt`` in (0, 1], and of each cell
    start, with their negatives and 0, -0."""
    words, _ = cell_tables.cell_words(fmt.codec.encode, fmt.name)
    words = words[-cell_tables.CELLS_PER_HALF:].long() & 0xFFFFFFFF  # the positive half
    low_bits = cell_tables.MANTISSA_BITS - cell_tables.INDEX_BITS
    cells = torch.arange(cell_tables.CELLS_PER_HALF, dtype=torch.int64)
    start = ((127 + cell_tables.FLOOR_BINADE) << cell_tables.MANTISSA_BITS) + (cells << low_bits)
    position = words >> (cell_tables.INDEX_BITS + 9)
    has_edge = position != (1 << low_bits) - 1
    changes = (start + position + 1)[has_edge]
    assert changes.numel() > 100  # the map's edges, not an empty sweep
    centres = torch.cat([changes, start])
    keys = (centres[:, None] + torch.arange(-3, 4)[None, :]).reshape(-1)
    keys = keys[(keys > 0) & (keys <= 0x3F800000)].unique()
    values = keys.to(torch.int32).view(torch.float32)
    return torch.cat([values, -values, torch.tensor([0.0, -0.0])])


def float8_edge_values() -> torch.Tensor:
    """Every float within 4 ulps of each e4m3fn value and of each midpoint between neighbours,
    divided by 448 (the normalised values the codec multiplies back), with their negatives,
    and 0 (not -0: Lion's ``0 * 0 + g`` makes a -0 gradient a +0 moment)."""
    codes = torch.arange(0x7F, dtype=torch.int32)  # 0 .. 448, the non-negative finite codes
    values = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
    midpoints = (values[1:] + values[:-1]) / 2  # exact: e4m3fn values have 4 significant bits
    centres = (torch.cat([values, midpoints]) / 448).view(torch.int32).to(torch.int64)
    keys = (centres[:, None] + torch.arange(-4, 5)[None, :]).reshape(-1)
    keys = keys[(keys > 0) & (keys <= 0x3F800000)].unique()
    normalised = keys.to(torch.int32).view(torch.float32)
    return torch.cat([normalised, -normalised, torch.tensor([0.0])])


def assert_same_codes(fmt, values: torch.Tensor, isa: str):
    """The kernel's codes of ``values`` (each block led by a 1.0, so its scale is 1) are the
    reference codec's."""
    per_block = BLOCK - 1
    blocks = -(-values.numel() // per_block)
    chosen = torch.zeros(blocks * per_block)
    chosen[:values.numel()] = values
    ones = torch.ones(blocks, 1)  # each block's largest magnitude: its scale is 1, so m / scale is m
    grad = torch.cat([ones, chosen.view(blocks, per_block)], dim=1).reshape(-1)
    param = torch.zeros_like(grad)
    state = QuantizedState.zeros(grad.shape, fmt, BLOCK)
    lion_values = [torch.tensor(v, dtype=torch.float64) for v in (0.0, 0.5, 0.0, 0.0)]  # lr, b1, b2, wd
    cpu_kernel.cpu_rule_step(param, grad, (state,), lion_values, functor="lion",
                             options=cpu_kernel.KernelOptions(False, False, isa))
    assert torch.equal(state.scales, torch.ones(blocks))
    expected = fmt.codec.encode(grad.view(blocks, BLOCK)).to(torch.uint8)
    mismatched = (state.codes.view(blocks, BLOCK) != expected).nonzero()
    assert mismatched.numel() == 0, (
        f"{mismatched.shape[0]} codes differ, first at value "
        f"{grad.view(blocks, BLOCK)[tuple(mismatched[0])].item()!r}")


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("name", CELL_FORMATS)
def test_cell_encoder_matches_the_codec_at_every_edge(name, isa):
    assert_same_codes(FORMATS[name], edge_values(FORMATS[name]), isa)


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("name", ["float8-e4m3", "float8-e4m3-nonzero"])
def test_float8_encoder_matches_the_codec_at_every_edge(name, isa):
    values = float8_edge_values()
    assert values.numel() > 2000  # 127 values and 126 midpoints, 9 floats each, both signs
    assert_same_codes(FORMATS[name], values, isa)
