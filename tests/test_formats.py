"""The quantization maps, codecs and blockwise formats."""

import re

import pytest
import torch
from conftest import relative_rmse, slow_except
from torch._inductor.utils import run_and_get_code

import lowbit_optim
from lowbit_optim.formats import codecs, maps
from lowbit_optim.formats.catalog import (
    DYNAMIC_4BIT_SIGNED,
    DYNAMIC_8BIT_SIGNED,
    DYNAMIC_8BIT_UNSIGNED,
    DYNAMIC_8BIT_UNSIGNED_EDGES_KEPT,
    DYNAMIC_8BIT_UNSIGNED_NONZERO,
    FLOAT8,
    FLOAT8_NONZERO,
    FORMATS,
    LINEAR_4BIT_NONZERO,
    NORMAL_4BIT_SIGNED,
    get_format,
)
from lowbit_optim.state import QuantizedState

ALL_FORMATS = list(FORMATS.values())
SIGNED = {DYNAMIC_8BIT_SIGNED.name, DYNAMIC_4BIT_SIGNED.name, FLOAT8.name}
ODD_SIZES = [1, 127, 4095, 4096, 4097, 1_000_003]


def sample(fmt, shape, spread=4.0):
    """Values over many decades (optimizer moments span orders of magnitude)."""
    values = torch.randn(shape) * torch.exp(torch.randn(shape) * spread)
    return values if fmt.name in SIGNED else values.abs()


# Worst-case dequantization error relative to the block's absmax: half the widest gap
# between neighbouring codes (8-bit: top decade, 0.9/64 apart; signed 4-bit: -1 is not in the
# map, so -absmax lands on -0.8875; linear 4-bit: a value near 0 lands on 1/16).
MAX_ERROR_PER_ABSMAX = {
    DYNAMIC_8BIT_SIGNED.name: 0.9 / 64 / 2 * 1.001,
    DYNAMIC_8BIT_UNSIGNED.name: 0.9 / 128 / 2 * 1.001,
    DYNAMIC_8BIT_UNSIGNED_NONZERO.name: 0.9 / 128 / 2 * 1.001,
    DYNAMIC_8BIT_UNSIGNED_EDGES_KEPT.name: 0.9 / 128 / 2 * 1.001,
    DYNAMIC_4BIT_SIGNED.name: (1 - 0.8875) * 1.001,
    LINEAR_4BIT_NONZERO.name: 1 / 16 * 1.001,
    # e4m3fn's top binade [256, 448] is 32 apart: half of it, of 448.
    FLOAT8.name: 16 / 448 * 1.001,
    FLOAT8_NONZERO.name: 16 / 448 * 1.001,
    # NF4's widest gap is its bottom one, -1 to -0.6962: half of it.
    NORMAL_4BIT_SIGNED.name: float(NORMAL_4BIT_SIGNED.table.diff().max()) / 2 * 1.001,
}


def test_8bit_maps_equal_bitsandbytes():
    functional = pytest.importorskip("bitsandbytes.functional")
    assert torch.equal(maps.SIGNED_8BIT, functional.create_dynamic_map(signed=True))
    assert torch.equal(maps.UNSIGNED_8BIT, functional.create_dynamic_map(signed=False))


def test_4bit_maps_are_the_documented_tables():
    expected_signed = [-0.8875, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055, 0.0,
                       0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0]
    torch.testing.assert_close(maps.SIGNED_4BIT, torch.tensor(expected_signed), rtol=1e-6, atol=0)
    assert torch.equal(maps.LINEAR_4BIT, torch.arange(1, 17) / 16)
    assert (maps.LINEAR_4BIT > 0).all(), "the second-moment map must not contain zero"


def nearest_in(fmt):
    """The table whose nearest code the encoder picks: the format's own, except for a zero-free
    codec that keeps the plain map's edges, whose codes are the plain map's nearest."""
    codec = fmt.codec
    keeps_edges = isinstance(codec, codecs.ZeroFreeCodec) and codec.keeps_edges
    return codec.inner.table if keeps_edges else fmt.table


