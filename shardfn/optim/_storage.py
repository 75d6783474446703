"""Pytree leaves as the tensors an element-wise update runs on, and back.

A ShardedArray's *storage* is what its backend keeps in this process, each distinct shard
once (``Backend.storage``): a torch kernel run on it updates every device's shard, replicas
once. A plain tensor is its own storage. The *update layout* of a parameter is the layout
its optimizer state takes: the parameter's own (pending reductions resolved), or sharded
further over the ZeRO-1 axes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..arrays.array import ShardedArray, wrap
from ..backends.registry import backend_for
from ..values.errors import ShardingError
from ..values.layout import Layout, local_shapes


def resolved(layout: Layout) -> Layout:
    """``layout`` with its pending reductions applied (the same dims sharding)."""
    return Layout(layout.mesh, layout.dims) if layout.partial else layout


def zero_layout(layout: Layout, shape: Sequence[int], axes: Sequence[str]) -> Layout:
    """``layout`` (resolved) further sharded over each of ``axes`` it does not use yet: each
    axis is added, minor, to the dim whose local size it divides with the largest shard
    (else the largest local dim); a 0-d value or one already sharded over it is left so."""
    layout = resolved(layout)
    mesh = layout.mesh
    for a in axes:
        if a not in mesh.axis_names:
            raise ShardingError(
                f"shard_state_over={tuple(axes)!r}: {a!r} is not an axis of {mesh!r} (axes: {mesh.axis_names})"
            )
        if a in layout.axis_dim or not shape:
            continue
        k = mesh.axis_size(a)
        local = max(local_shapes(layout, tuple(shape)), key=math.prod)  # the largest shard's shape
        best = max(range(len(shape)), key=lambda d: (local[d] % k == 0 and local[d] > 0, local[d]))
        dims = list(layout.dims)
        dims[best] = dims[best] + (a,)
        layout = Layout(mesh, tuple(dims))
    return layout


def storage(x: torch.Tensor, layout: Layout | None) -> list[torch.Tensor]:
    """The tensors holding ``x``'s data in this process, each distinct shard once (``x`` is
    stored in ``layout``, or a plain tensor when ``layout`` is None)."""
    if layout is None:
        return [x.detach()]
    return backend_for(layout.mesh).storage(x._local, layout, tuple(x.shape))


def from_storage(tensors: Sequence[torch.Tensor], layout: Layout | None, shape: Sequence[int], dtype: torch.dtype,
                 *, requires_grad: bool = False) -> torch.Tensor:
    """The array (or plain tensor) whose storage is ``tensors`` (see :func:`storage`)."""
    if layout is None:
        return tensors[0].requires_grad_(requires_grad) if requires_grad else tensors[0]
    value = backend_for(layout.mesh).from_storage(list(tensors), layout, tuple(shape))
    return wrap(value, layout, shape, dtype, requires_grad=requires_grad)


def in_layout(x: Any, layout: Layout | None, what: str) -> torch.Tensor:
    """``x`` (an array or plain tensor) laid out as ``layout``: a plain tensor given for an
    array is distributed (every process must pass the same value on dist), an array given
    for a plain tensor (``layout`` None: the gradient of a plain parameter used with
    ShardedArrays) is gathered."""
    if layout is None:
        return x.full_tensor() if isinstance(x, ShardedArray) else x
    if not isinstance(x, ShardedArray):
        from ..arrays.redistribute import distribute

        return distribute(x.detach(), layout)
    if x.mesh != layout.mesh:
        raise ShardingError(f"{what} is on {x.mesh!r} but its parameter is on {layout.mesh!r}")
    return x
