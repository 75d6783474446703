"""shard_map manual over some mesh axes only (``axis_names=``), and shard_map nested in
a shard_map body over axes the outer one left automatic.

Over the automatic axes, the arguments are gathered on entry and the body sees them as
ShardedArrays over a submesh of those axes (simulated in this process), laid out as
their in_specs say there, with ordinary propagation; its ShardedArray results are
gathered back and laid out as their out_specs say on exit (a slice, no communication).
Values and gradients are those of the unsharded computation. Inside,
``sf.lax`` collectives may name only the manual axes (``lax._manual_axes``). A nested
shard_map splits its arguments over its own axes by ``axis_index`` and gathers its
results back with ``all_gather`` / ``psum``, which are differentiable collectives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import optree
import torch

from .. import lax
from ...arrays.array import ShardedArray
from ...arrays.redistribute import distribute, gather, reshard
from ...backends import backend_for
from ...values.errors import ShardingError
from ...values.layout import Layout
from ...values.mesh import Mesh
from ...values.spec import NamedSharding, P, Replicate, _is_placements
from ..specs import _arg_specs, _is_spec, _layout, _match
from .io import _Inputs, _shard_map, _submeshes, _subs  # noqa: F401  (the running sub-meshes live in io)


def shard_map_manual(f: Callable, mesh: Mesh | None, in_specs: Any, out_specs: Any, check_vma: bool,
                     axis_names: Any, args: tuple, kwargs: dict) -> Any:
    """shard_map with ``axis_names`` (or called inside another shard_map body)."""
    if lax._in_shard_map():
        return _nested(f, in_specs, out_specs, axis_names, args, kwargs)
    inputs = _Inputs(in_specs, args, mesh)
    m = inputs.mesh
    manual = _check_axis_names(axis_names, m, frozenset(), "shard_map")
    auto = tuple(a for a in m.axis_names if a not in manual)
    body = _restricted(f, manual)
    if not auto:
        return _shard_map(body, m, in_specs, out_specs, check_vma, args, kwargs)
    if _plain_autograd():
        sub = backend_for(m).submesh(m, auto)
        if sub is not None:  # one device per process: the body runs on the sub-mesh of this rank's manual coordinates
            from .sub_dist import shard_map_dist

            return shard_map_dist(f, inputs, sub, manual, out_specs, check_vma, kwargs)
        from . import sub_sim as _sim_manual  # every device here: one run per manual coordinate, on sub-mesh arrays

        return _sim_manual.run(f, inputs, manual, auto, out_specs, check_vma, kwargs)
    sub = Mesh(tuple(m.axis_size(a) for a in auto), auto, backend="local", device_type=m.device_type)
    body = _on_submesh(body, sub, [None if l is None else _keep(l, sub) for l in inputs.layouts])
    whole_in = inputs.rebuild([None if l is None else _drop(l, auto) for l in inputs.layouts])
    whole_out = optree.tree_map(lambda s: _strip(s, auto, m), out_specs, is_leaf=_is_spec_leaf, none_is_leaf=True)
    out = _shard_map(body, m, tuple(whole_in), whole_out, check_vma, inputs.rebuild(inputs.leaves), kwargs)
    paths, outs, specs, treespec = _match(out_specs, out, "shard_map out_specs", "output")
    laid = [
        reshard(v, _layout(s, v.ndim, m, f"shard_map out_specs for {p}")) if isinstance(v, ShardedArray) else v
        for p, v, s in zip(paths, outs, specs)
    ]
    return optree.tree_unflatten(treespec, laid)


def _plain_autograd() -> bool:
    """No torch.func transform, forward-AD level or make_fx trace is active (the sub-mesh
    path's crossings are first-order autograd Functions; under those the body runs on
    whole values over the automatic axes, as before)."""
    from torch.autograd.forward_ad import _current_level
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return not torch._C._are_functorch_transforms_active() and _current_level < 0 and get_proxy_mode() is None


def _is_spec_leaf(s: Any) -> bool:
    return _is_spec(s)


def _check_axis_names(axis_names: Any, mesh: Mesh, taken: frozenset, fn: str) -> frozenset:
    if axis_names is None:
        return frozenset(a for a in mesh.axis_names if a not in taken)
    names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    for a in names:
        if a not in mesh.axis_names:
            raise ShardingError(f"{fn} axis_names names {a!r}, which is not a mesh axis; the axes are {mesh.axis_names!r}")
        if a in taken:
            raise ShardingError(
                f"{fn} axis_names names {a!r}, which the enclosing shard_map is already manual over; "
                f"a nested shard_map may be manual only over the remaining axes "
                f"{tuple(x for x in mesh.axis_names if x not in taken)!r}"
            )
    if not names:
        raise ShardingError(f"{fn} axis_names is empty; name at least one mesh axis (or pass None for all)")
    return frozenset(names)


def _restricted(f: Callable, manual: frozenset) -> Callable:
    """``f`` run with collectives limited to ``manual`` (in whichever thread runs it)."""

    @functools.wraps(f)
    def body(*args: Any, **kwargs: Any) -> Any:
        with lax._manual_axes(manual):
            return f(*args, **kwargs)

    return body


def _on_submesh(f: Callable, sub: Mesh, layouts: list) -> Callable:
    """``f`` seeing its tensor arguments as ShardedArrays over ``sub`` (the automatic
    axes), laid out as their in_specs say there; its ShardedArray results are gathered
    back to whole values. The submesh is simulated in this process (local backend)."""

    @functools.wraps(f)
    def body(*args: Any, **kwargs: Any) -> Any:
        leaves, treespec = optree.tree_flatten(args, none_is_leaf=True)
        leaves = [
            distribute(v, l) if l is not None and isinstance(v, torch.Tensor) else v for v, l in zip(leaves, layouts)
        ]
        _subs().append(sub)
        try:
            with sub:
                out = f(*optree.tree_unflatten(treespec, leaves), **kwargs)
        finally:
            _subs().pop()
        return optree.tree_map(_whole_value, out, none_is_leaf=True)

    return body


def _as_body_value(v: Any) -> Any:
    """A whole tensor made inside a partial-manual body, as a ShardedArray replicated over
    its submesh (so gradients never mix plain tensors and ShardedArrays)."""
    subs = _subs()
    if not subs or not isinstance(v, torch.Tensor):
        from .sub_dist import as_body_value

        return as_body_value(v)
    return distribute(v, Layout(subs[-1], ((),) * v.dim(), ()))


def _whole_value(v: Any) -> Any:
    from ...arrays import functorch as _ft

    if isinstance(v, torch.Tensor) and (isinstance(v, ShardedArray) or _ft.base_array(v) is not None):
        return gather(v)
    return v


def _keep(layout: Layout, sub: Mesh) -> Layout:
    """The part of ``layout`` over the axes of ``sub``, said on ``sub``."""
    dims = tuple(tuple(a for a in d if a in sub.axis_names) for d in layout.dims)
    return Layout(sub, dims, ())


def _drop(layout: Layout, axes: tuple[str, ...]) -> Layout:
    """``layout`` without any mention of ``axes`` (whole along them)."""
    dims = tuple(tuple(a for a in d if a not in axes) for d in layout.dims)
    return Layout(layout.mesh, dims, tuple(p for p in layout.partial if p[0] not in axes))


def _strip(spec: Any, auto: tuple[str, ...], mesh: Mesh) -> Any:
    """An out_spec with the automatic axes removed (the body's results are whole there)."""
    if spec is None:
        return None
    if isinstance(spec, NamedSharding):
        spec = spec.spec
    if isinstance(spec, Layout):
        bad = [a for a, _ in spec.partial if a in auto]
        spec_p = None
    elif _is_placements(spec):
        from ...values.spec import Partial

        bad = [a for a, pl in zip(mesh.axis_names, spec) if a in auto and isinstance(pl, Partial)]
        spec_p = None
    else:
        spec = spec if isinstance(spec, P) else P(*spec)
        bad = [a for a in spec.partial if a in auto]
        spec_p = spec
    if bad:
        raise ShardingError(
            f"shard_map out_spec {spec!r} has partial over {bad[0]!r}, which is not a manual axis: the "
            f"body's results do not vary over it, so a pending sum there would multiply them by "
            f"{mesh.axis_size(bad[0])}; drop {bad[0]!r} from partial="
        )
    if isinstance(spec, Layout):
        return _drop(spec, auto)
    if spec_p is None:
        return tuple(Replicate() if a in auto else pl for a, pl in zip(mesh.axis_names, spec))

    def entry(e: Any) -> Any:
        if e is None:
            return None
        kept = tuple(a for a in ((e,) if isinstance(e, str) else e) if a not in auto)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return P(*(entry(e) for e in spec_p), partial={a: op for a, op in spec_p.partial.items() if a not in auto} or None)


# -- nested in a shard_map body -----------------------------------------------------------------


def _nested(f: Callable, in_specs: Any, out_specs: Any, axis_names: Any, args: tuple, kwargs: dict) -> Any:
    body = lax._bodies()[-1]
    mesh = body.mesh
    outer = lax._manual_set(mesh)
    inner = _check_axis_names(axis_names, mesh, outer, "nested shard_map")
    sub = getattr(body, "submesh", None)
    if sub is not None:  # a simulated partial-manual run: its values are arrays on the sub-mesh
        from .sub_sim import nested_on_submesh

        return nested_on_submesh(f, sub, in_specs, out_specs, inner, args, kwargs)
    if in_specs is None:
        raise ShardingError("a nested shard_map needs in_specs: inside a shard_map body values are local tensors with no spec")
    specs = _arg_specs(in_specs, args, "nested shard_map in_specs")
    paths, leaves, specs, treespec = _match(specs, args, "nested shard_map in_specs", "args")
    # Where the results leave as plain values replicated over the sub-mesh whose cotangent
    # reaches the first replica only (``_as_body_value`` without a running sub-mesh), an input's
    # gradient sums the devices' cotangents over the inner axes (each used it whole).
    axes = tuple(a for a in mesh.axis_names if a in inner)
    summed = functools.partial(body.reduce, axes=axes, op="sum") if axes and not _subs() else None
    with lax._manual_axes(outer | inner):
        pieces = [_split(p, v, s, inner, summed) for p, v, s in zip(paths, leaves, specs)]
        out = f(*optree.tree_unflatten(treespec, pieces), **kwargs)
        opaths, outs, ospecs, otree = _match(out_specs, out, "nested shard_map out_specs", "output")
        whole = [_as_body_value(_gather(p, v, s, inner)) for p, v, s in zip(opaths, outs, ospecs)]
    return optree.tree_unflatten(otree, whole)


def _entries(path: str, spec: Any, ndim: int, inner: frozenset, what: str) -> tuple[list, dict]:
    if spec is None:
        return [()] * ndim, {}
    if not isinstance(spec, P):
        raise ShardingError(f"nested shard_map {what} for {path}: give a P(...), got {spec!r}")
    if len(spec) > ndim:
        raise ShardingError(f"nested shard_map {what} for {path}: {spec!r} has more entries than the rank {ndim}")
    dims = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec] + [()] * (ndim - len(spec))
    for a in [a for d in dims for a in d] + list(spec.partial):
        if a not in inner:
            raise ShardingError(
                f"nested shard_map {what} for {path} names axis {a!r}, which this shard_map is not manual "
                f"over (its axes: {sorted(inner)!r})"
            )
    return dims, dict(spec.partial)


