"""The step kernel's encoders on their own: ``encode_normalized`` runs the exact device code that
requantizes the moments (``moment_codes.encode``) on given normalised values, so tests can
hold it against the reference codecs (``lowbit_optim.formats.codecs``) value by value: under
the interpreter on CPU, and compiled on a GPU, where the 8-bit encoders read their cell tables
through inline PTX.

The values go in as the kernel's normalised values would (scale 1, so multiplying by the
reciprocal changes nothing): NaN, +-inf and values beyond +-1 included, which the reference
first maps to 0 and clamps to [-1, 1] (``QuantFormat._normalize``).
"""

import torch
import triton
import triton.language as tl

from lowbit_optim.formats.catalog import QuantFormat
from lowbit_optim.step.kernels import moment_codes
from lowbit_optim.step.kernels.launcher import device_guard
from lowbit_optim.step.kernels.tables import codec_kind, device_tables

_BLOCK = 1 << 16  # values per program: few programs under the interpreter


@triton.jit
def _encode_kernel(values_ptr, codes_ptr, encoder_ptr, numel, BLOCK: tl.constexpr, BITS: tl.constexpr,
                   CODEC: tl.constexpr, INTERPRETED: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    values = tl.reshape(tl.load(values_ptr + offsets, mask=mask, other=0.0), [1, BLOCK, 1])
    codes = moment_codes.encode(values, 1.0, 1.0, encoder_ptr, BITS, CODEC, INTERPRETED)
    tl.store(codes_ptr + offsets, tl.reshape(codes, [BLOCK]).to(tl.uint8), mask=mask)


def encode_normalized(values: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """One uint8 code per float32 value (unpacked, also for 4-bit formats), as the step
    kernel encodes a normalised value of a moment stored in ``fmt``."""
    values = values.float().contiguous().view(-1)
    codes = torch.empty(values.shape, dtype=torch.uint8, device=values.device)
    if values.numel():
        encoder = device_tables(fmt, values.device)[1]
        with device_guard(values.device):
            _encode_kernel[(triton.cdiv(values.numel(), _BLOCK),)](
                values, codes, encoder, values.numel(), BLOCK=_BLOCK, BITS=fmt.bits, CODEC=codec_kind(fmt),
                INTERPRETED=values.device.type == "cpu")
    return codes
