"""How a Muon momentum buffer can be stored between steps: the methods the 4-bit format was
chosen from (``benchmarks/bench_muon_methods.py`` trains with each; docs/muon.md has the table).

A codec turns the float32 momentum into a state and back:

* ``init(param)`` -> the state of a zero momentum;
* ``decode(state)`` -> the float32 momentum (``FloatMomentum`` returns its buffer itself, so that
  an in-place update of it is torch.optim.Muon's update of ``momentum_buffer``);
* ``encode(momentum, state)`` -> the new state;
* ``state_bytes(state)`` -> what the state occupies, every part counted (codes, scales, signs,
  residuals).

``BlockwiseMomentum`` stores codes of one of the package's blockwise formats (one float32 absmax
scale per block), optionally after a random-sign Hadamard rotation of each block (it spreads a
block's outliers over the whole block, so the scale is no longer set by one element) and with
stochastic rounding between the two nearest codes (unbiased: the rounding error averages out in
the momentum's running mean instead of accumulating). ``ErrorFeedbackMomentum`` also keeps the
quantization residual, in a codec of its own.
"""

import torch

from lowbit_optim.formats import catalog


class TableCodec:
    """Nearest code of any sorted table (by ``bucketize`` on its midpoints: the count of
    midpoints a value exceeds, as the package's small-table codec counts them)."""

    def __init__(self, table: torch.Tensor):
        self.table = table
        self._midpoints = (table[1:] + table[:-1]) / 2

    def encode(self, normalized: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(normalized, self._midpoints).to(torch.uint8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.table[codes.long()]


def linear_signed_map(*, total_bits: int) -> torch.Tensor:
    """``k / L`` for ``k = -L .. L``, ``L = 2**(bits - 1) - 1``: symmetric absmax integers
    (int8's -127..127, int4's -7..7); one code of the ``2**bits`` stays unused."""
    levels = 2 ** (total_bits - 1) - 1
    return torch.arange(-levels, levels + 1, dtype=torch.float32) / levels


LINEAR_8BIT_SIGNED = catalog.QuantFormat(
    "linear8-signed", 8, TableCodec(linear_signed_map(total_bits=8)), 2048)
LINEAR_4BIT_SIGNED = catalog.QuantFormat(
    "linear4-signed", 4, TableCodec(linear_signed_map(total_bits=4)), 128)
NORMAL_4BIT = catalog.NORMAL_4BIT_SIGNED  # the package's format (Muon4bit's momentum)


class FloatMomentum:
    """The momentum as a plain tensor (float32: torch.optim.Muon's ``momentum_buffer``)."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        self.dtype = dtype

    def init(self, param: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(param, dtype=self.dtype, memory_format=torch.preserve_format)

    def decode(self, state: torch.Tensor) -> torch.Tensor:
        return state if state.dtype == torch.float32 else state.float()

    def encode(self, momentum: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return momentum if self.dtype == torch.float32 else momentum.to(self.dtype)

    def state_bytes(self, state: torch.Tensor) -> int:
        return state.nbytes


def hadamard(size: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix divided by sqrt(size): orthogonal and its own inverse."""
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < size:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix / size**0.5


class BlockwiseMomentum:
    """Codes of ``fmt`` in blocks of ``block_size`` with a float32 absmax scale per block.

    ``rotate``: each block is multiplied by a fixed random sign per position (drawn once per
    parameter, ``block_size`` bits) and by the normalised Hadamard matrix before quantizing,
    and back after decoding. ``stochastic_rounding``: a value between codes ``lo`` and ``hi``
    takes ``hi`` with probability ``(x - lo) / (hi - lo)``.
    """

    def __init__(self, fmt: catalog.QuantFormat, block_size: int | None = None, *,
                 rotate: bool = False, stochastic_rounding: bool = False, seed: int = 0):
        self.fmt = fmt
        self.block_size = block_size or fmt.default_block_size
        catalog.check_block_size(self.block_size)
        self.rotate = rotate
        self.stochastic_rounding = stochastic_rounding
        self.generator = torch.Generator().manual_seed(seed)
        self._rotation = hadamard(self.block_size) if rotate else None

    def init(self, param: torch.Tensor) -> dict:
        blocks = self.fmt.num_blocks(param.numel(), self.block_size)
        codes, scales = self.fmt.quantize_blocks(torch.zeros(blocks, self.block_size))
        state = {"codes": codes, "scales": scales, "shape": param.shape}
        if self.rotate:
            draw = torch.randint(0, 2, (self.block_size,), generator=self.generator)
            state["signs"] = draw.float() * 2 - 1
        return state

    def _blocks(self, momentum: torch.Tensor) -> torch.Tensor:
        flat = momentum.reshape(-1).float()
        padding = -flat.numel() % self.block_size
        return torch.nn.functional.pad(flat, (0, padding)).view(-1, self.block_size)

    def encode(self, momentum: torch.Tensor, state: dict) -> dict:
        blocks = self._blocks(momentum)
        if self.rotate:
            blocks = (blocks * state["signs"]) @ self._rotation
        if self.stochastic_rounding:
            codes, scales = self._round_stochastically(blocks)
        else:
            codes, scales = self.fmt.quantize_blocks(blocks)
        return {**state, "codes": codes, "scales": scales}

    def _round_stochastically(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scales = torch.where(torch.isfinite(blocks), blocks.abs(), 0.0).amax(dim=-1)
        normalized = catalog.QuantFormat._normalize(blocks, scales)
        table = self.fmt.table
        low = (torch.searchsorted(table, normalized, right=True) - 1).clamp(0, table.numel() - 2)
        low_value, high_value = table[low], table[low + 1]
        up_probability = ((normalized - low_value) / (high_value - low_value)).clamp(0.0, 1.0)
        draw = torch.rand(normalized.shape, generator=self.generator)
        codes = (low + (draw < up_probability).long()).to(torch.uint8)
        return self.fmt.pack(codes), scales

    def decode(self, state: dict) -> torch.Tensor:
        blocks = self.fmt.dequantize_blocks(state["codes"], state["scales"])
        if self.rotate:
            blocks = (blocks @ self._rotation) * state["signs"]
        shape = state["shape"]
        return blocks.reshape(-1)[: shape.numel()].view(shape)

    def state_bytes(self, state: dict) -> int:
        signs_bytes = state["signs"].numel() // 8 if self.rotate else 0
        return state["codes"].nbytes + state["scales"].nbytes + signs_bytes


class ErrorFeedbackMomentum:
    """``main`` codes plus the residual ``momentum - main.decode(...)`` kept in ``residual``;
    the momentum read back is their sum."""

    def __init__(self, main, residual):
        self.main, self.residual = main, residual

    def init(self, param: torch.Tensor) -> tuple:
        return self.main.init(param), self.residual.init(param)

    def decode(self, state: tuple) -> torch.Tensor:
        return self.main.decode(state[0]) + self.residual.decode(state[1])

    def encode(self, momentum: torch.Tensor, state: tuple) -> tuple:
        main_state = self.main.encode(momentum, state[0])
        error = momentum - self.main.decode(main_state)
        return main_state, self.residual.encode(error, state[1])

    def state_bytes(self, state: tuple) -> int:
        return self.main.state_bytes(state[0]) + self.residual.state_bytes(state[1])
