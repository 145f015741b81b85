"""QuantizedState: the aten-op table, serialization and torch.compile tracing."""

import io

import pytest
import torch

from lowbit_optim.formats.catalog import DYNAMIC_4BIT_SIGNED, DYNAMIC_8BIT_SIGNED, LINEAR_4BIT_NONZERO
from lowbit_optim.state import QuantizedState

FORMATS = [DYNAMIC_8BIT_SIGNED, DYNAMIC_4BIT_SIGNED]


@pytest.fixture(params=FORMATS, ids=lambda f: f.name)
def state(request):
    fmt = request.param
    return QuantizedState.from_float(torch.randn(33, 70), fmt, fmt.default_block_size)


def test_looks_like_the_parameter(state):
    assert state.shape == (33, 70) and state.dtype == torch.float32
    assert state.codes.dtype == torch.uint8 and state.scales.dtype == torch.float32
    assert state.num_blocks == -(-33 * 70 // state.block_size)


def test_detach_shares_and_clone_copies(state):
    detached, cloned = state.detach(), state.clone()
    assert detached.codes.data_ptr() == state.codes.data_ptr()
    assert cloned.codes.data_ptr() != state.codes.data_ptr()
    assert torch.equal(cloned, state) and torch.equal(detached, state)


def test_dtype_cast_only_relabels(state):
    cast = state.to(torch.bfloat16)
    assert isinstance(cast, QuantizedState) and cast.dtype == torch.bfloat16
    assert torch.equal(cast.codes, state.codes) and torch.equal(cast.scales, state.scales)
    assert cast.dequantize().dtype == torch.bfloat16
    assert torch.equal(cast.dequantize(torch.float32), state.dequantize())


def test_copy_in_every_direction(state):
    values = torch.randn(state.shape)
    fresh = torch.zeros_like(state)
    assert isinstance(fresh, QuantizedState) and fresh.format_name == state.format_name
    assert torch.equal(fresh.dequantize(), torch.zeros(state.shape))
    fresh.copy_(values)  # float -> state quantizes
    assert torch.equal(fresh, QuantizedState.from_float(values, state.format, state.block_size))
    out = torch.empty(state.shape)
    out.copy_(fresh)  # state -> float dequantizes
    assert torch.equal(out, fresh.dequantize())
    other = torch.zeros_like(state)
    other.copy_(fresh)  # state -> state copies codes
    assert torch.equal(other, fresh)


def test_copy_between_formats_requantizes():
    values = torch.randn(4096)
    eight = QuantizedState.from_float(values, DYNAMIC_8BIT_SIGNED, 256)
    four = QuantizedState.zeros(values.shape, DYNAMIC_4BIT_SIGNED, 128)
    four.copy_(eight)
    assert torch.equal(four, QuantizedState.from_float(eight.dequantize(), DYNAMIC_4BIT_SIGNED, 128))


def test_view_relabels_shape(state):
    assert state.view(-1).shape == (33 * 70,)
    assert state.reshape(70, 33).shape == (70, 33)
    assert torch.equal(state.view(-1).dequantize(), state.dequantize().view(-1))
    with pytest.raises(RuntimeError, match="invalid"):
        state.view(7, 7)


def test_unsupported_op_names_the_remedy(state):
    with pytest.raises(NotImplementedError, match="dequantize"):
        state + 1


def test_save_and_load_weights_only_is_exact(state):
    buffer = io.BytesIO()
    torch.save({"exp_avg": state, "other": state.clone()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert isinstance(loaded["exp_avg"], QuantizedState)
    assert torch.equal(loaded["exp_avg"], state) and loaded["exp_avg"].format_name == state.format_name


def test_compiled_functions_trace_both_formats_in_one_process():
    # torchao's state classes crashed an 8-bit run served from a cache holding 4-bit graphs
    # in one process; ours carry the format through flatten/unflatten, so the graphs stay apart.
    @torch.compile(dynamic=False)
    def double_dequantized(state):
        return state.format.dequantize_blocks(state.codes, state.scales).view(-1) * 2

    values = torch.randn(4096).abs()
    for fmt in (DYNAMIC_4BIT_SIGNED, LINEAR_4BIT_NONZERO, DYNAMIC_8BIT_SIGNED):
        state = QuantizedState.from_float(values, fmt, fmt.default_block_size)
        assert torch.equal(double_dequantized(state)[: state.numel()], state.dequantize() * 2)
