"""Newton-Schulz of a sharded Muon parameter: gather the direction in bf16, keep this rank's rows.

Under FSDP2 every parameter is a ``DTensor`` and each rank holds a shard of it (whole rows:
``Shard(0)``). Muon's momentum update is per element, so each rank updates the momentum of its
own shard, quantized over its own blocks, with no communication. Newton-Schulz is not per
element: it orthogonalises the whole matrix. So for a sharded parameter each rank

1. rounds its float32 direction shard (the Nesterov mix) to bf16,
2. all-gathers the bf16 shards into the whole matrix (``DTensor.full_tensor``, which also
   handles uneven shards),
3. runs Newton-Schulz on it (every rank the same, on the same bits),
4. keeps its own rows (a ``Replicate`` -> the parameter's placements redistribution: a local
   slice, no communication) and updates its parameter shard with them.

Newton-Schulz runs in bf16 and its first operation rounds the direction to bf16
(``lowbit_optim.step.newton_schulz``, as ``torch.optim.Muon``), so
gathering bf16 instead of float32 loses nothing: the gathered matrix is the very one a single
process orthogonalises. The low-bit momentum itself is never gathered.

Cost per step and sharded Muon parameter of ``n`` elements on ``W`` ranks: each rank receives
``2 (W - 1) n / W`` bytes (half of what a float32 all-gather of the parameter would move), and
every rank computes the whole Newton-Schulz (the compute is replicated, not split).
"""

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Replicate

from lowbit_optim.state.sharding import is_dtensor, wrap_like


def orthogonalize(direction: torch.Tensor, param: torch.Tensor,
                  newton_schulz: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``newton_schulz`` of ``param``'s whole direction, as this rank's part of it.

    ``direction`` is this rank's float32 direction (``param``'s local shard's shape for a
    DTensor ``param``, ``param``'s shape otherwise); the result has the same shape. A plain
    ``param`` needs no communication: ``newton_schulz(direction)`` itself. Collective for a
    DTensor ``param``: every rank of its mesh calls it for that parameter, in the same order.
    """
    if not is_dtensor(param):
        return newton_schulz(direction)
    mesh = param.device_mesh
    whole = wrap_like(direction.bfloat16(), param).full_tensor()
    ortho = newton_schulz(whole)
    replicated = DTensor.from_local(ortho, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, param.placements).to_local()
