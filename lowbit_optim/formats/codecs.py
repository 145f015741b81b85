"""Encoders and decoders between normalised values in [-1, 1] and codes (indices into a map).

They are written so that Inductor turns them into vectorised loops: torchao's 8-step
binary search with a gather per step compiles to scalar code on CPU (measured: its 4-bit
step took ~570 ms for 10.5M parameters; docs/design.md, "Encoding speed"). Here

* a 16-entry map encodes by a chain of 15 selects on comparisons with its midpoints (the
  last midpoint a value exceeds wins, as the midpoints ascend) and decodes with a chain of
  15 selects over constants; the linear map ``(k + 1) / 16`` encodes with one multiply, one
  ``ceil`` and a clamp and decodes with one add and one multiply;
* a 256-entry dynamic-exponent map finds a value's decade by comparing it with the 6
  powers of ten between decades (selecting the decade's constants as it goes, where a
  ``log10`` and three 7-way selects on its result stood before), the position inside the
  decade from one multiply and ``floor``, plus two comparisons against exact table
  midpoints where decades meet. It decodes with one gather from the table
  (``aten._unsafe_index``: the codes are bytes, so no bounds check is needed, and Inductor
  emits none). An arithmetic decode was tried: ``10**(d - 6) * (0.1 + 0.9 * (j + 0.5) /
  count)`` in float32 misses the table by an ulp for 33 of the 127 signed magnitudes; the
  ``linspace`` edges rebuilt exactly (``0.1 + step * i`` below ``(count + 1) // 2``, else
  ``1 - step * (count - i)``, each rounded once, formed in float64) match all 256 entries,
  but compiled 2x slower than the gather (float64 vectors, and Inductor recomputes the
  decode in every pass), so the gather stays;
* float8 e4m3fn codes (``Float8Codec``) are the bits of ``448 x`` formed by integer
  arithmetic, equal to torch's cast (checked once on every float32 in [-448, 448]); they
  decode with the same single gather.

Every map encoder returns exactly the codes of the first formulation (``log10`` for the
decade, a sum of 15 comparisons): ``tests/test_formats.py`` checks this against that
formulation on every float32 within 3000 ulps of a code, a midpoint or a power of ten and on
a sample of all of [-1, 1] (and it was checked once on every 61st float32 in [-1, 1]), so
stored states, checkpoints and the Triton kernel (whose 8-bit encoders are tables built from
these codecs, ``lowbit_optim/formats/cell_tables.py``) agree code for code.

Rounding is to the nearest code. The 16-entry encoders are exact (the midpoints are float32
numbers; for the linear map see ``LinearNonzeroCodec``). The interior bin edges of the
dynamic map are computed in float32 arithmetic, so a value within a few ulps of a midpoint
may take the other neighbour, never a farther code; tests bound how often and by how much.
"""

import torch

from lowbit_optim.formats import maps


