"""The local backend: every device of the mesh simulated in this process.

A value is either *stacked*, one tensor of shape ``(d_0, ..., d_{m-1}, *local_shape)``
when every shard has the same shape, or a tuple of per-device shards (row-major) for
uneven layouts. In a stacked value ``d_k`` is the size of mesh axis k, or 1 where the
layout does not vary over axis k (the axis shards no dim and is not pending a reduction):
each distinct shard is stored once, and an op on stacked values runs once, broadcasting
over the mesh dims, so a computation replicated over an axis costs what it costs once.
:func:`full` expands the size-1 mesh dims (a view) for code that needs every device's
shard; :func:`compact` cuts them back to size 1.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Sequence, Union

import torch

from ..values.layout import Layout, device_box, is_even, local_shapes
from ..values.mesh import Mesh
from ..plans.planner import Step, _exchange
from ..values.sharded import Sharded
from .device_call import DeviceCall, raw_op, substitute, with_locals
from .hooks import SHARD_MAP_RUNNERS

Value = Union[torch.Tensor, tuple]


# -- conversions between the two forms ----------------------------------------------------


@functools.lru_cache(maxsize=4096)
def varying(layout: Layout) -> tuple[bool, ...]:
    """Per mesh axis: whether shards differ along it (it shards a dim or is pending)."""
    pending = layout.partial_ops
    return tuple(a in layout.axis_dim or a in pending for a in layout.mesh.axis_names)


def full(value: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """A stacked value with every mesh dim at its axis size (size-1 dims expanded)."""
    m = mesh.ndim
    if tuple(value.shape[:m]) == mesh.shape:
        return value
    return value.expand(*mesh.shape, *value.shape[m:])


def compact(value: Value, layout: Layout) -> Value:
    """A stacked value with the mesh dims ``layout`` does not vary over cut to size 1."""
    if isinstance(value, tuple):
        return value
    for k, v in enumerate(varying(layout)):
        if not v and value.shape[k] != 1:
            value = value.narrow(k, 0, 1)
    return value


def settle(value: torch.Tensor, layout: Layout) -> torch.Tensor:
    """An op's stacked output in its canonical form for ``layout``: size 1 on the axes
    the layout does not vary over, the axis size on the others (a size-1 output there
    was computed from inputs that are the same on every device, so it is too)."""
    mesh = layout.mesh
    for k, v in enumerate(varying(layout)):
        n = value.shape[k]
        if v and n == 1 and mesh.shape[k] != 1:
            value = value.expand(*value.shape[:k], mesh.shape[k], *value.shape[k + 1:])
        elif not v and n != 1:
            value = value.narrow(k, 0, 1)
    return value


@functools.lru_cache(maxsize=4096)
def canonical_sizes(layout: Layout) -> tuple[int, ...]:
    """The mesh-dim sizes of a stacked value in :func:`settle`'s form for ``layout``."""
    return tuple(g if v else 1 for g, v in zip(layout.mesh.shape, varying(layout)))


def is_canonical(value: Value, layout: Layout) -> bool:
    """Whether ``value`` is stored as op outputs are (:func:`settle`; per-device tuples
    have one form)."""
    return isinstance(value, tuple) or tuple(value.shape[:layout.mesh.ndim]) == canonical_sizes(layout)


def batch_consistent(ins: Sequence[torch.Tensor], outs: Sequence[torch.Tensor | None], mesh: Mesh,
                     layouts: Sequence[Layout | None] | None = None) -> bool:
    """Whether outputs of a local op run on size-1-compacted stacked inputs broadcast like
    the inputs: each mesh dim 1 or the axis size, and never 1 where an input varies and
    the output's layout does too (an op that does not broadcast over leading dims would
    have dropped devices; an output the same on every device, such as a ``new_zeros``,
    may be size 1 there)."""
    wides = [any(t.shape[k] != 1 for t in ins) for k in range(mesh.ndim)]
    for i, o in enumerate(outs):
        if o is None:
            continue
        vary = varying(layouts[i]) if layouts is not None and layouts[i] is not None else (True,) * mesh.ndim
        for k, g in enumerate(mesh.shape):
            n = o.shape[k]
            if g != 1 and (n != 1 and n != g or (wides[k] and vary[k] and n == 1)):
                return False
    return True


