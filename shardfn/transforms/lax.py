"""Collectives over mesh axes, valid inside :func:`shardfn.shard_map` (``jax.lax`` names).

Each public function checks its arguments, finds the enclosing shard_map and hands the
work to that shard_map's implementation of the small :class:`Collectives` protocol:

- local backend, even shards: ``shard_map/stacked.StackedBody`` — one vmap level per mesh axis;
  a collective is a reduce / permute / index over the physical mesh dims, and "varying
  over an axis" is exactly "batched at that axis's vmap level".
- local backend, uneven shards: ``shard_map/per_device.DeviceBody`` — the body runs once per
  device (one thread each); collectives meet at a barrier.
- dist backend: ``shard_map/dist.DistBody`` — torch functional collectives on per-axis
  process groups (hook: ``backends.dist.axis_group``).

The protocol only covers the tiled forms; the untiled forms (and pmean) are built on
top of them here, as JAX does. All collectives are differentiable.
"""

from __future__ import annotations

import contextlib
import math
import operator
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import optree
import torch

from ..backends.hooks import OBSERVERS, SUBMESH_COLLECTIVES, notify
from ..values.context import ThreadStack
from ..values.errors import ShardingError, ShardingRuntimeError, ShardingTypeError
from ..values.mesh import Mesh
from . import inner as _inner

AxisName = str | tuple[str, ...]

__all__ = [
    "all_gather",
    "all_gather_invariant",
    "all_to_all",
    "axis_index",
    "axis_size",
    "pmax",
    "pmean",
    "pbroadcast",
    "pcast",
    "pmin",
    "pvary",
    "ppermute",
    "pshuffle",
    "psum",
    "psum_scatter",
]


class Collectives(Protocol):
    """What a shard_map body implementation provides. ``axes`` is a non-empty tuple of
    distinct mesh axis names; a group is the devices differing only on ``axes``, ranked
    row-major over ``axes`` in the given order (first name major)."""

    mesh: Mesh
    leader: bool  # records communication for sf.debug.CommCounter (one per mesh)

    def reduce(self, x: torch.Tensor, axes: tuple[str, ...], op: str) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor, axes: tuple[str, ...], axis: int) -> torch.Tensor: ...

    def psum_scatter(self, x: torch.Tensor, axes: tuple[str, ...], dim: int) -> torch.Tensor: ...

    def all_to_all(self, x: torch.Tensor, axes: tuple[str, ...], split_axis: int,
                   concat_axis: int) -> torch.Tensor: ...

    def ppermute(self, x: torch.Tensor, axes: tuple[str, ...], perm: tuple[int, ...]) -> torch.Tensor: ...

    def axis_index(self, axes: tuple[str, ...]) -> torch.Tensor: ...


# -- the enclosing shard_map ------------------------------------------------------------

_running = ThreadStack()  # the shard_map bodies running in this thread, innermost last
_base_levels = ThreadStack()  # the torch.func level each of them was entered at
_manual_sets = ThreadStack()  # their manual axes, innermost last


def _bodies() -> list[Collectives]:
    return _running.items


@contextlib.contextmanager
def _entered(body: Collectives) -> Iterator[Collectives]:
    """Make ``body`` the target of collectives in this thread (used by shard_map)."""
    stack, levels = _bodies(), _base_levels.items
    stack.append(body)
    level = torch._C._functorch.maybe_current_level()
    levels.append(-1 if level is None else level)
    try:
        yield body
    finally:
        stack.pop()
        levels.pop()


def _run(body: Collectives, call: tuple, x: torch.Tensor) -> torch.Tensor:
    """Collective ``call`` (see ``inner.Call``) on ``x`` in ``body``; through ``inner`` when a
    torch.func transform opened inside the body traces ``x``."""
    return _inner.run(body, _base_levels.items[-1], call, x)  # body is the innermost (_context)


def _in_shard_map() -> bool:
    return bool(_bodies())


def _manual_stack() -> list[frozenset[str]]:
    return _manual_sets.items


@contextlib.contextmanager
def _manual_axes(axes: frozenset[str]) -> Iterator[None]:
    """Limit collectives in this thread to ``axes`` (shard_map ``axis_names``)."""
    stack = _manual_stack()
    stack.append(frozenset(axes))
    try:
        yield
    finally:
        stack.pop()


def _manual_set(mesh: Mesh) -> frozenset[str]:
    """The axes collectives may name here (all of the mesh unless limited)."""
    stack = _manual_stack()
    return stack[-1] if stack else frozenset(mesh.axis_names)


