"""Which parameters Muon steps and which the low-bit AdamW steps: ``muon_param_groups``, the
default split of ``Muon8bit``/``Muon4bit`` (docs/muon.md), public so that callers that build
their own groups (the HF Trainer integration, users) get the same one.

Muon is for the 2-D weights of hidden layers (Jordan et al.; torch.optim.Muon's docstring):
embeddings and the output head are matrices too, but their rows are looked up (or scored) one
token at a time, and Muon's orthogonalised step is meant for neither, so they go to AdamW with
the 1-D parameters (norms, biases) and anything of another rank.
"""

from collections.abc import Iterable

import torch
from torch import nn

# The last component of a module name that marks an output head (Linear layers).
HEAD_NAMES = ("lm_head", "head", "output", "classifier", "score")
# Substrings of a parameter name that mark an embedding, where only names are known.
EMBEDDING_NAME_PARTS = ("embed", "wte", "wpe")


def _module_adamw_ids(module: nn.Module) -> set[int]:
    """The ids of ``module``'s embedding weights (and anything tied to them: the same tensor)
    and its head Linear layers' weights."""
    ids = set()
    for name, child in module.named_modules():
        if isinstance(child, nn.Embedding):
            ids.add(id(child.weight))
        elif isinstance(child, nn.Linear) and name.rsplit(".", 1)[-1] in HEAD_NAMES:
            ids.add(id(child.weight))
    return ids


def is_head_or_embedding_name(name: str) -> bool:
    """Whether a parameter name (``named_parameters()``) marks an embedding or an output head:
    its module's last name component is one of ``HEAD_NAMES``, or the name contains one of
    ``EMBEDDING_NAME_PARTS``."""
    module_name = name.rsplit(".", 1)[0] if "." in name else ""
    return (module_name.rsplit(".", 1)[-1] in HEAD_NAMES
            or any(part in name for part in EMBEDDING_NAME_PARTS))


def _tensor_of(entry) -> torch.Tensor:
    return entry[1] if isinstance(entry, tuple) else entry


def _takes_muon(entry, adamw_ids: set[int]) -> bool:
    tensor = _tensor_of(entry)
    if tensor.dim() != 2 or id(tensor) in adamw_ids:
        return False
    return not (isinstance(entry, tuple) and is_head_or_embedding_name(entry[0]))


def _param_list(params) -> list:
    """A group's ``params`` as a list (a generator is consumed once, here). A set is refused
    as torch refuses it: its order, and so the state's, changes between runs."""
    if isinstance(params, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, but the "
                        "ordering of tensors in sets will change between runs. Please use a list instead.")
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _split_group(group: dict, adamw_ids: set[int]) -> list[dict]:
    """A group without ``use_muon``: its Muon part and its AdamW part, each with the group's
    other keys, in that order; an empty part is dropped."""
    params = _param_list(group["params"])
    chosen = [_takes_muon(entry, adamw_ids) for entry in params]
    parts = []
    for use_muon in (True, False):
        members = [entry for entry, takes in zip(params, chosen) if takes == use_muon]
        if members:
            parts.append({**group, "params": members, "use_muon": use_muon})
    return parts


def muon_param_groups(params) -> list[dict]:
    """Param groups for ``Muon8bit``/``Muon4bit``, each with ``use_muon`` set.

    ``params``: an ``nn.Module``, ``named_parameters()`` pairs, plain parameters, or param-group
    dicts (of either kind of parameters). A group dict that has ``use_muon`` is kept as given;
    any other group (or the whole list) is split into a Muon part and an AdamW part, each keeping
    the group's keys, in that order, empty parts dropped. A parameter takes Muon iff it is 2-D
    and not an embedding or an output head:

    * from a module: the weights of every ``nn.Embedding`` (and anything tied to one, the same
      tensor) and of the ``nn.Linear`` layers whose name ends in ``lm_head``, ``head``,
      ``output``, ``classifier`` or ``score`` take AdamW;
    * from names: the same head names (the module part of the name), and names containing
      ``embed``, ``wte`` or ``wpe``, take AdamW;
    * from bare parameters only the number of dimensions decides: pass the module or its named
      parameters to send embeddings and the head to AdamW.

    A module's parameters are given as plain tensors (as ``model.parameters()``), in its order.
    """
    adamw_ids: set[int] = set()
    if isinstance(params, nn.Module):
        adamw_ids = _module_adamw_ids(params)
        params = [param for _, param in params.named_parameters()]
    elif isinstance(params, torch.Tensor):
        params = [params]
    if not isinstance(params, Iterable):
        raise TypeError(f"params argument given to the optimizer should be an iterable of Tensors or dicts, "
                        f"but got {type(params).__name__}")
    params = list(params)
    if not params or not isinstance(params[0], dict):
        return _split_group({"params": params}, adamw_ids)
    groups = []
    for group in params:
        if "use_muon" in group:
            groups.append({**group, "params": _param_list(group["params"])})
        else:
            groups.extend(_split_group(group, adamw_ids))
    return groups