def excess_distance(fmt, normalized):
    """How much farther the chosen code is than the nearest one, in ulps of the input."""
    codes = fmt.codec.encode(normalized).long()
    distance = (nearest_in(fmt).double()[None, :] - normalized.double()[:, None]).abs()
    best = distance.min(dim=1).values
    chosen = distance.gather(1, codes[:, None])[:, 0]
    ulp = (normalized.abs().nextafter(torch.tensor(2.0)) - normalized.abs()).double()
    return (chosen - best) / ulp


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_encode_picks_the_nearest_code(fmt):
    normalized = sample(fmt, 300_000)
    normalized = normalized / normalized.abs().max()
    edges = torch.tensor([0.0, 1.0, -1.0, 1e-7, 1e-30, 0.5, -0.5, 0.0999, 0.1001])
    normalized = torch.cat([normalized, edges if fmt.name in SIGNED else edges.abs()])
    assert int((excess_distance(fmt, normalized) > 0).sum()) == 0


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_encode_at_midpoints_errs_by_at_most_a_few_ulps(fmt):
    # A value within a few ulps of a midpoint is a tie in float32: the 8-bit codec computes
    # bin edges arithmetically, so it may pick the other neighbour there, never a farther code.
    # An input k ulps from a midpoint is 2k ulps closer to one neighbour; we probe k <= 3.
    table = nearest_in(fmt)
    midpoints = (table[1:] + table[:-1]) / 2
    around = [midpoints]
    for direction in (2.0, -2.0):
        step = midpoints
        for _ in range(3):
            step = step.nextafter(torch.tensor(direction))
            around.append(step)
    normalized = torch.cat(around).clamp(-1, 1)
    if fmt.name not in SIGNED:
        normalized = normalized.clamp_min(0)
    assert float(excess_distance(fmt, normalized).max()) <= 6.0


def reference_encode(fmt, normalized):
    """The encoders in their plainest form, the oracle for the faster ones: a 16-entry map
    counts the midpoints a value exceeds; a dynamic map takes the decade from ``log10``,
    selects its constants with ``decade == d`` and corrects at the decade's lower midpoint
    and at the top; float8 is torch's cast. Stored states, old checkpoints and the Triton kernel
    follow these codes."""
    return reference_codes(fmt.codec, normalized)


