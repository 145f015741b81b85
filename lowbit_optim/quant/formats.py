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

from lowbit_optim.quant import codecs


@dataclass(frozen=True)
class QuantFormat:
    """How one optimizer moment is stored: ``bits`` per code, a codec, a default block."""

    name: str
    bits: int
    codec: object
    default_block_size: int

    @property
    def table(self) -> torch.Tensor:
        return self.codec.table

    @property
    def codes_per_byte(self) -> int:
        return 8 // self.bits

    def num_blocks(self, numel: int, block_size: int) -> int:
        return -(-numel // block_size)

    def check_block_size(self, block_size: int) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 2:
            raise ValueError(f"Invalid block_size: {block_size!r} (an int >= 2 is needed)")
        if block_size % (2 * self.codes_per_byte):
            raise ValueError(
                f"Invalid block_size: {block_size} ({self.name} needs a multiple of "
                f"{2 * self.codes_per_byte})"
            )

    def quantize_blocks(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float ``(n, block_size)`` -> packed uint8 codes and float32 scales ``(n,)``."""
        blocks = blocks.float()
        finite = torch.isfinite(blocks)
        scales = torch.where(finite, blocks.abs(), 0.0).amax(dim=-1)
        normalized = torch.where(scales[:, None] > 0, blocks / scales[:, None], 0.0)
        normalized = torch.nan_to_num(normalized, nan=0.0).clamp(-1.0, 1.0)
        return self.pack(self.codec.encode(normalized)), scales

    def dequantize_blocks(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Inverse of ``quantize_blocks``: float32 ``(n, block_size)``."""
        return self.codec.decode(self.unpack(codes)) * scales[:, None]

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return codes
        half = codes.shape[-1] // 2
        return codes[:, :half] | (codes[:, half:] << 4)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """Packed bytes -> one int32 code per element (int32: its shifts and masks vectorise)."""
        if self.bits == 8:
            return packed
        rows, half = packed.shape
        wide = packed.to(torch.int32)
        return torch.stack([wide & 0x0F, wide >> 4], dim=1).view(rows, 2 * half)


DYNAMIC_8BIT_SIGNED = QuantFormat("dynamic8-signed", 8, codecs.SIGNED_8BIT_CODEC, 256)
DYNAMIC_8BIT_UNSIGNED = QuantFormat("dynamic8-unsigned", 8, codecs.UNSIGNED_8BIT_CODEC, 256)
DYNAMIC_4BIT_SIGNED = QuantFormat("dynamic4-signed", 4, codecs.SIGNED_4BIT_CODEC, 128)
LINEAR_4BIT_NONZERO = QuantFormat("linear4-nonzero", 4, codecs.LINEAR_4BIT_CODEC, 128)

FORMATS = {
    fmt.name: fmt
    for fmt in (DYNAMIC_8BIT_SIGNED, DYNAMIC_8BIT_UNSIGNED, DYNAMIC_4BIT_SIGNED, LINEAR_4BIT_NONZERO)
}


def get_format(name: str) -> QuantFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"Unknown quantization format {name!r}; known: {sorted(FORMATS)}") from None