def _context(fn: str, axis_name: Any) -> tuple[Collectives, tuple[str, ...]]:
    stack = _bodies()
    if not stack:
        raise ShardingError(
            f"sf.lax.{fn}(..., {axis_name!r}) was called outside sf.shard_map; collectives "
            f"over mesh axes are only valid inside a shard_map body (the function passed to "
            f"sf.shard_map(f, mesh=..., in_specs=..., out_specs=...))"
        )
    body = stack[-1]
    return body, _axes(fn, axis_name, body.mesh)


def _axes(fn: str, axis_name: Any, mesh: Mesh) -> tuple[str, ...]:
    axes = (axis_name,) if isinstance(axis_name, str) else axis_name
    if not isinstance(axes, (tuple, list)) or not axes or not all(isinstance(a, str) for a in axes):
        raise ShardingTypeError(  # a TypeError too, as JAX's
            f"sf.lax.{fn}: axis_name {axis_name!r} must be a mesh axis name or a non-empty "
            f"tuple of names; the mesh axes are {mesh.axis_names!r}"
        )
    for a in axes:
        if a not in mesh.axis_names:
            raise ShardingError(
                f"sf.lax.{fn}: axis {a!r} is not an axis of the shard_map mesh {mesh!r}; "
                f"its axes are {mesh.axis_names!r}"
            )
    if len(set(axes)) != len(axes):
        raise ShardingError(f"sf.lax.{fn}: axis_name {tuple(axes)!r} repeats an axis")
    manual = _manual_set(mesh)
    for a in axes:
        if a not in manual:
            raise ShardingError(
                f"sf.lax.{fn}: axis {a!r} is not manual in this shard_map (axis_names={sorted(manual)!r}); "
                f"collectives may name only manual axes; the body sees whole values over {a!r}"
            )
    return tuple(axes)


def _group_size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.axis_size(a) for a in axes)


def _record(body: Collectives, kind: str, axes: tuple[str, ...], x: torch.Tensor, op: str | None = None) -> None:
    """Count a collective in any active sf.debug.CommCounter (ring costs, as plans)."""
    if not OBSERVERS or not body.leader:
        return
    from ..values.layout import Layout
    from ..plans.planner import Step

    g = _group_size(body.mesh, axes)
    n = x.numel() * x.element_size()
    cost = {
        "all_reduce": 2 * (g - 1) * n // g,
        "all_gather": (g - 1) * n,
        "reduce_scatter": (g - 1) * n // g,
        "all_to_all": (g - 1) * n // g,
        "permute": n,
    }[kind]
    here = Layout(body.mesh, ((),) * x.dim())
    notify(Step(kind, axes if len(axes) > 1 else axes[0], here, here, cost, g, op=op))


def _tensor(fn: str, x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ShardingError(f"sf.lax.{fn} takes a torch.Tensor, got {type(x).__name__}")
    return x


def _sharded_layout(x: Any) -> Any:
    """The layout of ``x`` if it is a ShardedArray (a body value over the automatic axes
    of a partial-manual shard_map), else None."""
    from ..arrays import functorch as _ft
    from ..arrays.array import ShardedArray

    if not isinstance(x, torch.Tensor):
        return None
    if isinstance(x, ShardedArray):
        return x._layout
    return _ft.layout_of(x) if _ft.base_array(x) is not None else None


def _on_whole(fn: Any) -> Any:
    """Run collective ``fn`` on the whole value of a ShardedArray first argument (a
    per-device value of the manual axes, sharded over the automatic ones) and lay the
    result out the same way (replicated if its rank changed)."""
    import functools

    @functools.wraps(fn)
    def run(x: Any, *args: Any, **kwargs: Any) -> Any:
        layout = _sharded_layout(x)
        if layout is None:
            return fn(x, *args, **kwargs)
        stack = _bodies()
        if stack and getattr(stack[-1], "array_values", False):  # a simulated partial-manual run
            return fn(x, *args, **kwargs)
        for on_submesh, collective in SUBMESH_COLLECTIVES:  # filled by shard_map/sub_dist.py
            if on_submesh(x):  # a dist partial-manual body: the collective acts on this rank's shard
                return collective(fn, x, args, kwargs)
        from ..arrays.redistribute import distribute, gather
        from ..values.layout import Layout

        out = fn(gather(x), *args, **kwargs)
        dims = layout.dims if out.dim() == layout.ndim else ((),) * out.dim()
        return distribute(out, Layout(layout.mesh, dims, ()))

    return run


def _dim(fn: str, arg: str, d: int, ndim: int) -> int:
    if isinstance(d, bool) or not isinstance(d, int):
        raise ShardingTypeError(f"sf.lax.{fn}: {arg}={d!r} must be an int dim of the local tensor, "
                                f"valid values are {-ndim}..{ndim - 1}")
    if not -ndim <= d < ndim:
        raise ShardingError(
            f"sf.lax.{fn}: {arg}={d} is out of range for a local tensor of rank {ndim}; "
            f"valid values are {-ndim}..{ndim - 1}"
        )
    return d % ndim


# -- reductions ---------------------------------------------------------------------------


def _reduce(fn: str, x: Any, axis_name: AxisName, op: str) -> Any:
    body, axes = _context(fn, axis_name)
    g = _group_size(body.mesh, axes)

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):  # a Python number is the same on every device
            if op != "sum":
                return t
            return complex(t.real * g, t.imag * g) if isinstance(t, complex) else t * g  # as the sum of g copies
        if op == "sum" and t.dtype == torch.bool:  # counts, as torch.sum and JAX's psum promote
            t = t.to(torch.int64)
        elif op != "sum" and t.is_complex():
            raise ShardingRuntimeError(
                f"sf.lax.{fn}: {t.dtype} has no order, so there is no {op}imum over {axes!r}; "
                f"use a real dtype (e.g. x.real or x.abs()), or sf.lax.psum / pmean"
            )
        _record(body, "all_reduce", axes, t, op)
        return _run(body, (op, axes, None, None), t)

    return optree.tree_map(_on_whole(one), x)


