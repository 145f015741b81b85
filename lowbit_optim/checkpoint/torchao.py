"""Reading a torchao low-bit optimizer checkpoint file without torchao installed.

A file written by ``torch.save(opt.state_dict(), path)`` for torchao's ``AdamW8bit``,
``AdamW4bit``, ``AdamWFp8``, ``Adam8bit``, ``Adam4bit`` or ``AdamFp8`` names torchao's state
classes in its pickle, so a plain ``torch.load`` imports torchao. torch pickles such a wrapper
tensor subclass as ``_rebuild_from_type_v2(_rebuild_wrapper_subclass, cls, args, state)``
(``torch.Tensor.__reduce_ex__``), where ``state`` is the instance's ``__dict__``: its plain
inner tensors (``codes``, ``scale``, ``qmap``) and attributes (``signed``, ``block_size``,
``_shape``). The unpickler here stands in for those classes and keeps each such state aside;
once the file is read, each becomes the float32 values its ``dequantize()`` returns, computed
with the same operations, so the result is bit-identical to what
``LowBitAdamW.load_state_dict`` reads from the real tensors
(``checkpoint.foreign_float_values``); loading it gives the same state.

torchao is never imported here; a pickle naming any other torchao class is refused.
"""

import pickle
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._tensor import _rebuild_from_type_v2


def _dequantize_with_qmap(codes, qmap, scale):
    """torchao ``quant_utils.dequant_with_qmap``: each code looked up, times its block's scale."""
    return (qmap[codes.int()].view(scale.shape[0], -1) * scale.view(-1, 1)).view(codes.shape)


def _dequantize_8bit(state) -> torch.Tensor:
    """``OptimState8bit.dequantize``: one uint8 code per element, shaped like the moment."""
    return _dequantize_with_qmap(state["codes"], state["qmap"], state["scale"])


def _dequantize_4bit(state) -> torch.Tensor:
    """``OptimState4bit.dequantize``: two codes per byte (high nibble first), flat."""
    codes = state["codes"]
    unpacked = torch.stack([codes >> 4, codes & 0b1111], dim=-1)
    return _dequantize_with_qmap(unpacked, state["qmap"], state["scale"]).view(state["_shape"])


def _dequantize_fp8(state) -> torch.Tensor:
    """``OptimStateFp8.dequantize``: float8 e4m3fn codes times their block's scale."""
    codes, scale = state["codes"], state["scale"]
    return (codes.float().view(scale.shape[0], -1) * scale.view(-1, 1)).view(codes.shape)


@dataclass(frozen=True)
class _StateClass:
    """Stands in for one of torchao's optimizer state classes while unpickling."""

    qualified_name: str
    tensor_keys: tuple
    dequantize: Callable

    def float_values(self, state) -> torch.Tensor:
        missing = [key for key in self.tensor_keys if not isinstance(state.get(key), torch.Tensor)]
        if missing:
            raise pickle.UnpicklingError(
                f"{self.qualified_name} in the checkpoint has no tensor {', '.join(missing)}")
        try:
            return self.dequantize(state)
        except (RuntimeError, KeyError, IndexError) as error:
            raise pickle.UnpicklingError(
                f"{self.qualified_name} in the checkpoint is malformed: {error}") from error


_STATE_CLASSES = {
    qualified_name: _StateClass(qualified_name, keys, dequantize)
    for qualified_name, keys, dequantize in (
        ("torchao.optim.subclass_8bit.OptimState8bit", ("codes", "scale", "qmap"), _dequantize_8bit),
        ("torchao.optim.subclass_4bit.OptimState4bit", ("codes", "scale", "qmap"), _dequantize_4bit),
        ("torchao.optim.subclass_fp8.OptimStateFp8", ("codes", "scale"), _dequantize_fp8),
    )
}


@dataclass(frozen=True)
class _UnreadState:
    """A torchao state as unpickled, dequantized once ``torch.load`` returns: in the legacy
    (non-zip) format the inner tensors' data is only read after the pickle."""

    state_class: _StateClass
    state: dict


def _rebuild_state_or_tensor(func, new_type, args, state):
    """torch's ``_rebuild_from_type_v2``, except that a torchao state is kept aside."""
    if isinstance(new_type, _StateClass):
        return _UnreadState(new_type, state)
    return _rebuild_from_type_v2(func, new_type, args, state)


def _with_float_values(loaded):
    """``loaded`` with every ``_UnreadState`` in its dicts, lists and tuples dequantized."""
    if isinstance(loaded, _UnreadState):
        return loaded.state_class.float_values(loaded.state)
    if isinstance(loaded, dict):
        return {key: _with_float_values(value) for key, value in loaded.items()}
    if isinstance(loaded, (list, tuple)):
        return type(loaded)(_with_float_values(value) for value in loaded)
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

    Each ``OptimState8bit``/``OptimState4bit``/``OptimStateFp8`` moment becomes a float32 tensor
    of its dequantized values (computed as torchao's ``dequantize()`` does, bit for bit); the
    rest (``step``, float32 moments of small parameters, ``param_groups``) is as saved. The
    result holds plain tensors only, so it can be saved again and read with
    ``torch.load(weights_only=True)``. ``f``: a path or a binary file object, as for
    ``torch.load``; ``map_location`` likewise.

    Security: this is a full unpickle (``torch.load(weights_only=False)``, needed because the
    file names torchao's classes): a malicious file can run code. Use it on trusted files only.

    Raises ``pickle.UnpicklingError`` naming the class if the file names any other torchao class.
    """
    return _with_float_values(
        torch.load(f, map_location=map_location, pickle_module=_PICKLE_MODULE, weights_only=False))
