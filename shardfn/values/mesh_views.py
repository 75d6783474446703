"""Views of one mesh: ``Mesh.flatten`` / ``Mesh.unflatten`` give meshes over the same
devices (same row-major numbering), and a ShardedArray moves between a mesh and its view
by relabelling its layout (``arrays/redistribute.py`` ``reshard_across``) — no data moves when the layouts
agree (``P(('dp','tp'))`` on ``(dp, tp)`` is ``P('dptp')`` on the flattened mesh).

Both meshes are factorisations of the same device count; their common refinement (the
*fine* mesh, one axis per factor) expresses every layout of either. A move goes
source -> fine (relabel) -> plan on the fine mesh (empty when the layouts agree) ->
destination (relabel).
"""

from __future__ import annotations


from .errors import ShardingError
from .layout import Layout
from .mesh import Mesh


def not_a_view(a: Mesh, b: Mesh) -> ShardingError:
    """The error for a move from mesh ``a`` to a mesh ``b`` that is not a view of it."""
    return ShardingError(
        f"the value is on {a!r} but the target sharding is on a different mesh {b!r}, which is not "
        f"a view of it (views have the same devices and backend; see Mesh.flatten / Mesh.unflatten)"
    )


def refinement(a: Mesh, b: Mesh) -> tuple[Mesh, dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """The fine mesh of ``a`` and ``b`` and, per axis of ``a`` and per axis of ``b`` (two maps:
    the meshes may share axis names, e.g. ``("x", "y")`` of 2x2 and ``("x",)`` of 4), its fine
    axes (major first)."""
    if a.size != b.size:
        raise not_a_view(a, b)
    sizes: list[int] = []
    own_a: dict[str, list[str]] = {n: [] for n in a.axis_names}
    own_b: dict[str, list[str]] = {n: [] for n in b.axis_names}
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
                f"the target sharding is on a different mesh {b!r}, which is not a view of {a!r}: "
                f"axis {b.axis_names[ib]!r} (size {b.shape[ib]}) does not "
                f"line up with axis {a.axis_names[ia]!r} (size {a.shape[ia]})"
            )
        name = f"_f{len(sizes)}"
        sizes.append(f)
        own_a[a.axis_names[ia]].append(name)
        own_b[b.axis_names[ib]].append(name)
        ra, rb = ra // f, rb // f
    fine = Mesh(tuple(sizes) or (1,), tuple(f"_f{i}" for i in range(len(sizes))) or ("_f0",), backend=a.backend,
                device_type=a.device_type)
    return fine, {n: tuple(v) for n, v in own_a.items()}, {n: tuple(v) for n, v in own_b.items()}


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