def reference_codes(codec, normalized):
    if isinstance(codec, codecs.ZeroFreeCodec):
        # Its own first edge (3/4 of the smallest value, or the inner codec's 1/2 where it keeps
        # the edges), the inner codec's other edges; negative values (no second moment is) to 0.
        first_edge = (0.5 if codec.keeps_edges else 0.75) * float(codec.table[1])
        zero_free = torch.where(normalized < first_edge, 0.0, normalized)
        return reference_codes(codec.inner, zero_free)
    if isinstance(codec, codecs.Float8Codec):
        return (normalized * 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    if isinstance(codec, codecs.SmallTableCodec):
        code = torch.zeros_like(normalized)
        for midpoint in codec._midpoints:
            code = code + (normalized > midpoint).float()
        return code.to(torch.uint8)
    magnitude, bits = normalized.abs(), codec.exponent_bits
    decade = (torch.floor(torch.log10(magnitude)) + bits).clamp(0, bits - 1)
    decade = torch.nan_to_num(decade, nan=0.0).long()

    def per_decade(values):
        return torch.tensor(values, dtype=torch.float32)[decade]

    count = per_decade([float(c) for c in codec._counts])
    first = per_decade([float(r) for r in codec._first_rank])
    shift = per_decade([10.0 ** (bits - 1 - d) for d in range(bits)])
    position = torch.floor((magnitude * shift - 0.1) * count / 0.9)
    rank = first + torch.minimum(position.clamp_min(0), count - 1)
    rank = torch.where(magnitude < per_decade(codec._lower_midpoints), first - 1, rank)
    rank = torch.where(magnitude >= codec._upper_midpoint, float(codec._max_rank), rank)
    if not codec.signed:
        return (rank + codec._zero_code + 1).to(torch.uint8)
    code = torch.where(normalized >= 0, codec._zero_code + 1 + rank,
                       codec._zero_code - 1 - rank.clamp_max(codec._max_rank - 1))
    return code.to(torch.uint8)


def floats_near(anchors, ulps):
    """Every float32 within ``ulps`` of each anchor, clamped to [0, 1]."""
    bits = anchors.float().abs().view(torch.int32)[:, None] + torch.arange(-ulps, ulps + 1, dtype=torch.int32)
    return bits.reshape(-1).clamp(0, 0x3F800000).view(torch.float32)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_encode_equals_the_reference_encoder(fmt):
    # Every float within 3000 ulps of a code, a midpoint or a power of ten (where the faster
    # encoders could part from the reference), and every 4099th float32 in [0, 1]; both signs.
    anchors = torch.cat([fmt.table, (fmt.table[1:] + fmt.table[:-1]) / 2,
                         torch.tensor([10.0**-k for k in range(12)])])
    spread = torch.arange(0, 0x3F800001, 4099, dtype=torch.int32).view(torch.float32)
    values = torch.cat([floats_near(anchors, 3000), spread, torch.tensor([0.0, 1e-45, 1e-38])])
    for normalized in (values, -values):
        assert torch.equal(fmt.codec.encode(normalized), reference_encode(fmt, normalized))


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_quantize_matches_the_reference_on_odd_blocks(fmt):
    # Zero-scale blocks holding inf or NaN (divided by inf: NaN, then code 0), a block of
    # denormals, a block with one huge value.
    block = fmt.default_block_size
    values = sample(fmt, (6, block))
    values[0] = 0.0
    values[0, 3] = float("inf")
    values[1] = 0.0
    values[1, 5] = float("nan")
    values[2] = 1e-44
    values[3, 7] = 3e38
    codes, scales = fmt.quantize_blocks(values)
    finite = torch.isfinite(values)
    expected_scales = torch.where(finite, values.abs(), 0.0).amax(dim=1)
    normalized = torch.where(expected_scales[:, None] > 0, values / expected_scales[:, None], 0.0)
    normalized = torch.nan_to_num(normalized, nan=0.0).clamp(-1, 1)
    assert torch.equal(scales, expected_scales)
    assert torch.equal(fmt.unpack(codes), reference_encode(fmt, normalized))


def test_float8_bit_arithmetic_is_torchs_cast():
    # Every float32 within 4096 ulps of an e4m3fn value or of a midpoint between two (the
    # rounding edges: ties go to even), every 257th float32 in [0, 448], and 0, -0 and
    # float32 subnormals; both signs. Checked once on every float32 in [-448, 448].
    e4m3 = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    anchors = torch.cat([e4m3, (e4m3[1:] + e4m3[:-1]) / 2])
    bits = anchors.view(torch.int32)[:, None] + torch.arange(-4096, 4097, dtype=torch.int32)
    top = torch.tensor(448.0).view(torch.int32)
    spread = torch.arange(0, int(top) + 1, 257, dtype=torch.int32)
    values = torch.cat([bits.reshape(-1).clamp(0, int(top)), spread]).view(torch.float32)
    values = torch.cat([values, torch.tensor([0.0, 1e-45, 1e-40, 1.1754942e-38])])
    for signed in (values, -values):
        expected = signed.to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(codecs.e4m3fn_bits(signed), expected)


def test_zero_free_codecs_never_decode_zero():
    for fmt in (DYNAMIC_8BIT_UNSIGNED_NONZERO, DYNAMIC_8BIT_UNSIGNED_EDGES_KEPT, FLOAT8_NONZERO):
        assert (fmt.table != 0).all(), fmt.name
        normalized = torch.linspace(0, 1, 100_001)
        assert (fmt.codec.decode(fmt.codec.encode(normalized)) > 0).all(), fmt.name
    with pytest.raises(ValueError, match="code 0 is 0"):
        codecs.ZeroFreeCodec(codecs.SIGNED_8BIT_CODEC)


def test_edges_kept_map_stores_the_plain_maps_codes_and_reads_code_0_as_half_the_smallest():
    """The benchmark's ``lowbit_8bit_edges_kept`` ablation: bitsandbytes' codes bit for bit
    (first bin edge t1 / 2, where the zero-free map moves it to 3 t1 / 4); only code 0 reads
    differently, t1 / 2 of the scale instead of 0."""
    plain, kept = DYNAMIC_8BIT_UNSIGNED, DYNAMIC_8BIT_UNSIGNED_EDGES_KEPT
    smallest = float(plain.table[1])
    values = torch.cat([floats_near(torch.tensor([smallest / 2, 0.75 * smallest, smallest]), 3000),
                        torch.rand(100_000) ** 8, torch.tensor([0.0, 1e-45, 1.0])])
    assert torch.equal(kept.codec.encode(values), plain.codec.encode(values))
    assert float(kept.table[0]) == smallest / 2 and torch.equal(kept.table[1:], plain.table[1:])
    moved = DYNAMIC_8BIT_UNSIGNED_NONZERO.codec.encode(values) != plain.codec.encode(values)
    assert moved.any() and bool(((values[moved] >= smallest / 2) & (values[moved] < 0.75 * smallest)).all())
    with pytest.raises(ValueError, match=r"zero_reads must lie in \(0, 1\).*got 0"):
        codecs.ZeroFreeCodec(codecs.UNSIGNED_8BIT_CODEC, zero_reads=0)


def test_linear_encoder_is_exact_arithmetic():
    # code = clamp(ceil(16 x - 1.5), 0, 15) counts the midpoints (2k + 3) / 32 that x exceeds:
    # 16 x is exact and so is 16 x - 1.5 wherever it is >= 0 (the proof is in the docstring).
    codec = LINEAR_4BIT_NONZERO.codec
    midpoints = torch.tensor(codec._midpoints)
    assert torch.equal(midpoints, (2 * torch.arange(15) + 3) / 32)
    x = floats_near(midpoints, 50)
    assert torch.equal(codec.encode(x), (x[:, None] > midpoints[None, :]).sum(1).to(torch.uint8))
    with pytest.raises(ValueError, match="needs the map"):
        codecs.LinearNonzeroCodec(maps.SIGNED_4BIT)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_decode_is_the_table(fmt):
    codes = torch.arange(fmt.table.numel(), dtype=torch.uint8)
    assert torch.equal(fmt.codec.decode(codes), fmt.table)


@pytest.mark.sweep
@pytest.mark.parametrize("numel", ODD_SIZES)
@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_round_trip_error_within_format_bound(fmt, numel):
    values = sample(fmt, numel, spread=1.0)
    state = QuantizedState.from_float(values, fmt, fmt.default_block_size)
    assert state.num_blocks == -(-numel // fmt.default_block_size)  # padded, never fp32
    restored = state.dequantize()
    assert restored.shape == values.shape
    padded = torch.nn.functional.pad(values, (0, state.num_blocks * state.block_size - numel))
    absmax = padded.view(state.num_blocks, -1).abs().amax(dim=1)
    error = (restored - values).abs()
    bound = torch.repeat_interleave(absmax, state.block_size)[:numel] * MAX_ERROR_PER_ABSMAX[fmt.name]
    assert (error <= bound).all()


def test_4bit_is_a_coarser_approximation_than_8bit():
    values = torch.randn(1 << 16)
    error8 = relative_rmse(QuantizedState.from_float(values, DYNAMIC_8BIT_SIGNED, 256).dequantize(), values)
    error4 = relative_rmse(QuantizedState.from_float(values, DYNAMIC_4BIT_SIGNED, 128).dequantize(), values)
    assert error8 < 0.02 < error4 < 0.2


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_all_zero_block_gives_zeros(fmt):
    state = QuantizedState.from_float(torch.zeros(3 * fmt.default_block_size), fmt, fmt.default_block_size)
    restored = state.dequantize()
    assert torch.equal(restored, torch.zeros_like(restored))


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_non_finite_inputs_stay_in_their_element(fmt):
    block = fmt.default_block_size
    values = sample(fmt, 2 * block, spread=0.5)
    values[3], values[5], values[block + 7] = float("nan"), float("inf"), float("inf")
    if fmt.name in SIGNED:
        values[9] = float("-inf")
    state = QuantizedState.from_float(values, fmt, block)
    restored = state.dequantize()
    assert torch.isfinite(restored).all()
    finite = torch.isfinite(values)
    scales = values.where(finite, 0).abs().view(2, block).amax(dim=1)
    assert torch.equal(state.scales, scales), "the block scale ignores non-finite values"
    # inf saturates to the largest finite magnitude of its block; NaN becomes the code nearest 0.
    assert restored[5] == scales[0] and restored[block + 7] == scales[1]
    assert restored[3] == fmt.table[fmt.table.abs().argmin()] * scales[0]
    clean = QuantizedState.from_float(values.where(finite, 0), fmt, block).dequantize()
    assert torch.equal(restored[finite], clean[finite]), "other elements are unaffected"


def test_4bit_packing_layout():
    fmt = DYNAMIC_4BIT_SIGNED
    codes = torch.randint(0, 16, (3, 128), dtype=torch.uint8)
    packed = fmt.pack(codes)
    assert packed.shape == (3, 64) and packed.dtype == torch.uint8
    assert torch.equal(packed & 15, codes[:, :64]) and torch.equal(packed >> 4, codes[:, 64:])
    assert torch.equal(fmt.unpack(packed), codes)


def test_state_bytes_per_element():
    shape = (1024, 1024)
    for first, second, limit in [(DYNAMIC_8BIT_SIGNED, DYNAMIC_8BIT_UNSIGNED, 2.04),
                                 (DYNAMIC_4BIT_SIGNED, LINEAR_4BIT_NONZERO, 1.07),
                                 (FLOAT8, FLOAT8_NONZERO, 2.04)]:
        states = [QuantizedState.zeros(shape, fmt, fmt.default_block_size) for fmt in (first, second)]
        nbytes = sum(s.codes.nbytes + s.scales.nbytes for s in states)
        assert nbytes / (1024 * 1024) <= limit


# One graph per format: the fast tier compiles the 8-bit signed map's (the compiled optimizer
# steps of tests/test_optimizer.py compile the others' encoders within their steps).
@pytest.mark.parametrize("fmt", slow_except(ALL_FORMATS, DYNAMIC_8BIT_SIGNED), ids=lambda f: f.name)
def test_compiled_quantize_matches_eager(fmt):
    blocks = sample(fmt, (37, fmt.default_block_size))
    compiled = torch.compile(fmt.quantize_blocks, dynamic=False)
    codes, scales = compiled(blocks)
    eager_codes, eager_scales = fmt.quantize_blocks(blocks)
    assert torch.equal(scales, eager_scales)
    # Inductor may fuse multiply-adds differently: allow codes that differ at float-rounding
    # ties, i.e. whose decoded values sit at equal distance within a few ulps.
    differ = codes != eager_codes
    assert int(differ.sum()) <= 2


def test_unknown_format_and_bad_block_size():
    with pytest.raises(ValueError, match="Unknown quantization format 'int3'"):
        get_format("int3")
    with pytest.raises(ValueError, match="Invalid block_size: 7 .a power of two"):
        QuantizedState.zeros((10,), DYNAMIC_4BIT_SIGNED, 7)


# Slow tier, and after every other test: run_and_get_code resets Dynamo, so every graph compiled
# before it would be compiled again.
@pytest.mark.slow
@pytest.mark.resets_dynamo
@pytest.mark.parametrize("optimizer", ["AdamW8bit", "AdamW4bit", "AdamWFp8"])
def test_compiled_cpu_step_has_no_scalar_fallbacks(optimizer):
    """Guards the compiled step's CPU speed in Inductor's generated C++: no float64 ``std::pow``
    per vector iteration (the bias corrections are computed once), no element-by-element
    ``std::isnan`` loop (no ``nan_to_num``), no bounds-checked gather, no ``log10``, and for
    4-bit no unpacked int32 copy of the codes (the halves are never stacked)."""
    param = torch.nn.Parameter(torch.randn(64, 256))
    param.grad = torch.randn_like(param)
    step = getattr(lowbit_optim, optimizer)([param], lr=1e-3, backend="compile").step
    _, sources = run_and_get_code(step)
    source = "\n".join(sources)
    for construct in ("std::pow", "std::isnan", "index out of bounds", "log10"):
        assert construct not in source, construct
    buffers = re.findall(r"empty_strided_cpu\((\([^)]*\)), \([^)]*\), (torch\.\w+)\)", source)
    assert buffers and all(dtype == "torch.float32" for _, dtype in buffers), buffers
