"""The master weight encodings of lowbit_optim.step.master_weights, value by value: a bfloat16
or float16 parameter and its int8 (24-bit) or int16 (32-bit) correction against the float32
master weight they stand for. The optimizers that use them: tests/test_master_weights.py.

The float16 cases are every float32 within a few ulps of every finite float16 value and of
every midpoint between two neighbours (binade edges, ties, values that round up into the
next binade, the largest float16 and the overflow past it), and random float32 values of
every binade.
"""

import pytest
import torch

from lowbit_optim.step.master_weights import read_master, split_master

FLOAT16_MAX_ROUNDING_DOWN = 65520.0  # the float16 midpoint past 65504: it and above round to inf
FLOAT16_MAX_24_BIT = 65519.875  # from here up a 24-bit master weight rounds to 65520 (inf)
SMALLEST_EXACT = 2.0**-15  # float16 32-bit master weights are exact from here up
SUBNORMAL_UNIT = 2.0**-38  # the 32-bit correction's unit below 2**-14


def same_bits(a, b):
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def float16_neighbourhoods() -> torch.Tensor:
    """Every float32 within 3 ulps of each finite float16 value and of each midpoint between
    neighbouring float16 values, both signs."""
    halves = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    following = torch.cat([halves[1:], torch.tensor([65536.0])])  # 65536: where 65504 rounds to inf
    midpoints = (halves + following) / 2  # exact: 12 significant bits
    centres = torch.cat([halves, midpoints]).view(torch.int32)
    near = (centres[:, None] + torch.arange(-3, 4, dtype=torch.int32)).reshape(-1).view(torch.float32)
    near = near[torch.isfinite(near)]
    return torch.cat([near, -near])


def random_float32_of_every_binade(count=1_000_000, seed=0) -> torch.Tensor:
    """Random float32 bit patterns with exponents from 2**-40 to 2**16, both signs."""
    generator = torch.Generator().manual_seed(seed)
    fields = torch.randint(127 - 40, 127 + 17, (count,), generator=generator, dtype=torch.int32)
    mantissas = torch.randint(0, 1 << 23, (count,), generator=generator, dtype=torch.int32)
    signs = torch.randint(0, 2, (count,), generator=generator, dtype=torch.int32) << 31
    return (signs | (fields << 23) | mantissas).view(torch.float32)


def float16_cases() -> torch.Tensor:
    return torch.cat([float16_neighbourhoods(), random_float32_of_every_binade()])


def float16_exponent(param: torch.Tensor) -> torch.Tensor:
    """E of the encoding's unit: the binade exponent of ``param``, -14 for zero and subnormals."""
    exponent = torch.frexp(param.float()).exponent - 1
    return torch.where(param == 0, -14, exponent.clamp(min=-14))


# --- bfloat16 -------------------------------------------------------------------------------

def test_the_bit_split_reproduces_every_float32_exactly_and_24_bits_within_128_ulps():
    finite = torch.randint(-2**31, 2**31 - 1, (200_000,), dtype=torch.int32).view(torch.float32)
    edges = torch.tensor([0.0, -0.0, 3.3895e38, -3.3895e38, 1e-45])
    values = torch.cat([finite[torch.isfinite(finite)], edges])
    param, correction = split_master(values, torch.bfloat16, torch.int16)
    assert same_bits(read_master(param, correction), values)
    param, correction = split_master(values, torch.bfloat16, torch.int8)
    error = (read_master(param, correction).view(torch.int32).long() - values.view(torch.int32).long()).abs()
    assert error.max() <= 128  # half of the 2**8 float32 ulps a 24-bit master drops
    assert error.max() > 0


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_encoding_keeps_inf_and_nan(param_dtype):
    values = torch.tensor([float("inf"), -float("inf"), float("nan"), -float("nan")])
    for dtype in (torch.int8, torch.int16):
        param, correction = split_master(values, param_dtype, dtype)
        master = read_master(param, correction)
        assert master[0] == float("inf") and master[1] == -float("inf") and torch.isnan(master[2:]).all()
        assert torch.isnan(param[2:].float()).all() and not correction.any()


# --- float16 --------------------------------------------------------------------------------

def test_float16_with_int16_reproduces_every_float32_from_2_to_the_minus_15_to_float16_max():
    values = float16_cases()
    magnitude = values.abs()
    values = values[(magnitude >= SMALLEST_EXACT) & (magnitude < FLOAT16_MAX_ROUNDING_DOWN)]
    param, correction = split_master(values, torch.float16, torch.int16)
    assert torch.equal(param.view(torch.int16), values.to(torch.float16).view(torch.int16))  # nearest even
    assert same_bits(read_master(param, correction), values)
    # Half a float16 ulp in units of 2**-13 of it: reached at the ties, which round to even.
    assert correction.abs().max() == 2**13


def test_float16_with_int16_below_2_to_the_minus_15_rounds_to_a_multiple_of_2_to_the_minus_38():
    values = float16_cases()
    edges = [0.0, -0.0, 1e-45, -1e-45, 2.0**-39, -3 * 2.0**-39, 2.0**-24 + 2.0**-40]
    values = torch.cat([values[values.abs() < SMALLEST_EXACT], torch.tensor(edges)])
    param, correction = split_master(values, torch.float16, torch.int16)
    expected = (values.double() / SUBNORMAL_UNIT).round() * SUBNORMAL_UNIT  # half to even, exact
    # Signed zeros included: a master weight of -0.0 reads back as -0.0.
    assert same_bits(read_master(param, correction), expected.float())
    assert not same_bits(read_master(param, correction), values)  # not exact down here