def parts(value: Value, mesh: Mesh) -> tuple[torch.Tensor, ...]:
    """Per-device shards (row-major), as views when the value is stacked."""
    if isinstance(value, tuple):
        return value
    out = [full(value, mesh)]
    for _ in range(mesh.ndim):
        out = [t for v in out for t in v.unbind(0)]
    return tuple(out)


def stack(shards: Sequence[torch.Tensor], mesh: Mesh) -> torch.Tensor:
    return torch.stack(list(shards)).view(*mesh.shape, *shards[0].shape)


def from_parts(shards: Sequence[torch.Tensor], layout: Layout, shape: tuple[int, ...]) -> Value:
    """Store shards in the preferred form for this layout: stacked over the mesh axes the
    layout varies over, one device's shard standing for the devices it does not vary over
    (they hold the same value; only those are stacked, so a replicated output is a view of
    device 0's, and per-call constants such as a fused kernel's RNG state, which torch may
    return on another device, never meet in a kernel)."""
    if not is_even(layout, shape):
        return tuple(shards)
    mesh = layout.mesh
    vary = varying(layout)
    if all(vary):
        return stack(shards, mesh)
    keep = [s for d, s in enumerate(shards) if all(v or c == 0 for v, c in zip(vary, mesh.coords(d)))]
    sizes = tuple(n if v else 1 for n, v in zip(mesh.shape, vary))
    if len(keep) == 1:
        return keep[0].view(sizes + tuple(keep[0].shape))
    return torch.stack(keep).view(sizes + tuple(keep[0].shape))


def replicated(whole: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """A stacked value in which every device holds ``whole`` (size 1 on every mesh dim)."""
    return whole.view((1,) * mesh.ndim + tuple(whole.shape))


def device_view(value: Value, mesh: Mesh, device: int) -> torch.Tensor:
    if isinstance(value, tuple):
        return value[device]
    return value[tuple(c if n > 1 else 0 for c, n in zip(mesh.coords(device), value.shape))]


# -- reductions -----------------------------------------------------------------------


def _reduce(x: torch.Tensor, dim: int, op: str) -> torch.Tensor:
    if op == "sum":
        return x.sum(dim, keepdim=True, dtype=x.dtype)
    if op == "avg":
        if x.is_floating_point() or x.is_complex():
            return x.mean(dim, keepdim=True)
        return torch.div(x.sum(dim, keepdim=True, dtype=x.dtype), x.shape[dim], rounding_mode="floor")
    if op == "max":
        return x.amax(dim, keepdim=True)
    return x.amin(dim, keepdim=True)


def reduce_parts(shards: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """Reduce a list of same-shape parts (used by the uneven path and by gathers)."""
    return _reduce(torch.stack(list(shards)), 0, op).squeeze(0)


# -- step implementations -------------------------------------------------------------------


def run_step(step: Step, value: Value, shape: tuple[int, ...], dtype: torch.dtype, *, sym_shape: tuple | None = None) -> Value:
    """``sym_shape``: the global shape with symbolic sizes (``shape`` holds their hints);
    such values only take the stacked path, which keeps the sizes symbolic."""
    mesh = step.src.mesh
    if not isinstance(value, tuple) and is_even(step.dst, shape):
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
    if step.kind in ("all_reduce", "reduce_local"):
        return from_parts(_reduce_uneven(step, shards, mesh), step.dst, shape)
    src = step.src
    if step.kind == "reduce_scatter":
        shards = _reduce_uneven(step, shards, mesh)
        src = src.with_partial(step.dst.partial_ops)
    routes = step.routes if step.routes is not None else _routes(src, step.dst, shape)
    return _run_routes(routes, shards, step.dst, shape)


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
    return x.expand(*x.shape[:ai], mesh.shape[ai], *x.shape[ai + 1:])


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
            return one * g
    return _reduce(_along(x, ai, mesh), ai, op)


def _all_reduce(step: Step, x: torch.Tensor, mesh: Mesh, shape: tuple[int, ...]) -> torch.Tensor:
    ai, _ = _ai(step, mesh)
    return _reduce_axis(x, ai, mesh, step.op)


def _reduce_scatter(step: Step, x: torch.Tensor, mesh: Mesh, shape: tuple[int, ...]) -> torch.Tensor:
    ai, m = _ai(step, mesh)
    r = _split(_reduce_axis(x, ai, mesh, step.op), m + step.dim, mesh.shape[ai])
    return r.squeeze(ai).movedim(m - 1 + step.dim, ai)


def _reduce_local(step: Step, x: torch.Tensor, mesh: Mesh, shape: tuple[int, ...]) -> torch.Tensor:
    if step.op != "sum":
        return x
    ai, _ = _ai(step, mesh)
    x = _along(x, ai, mesh)
    keep = torch.zeros(mesh.shape[ai], dtype=torch.bool, device=x.device)
    keep[0] = True
    keep = keep.view([-1 if i == ai else 1 for i in range(x.dim())])
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))


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
                    out[dev] = torch.zeros_like(shards[dev])
            continue
        reduced = reduce_parts([shards[d] for d in group], step.op)
        for dev in group:
            out[dev] = reduced
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _routes(src: Layout, dst: Layout, shape: tuple[int, ...]):
    return _exchange(src, dst, shape, 1).routes