def _split(path: str, v: Any, spec: Any, inner: frozenset, summed: Callable | None) -> Any:
    if not isinstance(v, torch.Tensor):
        return v
    v = _whole_value(v)  # a ShardedArray over the outer automatic axes: its whole value
    if summed is not None and (v.is_floating_point() or v.is_complex()):
        v = _UsedByEach.apply(v, summed)
    what = "in_specs"
    dims, partial = _entries(path, spec, v.dim(), inner, what)
    if partial:
        raise ShardingError(f"nested shard_map in_specs for {path} is partial; an in_spec cannot be partial")
    for d, axes in enumerate(dims):
        if not axes:
            continue
        g = lax.axis_size(axes)
        n = v.shape[d]
        if n % g:
            raise ShardingError(
                f"nested shard_map in_specs for {path}: dim {d} has size {n}, not divisible by the "
                f"{g} devices of {axes!r}; a nested shard_map needs even splits"
            )
        idx = lax.axis_index(axes).reshape(1)
        v = torch.index_select(v.unflatten(d, (g, n // g)), d, idx).squeeze(d)
    return v


class _UsedByEach(torch.autograd.Function):
    """A body value entering a nested shard_map, whole on each device of its manual axes
    (which then take their pieces). Backward: those devices' cotangents summed over the
    axes (``boundary.py``'s convention for an input replicated over an axis; the nested
    results' cotangents reach the first replica only)."""

    @staticmethod
    def forward(t: torch.Tensor, summed: Callable) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.summed = inputs[1]

    @staticmethod
    def backward(ctx: Any, ct: torch.Tensor) -> Any:
        return ctx.summed(ct), None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, _: Any) -> torch.Tensor:
        return t


def _gather(path: str, v: Any, spec: Any, inner: frozenset) -> Any:
    if not isinstance(v, torch.Tensor):
        return v
    dims, partial = _entries(path, spec, v.dim(), inner, "out_specs")
    if partial:
        v = lax.psum(v, tuple(partial))
    for d, axes in enumerate(dims):
        if axes:
            v = lax.all_gather(v, axes, axis=d, tiled=True)
    return v