def psum(x: Any, axis_name: AxisName) -> Any:
    """Sum of ``x`` over the devices of ``axis_name`` (a name or a tuple of names).

    The result is replicated over those axes. ``x`` may be a pytree; a Python number
    counts once per device, so ``psum(1, 'x')`` is the size of axis ``'x'``.
    Example: on a mesh of 4 along 'x' with ``x = axis_index('x')``, ``psum(x, 'x') == 6``.
    """
    return _reduce("psum", x, axis_name, "sum")


def pmax(x: Any, axis_name: AxisName) -> Any:
    """Elementwise maximum of ``x`` over the devices of ``axis_name`` (replicated result)."""
    return _reduce("pmax", x, axis_name, "max")


def pmin(x: Any, axis_name: AxisName) -> Any:
    """Elementwise minimum of ``x`` over the devices of ``axis_name`` (replicated result)."""
    return _reduce("pmin", x, axis_name, "min")


def pmean(x: Any, axis_name: AxisName) -> Any:
    """Mean of ``x`` over the devices of ``axis_name``: ``psum(x, axis_name) / size``."""
    body, axes = _context("pmean", axis_name)
    g = _group_size(body.mesh, axes)
    return optree.tree_map(lambda t: t / g, _reduce("pmean", x, axes, "sum"))


# -- data movement -------------------------------------------------------------------------


@_on_whole
def all_gather(x: torch.Tensor, axis_name: AxisName, *, axis: int = 0, tiled: bool = False) -> torch.Tensor:
    """Gather ``x`` from every device of ``axis_name``; the result is replicated there.

    ``tiled=False`` stacks the pieces in a new dim at ``axis``; ``tiled=True``
    concatenates them along the existing dim ``axis`` (pieces may differ in size along
    it). Example, 4 devices along 'x' holding ``[i]``: ``all_gather(x, 'x')`` is
    ``[[0], [1], [2], [3]]`` and with ``tiled=True`` it is ``[0, 1, 2, 3]``.
    """
    body, axes = _context("all_gather", axis_name)
    x = _tensor("all_gather", x)
    if not tiled:
        axis = _dim("all_gather", "axis", axis, x.dim() + 1)
        x = x.unsqueeze(axis)
    else:
        axis = _dim("all_gather", "axis", axis, x.dim())
    _record(body, "all_gather", axes, x)
    return _run(body, ("all_gather", axes, axis, None), x)


def all_gather_invariant(x: torch.Tensor, axis_name: AxisName, *, axis: int = 0,
                         tiled: bool = False) -> torch.Tensor:
    """An all_gather whose result is replicated (invariant) over ``axis_name``; its
    transpose takes this device's slice of the cotangent (JAX's ``all_gather_invariant``).

    shardfn's ``all_gather`` already types its result as replicated (check_vma), so the
    two agree on values and on the gradients of the whole computation.
    Example, 2 devices holding ``[0]`` and ``[1]``: the result is ``[0, 1]`` (tiled) on both.
    """
    _context("all_gather_invariant", axis_name)
    return all_gather(x, axis_name, axis=axis, tiled=tiled)


