"""Blockwise formats: a codec plus how codes are laid out in bytes.

A tensor of ``numel`` elements is split into ``ceil(numel / block_size)`` blocks (the last one
padded with zeros, so every size is quantized, not only multiples of the block size). Each
block stores one float32 scale (the absolute maximum of its finite values) and one code per
element; 4-bit codes are packed two per byte, element ``k`` of a block in the low nibble of
byte ``k`` and element ``k + block_size / 2`` in the high nibble, so that packing and unpacking
read contiguous halves of the block (which vectorises) instead of every other element.

Non-finite inputs cannot be stored: NaN is stored as the code nearest 0 and ±inf as ±1 (the
block's largest finite magnitude). The block scale ignores them, so one NaN never spreads to
the rest of its block. The optimizer decides separately what a non-finite gradient does.
"""

from dataclasses import dataclass

import torch

from lowbit_optim.formats import codecs

# The block sizes every format, the optimizers and both kernels accept: powers of two, so a
# block is whole bytes of codes in every format and a whole number of vector lanes and Triton
# tiles, between the smallest block worth a float32 scale and the largest the kernels hold.
MIN_BLOCK_SIZE = 16
MAX_BLOCK_SIZE = 4096


def check_block_size(block_size) -> None:
    """Raise ``ValueError`` naming ``block_size`` unless it is an int that is a power of two
    from ``MIN_BLOCK_SIZE`` to ``MAX_BLOCK_SIZE``: the one rule, wherever a block size enters."""
    valid = (isinstance(block_size, int) and not isinstance(block_size, bool)
             and MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE and block_size & (block_size - 1) == 0)
    if not valid:
        raise ValueError(
            f"Invalid block_size: {block_size!r} (a power of two from {MIN_BLOCK_SIZE} to "
            f"{MAX_BLOCK_SIZE} is needed)"
        )