def _run_routes(routes, shards: tuple, dst: Layout, shape: tuple[int, ...]) -> Value:
    mesh = dst.mesh
    like = shards[0]
    shapes = local_shapes(dst, shape)
    if is_even(dst, shape):
        out = torch.empty(*mesh.shape, *shapes[0], dtype=like.dtype, device=like.device)
        views = parts(out, mesh)
        for r in routes:
            views[r.dst][r.dst_slices] = shards[r.src][r.src_slices]
        return compact(out, dst)
    by_dst: dict[int, list] = {}
    for r in routes:
        by_dst.setdefault(r.dst, []).append(r)
    result = []
    for t, local_shape in enumerate(shapes):
        mine = by_dst.get(t, ())
        if len(mine) == 1 and shards[mine[0].src][mine[0].src_slices].shape == local_shape:
            result.append(shards[mine[0].src][mine[0].src_slices])
            continue
        buf = torch.empty(local_shape, dtype=like.dtype, device=like.device)
        for r in mine:
            buf[r.dst_slices] = shards[r.src][r.src_slices]
        result.append(buf)
    return tuple(result)


# -- protocol used by ShardedArray ----------------------------------------------------------


def one_replica(value: Value, mesh: Mesh) -> torch.Tensor:
    """The shard of device 0 (for a fully replicated value: the whole value)."""
    return value[0] if isinstance(value, tuple) else value[(0,) * mesh.ndim]


def from_shards(shards: Sequence[torch.Tensor], layout: Layout, shape: tuple[int, ...]) -> Value:
    return from_parts(shards, layout, shape)


@functools.lru_cache(maxsize=4096)
def _replica_of(layout: Layout) -> tuple[int, ...]:
    """Per device: the device with coordinate 0 on the axes ``layout`` does not vary over
    (the one whose shard it replicates; itself when it holds a distinct shard)."""
    mesh = layout.mesh
    vary = varying(layout)
    return tuple(mesh.device_at([c if v else 0 for c, v in zip(mesh.coords(d), vary)]) for d in range(mesh.size))