def pcast(x: Any, axis_name: AxisName, *, to: str = "varying") -> Any:
    """Mark ``x`` (replicated over ``axis_name``) as varying over it: no data moves, the
    value is unchanged, and the transpose is a ``psum`` over the axis (JAX's ``pcast``).
    Used to give check_vma the varying type it expects, e.g. for a loop carry that
    becomes varying after a ppermute. ``x`` may be a pytree."""
    if to != "varying":
        raise ShardingError(f"sf.lax.pcast: to={to!r} is not supported; use to='varying'")
    body, axes = _context("pcast", axis_name)
    one = body.axis_index(axes) * 0 + 1

    def cast(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            raise ShardingError(f"sf.lax.pcast takes tensors, got {type(t).__name__}")
        if t.is_complex():  # component by component: a complex product by 1+0j turns -inf j into nan - inf j
            r = torch.view_as_real(t.resolve_conj())
            return torch.view_as_complex(r * one.to(r.dtype))
        return t * one.to(t.dtype)  # x * 1 is x for every real x (-0, inf and nan included)

    cast = _on_whole(cast)

    return optree.tree_map(cast, x)


def pvary(x: Any, axis_name: AxisName) -> Any:
    """JAX's ``pvary``: ``pcast(x, axis_name, to="varying")``."""
    return pcast(x, axis_name, to="varying")


@_on_whole
def psum_scatter(x: torch.Tensor, axis_name: AxisName, *, scatter_dimension: int = 0,
                 tiled: bool = False) -> torch.Tensor:
    """Sum ``x`` over ``axis_name`` and give device ``i`` of the group the ``i``-th piece.

    ``tiled=False``: ``x.shape[scatter_dimension]`` must equal the group size and the
    dim is removed; ``tiled=True``: it must be a multiple and is divided by it.
    Example, 2 devices holding ``[1, 2]`` and ``[10, 20]``: device 0 gets ``11`` and
    device 1 gets ``22``.
    """
    body, axes = _context("psum_scatter", axis_name)
    x = _tensor("psum_scatter", x)
    g = _group_size(body.mesh, axes)
    d = _dim("psum_scatter", "scatter_dimension", scatter_dimension, x.dim())
    _check_split("psum_scatter", f"dim {d} of the local tensor", x.shape[d], g, tiled, axes)
    _record(body, "reduce_scatter", axes, x, "sum")
    out = _run(body, ("psum_scatter", axes, d, None), x)
    return out if tiled else out.squeeze(d)


@_on_whole
def all_to_all(x: torch.Tensor, axis_name: AxisName, split_axis: int, concat_axis: int, *,
               tiled: bool = False) -> torch.Tensor:
    """Split ``x`` along ``split_axis`` into one piece per device of ``axis_name``, send
    piece ``i`` to device ``i`` and concatenate the pieces received (in device order)
    along ``concat_axis``.

    ``tiled=False`` (JAX): ``x.shape[split_axis]`` equals the group size, that dim is
    removed and a new dim of that size is inserted at ``concat_axis``.
    """
    body, axes = _context("all_to_all", axis_name)
    x = _tensor("all_to_all", x)
    g = _group_size(body.mesh, axes)
    sa = _dim("all_to_all", "split_axis", split_axis, x.dim())
    ca = _dim("all_to_all", "concat_axis", concat_axis, x.dim())
    _check_split("all_to_all", f"split_axis {sa}", x.shape[sa], g, tiled, axes)
    _record(body, "all_to_all", axes, x)
    if tiled or sa == ca:
        return _run(body, ("all_to_all", axes, sa, ca), x)
    if sa < ca:  # concat_axis counts positions after split_axis is removed
        ca += 1
        x = x.unsqueeze(ca)
    else:
        x = x.unsqueeze(ca)
        sa += 1
    return _run(body, ("all_to_all", axes, sa, ca), x).squeeze(sa)


@_on_whole
def ppermute(x: torch.Tensor, axis_name: AxisName, perm: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Send ``x`` from device ``src`` to device ``dst`` for each ``(src, dst)`` in
    ``perm`` (indices along ``axis_name``); devices that receive nothing get zeros.

    Example, a ring shift on 4 devices: ``ppermute(x, 'x', [(i, (i + 1) % 4) for i in range(4)])``.
    """
    body, axes = _context("ppermute", axis_name)
    x = _tensor("ppermute", x)
    pairs = _check_perm(perm, _group_size(body.mesh, axes), axes)
    _record(body, "permute", axes, x)
    return _run(body, ("ppermute", axes, pairs, None), x)


_perms: dict[int, tuple[Any, tuple]] = {}


def pshuffle(x: torch.Tensor, axis_name: AxisName, perm: Sequence[int]) -> torch.Tensor:
    """Device ``i`` gets the ``x`` of device ``perm[i]`` (JAX's ``pshuffle``: ``perm`` is a
    permutation of the indices along ``axis_name``)."""
    body, axes = _context("pshuffle", axis_name)
    g = _group_size(body.mesh, axes)
    perm = list(perm)
    if sorted(perm) != list(range(g)):
        raise ShardingError(
            f"sf.lax.pshuffle: `perm` does not represent a permutation: {perm!r}; it must list each index "
            f"0..{g - 1} along {axes!r} once"
        )
    return ppermute(x, axis_name, [(src, dst) for dst, src in enumerate(perm)])


def pbroadcast(x: torch.Tensor, axis_name: AxisName, source: int) -> torch.Tensor:
    """Every device of ``axis_name`` gets device ``source``'s ``x`` (JAX's ``pbroadcast``).
    As in JAX the result counts as varying over the axis: its transpose sums the cotangents
    of every device into ``source``'s."""
    body, axes = _context("pbroadcast", axis_name)
    g = _group_size(body.mesh, axes)
    if isinstance(source, bool) or not isinstance(source, int) or not 0 <= source < g:
        raise ShardingError(f"sf.lax.pbroadcast: source={source!r} must be an index along {axes!r}, 0..{g - 1}")
    return pcast(all_gather(x, axis_name, axis=0)[source], axis_name)


def _materialised(perm: Any) -> Any:
    """A one-shot iterator (``zip(...)``) as ``perm``, read once and remembered: the body
    runs once per device and per call, and a second read would find it empty."""
    if not isinstance(perm, Iterator):
        return perm
    with _perm_lock:
        hit = _perms.get(id(perm))
        if hit is None or hit[0] is not perm:
            if len(_perms) > 256:
                _perms.clear()
            hit = _perms[id(perm)] = (perm, tuple(perm))
    return hit[1]


_perm_lock = threading.Lock()


def _check_perm(perm: Any, g: int, axes: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
    perm = _materialised(perm)
    try:  # operator.index: a float (0.5) is not silently truncated to a device index
        pairs = tuple((_index(s), _index(d)) for s, d in perm)
    except (TypeError, ValueError):
        raise ShardingError(f"sf.lax.ppermute: perm {perm!r} must be a sequence of (src, dst) pairs") from None
    for s, d in pairs:
        if not (0 <= s < g and 0 <= d < g):
            raise ShardingError(
                f"sf.lax.ppermute: pair {(s, d)} is out of range; indices along {axes!r} are 0..{g - 1}"
            )
    for name, col in (("source", [s for s, _ in pairs]), ("destination", [d for _, d in pairs])):
        if len(set(col)) != len(col):
            raise ShardingError(f"sf.lax.ppermute: perm {pairs!r} repeats a {name}; each device sends and receives at most once")
    return pairs


def _index(i: Any) -> int:
    """An int device index (Python, NumPy or a 0-d integer tensor; not a bool or a float)."""
    if isinstance(i, bool):
        raise TypeError(i)
    return operator.index(i)


def axis_index(axis_name: AxisName) -> torch.Tensor:
    """This device's index along ``axis_name`` (an int64 scalar tensor); for a tuple of
    names, the row-major index over them (first name major)."""
    body, axes = _context("axis_index", axis_name)
    return body.axis_index(axes)


def axis_size(axis_name: AxisName) -> int:
    """The number of devices along ``axis_name`` (product over a tuple of names)."""
    body, axes = _context("axis_size", axis_name)
    return _group_size(body.mesh, axes)


def _check_split(fn: str, what: str, n: int, g: int, tiled: bool, axes: Any) -> None:
    """A dim split over a group must have the group's size (untiled) or a multiple of it."""
    if (not tiled and n != g) or (tiled and n % g):
        need = f"equal {g}" if not tiled else f"be a multiple of {g}"
        raise ShardingError(
            f"sf.lax.{fn}(tiled={tiled}): {what} has size {n}; it must {need}, "
            f"the size of the group over {axes!r}"
        )