class SmallTableCodec:
    """Nearest-code search for a map of at most 16 entries, by comparisons with constants."""

    def __init__(self, table: torch.Tensor):
        self.table = table
        self._values = table.tolist()
        self._midpoints = ((table[1:] + table[:-1]) / 2).tolist()
        self._zero_like_code = int((table.abs()).argmin())

    def encode(self, normalized: torch.Tensor) -> torch.Tensor:
        # Selected in float32 and narrowed once: Inductor's CPU backend vectorises float32
        # arithmetic but falls back to scalar loops for uint8 ones (measured ~5x slower).
        # A select per midpoint, not a sum of comparisons: one operation fewer each.
        code = torch.zeros_like(normalized, dtype=torch.float32)
        for count, midpoint in enumerate(self._midpoints, start=1):
            code = torch.where(normalized > midpoint, float(count), code)
        return code.to(torch.uint8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        codes = codes.to(torch.int32)  # int32 compares vectorise; uint8 ones do not
        values = torch.full_like(codes, self._values[0], dtype=torch.float32)
        for code, value in enumerate(self._values[1:], start=1):
            values = torch.where(codes == code, value, values)
        return values


class LinearNonzeroCodec(SmallTableCodec):
    """The map ``(k + 1) / L`` (``L`` a power of two): arithmetic encode and decode.

    ``x`` exceeds the midpoint ``(2k + 3) / (2L)`` exactly when ``t = x * L - 1.5 > k``, so
    the number of midpoints exceeded, the code, is ``clamp(ceil(t), 0, L - 1)``. ``t`` is
    exact in float32 for ``x * L`` in [0.75, L] (a power-of-two multiply, then a subtraction
    of two numbers whose difference needs no more bits than ``x * L``); below that ``t < 0``
    and the code is 0 either way. So the codes equal the comparison count bit for bit.
    """

    def __init__(self, table: torch.Tensor):
        super().__init__(table)
        self._levels = table.numel()
        if not torch.equal(table, maps.linear_nonzero_map(total_bits=self._levels.bit_length() - 1)):
            raise ValueError("LinearNonzeroCodec needs the map (k + 1) / L, L a power of two")

    def encode(self, normalized: torch.Tensor) -> torch.Tensor:
        code = torch.ceil(normalized * float(self._levels) - 1.5)
        return code.clamp(0.0, self._levels - 1.0).to(torch.uint8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        # (k + 1) / L is exact: a small integer times a power of two.
        return (codes.to(torch.float32) + 1.0) * (1.0 / self._levels)


def gather_decode(table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``table[codes]`` for byte codes and a 256-entry table."""
    # _unsafe_index: a byte cannot leave a 256-entry table, and plain indexing made
    # Inductor check bounds on int64 copies of the codes, 16 elements at a time.
    return torch.ops.aten._unsafe_index(table.to(codes.device), [codes.to(torch.int32)])


class DynamicExponentCodec:
    """Nearest-code search for the 8-bit dynamic-tree maps by exponent arithmetic.

    Sorted-table layout (see ``maps.dynamic_exponent_map``): the magnitudes below 1 have
    ranks ``r = 0 .. M - 1`` in increasing order, decade ``d`` holding ``count(d)`` of them
    at ``10**(d - E) * (0.1 + 0.9 * (j + 0.5) / count(d))``. Rank -1 stands for 0 and
    rank ``M`` for 1. A signed map stores +v at ``zero + 1 + r`` and -v at ``zero - 1 - r``.

    The decade need not be exact next to a power of ten ``P`` between decades ``d`` and
    ``d + 1``: from the top bin of decade ``d`` (``P * (1 - 0.9 / count(d))``) up to the
    lower midpoint of decade ``d + 1`` (``P * (1 + 0.9 / count(d))``) both decades give the
    same code (taking ``d`` clamps the position to decade ``d``'s top; taking ``d + 1``
    falls below its lower midpoint, to the same code). Comparing with ``float32(P)``, one ulp
    from ``P``, is therefore exact in effect, as was ``floor(log10(x))`` before it.
    """

    def __init__(self, table: torch.Tensor, *, signed: bool):
        self.table = table
        self.signed = signed
        self.exponent_bits = (table.numel().bit_length() - 1) - 1
        self._zero_code = int((table == 0).nonzero()[0])
        positive = table[table > 0].tolist()[:-1]  # the magnitudes below 1, ascending
        self._max_rank = len(positive)
        self._counts = [2 ** (d if signed else d + 1) for d in range(self.exponent_bits)]
        self._first_rank = [sum(self._counts[:d]) for d in range(self.exponent_bits)]
        # Midpoint between a decade's smallest value and the value below it (the previous
        # decade's largest, or 0): below it, the nearest code lies in the previous decade.
        below = [0.0] + [positive[r - 1] for r in self._first_rank[1:]]
        self._lower_midpoints = [
            (positive[r] + b) / 2 for r, b in zip(self._first_rank, below)
        ]
        self._upper_midpoint = (positive[-1] + 1.0) / 2
        top = self.exponent_bits - 1
        self._shifts = [10.0 ** (top - d) for d in range(self.exponent_bits)]
        # float32(10**-k) where decade d - 1 ends and decade d starts, d = 1 .. E - 1.
        self._decade_starts = [10.0 ** (d - self.exponent_bits) for d in range(1, self.exponent_bits)]

    def _decade_constants(self, magnitude: torch.Tensor):
        """(shift to [0.1, 1), code count, lower midpoint) of each value's decade."""
        shift = torch.full_like(magnitude, self._shifts[0])
        count = torch.full_like(magnitude, float(self._counts[0]))
        lower = torch.full_like(magnitude, self._lower_midpoints[0])
        for d, start in enumerate(self._decade_starts, start=1):
            # The starts ascend, so the last one a value reaches selects its decade.
            in_decade = magnitude >= start
            shift = torch.where(in_decade, self._shifts[d], shift)
            count = torch.where(in_decade, float(self._counts[d]), count)
            lower = torch.where(in_decade, self._lower_midpoints[d], lower)
        return shift, count, lower

    def _magnitude_rank(self, magnitude: torch.Tensor) -> torch.Tensor:
        shift, count, lower = self._decade_constants(magnitude)
        # Counts are powers of two (2**d signed, 2**(d + 1) unsigned), and the ranks before a
        # decade add up to count - 1 (signed) or count - 2 (unsigned).
        first = count - (1.0 if self.signed else 2.0)
        position = torch.floor((magnitude * shift - 0.1) * count / 0.9)
        rank = first + torch.minimum(position.clamp_min(0), count - 1)
        rank = torch.where(magnitude < lower, first - 1, rank)
        return torch.where(magnitude >= self._upper_midpoint, float(self._max_rank), rank)

    def encode(self, normalized: torch.Tensor) -> torch.Tensor:
        rank = self._magnitude_rank(normalized.abs())
        if not self.signed:
            return (rank + (self._zero_code + 1)).to(torch.uint8)
        negative_rank = torch.minimum(rank, torch.full_like(rank, self._max_rank - 1))
        code = torch.where(
            normalized >= 0, self._zero_code + 1 + rank, self._zero_code - 1 - negative_rank
        )
        return code.to(torch.uint8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return gather_decode(self.table, codes)


E4M3FN_SMALLEST_NORMAL_BITS = 0x3C800000  # float32 bits of 2**-6
# 2**14: float32's ulp there is 2**-9, e4m3fn's subnormal step.
E4M3FN_SUBNORMAL_SHIFT, E4M3FN_SUBNORMAL_SHIFT_BITS = 16384.0, 0x46800000
E4M3FN_BIAS_CHANGE = (127 - 7) << 3  # float32's exponent bias minus e4m3fn's, in code units
# e4m3fn keeps 3 of float32's 23 mantissa bits: the low 20 are dropped when encoding.
E4M3FN_DROPPED_BITS = 23 - 3
# Added with the lowest kept bit before the shift, it rounds the dropped bits to nearest even.
E4M3FN_ROUND_HALF = (1 << (E4M3FN_DROPPED_BITS - 1)) - 1


def e4m3fn_bits(values: torch.Tensor) -> torch.Tensor:
    """``values.to(torch.float8_e4m3fn).view(torch.uint8)`` for float32 ``|values| <= 448``,
    by integer arithmetic (``Float8Codec`` explains it)."""
    bits = values.view(torch.int32)
    magnitude = bits & 0x7FFFFFFF
    sign = (bits >> 24) & 0x80
    kept_lowest = (magnitude >> E4M3FN_DROPPED_BITS) & 1
    normal = ((magnitude + (E4M3FN_ROUND_HALF + kept_lowest)) >> E4M3FN_DROPPED_BITS) - E4M3FN_BIAS_CHANGE
    subnormal = (values.abs() + E4M3FN_SUBNORMAL_SHIFT).view(torch.int32) - E4M3FN_SUBNORMAL_SHIFT_BITS
    code = torch.where(magnitude < E4M3FN_SMALLEST_NORMAL_BITS, subnormal, normal) | sign
    return code.to(torch.uint8)


class Float8Codec:
    """float8 e4m3fn codes (torchao's ``AdamWFp8`` state): code = the e4m3fn bits of
    ``x * 448`` for a normalised value ``x`` in [-1, 1], rounded to nearest even, exactly
    ``(x * 448).to(torch.float8_e4m3fn)`` (448 is e4m3fn's largest finite value, so the
    block's absolute maximum takes code 0x7E). Decoding is one gather from the 256 values
    ``e4m3fn(code) / 448`` in float32.

    The encoder is integer arithmetic on the float32 bits rather than torch's cast, so that
    Inductor vectorises it on CPU (and it needs no float8 conversion instruction, which sm_80
    and the Triton interpreter lack). With ``y = x * 448``:

    * ``|y| >= 2**-6`` (e4m3fn normals): drop 20 of float32's 23 mantissa bits rounding to
      nearest even (add ``0x7FFFF`` plus the lowest kept bit, shift), then move the exponent
      bias from 127 to 7 (subtract ``120 << 3``). A carry out of the mantissa correctly
      bumps the exponent; ``|y| <= 448`` never reaches the NaN pattern 0x7F.
    * ``|y| < 2**-6`` (subnormals, multiples of 2**-9): adding ``2**14`` makes float32's
      last mantissa bit worth 2**-9, so the hardware addition rounds ``|y|`` to nearest even
      in those units, and the sum's bits minus those of ``2**14`` are the code.
    * The sign bit moves from bit 31 to bit 7 (``-0`` keeps it, as torch's cast does).

    ``tests/test_formats.py`` checks it against torch's cast on every float32 near an e4m3fn
    value or a rounding edge. The two NaN patterns (0x7F, 0xFF), which it never produces,
    decode as +-1: a corrupted code cannot make a moment NaN.
    """

    largest = 448.0  # torch.finfo(torch.float8_e4m3fn).max

    def __init__(self):
        codes = torch.arange(256, dtype=torch.int32)
        values = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
        saturated = torch.where(codes < 128, self.largest, -self.largest)
        self.table = torch.where(values.isnan(), saturated, values) / self.largest

    def encode(self, normalized: torch.Tensor) -> torch.Tensor:
        return e4m3fn_bits(normalized * self.largest)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return gather_decode(self.table, codes)


class ZeroFreeCodec:
    """A codec whose code 0 stands for 0 and code 1 for its smallest positive value, with
    every code that decoded to 0 standing for half that value instead (the zero-point
    hazard, below and docs/design.md); for a second moment, which is never negative.

    With an exact zero, a second-moment element far below its block's largest (a gradient
    under ~1.3e-4 of the block's largest, for the 8-bit dynamic map; under ~1.5e-3 for
    float8 e4m3fn, whose smallest positive value is 2**-9 / 448 = 4.4e-6 of the block's
    largest) decodes to 0 while its first moment does not, and the next step divides by
    ``eps``: a parameter moved 2,500x what AdamW moves it. Here it decodes to ``t1 / 2`` of
    the block's scale (``t1`` the smallest positive value), never to 0, so ``m / sqrt(v)``
    stays bounded; a true 0 (the block's scale 0, or an element that never had a gradient
    while its first moment is 0 too) still yields a zero update. Codes are nearest to this
    table: the first bin edge moves from ``t1 / 2`` to ``3 t1 / 4`` (one select before the
    inner codec's encoder, which sends everything below it to code 0), every other edge is
    the inner codec's; decoding is the same one gather from this table. Codes of the inner
    codec's format read as this one's (``QuantFormat.reads_codes_of``): only the zeros'
    meaning changes.

    ``zero_reads`` sets code 0's value as a fraction of ``t1`` (default 1/2); ``keep_edges``
    keeps the inner codec's first edge, ``t1 / 2``, so that every non-negative value keeps the
    inner codec's code bit for bit and only what code 0 reads changes (the main benchmark's
    ``lowbit_8bit_edges_kept`` ablation).
    """

    def __init__(self, inner, *, zero_reads: float = 0.5, keep_edges: bool = False):
        smallest = float(inner.table[inner.table > 0].min())
        if float(inner.table[0]) != 0 or float(inner.table[1]) != smallest:
            raise ValueError("ZeroFreeCodec needs a codec whose code 0 is 0 and code 1 its smallest "
                             "positive value")
        if not 0 < zero_reads < 1:
            raise ValueError(f"zero_reads must lie in (0, 1) (a fraction of the smallest positive "
                             f"value), got {zero_reads!r}")
        self.inner = inner
        self.keeps_edges = keep_edges
        self.table = torch.where(inner.table == 0, smallest * zero_reads, inner.table)
        # Nearest to this table, or (keep_edges) the inner codec's own first edge, t1 / 2:
        # then a non-negative value keeps the inner codec's code and only code 0's value changes.
        low = 0.0 if keep_edges else smallest * zero_reads
        self.first_edge = (low + smallest) / 2

    def encode(self, normalized: torch.Tensor) -> torch.Tensor:
        return self.inner.encode(torch.where(normalized < self.first_edge, 0.0, normalized))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return gather_decode(self.table, codes)


SIGNED_8BIT_CODEC = DynamicExponentCodec(maps.SIGNED_8BIT, signed=True)
UNSIGNED_8BIT_CODEC = DynamicExponentCodec(maps.UNSIGNED_8BIT, signed=False)
UNSIGNED_8BIT_NONZERO_CODEC = ZeroFreeCodec(UNSIGNED_8BIT_CODEC)
SIGNED_4BIT_CODEC = SmallTableCodec(maps.SIGNED_4BIT)
NORMAL_4BIT_CODEC = SmallTableCodec(maps.NORMAL_4BIT)
LINEAR_4BIT_CODEC = LinearNonzeroCodec(maps.LINEAR_4BIT)
FLOAT8_CODEC = Float8Codec()
FLOAT8_NONZERO_CODEC = ZeroFreeCodec(FLOAT8_CODEC)