def test_float16_with_int8_keeps_18_significant_bits():
    values = float16_cases()
    values = values[values.abs() < FLOAT16_MAX_24_BIT]
    param, correction = split_master(values, torch.float16, torch.int8)
    assert correction.abs().max() == 64  # half a float16 ulp in units of 2**-7 of it
    # E: the exponent of values' own rounding (the parameter's, but for a master weight that
    # is a float16 midpoint, whose parameter is the even neighbour: test below).
    exponent = float16_exponent(values.to(torch.float16)).double()
    master = read_master(param, correction).double()
    # The master is values rounded to a multiple of 2**(E - 17), half to even.
    unit = torch.exp2(exponent - 17)
    assert torch.equal(master, (values.double() / unit).round() * unit)
    error = (master - values.double()).abs()
    assert (error <= torch.exp2(exponent - 18)).all() and error.max() > 0
    normal = values.abs() >= 2.0**-14
    assert (error[normal] <= 2.0**-17 * values[normal].abs().double()).all()


@pytest.mark.parametrize("correction_dtype", [torch.int8, torch.int16], ids=str)
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_parameter_is_its_master_weight_rounded_and_a_pair_splits_back_unchanged(param_dtype,
                                                                                   correction_dtype):
    # A step that keeps an element's master weight (a NaN gradient) reads and splits it again:
    # parameter and correction must come back as they were.
    values = float16_cases() if param_dtype == torch.float16 else random_float32_of_every_binade()
    param, correction = split_master(values, param_dtype, correction_dtype)
    master = read_master(param, correction)
    again = split_master(master, param_dtype, correction_dtype)
    assert torch.equal(again[0].view(torch.int16), param.view(torch.int16))
    assert torch.equal(again[1], correction)
    if param_dtype == torch.float16:
        finite = torch.isfinite(master)
        rounded = master[finite].to(torch.float16)
        assert torch.equal(param[finite].view(torch.int16), rounded.view(torch.int16))
        # values' own rounding differs only where the master weight is the midpoint between it
        # and the parameter (int16: only below 2**-15, where the master is rounded too).
        own = values.to(torch.float16)
        moved = (param.view(torch.int16) != own.view(torch.int16)) & finite
        assert moved.any() and torch.equal(master[moved], (param[moved].float() + own[moved].float()) / 2)
        if correction_dtype == torch.int16:
            assert (values[moved].abs() < SMALLEST_EXACT).all()


@pytest.mark.parametrize("correction_dtype", [torch.int8, torch.int16], ids=str)
def test_float16_overflow_gives_inf_with_no_correction(correction_dtype):
    largest_below = (torch.tensor(FLOAT16_MAX_ROUNDING_DOWN).view(torch.int32) - 1).view(torch.float32)
    # The 24-bit master weight of the largest float32 below 65520 is 65520 itself: inf too.
    int8 = correction_dtype == torch.int8
    overflowing = [65520.0, -65520.0, 1e30, -3.4e38] + ([largest_below.item()] if int8 else [])
    below = [65504.0, 65519.875 - 2**-8] + ([] if int8 else [largest_below.item()])
    values = torch.tensor(overflowing + below)
    param, correction = split_master(values, torch.float16, correction_dtype)
    master = read_master(param, correction)
    count = len(overflowing)
    assert torch.isinf(param[:count]).all()
    assert torch.equal(torch.sign(param[:count].float()), torch.sign(values[:count]))
    assert torch.equal(master[:count], param[:count].float()) and not correction[:count].any()
    assert (param[count:] == 65504.0).all()  # the largest float16 holds the rest
    if correction_dtype == torch.int16:
        assert same_bits(master[count:], values[count:])


def test_float16_nan_becomes_one_quiet_nan():
    patterns = torch.tensor([0x7FC00000, 0xFFC00001 - 2**32, 0x7F800001, 0x7FBFFFFF], dtype=torch.int32)
    param, correction = split_master(patterns.view(torch.float32), torch.float16, torch.int16)
    assert (param.view(torch.int16) == 0x7E00).all() and not correction.any()


@pytest.mark.slow
def test_compiled_encodings_match_eager_bit_for_bit():
    """Inductor's casts, rounding and signed zeros give the eager encoding's bits."""
    values = torch.cat([float16_neighbourhoods(), torch.tensor([float("nan"), float("inf"), 1e30, -0.0])])

    def round_trips(master):
        results = []
        for param_dtype in (torch.bfloat16, torch.float16):
            for correction_dtype in (torch.int8, torch.int16):
                param, correction = split_master(master, param_dtype, correction_dtype)
                results += [param, correction, read_master(param, correction)]
        return results

    compiled = torch.compile(round_trips, dynamic=False)(values)
    for got, expected in zip(compiled, round_trips(values)):
        assert got.dtype == expected.dtype
        if got.dtype == torch.float32:
            # The master weights read back: NaN where the parameter is NaN, whatever its payload
            # (torch's eager float16 -> float32 cast gives 0x7FFFFFFF or 0x7FC00000 for 0x7E00
            # depending on the element's position); splitting them again makes it one NaN.
            nan = torch.isnan(expected)
            assert torch.equal(torch.isnan(got), nan)
            got, expected = got[~nan], expected[~nan]
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
