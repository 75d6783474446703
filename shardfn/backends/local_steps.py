"""Plan steps on the local backend: a stacked value moves between even layouts by one
reshape/permute (``_regrid``) or reduces over a mesh dim; per-device shards move by exact
box routes. Every simulated device's part is computed here, in this process."""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch

from ..plans.planner import Step, routes_to
from ..values.layout import Layout, device_box, is_even, local_shapes
from ..values.mesh import Mesh
from .view_replay import replay
from .local_values import (Value, added_many, compact, device_view, from_parts, full, parts, reduce_dim,
                           reduce_parts, replica_of, sum_neutral, sum_of_copies)


# -- step implementations -------------------------------------------------------------------


def run_step(step: Step, value: Value, shape: tuple[int, ...], dtype: torch.dtype, *, sym_shape: tuple | None = None) -> Value:
    """``sym_shape``: the global shape with symbolic sizes (``shape`` holds their hints);
    such values only take the stacked path, which keeps the sizes symbolic."""
    mesh = step.src.mesh
    if not isinstance(value, tuple) and is_even(step.dst, shape):
        if step.kind in _REGRID_KINDS and sym_shape is None:
            out = _regrid_compact(step.src, step.dst, shape, value, _cut(step.dst))
            if out is not None:
                return out
        if step.kind in _REGRID_KINDS:
            out = _regrid(step.src, step.dst, shape, full(value, mesh), sym_shape)
        else:
            out = _STACKED[step.kind](step, value, mesh, shape)
        if out is not None:
            return compact(out, step.dst)
    if sym_shape is not None:
        # uneven shards need concrete sizes: specialise (a guard on each symbolic size)
        for n, h in zip(sym_shape, shape):
            if int(n) != h:
                raise AssertionError(f"symbolic size {n} has hint {h} but value {int(n)}")
        if not isinstance(value, tuple):
            value = value.view(*value.shape[:mesh.ndim], *local_shapes(step.src, shape)[0])
        return run_step(step, value, shape, dtype)
    shards = parts(value, mesh)
    if step.kind == "reduce_local" and step.dim is not None:
        return from_parts(tuple(pad_piece(step, x, dev, shape) for dev, x in enumerate(shards)), step.dst, shape)
    if step.kind in ("all_reduce", "reduce_local"):
        return from_parts(_reduce_uneven(step, shards, mesh), step.dst, shape)
    src = step.src
    if step.kind == "reduce_scatter":
        shards = _reduce_uneven(step, shards, mesh)
        src = src.with_partial(step.dst.partial_ops)
    return _run_routes(_routes(src, step.dst, shape), shards, step.dst, shape)


def run_steps(steps: Sequence[Step], value: Value, shape: tuple[int, ...], dtype: torch.dtype, *,
              sym_shape: tuple | None = None) -> Value:
    """A plan's steps in order. A run of two or more data-moving steps (gathers,
    all_to_alls, slices, permutes) through an uneven layout runs as one exchange from its
    first layout to its last: each element copied once, into one buffer per distinct
    destination shard, and no intermediate value (the per-axis steps a planner picks for
    real collectives would copy each element once per step)."""
    i = 0
    while i < len(steps):
        j = i
        while j < len(steps) and steps[j].kind in _REGRID_KINDS:
            j += 1
        if sym_shape is None and j - i >= 2 and _fusable(tuple(steps[i:j]), shape):
            value = _move(steps[i].src, steps[j - 1].dst, value, shape)
            i = j
            continue
        value = run_step(steps[i], value, shape, dtype, sym_shape=sym_shape)
        i += 1
    return value


def _fusable(steps: tuple[Step, ...], shape: tuple[int, ...]) -> bool:
    if steps[0].src.partial != steps[-1].dst.partial:
        return False
    return not all(is_even(s.dst, shape) for s in steps) or not is_even(steps[0].src, shape)


def _move(src: Layout, dst: Layout, value: Value, shape: tuple[int, ...]) -> Value:
    """``value`` of ``src`` as ``dst`` (the same pending reductions), by one regrid when both
    are even and stacked, else by routing each distinct destination shard's pieces."""
    mesh = src.mesh
    if not isinstance(value, tuple) and is_even(dst, shape):
        out = _regrid_compact(src, dst, shape, value, _cut(dst))
        if out is not None:
            return out
    return _run_routes(_routes(src, dst, shape), parts(value, mesh), dst, shape)


def _ai(step: Step, mesh: Mesh) -> tuple[int, int]:
    return mesh.axis_index(step.axis), mesh.ndim


