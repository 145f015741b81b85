"""Cell tables for the kernels' encoders: a code from the top bits of a float32.

A normalised value ``x`` in [-1, 1] must encode as ``codec.encode(x)`` of its format
(``lowbit_optim.formats.codecs``), exactly: encoding is a comparison, ties included. The
Triton kernel (``step/kernels/moment_codes._encode_cells``) and the C++ CPU kernel (the
8-bit dynamic maps, ``step/csrc/cpu_step_kernel.h``) get it without a search:

1. The magnitude ``m`` (``|x|``, or ``x`` itself for a zero-free codec, below) is clamped to
   ``[2**FLOOR_BINADE, 1]`` by a max and a min: exact, and the max drops NaN, which lands on
   the floor. Every codec here has no bin edge at or below the floor (checked when the table
   is built), so the clamp keeps every code in [-1, 1], gives NaN the code of 0 and +-inf and
   values past +-1 the code of +-1: what the reference's normalisation (NaN -> 0, clamp to
   [-1, 1]) gives them.
2. ``m``'s float32 bits ``b`` shifted right by ``23 - INDEX_BITS`` (its exponent and top
   ``INDEX_BITS`` mantissa bits), minus the floor's, index a cell: one of ``2**INDEX_BITS``
   equal slices of a binade; 1.0 alone has the last cell.
3. The cell's int32 word holds the code of the cell's first float (low byte), the code past
   the cell's bin edge (second byte) and the edge's position in the cell (the top
   ``23 - INDEX_BITS`` bits: the low bits of the last float that keeps the first code, all
   ones where the cell has no edge). ``b << (INDEX_BITS + 9)`` drops the sign, exponent and
   index bits and leaves ``b``'s position in the cell above 16 zero bits, so one unsigned
   comparison with the word is ``position > edge``, and it selects the word's second byte
   (``word >> 8``) or its first.

Why that is ``codec.encode`` for every float32: each codec is a monotone function of ``x``
on either sign, so on a half it is fixed by the floats where its code changes. Monotone,
because every float32 operation rounds monotonically: ``DynamicExponentCodec`` takes a rank
from ``|x|`` by comparisons with ascending decade starts and, within a decade,
``floor(((m * shift) - 0.1) * count / 0.9)`` clamped to the decade, whose rank ranges follow
each other; its signed map's negative codes fall as ``|x|`` grows. ``Float8Codec`` rounds
``x * 448`` twice (the product, then to e4m3fn), and e4m3fn's bit patterns order its values
of one sign. ``ZeroFreeCodec`` sends everything below its first edge, negative values too,
to code 0, and is its inner codec above. ``cell_words`` builds every word from
``codec.encode`` itself: the codes at each cell's two ends, and where they differ, the float
where the code changes, by bisection over the cell's bit patterns. It refuses a format whose
codes differ by more than one step across a cell (two edges in one cell: ``INDEX_BITS`` too
small for its map) or which has an edge at or below the floor. Given monotonicity, the word
then holds the code of every float32 in its cell, and the kernel forms ``b``, the index and
the comparison without rounding (max, min and integer operations), so its code is the
codec's (``SmallTableCodec``, the 4-bit maps' comparisons with their midpoints, is monotone
too). ``tests/test_triton_encoders.py`` runs the kernel's encoder against
``codec.encode`` on every float32 within 300 ulps of every table value and midpoint, at every
cell boundary, on NaN, +-inf, +-0, subnormals and a sample of all of [-1, 1]; the same lookup
written in torch matched ``codec.encode`` once on every float32 in [-1, 1] for the default
optimizers' formats (dynamic8-signed, dynamic8-unsigned-nonzero, dynamic4-signed, float8-e4m3
and its zero-free variant).

Signs (``sign_handling``): a format that encodes ``-x`` as ``x`` (``ABS``) indexes ``|x|``; a
zero-free one, whose negative values all encode as 0 does (``CLAMPED``), clamps ``x`` itself,
so that they land on the floor. A signed one has a second half of cells for negative values
(``SIGNED``), which the kernel reaches by putting ``x``'s sign bit back on the clamped
magnitude: the sign becomes the index's bit 15, so the halves sit ``SIGNED_POSITIVE_START``
cells apart (the words between are never read). Where -0.0 has a code of its own (float8:
0x80), the sign is taken after ``min(x, inf)``, which turns NaN (whose sign bit the hardware
leaves either way) into +inf: NaN must encode as +0.0 does (``SIGNED_ZERO``).

Layout constants: 2**7 cells per binade is also the fewest the word allows (its two code
bytes sit below the position, which starts at bit ``INDEX_BITS + 9``), and enough for the
8-bit dynamic maps, whose densest binade [0.5, 1) has edges 0.9 / 128 apart and cells of
2**-8; their smallest edge is 1.6e-7 (float8's 2.2e-6, the 4-bit map's 2.8e-3), above the
floor 2**-23. A table is 2945 words (11.5 KB) per half.
"""

