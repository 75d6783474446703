"""``clip_grad_norm``: torch.nn.utils.clip_grad_norm_'s numbers, pure, over pytrees.

Each process reduces its stored shards (each distinct shard once, ``Backend.shard_reduce``);
the per-gradient partial results of one mesh travel as one vector pending a reduction over
every mesh axis, so the norm costs one all_reduce per mesh (none on the local backend).
"""

from __future__ import annotations

import math
from typing import Any

import optree
import torch

from ..arrays.array import ShardedArray, reshard, wrap
from ..backends.registry import backend_for
from ..values.errors import ShardingError
from ..values.layout import Layout
from ._storage import from_storage, resolved, storage


def _reducer(p: float):
    """``fn(t, dims)``: the per-shard part of a p-norm (a sum of |x|^p, or a max/min of |x|)."""
    def fn(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
        acc = torch.promote_types(t.dtype, torch.float32)
        a = t.abs().to(acc)
        batch = [n for i, n in enumerate(t.shape) if i not in dims]
        if math.isinf(p):
            if a.numel() == 0:
                return torch.full(batch, 0.0 if p > 0 else math.inf, dtype=acc, device=t.device)
            return a.amax(dims) if p > 0 else a.amin(dims)
        if p == 2:
            return (a * a).sum(dims)
        if p == 1:
            return a.sum(dims)
        return a.pow(p).sum(dims) if p != 0 else (a != 0).to(acc).sum(dims)
    return fn


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
    fn = _reducer(p)
    neutral = math.inf if p == -math.inf else 0.0
    parts: list[torch.Tensor | None] = [None] * len(leaves)
    by_mesh: dict[Any, list[int]] = {}
    for i, g in enumerate(leaves):
        if isinstance(g, ShardedArray):
            by_mesh.setdefault(g.mesh, []).append(i)
        else:
            parts[i] = fn(g, tuple(range(g.dim()))) if g.dim() else fn(g.reshape(1), (0,))
    op = ("max" if p > 0 else "min") if math.isinf(p) else "sum"
    for mesh, idx in by_mesh.items():
        backend = backend_for(mesh)
        vals = [backend.shard_reduce(leaves[i]._local, leaves[i]._layout, tuple(leaves[i].shape), fn, neutral)
                for i in idx]
        dtype = vals[0].dtype
        for v in vals[1:]:
            dtype = torch.promote_types(dtype, v.dtype)
        stacked = torch.stack([v.to(dtype) for v in vals], dim=-1)
        flat = mesh
        if mesh.ndim > 1:  # one axis over every device: one all_reduce, not one per axis
            flat = mesh.flatten(mesh.axis_names, "_".join(mesh.axis_names) + "_clip")
            stacked = backend.relabel(stacked, mesh, flat)
        pending = Layout(flat, ((),), tuple((a, op) for a in flat.axis_names))
        summed = reshard(wrap(stacked, pending, (len(idx),), dtype), Layout(flat, ((),)))
        total = summed.full_tensor()
        for k, i in enumerate(idx):
            parts[i] = total[k]
    norms = []
    for g, s in zip(leaves, parts):
        n = s if math.isinf(p) else (s if p == 0 else s.pow(1.0 / p))
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
