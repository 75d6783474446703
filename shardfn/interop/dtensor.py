"""Interop with torch's DTensor on the dist backend, without copying the local shard.

``to_dtensor(x)`` wraps this rank's shard of a ShardedArray as a DTensor on a DeviceMesh
built from the backend's per-axis process groups; ``from_dtensor(dt)`` wraps a DTensor's
local tensor as a ShardedArray. Both are differentiable (they are built from
``DTensor.from_local`` / ``to_local`` and shardfn's ``from_local`` / ``to_local``), so
shardfn values can meet FSDP2 or torch's tensor-parallel styles. Layouts agree: both use
ceil-sized pieces with short or empty trailing pieces, nested in mesh order.
"""

from __future__ import annotations

from typing import Any

import torch

from ..arrays import array as _array
from ..arrays.array import ShardedArray
from ..backends.registry import backend_for
from ..values.errors import ShardingError
from ..values.mesh import Mesh
from ..values.spec import Partial, Placement, Replicate, Shard, layout_placements

_device_meshes: dict[Mesh, Any] = {}


def device_mesh(mesh: Mesh) -> Any:
    """The torch DeviceMesh of a dist ``mesh`` (same shape, axis names and groups)."""
    from torch.distributed.device_mesh import DeviceMesh

    dm = _device_meshes.get(mesh)
    if dm is None:
        groups = [backend_for(mesh).axis_group(mesh, (a,)).pg for a in mesh.axis_names]
        ranks = torch.arange(mesh.size).view(mesh.shape)
        dm = DeviceMesh.from_group(
            groups if mesh.ndim > 1 else groups[0], mesh.device_type, mesh=ranks,
            mesh_dim_names=mesh.axis_names,
        )
        _device_meshes[mesh] = dm
    return dm


def _to_torch(p: Placement) -> Any:
    from torch.distributed.tensor import placement_types as pt

    if isinstance(p, Shard):
        return pt.Shard(p.dim)
    if isinstance(p, Partial):
        return pt.Partial(p.op)
    return pt.Replicate()


def _from_torch(p: Any, where: str) -> Placement:
    from torch.distributed.tensor import placement_types as pt

    if type(p) is pt.Shard:
        return Shard(p.dim)
    if isinstance(p, pt.Replicate):
        return Replicate()
    if isinstance(p, pt.Partial) and p.reduce_op in ("sum", "avg", "max", "min"):
        return Partial(p.reduce_op)
    raise ShardingError(
        f"from_dtensor: {where} has placement {p!r}, which shardfn cannot express; "
        f"redistribute the DTensor to Shard/Replicate/Partial(sum|avg|max|min) placements first"
    )


def to_dtensor(x: ShardedArray) -> Any:
    """``x`` as a DTensor holding a copy of this rank's local tensor (dist backend only).

    Example::

        dt = x.to_dtensor()          # x: ShardedArray on Mesh((4,), ('dp',), backend='dist')
        y = sf.from_dtensor(dt)      # same shards, no copy
    """
    from torch.distributed.tensor import DTensor

    mesh = x.mesh
    if backend_for(mesh).axis_group(mesh, mesh.axis_names) is None:
        raise ShardingError(
            f"to_dtensor needs a mesh with backend='dist' (one process per device); {mesh!r} "
            f"simulates its devices in this process, which DTensor cannot represent"
        )
    placements = tuple(_to_torch(p) for p in layout_placements(x._layout))
    return DTensor.from_local(
        x.to_local(), device_mesh(mesh), placements, run_check=False, shape=x.shape, stride=x.stride(),
    )


def from_dtensor(dt: Any) -> ShardedArray:
    """A ShardedArray holding a copy of ``dt``'s local tensor, on a dist mesh with the DeviceMesh's
    shape and dim names (``d0``, ``d1``, ... when unnamed). The DeviceMesh must span the
    whole world in row-major rank order."""
    from torch.distributed.tensor import DTensor

    if not isinstance(dt, DTensor):
        raise ShardingError(f"from_dtensor takes a torch DTensor, got {type(dt).__name__}")
    dm = dt.device_mesh
    ranks = dm.mesh.flatten().tolist()
    if ranks != list(range(len(ranks))):
        raise ShardingError(
            f"from_dtensor: the DeviceMesh holds ranks {dm.mesh.tolist()}, but a shardfn dist "
            f"mesh maps the world onto its devices row-major (ranks 0..{len(ranks) - 1} in order)"
        )
    names = dm.mesh_dim_names or tuple(f"d{i}" for i in range(dm.ndim))
    mesh = Mesh(tuple(dm.mesh.shape), tuple(names), backend="dist", device_type=dm.device_type)
    placements = tuple(_from_torch(p, f"mesh dim {n!r}") for p, n in zip(dt.placements, names))
    if mesh not in _device_meshes:
        _device_meshes[mesh] = dm
    return ShardedArray.from_local(dt.to_local(), placements, mesh=mesh, shape=tuple(dt.shape))


_array._to_dtensor = to_dtensor  # ShardedArray.to_dtensor (arrays cannot import this package)
