"""torchao's low-bit optimizer state in ours: its codes carried over where the maps agree, and
its checkpoint files read without torchao installed.

**Carrying codes.** torchao's ``OptimState4bit``/``OptimState8bit``/``OptimStateFp8`` hold codes
into the same maps as our formats (tested: its signed and unsigned qmaps equal our
``dynamic4-signed``, ``linear4-nonzero``, ``dynamic8-signed`` and ``dynamic8-unsigned``
tables bit for bit, and its float8 codes are e4m3fn bits as in ``float8-e4m3``), with one
float32 scale per block of a flat tensor. So a moment is carried over as it is
(``quantized_from_torchao``) rather than dequantized and quantized again, which is not the
identity: the signed maps stop short of -1 (the 4-bit one at -0.8875), so a block whose
largest magnitude is negative would get a smaller scale (38% of a 4-bit first moment's
codes changed that way in a 96 x 160 test). Two conventions differ and are converted:

* 4-bit nibble order: torchao packs element ``2k`` in the high nibble of byte ``k`` and
  ``2k + 1`` in the low one; ours packs element ``k`` of a block low and ``k + block_size / 2``
  high (``formats.catalog``). The codes are unpacked and packed again, one block at a time.
* float8 scale: torchao stores ``absmax / 448`` and codes of ``x / scale``; ours stores
  ``absmax`` and codes of ``x / absmax * 448``. The scale is multiplied by 448 in float32.
  The dequantized values then differ from torchao's by at most 2 float32 ulps (two more
  roundings, ``e4m3(c) / 448`` and the scale's); for 4-bit and 8-bit they are bit-identical.

Where the layout cannot be carried (a block size our format does not accept) the moment is
read as float values, as torchao's ``dequantize()`` computes them.

**Files without torchao.** A file written by ``torch.save(opt.state_dict(), path)`` for
torchao's ``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``, ``Adam8bit``, ``Adam4bit`` or ``AdamFp8``
names torchao's state classes in its pickle, so a plain ``torch.load`` imports torchao. torch
pickles such a wrapper tensor subclass as ``_rebuild_from_type_v2(_rebuild_wrapper_subclass,
cls, args, state)`` (``torch.Tensor.__reduce_ex__``), where ``state`` is the instance's
``__dict__``: its plain inner tensors (``codes``, ``scale``, ``qmap``) and attributes
(``signed``, ``block_size``, ``_shape``). The unpickler here stands in for those classes and
keeps each such state aside; once the file is read, each becomes the ``QuantizedState`` that
``quantized_from_torchao`` makes of the live tensor, so loading it gives the same state as
loading torchao's own state dict.

torchao is never imported here; a pickle naming any other torchao class is refused.
"""

import pickle
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._tensor import _rebuild_from_type_v2

from lowbit_optim.formats.catalog import (
    DYNAMIC_4BIT_SIGNED,
    DYNAMIC_8BIT_SIGNED,
    DYNAMIC_8BIT_UNSIGNED,
    FLOAT8,
    LINEAR_4BIT_NONZERO,
    QuantFormat,
    check_block_size,
)
from lowbit_optim.formats.codecs import FLOAT8_CODEC
from lowbit_optim.state.quantized import QuantizedState


def _dequantize_with_qmap(codes, qmap, scale):
    """torchao ``quant_utils.dequant_with_qmap``: each code looked up, times its block's scale."""
    return (qmap[codes.int()].view(scale.shape[0], -1) * scale.view(-1, 1)).view(codes.shape)


def _unpack_4bit(codes: torch.Tensor) -> torch.Tensor:
    """torchao's packed 4-bit codes, one per element in order (high nibble first)."""
    return torch.stack([codes >> 4, codes & 0b1111], dim=-1).view(-1)


def _dequantize_8bit(state) -> torch.Tensor:
    """``OptimState8bit.dequantize``: one uint8 code per element, shaped like the moment."""
    return _dequantize_with_qmap(state["codes"], state["qmap"], state["scale"])


def _dequantize_4bit(state) -> torch.Tensor:
    """``OptimState4bit.dequantize``: two codes per byte (high nibble first), flat."""
    unpacked = _unpack_4bit(state["codes"])
    return _dequantize_with_qmap(unpacked, state["qmap"], state["scale"]).view(state["_shape"])