def storage(value: Value, layout: Layout, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Even layouts: the canonical stacked tensor; uneven: the distinct shards (row-major)."""
    if is_even(layout, shape):
        if isinstance(value, tuple):
            value = from_parts(value, layout, shape)
        return [settle(compact(value, layout), layout)]
    shards = parts(value, layout.mesh)
    first = _replica_of(layout)
    return [shards[d] for d in range(layout.mesh.size) if first[d] == d]


def from_storage(tensors: Sequence[torch.Tensor], layout: Layout, shape: tuple[int, ...]) -> Value:
    if is_even(layout, shape):
        return tensors[0]
    first = _replica_of(layout)
    index = {d: i for i, d in enumerate(sorted(set(first)))}
    return tuple(tensors[index[first[d]]] for d in range(layout.mesh.size))


def shard_reduce(value: Value, layout: Layout, shape: tuple[int, ...], fn: Any, neutral: float) -> torch.Tensor:
    """Stacked over the full mesh: distinct shards reduced in one batched call when even."""
    mesh = layout.mesh
    m, nd = mesh.ndim, len(shape)
    if is_even(layout, shape):
        t = storage(value, layout, shape)[0]
        red = fn(t, tuple(range(m, m + nd))) if nd else fn(t.unsqueeze(-1), (m,))
        out = torch.full(mesh.shape, neutral, dtype=red.dtype, device=red.device)
        out[tuple(slice(None) if n != 1 else slice(0, 1) for n in red.shape)] = red
        return out
    shards = parts(value, mesh)
    first = _replica_of(layout)
    vals = []
    for d in range(mesh.size):
        if first[d] == d:
            vals.append(fn(shards[d], tuple(range(nd))) if nd else fn(shards[d].reshape(1), (0,)))
        else:
            vals.append(None)
    like = next(v for v in vals if v is not None)
    vals = [v if v is not None else torch.full((), neutral, dtype=like.dtype, device=like.device) for v in vals]
    return torch.stack(vals).view(mesh.shape)


def global_shape(shards: Sequence[torch.Tensor], layout: Layout, shape: Sequence[int] | None, *,
                 check_ranks: bool = True) -> tuple[int, ...]:
    """The global shape the shards describe (or ``shape``), checked against the layout
    (every device's shard is here, so ``check_ranks`` has nothing more to check)."""
    from ..values.errors import ShardingError

    mesh = layout.mesh
    actual = tuple(tuple(s.shape) for s in shards)
    given = shape is not None
    if shape is None:
        dims = []
        for d, axes in enumerate(layout.dims):
            idx = [mesh.axis_index(a) for a in axes]
            total = 0
            for dev in range(mesh.size):
                c = mesh.coords(dev)
                if all(c[i] == 0 for i in range(mesh.ndim) if i not in idx):
                    total += actual[dev][d]
            dims.append(total)
        shape = tuple(dims)
    shape = tuple(int(n) for n in shape)
    if len(shape) != len(actual[0]):
        raise ShardingError(f"from_local: shape={shape} has rank {len(shape)} but the shards have rank {len(actual[0])}")
    expected = local_shapes(layout, shape)
    bad = [dev for dev, (want, got) in enumerate(zip(expected, actual)) if want != got]
    if bad:
        dev = bad[0]
        where = (
            f"the global shape {shape}" if given
            else f"the global shape {shape} (inferred by adding shard sizes along the sharded axes)"
        )
        raise ShardingError(
            f"from_local: shard {dev} (mesh coords {mesh.coords(dev)}) has shape {actual[dev]}, but "
            f"{layout.spec_str()} on {mesh!r} with {where} puts a shard of shape {expected[dev]} "
            f"there; expected shard shapes {list(expected)}; pass shape= to state the global shape"
        )
    return shape


def shard_list(value: Value, mesh: Mesh) -> tuple:
    return parts(value, mesh)


def all_true(flags: Sequence[bool], mesh: Mesh) -> bool:
    return all(flags)


# -- running an op's local call -------------------------------------------------------------


def compile_call(func: Any, call: Any, cand: Any, out_shapes: Sequence[Any], positional: tuple | None) -> Any:
    """The local computation of one strategy on this backend's values: one call on the
    stacked values when every layout is even and the call has a batched form
    (``batching``), else once per device. ``(args, kwargs, values, symbolic) -> flat
    outputs`` (stacked values or per-device tuples, non-tensor outputs as they are)."""
    from . import batching as _batching

    per_device = PerDeviceCall(func, cand, call, out_shapes, positional)
    canon = tuple(torch.Size(canonical_sizes(v._layout)) for _, v in call.arrays)
    even = all(is_even(l, tuple(v.shape)) for (_, v), l in zip(call.arrays, cand.in_layouts)) and all(
        l is None or is_even(l, s) for l, s in zip(cand.out_layouts, out_shapes))
    batched = _batching.batched_call(func, cand, call, out_shapes) if even else None
    if batched is None:
        return per_device
    return StackedCall(batched, per_device, call.mesh, cand.out_layouts, positional, canon)


def _flat(out: Any) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


class StackedCall:
    """One local call on the stacked values. Mesh dims of size 1 (the same on every
    device) broadcast; the first run for each combination of input mesh-dim sizes is
    checked (:func:`batch_consistent`), and a call that fails it or raises is run on
    values expanded to the full mesh, and if that raises too, once per device."""

    keeps_symbolic = True

    def __init__(self, fn: Any, per_device: "PerDeviceCall", mesh: Mesh, layouts: tuple, positional: tuple | None,
                 canon: tuple) -> None:
        self.fn, self.per_device, self.mesh, self.layouts, self.positional = fn, per_device, mesh, layouts, positional
        self.mode = "batched"  # -> "full" -> "per_device" as calls show what the op supports
        self.verified: dict = {}
        batched_direct = getattr(fn, "direct", None)  # the op itself when no argument needs adapting
        self.direct = raw_op(batched_direct)
        self.m = mesh.ndim
        self.canon = canon  # the inputs' mesh-dim sizes when the arrays are stored canonically
        self.ready = False  # that call verified: ``lean`` may run it without looking at shapes
        # canonical inputs and outputs the same on every device (a 1-device mesh, a fully
        # replicated computation), and a batched form that is more than the aten op itself:
        # ``lean`` runs device 0's call on the squeezed values instead
        same = all(n == 1 for sizes in canon for n in sizes) and all(
            l is None or all(n == 1 for n in canonical_sizes(l)) for l in layouts)
        adapted = not isinstance(batched_direct, torch._ops.OpOverload)
        self.once = per_device.device_call if same and adapted and positional is not None else None
        self.once_direct = raw_op(self.once.direct) if self.once is not None else None
        self.first = 0 if self.m == 1 else (0,) * self.m

    def lean(self, args: tuple, kwargs: dict) -> Any:
        """The lone output for arrays at ``positional``, stored canonically and needing no
        move (dispatch's fast path), or None until such a call has been verified."""
        if self.once is not None:
            return self._once(args, kwargs)
        if not self.ready:
            return None
        a = with_locals(args, self.positional)
        if self.direct is not None:
            return self.direct(*a, **kwargs)
        return self.fn(tuple(a), kwargs, False)

    def _once(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """Device 0's call on the squeezed values, its output given size-1 mesh dims: what
        per-device execution gives when every device computes the same thing."""
        a = with_locals(args, self.positional, self.first)
        direct = self.once_direct
        out = direct(*a, **kwargs) if direct is not None else self.once(tuple(a), kwargs, 0)[0]
        return out.unsqueeze(0) if self.m == 1 else out.view((1,) * self.m + tuple(out.shape))

    def __call__(self, args: tuple, kwargs: dict, values: dict, symbolic: bool = False) -> list:
        if self.mode == "batched":
            m = self.m
            sig = tuple([v.shape[:m] for v in values.values()])
            try:
                settled = self.verified.get(sig)
            except TypeError:  # torch.compile(dynamic=True) made the mesh dims symbolic: they are not
                sig = tuple(tuple(n if isinstance(n, int) else n.node.hint for n in s) for s in sig)
                settled = self.verified.get(sig)
            a, k = substitute(args, kwargs, values, self.positional)
            if settled is True:
                out = self.direct(*a, **k) if self.direct is not None else self.fn(a, k, symbolic)
                return list(out) if isinstance(out, (tuple, list)) else [out]
        mesh, layouts = self.mesh, self.layouts
        if self.mode == "batched":
            try:
                outs = _flat(self.fn(a, k, symbolic))
            except (RuntimeError, IndexError, ValueError) as e:
                if _is_sharding_error(e):
                    raise
                outs = None
            tensors = [o if isinstance(o, torch.Tensor) and l is not None else None
                       for o, l in zip(outs or (), layouts)]
            if outs is not None and (settled is not None or batch_consistent(list(values.values()), tensors, mesh, layouts)):
                fixed = [o if t is None else settle(o, l) for o, t, l in zip(outs, tensors, layouts)]
                if len(self.verified) < 64:
                    self.verified[sig] = all(f is o for f, o in zip(fixed, outs))
                    self.ready = self.verified.get(self.canon) is True and self.positional is not None
                return fixed
            self.mode, self.ready = "full", False
        if self.mode == "full":
            a, k = substitute(args, kwargs, values, self.positional, functools.partial(full, mesh=mesh))
            try:
                outs = _flat(self.fn(a, k, symbolic))
            except (RuntimeError, IndexError, ValueError) as e:
                if symbolic or _is_sharding_error(e):
                    raise
                self.mode, self.ready = "per_device", False
            else:
                return [settle(o, l) if isinstance(o, torch.Tensor) and l is not None else o
                        for o, l in zip(outs, layouts)]
        return self.per_device(args, kwargs, values)


def _is_sharding_error(e: Exception) -> bool:
    from ..values.errors import ShardingError

    return isinstance(e, ShardingError)


class PerDeviceCall:
    """The local call once per device, on each device's shard (uneven layouts, or ops
    with no batched form); outputs are stored in their preferred form."""

    keeps_symbolic = False
    lean = None  # no fast form: a warm call takes ``__call__``

    def __init__(self, func: Any, cand: Any, call: Any, out_shapes: Sequence[Any], positional: tuple | None) -> None:
        self.mesh = call.mesh
        self.device_call = DeviceCall(func, cand, [tuple(v.shape) for _, v in call.arrays], out_shapes,
                                      range(call.mesh.size))
        self.layouts, self.out_shapes, self.positional = cand.out_layouts, list(out_shapes), positional

    def __call__(self, args: tuple, kwargs: dict, values: dict, symbolic: bool = False) -> list:
        mesh = self.mesh
        per_dev = []
        for dev in range(mesh.size):
            a, k = substitute(args, kwargs, values, self.positional, lambda v: device_view(v, mesh, dev))
            per_dev.append(self.device_call(a, k, dev))
        out = []
        for i, (layout, shape) in enumerate(zip(self.layouts, self.out_shapes)):
            col = [o[i] for o in per_dev]
            out.append(col[0] if layout is None else from_parts(col, layout, shape))
        return out

# -- the Backend protocol -------------------------------------------------------------------


class LocalBackend:
    """Every device of the mesh simulated in this process (see the module docstring);
    implements :class:`shardfn.backends.Backend`. This process holds every device."""

    # the module's functions where they are the method (no wrapper on the hot path)
    run_step = staticmethod(run_step)
    shard_list = staticmethod(parts)
    shard = staticmethod(device_view)
    one_replica = staticmethod(one_replica)
    replicated = staticmethod(replicated)
    from_shards = staticmethod(from_shards)
    global_shape = staticmethod(global_shape)
    all_true = staticmethod(all_true)
    compile_call = staticmethod(compile_call)  # dispatch: an op's local call, once per cache entry
    is_canonical = staticmethod(is_canonical)
    storage = staticmethod(storage)
    from_storage = staticmethod(from_storage)
    shard_reduce = staticmethod(shard_reduce)

    def devices(self, mesh: Mesh) -> range:
        return range(mesh.size)

    def build(self, layout: Layout, shape: tuple[int, ...], make) -> Value:
        """Even layouts: one ``make`` call per distinct shard (coordinate 0 on the axes
        the layout does not vary over), stacked compact; uneven: one per device."""
        mesh = layout.mesh
        if not is_even(layout, shape):
            return tuple(make(dev) for dev in range(mesh.size))
        sub = tuple(n if v else 1 for n, v in zip(mesh.shape, varying(layout)))
        shards = [make(mesh.device_at(c)) for c in itertools.product(*(range(n) for n in sub))]
        local = local_shapes(layout, shape)[0]
        return shards[0].reshape(*sub, *local) if len(shards) == 1 else torch.stack(shards).view(*sub, *local)

    def empty(self, layout: Layout, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Value:
        """Even layouts: one stacked buffer of the canonical sizes; uneven: one tensor per
        distinct part (box and position on the axes of pending reductions), shared by replicas."""
        if is_even(layout, shape):
            return torch.empty(*canonical_sizes(layout), *local_shapes(layout, shape)[0], dtype=dtype, device=device)
        mesh = layout.mesh
        axes = [mesh.axis_index(a) for a, _ in layout.partial]
        made: dict = {}
        out = []
        for dev, local in enumerate(local_shapes(layout, shape)):
            key = (device_box(layout, shape, dev), tuple(mesh.coords(dev)[i] for i in axes))
            if key not in made:
                made[key] = torch.empty(local, dtype=dtype, device=device)
            out.append(made[key])
        return tuple(out)

    def relabel(self, value: Value, src: Mesh, dst: Mesh) -> Value:
        if isinstance(value, tuple):
            return value  # per-device shards in row-major order
        local = value.shape[src.ndim:]
        return value.expand(*src.shape, *local).reshape(*dst.shape, *local)  # mesh dims may be broadcast

    def pack_local(self, shards: Sequence, mesh: Mesh) -> list:
        return list(shards)

    def unpack_local(self, local, mesh: Mesh) -> list:
        from ..values.errors import ShardingError

        if isinstance(local, torch.Tensor) and not isinstance(local, Sharded):
            if local.dim() >= 1 and local.shape[0] == mesh.size:
                return list(local.unbind(0))
            raise ShardingError(
                f"from_local on the local backend takes a list of {mesh.size} tensors (one per "
                f"device of {mesh!r}), got a single tensor of shape {tuple(local.shape)}"
            )
        if not isinstance(local, (list, tuple)):
            raise ShardingError(
                f"from_local on the local backend takes a list of {mesh.size} tensors (one per device "
                f"of {mesh!r}), got {type(local).__name__}"
            )
        if len(local) != mesh.size:
            raise ShardingError(
                f"from_local got {len(local)} local shards but {mesh!r} has {mesh.size} devices; "
                f"pass one tensor per device, row-major"
            )
        return list(local)

    def output_shape(self, outs: Sequence[torch.Tensor], layout: Layout, exchange: bool) -> tuple[int, ...]:
        return global_shape(outs, layout, None)  # every shard is here: nothing to exchange

    def check_same_meta(self, mesh: Mesh, shape: Sequence[int], dtype: torch.dtype, what: str) -> None:
        pass  # one process passed the one value

    def check_replicas(self, mesh: Mesh, t: torch.Tensor, over: Sequence[str], what: str) -> None:
        pass  # one process passed the one value

    def submesh(self, mesh: Mesh, axes: Sequence[str]) -> None:
        return None  # every device is here: the caller simulates the manual axes

    def zero_cotangent(self, like: torch.Tensor) -> None:
        return None  # one autograd graph over every device: no gradient is no work

    def keeps_symbolic(self, value: Value) -> bool:
        return not isinstance(value, tuple)  # stacked values keep symbolic sizes; per-device parts do not

    def shard_map(self, f, inputs, out_specs, check_vma: bool, kwargs: dict):
        """Even inputs: the body once under vmap over the mesh; else once per device in
        threads (``transforms/shard_map/stacked.py``, ``per_device.py``)."""
        return SHARD_MAP_RUNNERS["local"](f, inputs, out_specs, check_vma, kwargs)

    def axis_group(self, mesh: Mesh, axes: Sequence[str]) -> None:
        return None  # devices are simulated in this process: no process groups

    def default_device_type(self) -> str:
        return "cpu"
