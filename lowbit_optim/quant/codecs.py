"""Encoders and decoders between normalised values in [-1, 1] and codes (indices into a map).

They are written so that Inductor turns them into vectorised loops: torchao's 8-step
binary search with a gather per step compiles to scalar code on CPU (shared FINDINGS:
its 4-bit step takes ~570 ms for 10.5M parameters). Here

* a 16-entry map encodes by counting the midpoints a value exceeds (15 comparisons against
  constants) and decodes with a chain of 15 selects: no memory lookups at all;
* a 256-entry dynamic-exponent map encodes with exponent arithmetic (the decade from
  ``log10``, the position inside it from one multiply and ``floor``) plus two comparisons
  against exact table midpoints where decades meet; it decodes with one table gather.

Rounding is to the nearest code. The interior bin edges of the dynamic map are computed
in float32 arithmetic, so a value within a few ulps of a midpoint may take the other
neighbour; tests bound how often and by how much.
"""

import math

import torch

from lowbit_optim.quant import maps


class SmallTableCodec:
    """Nearest-code search for a map of at most 16 entries, by comparisons with constants."""

    def __init__(self, table: torch.Tensor):
        self.table = table
        self._values = table.tolist()
        self._midpoints = ((table[1:] + table[:-1]) / 2).tolist()
        self._zero_like_code = int((table.abs()).argmin())

    def encode(self, normalized: torch.Tensor) -> torch.Tensor:
        # Counted in float32 and narrowed once: Inductor's CPU backend vectorises float32
        # arithmetic but falls back to scalar loops for uint8 adds (measured ~5x slower).
        code = torch.zeros_like(normalized, dtype=torch.float32)
        for midpoint in self._midpoints:
            code = code + (normalized > midpoint).to(torch.float32)
        return code.to(torch.uint8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        codes = codes.to(torch.int32)  # int32 compares vectorise; uint8 ones do not
        values = torch.full_like(codes, self._values[0], dtype=torch.float32)
        for code, value in enumerate(self._values[1:], start=1):
            values = torch.where(codes == code, value, values)
        return values


class DynamicExponentCodec:
    """Nearest-code search for the 8-bit dynamic-tree maps by exponent arithmetic.

    Sorted-table layout (see ``maps.dynamic_exponent_map``): the magnitudes below 1 have
    ranks ``r = 0 .. M - 1`` in increasing order, decade ``d`` holding ``count(d)`` of them
    at ``10**(d - E) * (0.1 + 0.9 * (j + 0.5) / count(d))``. Rank -1 stands for 0 and
    rank ``M`` for 1. A signed map stores +v at ``zero + 1 + r`` and -v at ``zero - 1 - r``.
    """

    def __init__(self, table: torch.Tensor, *, signed: bool):
        self.table = table
        self.signed = signed
        self.exponent_bits = int(math.log2(table.numel())) - 1
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

    def _per_decade(self, decade: torch.Tensor, constants: list[float]) -> torch.Tensor:
        out = torch.full_like(decade, constants[0], dtype=torch.float32)
        for d, constant in enumerate(constants[1:], start=1):
            out = torch.where(decade == d, constant, out)
        return out

    def _magnitude_rank(self, magnitude: torch.Tensor) -> torch.Tensor:
        top = self.exponent_bits - 1
        decade = (torch.floor(torch.log10(magnitude)) + self.exponent_bits).clamp(0, top)
        decade = torch.nan_to_num(decade, nan=0.0).to(torch.int32)
        shift = self._per_decade(decade, [10.0 ** (top - d) for d in range(self.exponent_bits)])
        count = self._per_decade(decade, [float(c) for c in self._counts])
        first = self._per_decade(decade, [float(r) for r in self._first_rank])
        lower = self._per_decade(decade, self._lower_midpoints)
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
        return self.table.to(codes.device)[codes.to(torch.int64)]


SIGNED_8BIT_CODEC = DynamicExponentCodec(maps.SIGNED_8BIT, signed=True)
UNSIGNED_8BIT_CODEC = DynamicExponentCodec(maps.UNSIGNED_8BIT, signed=False)
SIGNED_4BIT_CODEC = SmallTableCodec(maps.SIGNED_4BIT)
LINEAR_4BIT_CODEC = SmallTableCodec(maps.LINEAR_4BIT)