def _dequantize_fp8(state) -> torch.Tensor:
    """``OptimStateFp8.dequantize``: float8 e4m3fn codes times their block's scale."""
    codes, scale = state["codes"], state["scale"]
    return (codes.float().view(scale.shape[0], -1) * scale.view(-1, 1)).view(codes.shape)


def _block_codes_8bit(state, fmt: QuantFormat, block_size: int) -> torch.Tensor:
    return state["codes"].reshape(-1, block_size)


def _block_codes_4bit(state, fmt: QuantFormat, block_size: int) -> torch.Tensor:
    return fmt.pack(_unpack_4bit(state["codes"]).view(-1, block_size))


def _block_codes_fp8(state, fmt: QuantFormat, block_size: int) -> torch.Tensor:
    return state["codes"].view(torch.uint8).reshape(-1, block_size)


@dataclass(frozen=True)
class _StateClass:
    """One of torchao's optimizer state classes: how to read it, and to carry its codes."""

    qualified_name: str
    tensor_keys: tuple
    codes_dtype: torch.dtype
    codes_per_byte: int
    dequantize: Callable
    # Our formats with one of the maps this class holds (which one: ``_format_of``).
    formats: tuple
    # (state, our format, block size) -> the codes in our layout, (blocks, bytes per block).
    block_codes: Callable
    # Our scale for torchao's: float8 scales are stored divided by e4m3fn's largest value.
    scale_factor: float = 1.0

    def moment(self, state) -> torch.Tensor:
        """The moment ``state`` (the state class's ``__dict__``) as a ``QuantizedState`` with
        its codes, or as float32 values where our formats cannot hold its layout."""
        missing = [key for key in self.tensor_keys if not isinstance(state.get(key), torch.Tensor)]
        if missing:
            raise pickle.UnpicklingError(
                f"{self.qualified_name} in the checkpoint has no tensor {', '.join(missing)}")
        try:
            carried = self._carried(state)
            return self.dequantize(state).float() if carried is None else carried
        except (RuntimeError, KeyError, IndexError) as error:
            raise pickle.UnpicklingError(
                f"{self.qualified_name} in the checkpoint is malformed: {error}") from error

    def _format_of(self, state) -> QuantFormat | None:
        """Our format whose table is the state's qmap bit for bit (float8 has no qmap)."""
        qmap = state.get("qmap")
        for fmt in self.formats:
            if qmap is None or (qmap.shape == fmt.table.shape and torch.equal(qmap.cpu(), fmt.table)):
                return fmt
        return None

    def _carried(self, state) -> QuantizedState | None:
        codes, scale = state["codes"], state["scale"]
        shape = torch.Size(state.get("_shape", codes.shape))
        fmt = self._format_of(state)
        if fmt is None or codes.dtype != self.codes_dtype or scale.dtype != torch.float32:
            return None
        if scale.ndim != 1 or scale.numel() == 0:
            return None
        block_size = codes.numel() * self.codes_per_byte // scale.numel()
        try:
            check_block_size(block_size)
        except ValueError:
            return None
        numel = shape.numel()
        if scale.numel() * block_size != numel or codes.numel() * self.codes_per_byte != numel:
            return None  # a layout for dequantize() to judge (and refuse if malformed)
        scales = scale.float() * self.scale_factor  # one float32 rounding, see the docstring
        block_codes = self.block_codes(state, fmt, block_size).contiguous()
        return QuantizedState(block_codes, scales, fmt.name, shape, torch.float32)


_STATE_CLASSES = {
    state_class.qualified_name: state_class
    for state_class in (
        _StateClass(
            "torchao.optim.subclass_8bit.OptimState8bit", tensor_keys=("codes", "scale", "qmap"),
            codes_dtype=torch.uint8, codes_per_byte=1, dequantize=_dequantize_8bit,
            formats=(DYNAMIC_8BIT_SIGNED, DYNAMIC_8BIT_UNSIGNED), block_codes=_block_codes_8bit,
        ),
        _StateClass(
            "torchao.optim.subclass_4bit.OptimState4bit", tensor_keys=("codes", "scale", "qmap"),
            codes_dtype=torch.uint8, codes_per_byte=2, dequantize=_dequantize_4bit,
            formats=(DYNAMIC_4BIT_SIGNED, LINEAR_4BIT_NONZERO), block_codes=_block_codes_4bit,
        ),
        _StateClass(
            "torchao.optim.subclass_fp8.OptimStateFp8", tensor_keys=("codes", "scale"),
            codes_dtype=torch.float8_e4m3fn, codes_per_byte=1, dequantize=_dequantize_fp8,
            formats=(FLOAT8,), block_codes=_block_codes_fp8, scale_factor=FLOAT8_CODEC.largest,
        ),
    )
}


