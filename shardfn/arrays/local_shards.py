"""A ShardedArray and its local shards: ``x.to_local()`` (each held device's shard, its gradient
laid out as asked) and ``ShardedArray.from_local`` (shards -> an array, checked: one rank and
dtype, shapes against the layout, replicas equal), both differentiable."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ..backends.registry import backend_for
from ..values import layout as _lay
from ..values import replica_checks as _replicas
from ..values.errors import ShardingError
from ..values.layout import Layout
from ..values.mesh import Mesh, current_mesh, to_mesh_device
from .fragments import _fragment
from ..values.spec import NamedSharding, Sharding, check_mesh, to_layout
from .array import ShardedArray, strides_in_order_of
from .redistribute import _as_sharded, _shares_memory, _sharding_mesh, raw_reshard, reshard


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(x: ShardedArray, grad_layout: Layout) -> tuple:
        return tuple(x.local_shards())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        x, grad_layout = inputs
        ctx.meta = (grad_layout, tuple(x.shape), x.dtype)
        ctx.mark_non_differentiable(*[s for s in output if not s.is_floating_point() and not s.is_complex()])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        layout, shape, dtype = ctx.meta
        shapes = _lay.local_shapes(layout, shape)
        backend = backend_for(layout.mesh)
        grads = [
            torch.zeros(shapes[d], dtype=dtype) if g is None else g
            for d, g in zip(backend.devices(layout.mesh), grads)
        ]
        return _from_local(backend.pack_local(grads, layout.mesh), layout, layout.mesh, shape, None), None


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(layout: Layout, shape: tuple, stride: Any, *shards: torch.Tensor) -> ShardedArray:
        backend = backend_for(layout.mesh)
        local = backend.from_shards([s.detach() for s in shards], layout, shape)
        if _shares_memory(local, shards):  # kept as given (uneven, dist): copied
            local = backend.from_shards([s.detach().clone() for s in shards], layout, shape)
        out = ShardedArray(local, layout, shape, shards[0].dtype, stride=stride)
        _fragment(out)  # its interned key fragment now, as an op's output has it (was: on first use)
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        layout, shape = inputs[0], inputs[1]
        ctx.meta = (layout, shape, part_weights(output.detach()))

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        layout, shape, value = ctx.meta
        grad = reshard(_as_sharded(g, layout), layout.without_partial())
        shards = grad.local_shards()
        if value is not None:  # avg / max / min: each part's share of the reduced value
            shards = [s * w for s, w in zip(shards, value.local_shards())]
        return (None, None, None, *shards)


def part_weights(value: ShardedArray) -> ShardedArray | None:
    """What each part of a pending avg / max / min contributes to the reduced value, as the
    parts of an array pending a sum (None for pending sums: every part counts fully). An
    average's parts weigh 1/n; a max's or min's the parts attaining it, split evenly among
    ties, as torch.amax's gradient is. Cotangents and tangents of the parts scale by these
    (constants: read from the raw shards, outside autograd)."""
    layout = value._layout
    if all(op == "sum" for _, op in layout.partial) or not (value.is_floating_point() or value.is_complex()):
        return None
    mesh, shape, backend = layout.mesh, tuple(value.shape), backend_for(layout.mesh)
    sums = Layout(mesh, layout.dims, tuple((a, "sum") for a, _ in layout.partial))
    scale = 1 / math.prod(mesh.axis_size(a) for a, op in layout.partial if op == "avg")
    parts = [p.detach() for p in value.local_shards()]
    if not _selects(layout):
        weights = [torch.full_like(p, scale) for p in parts]
    else:
        kept = tuple(p for p in layout.partial if p[1] not in ("max", "min"))
        reduced = _shards_of(raw_reshard(value, Layout(mesh, layout.dims, kept)), mesh)
        masks = [((p == r) | (p.isnan() & r.isnan())).to(p.dtype) for p, r in zip(parts, reduced)]
        counted = ShardedArray(backend.from_shards(masks, sums, shape), sums, shape, value.dtype)
        counts = _shards_of(raw_reshard(counted, Layout(mesh, layout.dims, tuple((a, "sum") for a, _ in kept))), mesh)
        weights = [m * scale / c.clamp(min=1) for m, c in zip(masks, counts)]
    return ShardedArray(backend.from_shards(weights, sums, shape), sums, shape, value.dtype)


def _selects(layout: Layout) -> bool:
    return any(op in ("max", "min") for _, op in layout.partial)


def _shards_of(value: Any, mesh: Mesh) -> tuple:
    return tuple(backend_for(mesh).shard_list(value, mesh))


def _from_local(local: Any, sharding: Sharding, mesh: Mesh | None, shape: Sequence[int] | None,
                stride: Sequence[int] | None, *, run_check: bool = False) -> ShardedArray:
    if mesh is not None:
        check_mesh(mesh, "from_local(mesh=...)")
    if mesh is None and not isinstance(sharding, NamedSharding | Layout):
        mesh = current_mesh()
    if shape is not None:
        from ..plans.planner import check_shape

        shape = check_shape(shape, "from_local")
    shards = _check_shard_list(local, mesh if mesh is not None else _sharding_mesh(sharding))
    ndim = shards[0].dim()
    layout = to_layout(sharding, ndim, mesh, arg="sharding")
    shards = _to_mesh_devices(shards, layout.mesh)  # the mesh owns the device
    backend = backend_for(layout.mesh)
    shape = backend.global_shape(shards, layout, shape, check_ranks=run_check)
    if stride is not None and (
        isinstance(stride, (str, bytes)) or len(tuple(stride)) != len(shape)
        or not all(isinstance(n, (int, torch.SymInt)) and not isinstance(n, bool) and n >= 0 for n in stride)
    ):
        raise ShardingError(f"from_local: stride={stride!r} is not a stride for the global shape {tuple(shape)}; "
                            f"give {len(shape)} non-negative ints (or stride=None: contiguous)")
    checked = _replicas.checking()
    if run_check or checked:
        _check_replicas_agree(shards, layout)
    if checked:
        split = set(layout.axis_dim) | set(layout.partial_ops)
        over = tuple(a for a in layout.mesh.axis_names if a not in split)
        backend.check_replicas(layout.mesh, shards[0], over, f"from_local: the local tensor ({layout.spec_str()})")
    # stride=None: the global strides follow the shards' dim order, as DTensor's from_local infers them
    stride = tuple(stride) if stride is not None else strides_in_order_of(shape, shards[0])
    return _FromLocal.apply(layout, shape, stride, *shards)


def _to_mesh_devices(shards: list[torch.Tensor], mesh: Mesh) -> list[torch.Tensor]:
    """Each shard on the mesh's device type (copied there where it is elsewhere). A shard that
    cannot be copied there (a meta tensor holds no data) is a ShardingError naming the device
    of every such shard and the mesh's device_type."""
    devices = backend_for(mesh).devices(mesh)

    def where(bad: list[int]) -> str:
        named = (f"the shard of device {devices[i]} is on {shards[i].device}" for i in bad[:8])
        return ", ".join(named) + (" ..." if len(bad) > 8 else "")

    no_data = [i for i, t in enumerate(shards) if t.is_meta and mesh.device_type != "meta"]
    if no_data:
        raise ShardingError(
            f"from_local: {where(no_data)}: a meta tensor holds no values, but {mesh!r} has device_type "
            f"{mesh.device_type!r} and needs every shard's values; pass tensors with data (any device: they "
            f"are copied to {mesh.device_type!r}), or use a mesh with device_type='meta'"
        )
    out = []
    for i, t in enumerate(shards):
        try:
            out.append(to_mesh_device(t, mesh))
        except (RuntimeError, NotImplementedError) as e:
            raise ShardingError(
                f"from_local: {where([i])} cannot be copied to {mesh!r}'s device_type {mesh.device_type!r}: "
                f"{str(e).splitlines()[0]}"
            ) from None
    return out


