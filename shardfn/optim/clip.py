"""``clip_grad_norm``: torch.nn.utils.clip_grad_norm_'s numbers, pure, over pytrees.

The per-gradient norms are ``rules/foreach.py``'s: each process reduces its stored shards
(each distinct shard once), the partial results of one mesh travel as one vector pending a
reduction over every mesh axis, so the norm costs one all_reduce per mesh.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from ..arrays.array import ShardedArray
from ..arrays.redistribute import reshard
from ..rules.foreach import finish, reduced_parts, reducer
from ..values.errors import ShardingError
from ._storage import from_storage, resolved, storage


def clip_grad_norm(grads: Any, max_norm: float, *, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False) -> tuple[Any, torch.Tensor]:
    """``(clipped grads, total_norm)`` with the numbers of ``torch.nn.utils.clip_grad_norm_``
    on the unsharded gradients: the norm of all gradients together, each scaled by
    ``min(1, max_norm / (total_norm + 1e-6))``. ``grads`` is a pytree of ShardedArrays
    and/or tensors (None leaves stay None); nothing passed in changes. Gradients pending a
    reduction come back reduced. ``total_norm`` is a plain 0-d tensor, the same on every process."""
    p = float(norm_type)
    paths, leaves, spec = optree.tree_flatten_with_path(grads)
    for x, path in zip(leaves, paths):
        if not isinstance(x, torch.Tensor):
            raise ShardingError(f"grads{''.join(f'[{k!r}]' for k in path)} is {type(x).__name__}; "
                                f"clip_grad_norm takes a pytree of tensors / ShardedArrays (None leaves allowed)")
    if not leaves:
        return grads, torch.tensor(0.0)
    # gradients pending a sum are reduced first (their stored parts are not the values)
    pend = [i for i, g in enumerate(leaves) if isinstance(g, ShardedArray) and g._layout.partial]
    leaves = [g.detach() for g in leaves]
    if pend:
        for i, g in zip(pend, reshard([leaves[i] for i in pend], [resolved(leaves[i]._layout) for i in pend])):
            leaves[i] = g
    fn = reducer(p)
    parts: list[torch.Tensor | None] = [None] * len(leaves)
    sharded = [i for i, g in enumerate(leaves) if isinstance(g, ShardedArray)]
    for i, g in enumerate(leaves):
        if not isinstance(g, ShardedArray):
            parts[i] = fn(g, tuple(range(g.dim()))) if g.dim() else fn(g.reshape(1), (0,))
    for idx, total in reduced_parts([leaves[i] for i in sharded], p).values():
        for k, j in enumerate(idx):
            parts[sharded[j]] = total[k]
    norms = []
    for g, s in zip(leaves, parts):
        n = finish(s, p)
        norms.append(n.to(g.dtype) if g.dtype.is_floating_point else n)
    total_norm = torch.linalg.vector_norm(torch.stack([n.to(norms[0].dtype) for n in norms]), p)
    if error_if_nonfinite and (torch.isnan(total_norm) or torch.isinf(total_norm)):
        raise RuntimeError(
            f"The total norm of order {p} for gradients from `parameters` is non-finite, so it cannot be clipped. "
            "To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    out = []
    for g in leaves:
        layout = g._layout if isinstance(g, ShardedArray) else None
        st = storage(g, layout)
        scaled = torch._foreach_mul(st, coef.to(device=st[0].device, dtype=g.dtype))
        out.append(from_storage(scaled, layout, g.shape, g.dtype))
    return optree.tree_unflatten(spec, out), total_norm