def quantized_from_torchao(value):
    """A torchao ``OptimState8bit``/``OptimState4bit``/``OptimStateFp8`` as a ``QuantizedState``
    in the format with its map, codes and scales carried over (float32 values where the layout
    cannot be carried); ``None`` for any other tensor."""
    cls = type(value)
    state_class = _STATE_CLASSES.get(f"{cls.__module__}.{cls.__qualname__}")
    if state_class is None:
        return None
    fields = {key: getattr(value, key) for key in state_class.tensor_keys}
    return state_class.moment({**fields, "_shape": tuple(value.shape)})


@dataclass(frozen=True)
class _UnreadState:
    """A torchao state as unpickled, converted once ``torch.load`` returns: in the legacy
    (non-zip) format the inner tensors' data is only read after the pickle."""

    state_class: _StateClass
    state: dict


def _rebuild_state_or_tensor(func, new_type, args, state):
    """torch's ``_rebuild_from_type_v2``, except that a torchao state is kept aside."""
    if isinstance(new_type, _StateClass):
        return _UnreadState(new_type, state)
    return _rebuild_from_type_v2(func, new_type, args, state)


def _with_moments(loaded):
    """``loaded`` with every ``_UnreadState`` in its dicts, lists and tuples converted."""
    if isinstance(loaded, _UnreadState):
        return loaded.state_class.moment(loaded.state)
    if isinstance(loaded, dict):
        return {key: _with_moments(value) for key, value in loaded.items()}
    if isinstance(loaded, (list, tuple)):
        return type(loaded)(_with_moments(value) for value in loaded)
    return loaded


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        qualified_name = f"{module}.{name}"
        if qualified_name in _STATE_CLASSES:
            return _STATE_CLASSES[qualified_name]
        if module == "torchao" or module.startswith("torchao."):
            raise pickle.UnpicklingError(
                f"the checkpoint names {qualified_name}, which lowbit_optim cannot read without "
                f"torchao; it reads {', '.join(sorted(_STATE_CLASSES))}"
            )
        if (module, name) == ("torch._tensor", "_rebuild_from_type_v2"):
            return _rebuild_state_or_tensor
        return super().find_class(module, name)


# What torch.load asks of its ``pickle_module``.
_PICKLE_MODULE = types.SimpleNamespace(
    __name__="lowbit_optim.checkpoint.torchao", Unpickler=_Unpickler,
    load=lambda file, **kwargs: _Unpickler(file, **kwargs).load(),
)


def load_torchao_optimizer_state(f, map_location="cpu") -> dict:
    """The optimizer state dict saved in ``f`` by one of torchao's low-bit optimizers, read
    without importing torchao, ready for ``load_state_dict`` of our class of the same name.

    Each ``OptimState8bit``/``OptimState4bit``/``OptimStateFp8`` moment becomes the
    ``QuantizedState`` with its codes and scales (``quantized_from_torchao``; float32 values
    computed as torchao's ``dequantize()`` does where the layout cannot be carried); the rest
    (``step``, float32 moments of small parameters, ``param_groups``) is as saved. The result
    holds plain tensors and ``QuantizedState`` only, so it can be saved again and read with
    ``torch.load(weights_only=True)``; ``checkpoint.to_torch_adamw`` turns it into float values
    for ``torch.optim.AdamW``. ``f``: a path or a binary file object, as for
    ``torch.load``; ``map_location`` likewise.

    Security: this is a full unpickle (``torch.load(weights_only=False)``, needed because the
    file names torchao's classes): a malicious file can run code. Use it on trusted files only.

    Raises ``pickle.UnpicklingError`` naming the class if the file names any other torchao class.
    """
    return _with_moments(
        torch.load(f, map_location=map_location, pickle_module=_PICKLE_MODULE, weights_only=False))