def _check_replicas_agree(shards: list[torch.Tensor], layout: Layout) -> None:
    """Shards on devices that differ only along replicated mesh axes hold one value: a
    ShardingError names the devices that disagree. Only replicas this process holds are
    compared (every one on the local backend; on dist values are trusted, as in JAX/DTensor)."""
    mesh = layout.mesh
    split = set(layout.axis_dim) | set(layout.partial_ops)
    replicated = [i for i, a in enumerate(mesh.axis_names) if a not in split and mesh.shape[i] > 1]
    if not replicated:
        return
    held = {dev: i for i, dev in enumerate(backend_for(mesh).devices(mesh))}
    bad = []
    for dev, i in held.items():
        coords = list(mesh.coords(dev))
        for k in replicated:
            coords[k] = 0
        first = mesh.device_at(coords)
        j = held.get(first)
        if j is not None and first != dev and not _same_values(shards[j], shards[i]):
            bad.append((first, dev))
    if bad:
        axes = [mesh.axis_names[i] for i in replicated]
        pairs = ", ".join(f"{a} vs {b}" for a, b in bad[:8])
        raise ShardingError(
            f"from_local: {layout.spec_str()} replicates over mesh axes {axes!r}, but the shards of "
            f"devices {pairs} differ; replicas must hold equal values (shard the value, declare it "
            f"Partial, or pass equal shards)"
        )


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (NaN equal to NaN, as a copy would be); meta shards hold no values to compare."""
    if a.shape != b.shape or a.is_meta or b.is_meta:
        return a.shape == b.shape
    if torch.equal(a, b):
        return True
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return False


def _check_shard_list(local: Any, mesh: Mesh | None) -> list[torch.Tensor]:
    if mesh is None:
        raise ShardingError("from_local needs a mesh: pass mesh=, a NamedSharding, or enter `with mesh:`")
    local = backend_for(mesh).unpack_local(local, mesh)
    for i, t in enumerate(local):
        if not isinstance(t, torch.Tensor) or isinstance(t, ShardedArray):
            raise ShardingError(f"from_local: shard {i} is {type(t).__name__}, not a plain torch.Tensor")
        if t.dim() != local[0].dim() or t.dtype != local[0].dtype:
            raise ShardingError(
                f"from_local: shard {i} is {t.dtype}[{tuple(t.shape)}] but shard 0 is "
                f"{local[0].dtype}[{tuple(local[0].shape)}]; all shards need one rank and dtype"
            )
    return local