def _split(x: torch.Tensor, pos: int, g: int) -> torch.Tensor:
    """Split dim ``pos`` of ``x`` into (g, size // g)."""
    n = x.shape[pos]
    return x.reshape(*x.shape[:pos], g, n // g, *x.shape[pos + 1:])


def _regrid_step(step: Step, x: torch.Tensor, mesh: Mesh, shape: tuple[int, ...]) -> torch.Tensor | None:
    return _regrid(step.src, step.dst, shape, x)


def _regrid(src: Layout, dst: Layout, shape: tuple[int, ...], x: torch.Tensor,
            sym_shape: tuple | None = None) -> torch.Tensor | None:
    """Move a stacked value between two even layouts with one reshape/permute.

    Each tensor dim is cut into "digits" (a mixed-radix refinement of both layouts'
    splits); source digits sit on mesh dims or in the local dim, and are permuted to where
    the destination wants them. Returns None when the two splits have no common
    refinement (e.g. a dim split 2 ways by one layout and 3 ways by the other).
    """
    plan = _regrid_plan(src, dst, shape)
    if plan is None:
        return None
    if plan == "empty":
        return x.new_empty(*src.mesh.shape, *local_shapes(dst, shape)[0])
    split_shape, drops, order, bcast, final, tails = plan
    if sym_shape is not None:
        # the innermost digit of dim d is n_d // (product of its other digits): the only
        # sizes that depend on the global shape; rebuild them from the symbolic sizes
        split_shape, final = list(split_shape), list(final)
        m = src.mesh.ndim
        for d, tail in enumerate(tails):
            if not isinstance(sym_shape[d], torch.SymInt):
                continue
            if tail is None:
                return None
            split_shape[tail[0]] = sym_shape[d] // tail[1]
            final[m + d] = sym_shape[d] // _prod(src.mesh, dst.dims[d])
    return _chain(x, (split_shape, drops, order, bcast, final, tails))


def _cut(layout: Layout) -> tuple[int, ...]:
    """The mesh dims :func:`compact` cuts to size 1 for ``layout``."""
    return tuple(k for k, v in enumerate(layout.varying) if not v)


def _regrid_compact(src: Layout, dst: Layout, shape: tuple[int, ...], value: torch.Tensor,
                    cut: tuple[int, ...]) -> torch.Tensor | None:
    """``compact(_regrid(src, dst, shape, full(value)), dst)`` (``cut``: :func:`_cut` of ``dst``) for
    concrete sizes; the plan, the mesh's shape and ``cut`` fix the chain of views, so a warm one
    that views ``value`` is one ``as_strided`` (``view_replay``). None where there is no regrid."""
    plan = _regrid_plan(src, dst, shape)
    if plan is None:
        return None
    if plan == "empty":
        return compact(_regrid(src, dst, shape, full(value, src.mesh)), dst)
    return replay((plan, src.mesh.shape, cut), value, _full_chain)


def _full_chain(x: torch.Tensor, key: tuple) -> torch.Tensor:
    plan, mesh_shape, cut = key
    m = len(mesh_shape)
    if tuple(x.shape[:m]) != mesh_shape:  # ``full``
        x = x.expand(*mesh_shape, *x.shape[m:])
    y = _chain(x, plan)
    for k in cut:  # ``compact``
        if y.shape[k] != 1:
            y = y.narrow(k, 0, 1)
    return y


def _chain(x: torch.Tensor, plan: tuple) -> torch.Tensor:
    """``_regrid``'s reshape, selects, permute, unsqueezes, expand and reshape."""
    split_shape, drops, order, bcast, final, _ = plan
    y = x.reshape(split_shape)
    for pos in drops:
        y = y.select(pos, 0)
    y = y.permute(order)
    for pos, _ in bcast:
        y = y.unsqueeze(pos)
    if bcast:
        sizes = list(y.shape)
        for pos, g in bcast:
            sizes[pos] = g
        y = y.expand(sizes)
    return y.reshape(final)


@functools.lru_cache(maxsize=4096)
def _regrid_plan(src: Layout, dst: Layout, shape: tuple[int, ...]):
    mesh = src.mesh
    if any(n == 0 for n in shape):
        return "empty"
    digits = {}
    for d, n in enumerate(shape):
        cs, ct = _cuts(mesh, src.dims[d], n), _cuts(mesh, dst.dims[d], n)
        merged = sorted(set(cs) | set(ct) | {n})
        prev, sizes = 1, []
        for c in merged:
            if c % prev:
                return None
            sizes.append(c // prev)
            prev = c
        digits[d] = (merged, sizes)

    def owned(d: int, lo: int, hi: int) -> list:
        merged, sizes = digits[d]
        return [(("dig", d, j), sizes[j]) for j, c in enumerate(merged) if lo < c <= hi]

    def layout_labels(layout: Layout, source: bool) -> list:
        out = []
        for a, g in zip(mesh.axis_names, mesh.shape):
            if g == 1:
                out.append((("pass", a), 1))
            elif a in layout.axis_dim:
                d = layout.axis_dim[a]
                axes = [b for b in layout.dims[d] if mesh.axis_size(b) > 1]
                i = axes.index(a)
                lo = _prod(mesh, axes[:i])
                out.extend(owned(d, lo, lo * g))
            elif a in (dst.axis_dim if source else src.axis_dim):
                out.append((("drop" if source else "bcast", a), g))
            else:
                out.append((("pass", a), g))
        for d, n in enumerate(shape):
            axes = [b for b in layout.dims[d] if mesh.axis_size(b) > 1]
            out.extend(owned(d, _prod(mesh, axes), n))
        return out

    src_labels = layout_labels(src, True)
    dst_labels = layout_labels(dst, False)
    split_shape = tuple(size for _, size in src_labels)
    drops = [i for i, (lab, _) in enumerate(src_labels) if lab[0] == "drop"]
    kept = [lab for lab, _ in src_labels if lab[0] != "drop"]
    drops = sorted(drops, reverse=True)
    order = [kept.index(lab) for lab, _ in dst_labels if lab[0] != "bcast"]
    bcast = [(i, g) for i, (lab, g) in enumerate(dst_labels) if lab[0] == "bcast"]
    final = (*mesh.shape, *local_shapes(dst, shape)[0])
    tails = []  # per dim: (position of its innermost digit, the digit's divisor) or None
    labels = [lab for lab, _ in src_labels]
    for d in range(len(shape)):
        merged, _ = digits[d]
        last = ("dig", d, len(merged) - 1)
        tails.append((labels.index(last), merged[-2] if len(merged) > 1 else 1) if last in labels else None)
    return split_shape, tuple(drops), tuple(order), tuple(bcast), final, tuple(tails)


def _cuts(mesh: Mesh, axes: tuple[str, ...], n: int) -> list[int]:
    out, acc = [], 1
    for a in axes:
        g = mesh.axis_size(a)
        if g > 1:
            acc *= g
            out.append(acc)
    return out


def _prod(mesh: Mesh, axes: Sequence[str]) -> int:
    p = 1
    for a in axes:
        p *= mesh.axis_size(a)
    return p


def _along(x: torch.Tensor, ai: int, mesh: Mesh) -> torch.Tensor:
    """``x`` with mesh dim ``ai`` at its axis size (a value the same on every device of
    the axis is expanded, so a sum over the axis counts every device)."""
    n = mesh.shape[ai]
    return x if x.shape[ai] == n else x.expand(*x.shape[:ai], n, *x.shape[ai + 1:])


def _reduce_axis(x: torch.Tensor, ai: int, mesh: Mesh, op: str) -> torch.Tensor:
    """Reduce over mesh dim ``ai`` (kept, size 1). Parts the same on every device of the
    axis (size 1, or expanded: stride 0) are not added up one by one: a floating sum is
    the part times the axis size (exact for a power of two), avg/max/min the part."""
    g = mesh.shape[ai]
    if g > 1 and (x.shape[ai] == 1 or x.stride(ai) == 0):
        one = x.narrow(ai, 0, 1)
        if op != "sum":
            return one
        if x.is_floating_point() or x.is_complex():
            return sum_of_copies(one, g)
    return reduce_dim(_along(x, ai, mesh), ai, op)


def _all_reduce(step: Step, x: torch.Tensor, mesh: Mesh, shape: tuple[int, ...]) -> torch.Tensor:
    ai, _ = _ai(step, mesh)
    return _reduce_axis(x, ai, mesh, step.op)


def _reduce_scatter(step: Step, x: torch.Tensor, mesh: Mesh, shape: tuple[int, ...]) -> torch.Tensor:
    ai, m = _ai(step, mesh)
    r = _split(_reduce_axis(x, ai, mesh, step.op), m + step.dim, mesh.shape[ai])
    return r.squeeze(ai).movedim(m - 1 + step.dim, ai)


def _reduce_local(step: Step, x: torch.Tensor, mesh: Mesh, shape: tuple[int, ...]) -> torch.Tensor:
    """A value the same on every device of the axis made pending a sum over it: the first
    device of the axis keeps it, the others hold zeros (-0.0 in floats, :func:`sum_neutral`). One op (a zero pad of the mesh dim
    after the first part: one fill and one copy), not a mask built and applied per call.
    With ``step.dim`` set, a shard of that dim is zero-padded instead (``_pad_local``)."""
    if step.dim is not None:
        return _pad_local(step, x, mesh, shape)
    if step.op != "sum":
        return x
    ai, _ = _ai(step, mesh)
    g = mesh.shape[ai]
    if g == 1:
        return x
    if x.shape[ai] != 1:  # the same part on every device of the axis (expanded or copied)
        x = x.narrow(ai, 0, 1)
    return torch.constant_pad_nd(x, (0, 0) * (x.dim() - 1 - ai) + (0, g - 1), sum_neutral(x.dtype))


def _pad_local(step: Step, x: torch.Tensor, mesh: Mesh, shape: tuple[int, ...]) -> torch.Tensor:
    """Even shards of dim ``step.dim`` over an axis made a pending sum over it: device i's
    piece at offset i * c of the whole extent, zeros around it (exact zeros: a pad, not a
    mask, so inf and nan stay where they were)."""
    ai, m = _ai(step, mesh)
    g, dd = mesh.shape[ai], m + step.dim
    c = x.shape[dd]
    tail = (0, 0) * (x.dim() - 1 - dd)
    z = sum_neutral(x.dtype)
    return torch.cat([torch.constant_pad_nd(x.narrow(ai, i, 1), tail + (i * c, (g - 1 - i) * c), z) for i in range(g)], ai)


def pad_piece(step: Step, x: torch.Tensor, device: int, shape: tuple[int, ...]) -> torch.Tensor:
    """One device's shard for a reduce_local step of a shard (``step.dim`` set): its piece in place in the extent of dim
    ``step.dim`` it shares with its axis group, zeros around it."""
    d = step.dim
    (lo, hi), (base, end) = device_box(step.src, shape, device)[d], device_box(step.dst, shape, device)[d]
    return torch.constant_pad_nd(x, (0, 0) * (x.dim() - 1 - d) + (lo - base, end - hi), sum_neutral(x.dtype))


_REGRID_KINDS = frozenset({"all_gather", "all_to_all", "slice", "permute"})

_STACKED = {
    "all_gather": _regrid_step,
    "all_to_all": _regrid_step,
    "slice": _regrid_step,
    "permute": _regrid_step,
    "all_reduce": _all_reduce,
    "reduce_scatter": _reduce_scatter,
    "reduce_local": _reduce_local,
}


def compile_plan(steps: Sequence[Step], shape: tuple[int, ...]) -> Callable[[Value], Value | None] | None:
    """A plan of all-reduces and data moves between even layouts (a gradient's pending sum
    resolved over 'dp', a batch split over 'dp') as one closure on stacked values, each
    step's mesh dim, op, regrid and the dims its output is cut to worked out once: what
    :func:`run_steps` computes for a stacked value, without its per-step dispatch on kinds
    and layouts. The closure returns None for a value it does not take (per-device shards),
    which then takes :func:`run_steps`. None for any other plan."""
    compiled = []
    for step in steps:
        if not is_even(step.src, shape) or not is_even(step.dst, shape):
            return None
        mesh = step.src.mesh
        cut = tuple(k for k, v in enumerate(step.dst.varying) if not v)  # ``compact``
        if step.kind == "all_reduce":
            compiled.append((mesh.axis_index(step.axis), mesh, step.op, cut))
        elif step.kind in _REGRID_KINDS and _regrid_plan(step.src, step.dst, shape) is not None:
            compiled.append((None, step, shape, cut))
        else:
            return None
    if not compiled:
        return None

    def run(value: Value) -> Value | None:
        if isinstance(value, tuple):
            return None
        for ai, a, b, cut in compiled:
            if ai is None:  # a regrid: ``a`` the step, ``b`` the shape (and the cut)
                value = _regrid_compact(a.src, a.dst, b, value, cut)
                continue
            value = _reduce_axis(value, ai, a, b)  # an all-reduce over mesh dim ``ai`` of mesh ``a`` by op ``b``
            for k in cut:
                if value.shape[k] != 1:
                    value = value.narrow(k, 0, 1)
        return value

    return run


def compile_many(steps: Sequence[Step]) -> Callable[[list], list | None] | None:
    """A plan of element-wise all-reduces (a coalesced bucket's: ``transforms/coalesce.py``) as
    one closure on several stacked values at once, each holding some of the bucket's elements
    with the mesh dims the bucket's flat value has: what the plan computes on their
    concatenation, element by element, without concatenating them. Parts that add up as a
    collective adds them (:func:`local_values.added_many`) add for every value by one
    ``_foreach_add`` per level; any other value reduces alone (:func:`_reduce_axis`). The
    closure returns None for values it does not take (per-device shards). None for any other plan."""
    compiled = []
    for step in steps:
        if step.kind != "all_reduce":
            return None
        mesh = step.src.mesh
        compiled.append((mesh.axis_index(step.axis), mesh, step.op,
                         tuple(k for k, v in enumerate(step.dst.varying) if not v)))
    if not compiled:
        return None

    def run(values: list) -> list | None:
        for v in values:
            if type(v) is tuple:
                return None
        for ai, mesh, op, cut in compiled:
            g = mesh.shape[ai]
            # the values whose parts over mesh dim ``ai`` are each device's own (not one part
            # the same on every device of the axis: ``_reduce_axis`` multiplies that one)
            own = [i for i, v in enumerate(values) if g > 1 and v.shape[ai] == g and v.stride(ai) != 0]
            added = added_many([values[i] for i in own], ai) if op == "sum" and len(own) > 1 else None
            out = list(values)
            if added is not None:
                for i, v in zip(own, added):
                    out[i] = v
            for i, v in enumerate(values):
                if added is None or out[i] is v:
                    out[i] = _reduce_axis(v, ai, mesh, op)
                for k in cut:
                    if out[i].shape[k] != 1:
                        out[i] = out[i].narrow(k, 0, 1)
            values = out
        return values

    return run


def _groups(mesh: Mesh, axis: str) -> list[list[int]]:
    """Devices grouped by all coordinates but ``axis``, each group in axis order."""
    ai = mesh.axis_index(axis)
    groups: dict[tuple, list[int]] = {}
    for dev in range(mesh.size):
        c = mesh.coords(dev)
        groups.setdefault(c[:ai] + c[ai + 1:], []).append(dev)
    return list(groups.values())


def _reduce_uneven(step: Step, shards: tuple, mesh: Mesh) -> tuple:
    """all_reduce / reduce_local on per-device shards (the reduce half of reduce_scatter)."""
    out = list(shards)
    for group in _groups(mesh, step.axis):
        if step.kind == "reduce_local":
            if step.op == "sum":
                for dev in group[1:]:
                    out[dev] = torch.full_like(shards[dev], sum_neutral(shards[dev].dtype))
            continue
        reduced = reduce_parts([shards[d] for d in group], step.op)
        for dev in group:
            out[dev] = reduced
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _routes(src: Layout, dst: Layout, shape: tuple[int, ...]):
    """The pieces each distinct destination shard is built from (one device per replica
    group of ``dst``: the others share its tensor)."""
    first = replica_of(dst)
    return routes_to(src, dst, shape, [d for d in range(dst.mesh.size) if first[d] == d])


def _run_routes(routes, shards: tuple, dst: Layout, shape: tuple[int, ...]) -> Value:
    """Build the destination shards of ``dst``'s :func:`replica_of` devices from
    ``routes``; replicas share them, so memory is one copy per distinct shard."""
    mesh = dst.mesh
    like = shards[0]
    shapes = local_shapes(dst, shape)
    if is_even(dst, shape):
        out = torch.empty(*dst.varying_sizes, *shapes[0], dtype=like.dtype, device=like.device)
        for r in routes:  # into the buffer itself, never through an expanded view (whose
            # writes functionalization, under torch.compile, does not carry back)
            device_view(out, mesh, r.dst)[r.dst_slices] = shards[r.src][r.src_slices]
        return out
    by_dst: dict[int, list] = {}
    for r in routes:
        by_dst.setdefault(r.dst, []).append(r)
    first = replica_of(dst)
    result: list[torch.Tensor] = []
    for t, local_shape in enumerate(shapes):
        if first[t] != t:
            result.append(result[first[t]])
            continue
        mine = by_dst.get(t, ())
        if len(mine) == 1 and shards[mine[0].src][mine[0].src_slices].shape == local_shape:
            result.append(shards[mine[0].src][mine[0].src_slices])
            continue
        buf = torch.empty(local_shape, dtype=like.dtype, device=like.device)
        for r in mine:
            buf[r.dst_slices] = shards[r.src][r.src_slices]
        result.append(buf)
    return tuple(result)