import torch

# The cell layout every table shares, so that the kernel's shifts are constants: binades
# 2**-23 to 2**-1 in 2**7 cells each, and 1.0 itself.
INDEX_BITS = 7
FLOOR_BINADE = -23
MANTISSA_BITS = 23
CELLS_PER_HALF = (-FLOOR_BINADE << INDEX_BITS) + 1
# A signed table's positive half starts here: the weight of the sign bit in the cell index.
SIGNED_POSITIVE_START = 1 << (31 - (MANTISSA_BITS - INDEX_BITS))
_ONE_BITS = 0x3F800000
# How a format's values reach the cells (the kernel's encoder kinds, tables.py).
CLAMPED, ABS, SIGNED, SIGNED_ZERO = 0, 1, 2, 3


def _floats(keys: torch.Tensor, negative: bool) -> torch.Tensor:
    values = keys.to(torch.int32).view(torch.float32)
    return -values if negative else values


def sign_handling(encode) -> int:
    """How negative values encode: like their magnitude (ABS), like 0 (CLAMPED), or by a half
    of their own (SIGNED). Judged on a sweep of magnitudes and their negatives; the table then
    holds whatever the codec does, and the tests check every case."""
    magnitudes = torch.arange(0, _ONE_BITS + 1, 1 << 12, dtype=torch.int64)
    positive, negative = encode(_floats(magnitudes, False)), encode(_floats(magnitudes, True))
    if torch.equal(positive, negative):
        return ABS
    if bool((negative == encode(torch.zeros(1))).all()):
        return CLAMPED
    return SIGNED


def _first_change(encode, low: torch.Tensor, high: torch.Tensor, negative: bool) -> torch.Tensor:
    """Per cell, the first key whose code differs from ``low``'s (``high``'s code differs)."""
    low_code = encode(_floats(low, negative))
    while bool((high - low > 1).any()):
        middle = (low + high) // 2
        same = encode(_floats(middle, negative)) == low_code
        low, high = torch.where(same, middle, low), torch.where(same, high, middle)
    return high


def _half_words(encode, negative: bool, name: str) -> torch.Tensor:
    low_bits = MANTISSA_BITS - INDEX_BITS
    cells = torch.arange(CELLS_PER_HALF, dtype=torch.int64)
    start = ((127 + FLOOR_BINADE) << MANTISSA_BITS) + (cells << low_bits)
    end = torch.minimum(start + (1 << low_bits) - 1, torch.tensor(_ONE_BITS))
    first, last = encode(_floats(start, negative)), encode(_floats(end, negative))
    if int((last - first).abs().max()) > 1:
        raise ValueError(f"format {name!r}: a cell of 2**-{INDEX_BITS} of a binade holds more than one "
                         "bin edge; the cell encoders need more index bits for it")
    # The floor: x up to 2**FLOOR_BINADE (and NaN) encodes as 0 does.
    if int(first[0]) != int(encode(_floats(torch.zeros(1, dtype=torch.int64), negative))[0]):
        raise ValueError(f"format {name!r} has a bin edge below 2**{FLOOR_BINADE}: the cell encoders "
                         "clamps magnitudes there")
    change = _first_change(encode, start, end, negative)
    # The low bits of the last float with the first code; all ones where there is no edge.
    position = torch.where(last != first, change - 1 - start, (1 << low_bits) - 1)
    words = (position << (INDEX_BITS + 9)) | (last << 8) | first
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def cell_words(encode, name: str = "format") -> tuple[torch.Tensor, int]:
    """(int32 words: the positive half's cells, then the negative half's for SIGNED; the sign
    handling) for ``encode``, a codec's ``encode`` of float32 values in [-1, 1]."""
    def codes(values):
        return encode(values).long()

    sign = sign_handling(codes)
    positive = _half_words(codes, False, name)
    if sign != SIGNED:
        return positive, sign
    negative = _half_words(codes, True, name)
    if negative[0] != positive[0]:
        sign = SIGNED_ZERO  # -0.0 (on the negative floor) and +0.0 have different codes
    unread = torch.zeros(SIGNED_POSITIVE_START - CELLS_PER_HALF, dtype=torch.int32)
    return torch.cat([negative, unread, positive]), sign