@dataclass(frozen=True)
class QuantFormat:
    """How one optimizer moment is stored: ``bits`` per code, a codec, a default block."""

    name: str
    bits: int
    codec: object
    default_block_size: int
    # Older formats whose codes and scales this one reads as its own (a checkpoint saved in
    # one of them loads without re-quantization, see lowbit_optim.checkpoint).
    reads_codes_of: tuple[str, ...] = ()

    @property
    def table(self) -> torch.Tensor:
        return self.codec.table

    @property
    def codes_per_byte(self) -> int:
        return 8 // self.bits

    def num_blocks(self, numel: int, block_size: int) -> int:
        return -(-numel // block_size)

    @property
    def parts(self) -> int:
        """How many column slices of a block share one byte of codes: 2 for 4-bit (the low
        and high halves of the block), 1 for 8-bit."""
        return self.codes_per_byte

    def split(self, blocks: torch.Tensor) -> list[torch.Tensor]:
        """``(n, block_size)`` -> the ``parts`` column slices whose codes share bytes."""
        if self.parts == 1:
            return [blocks]
        half = blocks.shape[-1] // 2
        return [blocks[:, :half], blocks[:, half:]]

    def encode_parts(self, parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``quantize_blocks`` on a block given as its ``split`` slices: packed codes, scales.

        Each slice is normalised, encoded and packed on its own, never concatenated, so that
        Inductor computes both nibbles of a byte in one loop without materialising the
        block (measured: a ``stack`` of the halves made Inductor keep an int32 buffer per moment).
        """
        parts = [part.float() for part in parts]
        scales = None
        for part in parts:
            part_max = torch.where(torch.isfinite(part), part.abs(), 0.0).amax(dim=-1)
            scales = part_max if scales is None else torch.maximum(scales, part_max)
        codes = [self.codec.encode(self._normalize(part, scales)) for part in parts]
        if self.parts == 1:
            return codes[0], scales
        return codes[0] | (codes[1] << 4), scales

    def decode_parts(self, codes: torch.Tensor, scales: torch.Tensor) -> list[torch.Tensor]:
        """Inverse of ``encode_parts``: the float32 ``split`` slices of the blocks."""
        return [self.codec.decode(part) * scales[:, None] for part in self.unpack_parts(codes)]

    @staticmethod
    def _normalize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        # An exact division, not a multiply by 1 / scale: the codes stay those of the rounded
        # quotient, which the Triton kernel (div_rn) and stored checkpoints agree on. A block
        # whose scale is 0 divides by inf instead: its finite values become ±0 and inf or NaN
        # become NaN, then 0, as a select on the scale would give, without a per-row select.
        divisor = torch.where(scales > 0, scales, float("inf"))[:, None]
        normalized = blocks / divisor
        # A select, not nan_to_num: Inductor's CPU code tests NaN in a scalar loop for it.
        return torch.where(normalized == normalized, normalized, 0.0).clamp(-1.0, 1.0)

    def quantize_blocks(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float ``(n, block_size)`` -> packed uint8 codes and float32 scales ``(n,)``."""
        return self.encode_parts(self.split(blocks))

    def dequantize_blocks(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Inverse of ``quantize_blocks``: float32 ``(n, block_size)``."""
        parts = self.decode_parts(codes, scales)
        return parts[0] if self.parts == 1 else torch.cat(parts, dim=-1)

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return codes
        low, high = self.split(codes)
        return low | (high << 4)

    def unpack_parts(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """Packed bytes -> the codes of each ``split`` slice, int32 (its shifts and masks
        vectorise; uint8 ones do not)."""
        if self.bits == 8:
            return [packed]
        wide = packed.to(torch.int32)
        return [wide & 0x0F, wide >> 4]

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """Packed bytes -> one code per element, ``(n, block_size)``."""
        parts = self.unpack_parts(packed)
        return parts[0] if self.parts == 1 else torch.cat(parts, dim=-1)


DYNAMIC_8BIT_SIGNED = QuantFormat("dynamic8-signed", 8, codecs.SIGNED_8BIT_CODEC, 256)
DYNAMIC_8BIT_UNSIGNED = QuantFormat("dynamic8-unsigned", 8, codecs.UNSIGNED_8BIT_CODEC, 256)
# The 8-bit second moment: the same map with no zero code (codecs.ZeroFreeCodec); checkpoints
# saved in the map with a zero code are read as this one (``reads_codes_of``).
DYNAMIC_8BIT_UNSIGNED_NONZERO = QuantFormat(
    "dynamic8-unsigned-nonzero", 8, codecs.UNSIGNED_8BIT_NONZERO_CODEC, 256,
    reads_codes_of=(DYNAMIC_8BIT_UNSIGNED.name,),
)
# An ablation the main benchmark measures (``lowbit_8bit_edges_kept``): the plain map's codes
# bit for bit (first bin edge t1 / 2), code 0 read as t1 / 2 instead of 0.
DYNAMIC_8BIT_UNSIGNED_EDGES_KEPT = QuantFormat(
    "dynamic8-unsigned-nonzero-edges-kept", 8,
    codecs.ZeroFreeCodec(codecs.UNSIGNED_8BIT_CODEC, keep_edges=True), 256,
    reads_codes_of=(DYNAMIC_8BIT_UNSIGNED.name,),
)
DYNAMIC_4BIT_SIGNED = QuantFormat("dynamic4-signed", 4, codecs.SIGNED_4BIT_CODEC, 128)
LINEAR_4BIT_NONZERO = QuantFormat("linear4-nonzero", 4, codecs.LINEAR_4BIT_CODEC, 128)
# Muon4bit's momentum: NF4's normal quantiles, rounded to nearest, in blocks of 64 (0.5625
# B/param). docs/muon.md: the lowest loss of the 4-bit storages tried, and blocks of 64 halve
# its gap to float momentum at Muon's higher LRs (+2.14% at 128, +1.24% at 64).
NORMAL_4BIT_SIGNED = QuantFormat("normal4-signed", 4, codecs.NORMAL_4BIT_CODEC, 64)
# torchao's AdamWFp8 layout (e4m3fn codes, blocks of 256: ~2.03 bytes/param for both moments).
FLOAT8 = QuantFormat("float8-e4m3", 8, codecs.FLOAT8_CODEC, 256)
# Its second moment with no zero code: e4m3fn's smallest positive value is 4.4e-6 of the
# block's largest, so the zero-point hazard (codecs.ZeroFreeCodec) is wider than for the
# 8-bit map.
FLOAT8_NONZERO = QuantFormat(
    "float8-e4m3-nonzero", 8, codecs.FLOAT8_NONZERO_CODEC, 256, reads_codes_of=(FLOAT8.name,),
)

FORMATS = {
    fmt.name: fmt
    for fmt in (DYNAMIC_8BIT_SIGNED, DYNAMIC_8BIT_UNSIGNED, DYNAMIC_8BIT_UNSIGNED_NONZERO,
                DYNAMIC_8BIT_UNSIGNED_EDGES_KEPT,
                DYNAMIC_4BIT_SIGNED, LINEAR_4BIT_NONZERO, NORMAL_4BIT_SIGNED, FLOAT8, FLOAT8_NONZERO)
}


def get_format(name: str) -> QuantFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"Unknown quantization format {name!r}; known: {sorted(FORMATS)}") from None
