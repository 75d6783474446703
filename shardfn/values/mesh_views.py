"""Views of one mesh: ``Mesh.flatten`` / ``Mesh.unflatten`` give meshes over the same
devices (same row-major numbering), and a ShardedArray moves between a mesh and its view
by relabelling its layout — no data moves when the layouts agree (``P(('dp','tp'))`` on
``(dp, tp)`` is ``P('dptp')`` on the flattened mesh).

Both meshes are factorisations of the same device count; their common refinement (the
*fine* mesh, one axis per factor) expresses every layout of either. A move goes
source -> fine (relabel) -> plan on the fine mesh (empty when the layouts agree) ->
destination (relabel).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..backends.registry import backend_for
from .errors import ShardingError
from .layout import Layout
from .mesh import Mesh


def refinement(a: Mesh, b: Mesh) -> tuple[Mesh, dict[str, tuple[str, ...]]]:
    """The fine mesh of ``a`` and ``b`` and, per axis of either, its fine axes (major first)."""
    if a.size != b.size or backend_for(a) is not backend_for(b):
        raise ShardingError(
            f"the value is on {a!r} but the target sharding is on a different mesh {b!r}, which is not "
            f"a view of it (views have the same devices and backend; see Mesh.flatten / Mesh.unflatten)"
        )
    sizes: list[int] = []
    owner: dict[str, list[str]] = {n: [] for n in (*a.axis_names, *b.axis_names)}
    ia = ib = 0
    ra, rb = _rest(a, 0), _rest(b, 0)
    while ia < a.ndim or ib < b.ndim:
        if ia < a.ndim and ra == 1:
            ia, ra = ia + 1, _rest(a, ia + 1)
            continue
        if ib < b.ndim and rb == 1:
            ib, rb = ib + 1, _rest(b, ib + 1)
            continue
        f = min(ra, rb)
        if max(ra, rb) % f:
            raise ShardingError(
                f"the target sharding is on a different mesh {b!r}, which is not a view of {a!r}: axis {b.axis_names[ib]!r} (size {b.shape[ib]}) does not "
                f"line up with axis {a.axis_names[ia]!r} (size {a.shape[ia]})"
            )
        name = f"_f{len(sizes)}"
        sizes.append(f)
        owner[a.axis_names[ia]].append(name)
        owner[b.axis_names[ib]].append(name)
        ra, rb = ra // f, rb // f
    fine = Mesh(tuple(sizes) or (1,), tuple(f"_f{i}" for i in range(len(sizes))) or ("_f0",), backend=a.backend,
                device_type=a.device_type)
    return fine, {n: tuple(v) for n, v in owner.items()}


def _rest(m: Mesh, i: int) -> int:
    return m.shape[i] if i < m.ndim else 1


def to_fine(layout: Layout, fine: Mesh, owner: dict) -> Layout:
    """``layout`` (on a coarse mesh) said on the fine mesh."""
    dims = tuple(tuple(f for a in axes for f in owner[a]) for axes in layout.dims)
    order = fine.axis_names
    partial = sorted(((f, op) for a, op in layout.partial for f in owner[a]), key=lambda p: order.index(p[0]))
    return Layout(fine, dims, tuple(partial))


def from_fine(layout: Layout, mesh: Mesh, owner: dict) -> Layout | None:
    """``layout`` (on the fine mesh) said on ``mesh``; None if an axis of ``mesh`` is only
    partly used in some role (then data must move on the fine mesh first)."""
    coarse = {owner[a]: a for a in mesh.axis_names if owner[a]}
    dims = []
    for axes in layout.dims:
        out, i = [], 0
        while i < len(axes):
            hit = next((c for c in coarse if axes[i:i + len(c)] == c), None)
            if hit is None:
                return None
            out.append(coarse[hit])
            i += len(hit)
        dims.append(tuple(out))
    ops = layout.partial_ops
    partial = []
    for a in mesh.axis_names:
        got = {ops.get(f) for f in owner[a]}
        if len(got) > 1:
            return None
        op = got.pop() if got else None
        if op is not None:
            partial.append((a, op))
    used = {a for d in dims for a in d} | {a for a, _ in partial}
    for a in mesh.axis_names:  # an unused coarse axis must have no fine axis sharding anything
        if a not in used and any(f in layout.axis_dim or f in ops for f in owner[a]):
            return None
    return Layout(mesh, tuple(dims), tuple(partial))


def relabel(value: Any, src: Mesh, dst: Mesh) -> Any:
    """The backend value of a layout on ``src`` as the same shards on ``dst``."""
    return backend_for(src).relabel(value, src, dst)


def reshard_across(x: Any, dst: Layout) -> Any:
    """``x`` laid out as ``dst`` on a view of its mesh (differentiable)."""
    return _Across.apply(x, dst)


def _move(x: Any, dst: Layout) -> Any:
    from ..arrays.array import ShardedArray, raw_reshard, wrap

    src_mesh = x._layout.mesh
    fine, owner = refinement(src_mesh, dst.mesh)
    src_f = to_fine(x._layout, fine, owner)
    dst_f = to_fine(dst, fine, owner)
    value = relabel(x._local, src_mesh, fine)
    on_fine = ShardedArray(value, src_f, tuple(x.shape), x.dtype)
    value = raw_reshard(on_fine, dst_f)
    return wrap(relabel(value, fine, dst.mesh), dst, tuple(x.shape), x.dtype)


class _Across(torch.autograd.Function):
    @staticmethod
    def forward(x: Any, dst: Layout) -> Any:
        return _move(x, dst)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.src, ctx.dst = inputs[0]._layout, inputs[1]

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        from ..arrays.array import ShardedArray

        if not isinstance(g, ShardedArray):
            return None, None
        return reshard_across(g, ctx.src.without_partial() if ctx.src.partial else ctx.src), None

    @staticmethod
    def jvp(ctx: Any, t: Any, _: Any) -> Any:
        from ..arrays.array import reshard

        return _move(reshard(t, ctx.src), ctx.dst)


def flatten(mesh: Mesh, axes: tuple[str, ...], name: str) -> Mesh:
    axes = tuple(axes)
    if not axes or any(a not in mesh.axis_names for a in axes):
        raise ShardingError(f"Mesh.flatten: axes {axes!r} must be axes of {mesh!r}")
    idx = [mesh.axis_names.index(a) for a in axes]
    if idx != list(range(idx[0], idx[0] + len(idx))):
        raise ShardingError(
            f"Mesh.flatten: axes {axes!r} must be adjacent and in mesh order {mesh.axis_names!r}; "
            f"only such axes merge into one axis over the same devices"
        )
    if name in mesh.axis_names and name not in axes:
        raise ShardingError(f"Mesh.flatten: name {name!r} is already an axis of {mesh!r}")
    lo, hi = idx[0], idx[-1] + 1
    shape = (*mesh.shape[:lo], math.prod(mesh.shape[lo:hi]), *mesh.shape[hi:])
    names = (*mesh.axis_names[:lo], name, *mesh.axis_names[hi:])
    return Mesh(shape, names, backend=mesh.backend, device_type=mesh.device_type)


def unflatten(mesh: Mesh, axis: str, shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    i = mesh.axis_index(axis)
    shape, names = tuple(shape), tuple(names)
    if len(shape) != len(names):
        raise ShardingError(f"Mesh.unflatten: shape {shape!r} and names {names!r} differ in length")
    if math.prod(shape) != mesh.shape[i]:
        raise ShardingError(
            f"Mesh.unflatten: shape {shape!r} has {math.prod(shape)} devices but axis {axis!r} has {mesh.shape[i]}"
        )
    for n in names:
        if n in mesh.axis_names and n != axis:
            raise ShardingError(f"Mesh.unflatten: name {n!r} is already an axis of {mesh!r}")
    return Mesh((*mesh.shape[:i], *shape, *mesh.shape[i + 1:]), (*mesh.axis_names[:i], *names, *mesh.axis_names[i + 1:]),
                backend=mesh.backend, device_type=mesh.device_type)
