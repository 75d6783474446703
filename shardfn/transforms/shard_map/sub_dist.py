"""Partial-manual shard_map (``axis_names=``) where each process holds one device (dist).

The body runs once per rank on ShardedArrays over a *sub-mesh*: the view of the mesh over
the automatic axes at this rank's manual coordinates (``Mesh.submesh``), whose collectives
use the per-axis process groups the mesh already has. An argument laid out as its in_spec
says is handed in as this rank's shard relabelled onto the sub-mesh (no data moves), and a
result is resharded on the sub-mesh to its out_spec's layout over the automatic axes (the
communication the out_spec needs, no more) and relabelled back. ``sf.lax`` collectives over
the manual axes act on the shard (``lax._on_whole`` asks :func:`collective`).

Gradients follow the shard_map conventions (``_boundary``): an argument replicated over a
manual axis receives the sum of the bodies' gradients (Partial), an output replicated over
a manual axis passes its cotangent to its first replica only. ``check_vma`` over the
manual axes is tracked by tagging values (``_per_device``'s TorchFunctionMode).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch

from . import per_device as _per_device
from .. import lax
from ...arrays.array import ShardedArray, wrap
from ...arrays.redistribute import distribute, into_layout, reshard
from ...backends import backend_for
from ...backends.hooks import register_submesh_collective
from ...values.layout import Layout
from ...values.mesh import Mesh
from ..specs import _match
from .io import check_output_vma, check_scalar_output
from .sub_layouts import (_block_shape, _full_layout, _manual_out_layout, _order_check, _sub_layout, _varying_manual,
                          _whole_shape)

_active: list[Mesh] = []  # the sub-meshes of the dist partial-manual bodies running (one thread per rank)


def _rank(mesh: Mesh) -> int:
    return backend_for(mesh).devices(mesh)[0]


class _Enter(torch.autograd.Function):
    """An array laid out on the whole mesh -> this rank's shard as an array on the
    sub-mesh (a relabelling). Backward: the body's gradient relabelled back, summed over
    the manual axes the input is replicated on."""

    @staticmethod
    def forward(x: ShardedArray, sub: Mesh, manual: frozenset) -> ShardedArray:
        layout = x._layout
        shape = _block_shape(layout, tuple(x.shape), manual, _rank(layout.mesh))
        return wrap(x._local.view(x._local.shape), _sub_layout(layout, sub), shape, x.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        x, sub, manual = inputs
        ctx.meta = (x._layout, tuple(x.shape), x.dtype, sub, manual)

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        layout, shape, dtype, sub, manual = ctx.meta
        if not isinstance(g, ShardedArray):  # a plain gradient: the same on the whole sub-mesh
            g = distribute(g, Layout(sub, ((),) * g.dim(), ()))
        full = _full_layout(g._layout, layout.without_partial(), manual, summed=True)
        return wrap(g._local.view(g._local.shape), full, shape, dtype), None, None


class _Exit(torch.autograd.Function):
    """A body result on the sub-mesh (already in its out_spec's layout there) -> the array
    on the whole mesh. Backward: the cotangent in the output's layout, relabelled; zero on
    the later replicas over manual axes the output is replicated on (their first replica
    carries it, as ``_boundary.ExitParts``)."""

    @staticmethod
    def forward(y: ShardedArray, layout: Layout, shape: tuple[int, ...], manual: frozenset) -> ShardedArray:
        return wrap(y._local.view(y._local.shape), layout, shape, y.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        y, layout, shape, manual = inputs
        ctx.meta = (y._layout, tuple(y.shape), layout, manual)

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        sub_layout, block, layout, manual = ctx.meta
        mesh = layout.mesh
        want = layout.without_partial()
        g = into_layout(g, want)
        local = g._local
        coords = mesh.coords(_rank(mesh))
        used = set(layout.axis_dim) | set(layout.partial_ops)
        if any(coords[mesh.axis_index(a)] != 0 for a in manual if a not in used):
            local = backend_for(mesh).zero_cotangent(local)
        return wrap(local.view(local.shape), sub_layout.without_partial(), block, g.dtype), None, None, None


# -- collectives over the manual axes on sub-mesh arrays --------------------------------------------------------


class _Local(torch.autograd.Function):
    """A sub-mesh array -> its local shard (a plain tensor) for a collective over manual axes."""

    @staticmethod
    def forward(x: ShardedArray) -> torch.Tensor:
        return x._local.view(x._local.shape)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.meta = (inputs[0]._layout.without_partial(), tuple(inputs[0].shape))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        layout, shape = ctx.meta
        return wrap(g, layout, shape, g.dtype)


class _Rewrap(torch.autograd.Function):
    """A collective's local result -> a sub-mesh array laid out as ``layout``."""

    @staticmethod
    def forward(t: torch.Tensor, layout: Layout, shape: tuple[int, ...]) -> ShardedArray:
        return wrap(t.view(t.shape), layout, shape, t.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.layout = inputs[1].without_partial()

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        g = into_layout(g, ctx.layout)
        return g._local.view(g._local.shape), None, None


def on_submesh(x: Any) -> bool:
    """Whether ``x`` is an array of a dist partial-manual body running here."""
    return isinstance(x, ShardedArray) and x.mesh in _active


_SAME_RANK_TOUCH = {"all_gather": ("axis",), "psum_scatter": ("scatter_dimension",),
                    "all_to_all": ("split_axis", "concat_axis")}


def collective(fn: Callable, x: ShardedArray, args: tuple, kwargs: dict) -> Any:
    """``sf.lax`` collective ``fn`` (over manual axes) applied to this rank's shard of the
    sub-mesh array ``x``; the dims it moves data along are first made whole over the
    automatic axes (a reshard on the sub-mesh), the result laid out like ``x``."""
    name = fn.__name__
    layout = x._layout
    if name not in ("ppermute", "cast"):  # linear maps keep pending sums; others need values
        layout = layout.without_partial()
    touched = _touched(name, x.dim(), args, kwargs)
    if touched is None:  # rank-changing form: whole over the automatic axes
        layout = Layout(layout.mesh, ((),) * x.dim(), ())
    else:
        for d in touched:
            layout = layout.with_dims(d, ())
    if layout != x._layout:
        x = reshard(x, layout)
    vma = _per_device.vma_of(x)
    out = fn(_per_device.tag(_Local.apply(x), vma), *args, **kwargs)
    dims = layout.dims if out.dim() == x.dim() else ((),) * out.dim()
    out_layout = Layout(layout.mesh, dims, layout.partial if out.dim() == x.dim() else ())
    shape = tuple(out.shape[d] if not axes else x.shape[d] for d, axes in enumerate(dims))
    return _per_device.tag(_Rewrap.apply(out, out_layout, shape), _per_device.vma_of(out))


def _touched(name: str, ndim: int, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
    """The dims of the argument a same-rank collective moves data along; None when the
    collective may change the rank (untiled forms)."""
    if name not in _SAME_RANK_TOUCH:
        return ()
    if not kwargs.get("tiled", False):
        return None
    import inspect


    sig = inspect.signature(getattr(lax, name))
    bound = sig.bind_partial(None, *args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments[p] % max(ndim, 1) for p in _SAME_RANK_TOUCH[name])


# -- the call --------------------------------------------------------------------------------------------------


def shard_map_dist(f: Callable, inputs: Any, sub: Mesh, manual: frozenset, out_specs: Any, check_vma: bool,
                   kwargs: dict) -> Any:
    """One rank's part of a partial-manual shard_map call (see the module docstring)."""
    mesh = inputs.mesh
    leaves = []
    for path, v, layout in zip(inputs.paths, inputs.leaves, inputs.layouts):
        if layout is None or not isinstance(v, torch.Tensor):
            leaves.append(v)
            continue
        _order_check(layout, manual, f"shard_map in_specs for {path}")
        arr = into_layout(v, layout)
        vma = _varying_manual(layout, manual)
        leaves.append(_per_device.tag(_Enter.apply(arr, sub, manual), vma))
    closures = _SubClosures(mesh, sub, manual, leaves) if torch.is_grad_enabled() else contextlib.nullcontext()
    with _running(sub), lax._manual_axes(manual), lax._entered(_SubBody(mesh)), sub, closures:
        with _per_device._VmaMode():
            out = f(*inputs.rebuild(leaves), **kwargs)
    flat, treespec = optree.tree_flatten(out, none_is_leaf=True)
    out_tree = optree.tree_unflatten(treespec, list(range(len(flat))))
    paths, idx, specs, _ = _match(out_specs, out_tree, "shard_map out_specs", "output")
    rank = _rank(mesh)
    results = []
    for p, i, s in zip(paths, idx, specs):
        o = flat[i]
        if not isinstance(o, torch.Tensor):
            check_scalar_output(p, o, s)
            results.append(o)
            continue
        layout = _manual_out_layout(p, s, o.dim(), mesh, manual)
        vma = _per_device.vma_of(o) & manual
        if check_vma:
            check_output_vma(p, s, layout, set(vma))
        sub_layout = _sub_layout(layout, sub)
        o = into_layout(o, sub_layout)
        shape = _global_shape(o, layout, manual, inputs.even(), rank)
        results.append(_Exit.apply(o, layout, shape, manual))
    return optree.tree_unflatten(treespec, results)


def _global_shape(o: ShardedArray, layout: Layout, manual: frozenset, even: bool, rank: int) -> tuple[int, ...]:
    """The whole output's shape from this rank's block (even inputs: the blocks are equal;
    else the blocks' shapes are exchanged)."""
    mesh = layout.mesh
    block = tuple(o.shape)
    if even:
        return tuple(
            n * math.prod(mesh.axis_size(a) for a in axes if a in manual) for n, axes in zip(block, layout.dims)
        )
    from ...backends.dist import all_local_shapes

    blocks = all_local_shapes(torch.empty(block, device="meta"), mesh)  # the blocks' shapes, per rank
    return _whole_shape(layout, block, blocks, mesh, manual)


@contextlib.contextmanager
def _running(sub: Mesh) -> Iterator[None]:
    _active.append(sub)
    try:
        yield
    finally:
        _active.pop()


class _PlainGrad(torch.autograd.Function):
    """Identity on a plain body value; a cotangent that arrives as a sub-mesh array (the
    value met arrays in the body) is made whole first, for the plain collective behind it."""

    @staticmethod
    def forward(t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        pass  # (separate from forward, so torch.func transforms accept the Function)

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        from ...arrays.redistribute import gather

        return gather(g) if isinstance(g, ShardedArray) else g


def as_body_value(v: Any) -> Any:
    """A nested shard_map's whole result (a plain tensor, the same on the sub-mesh's
    ranks) as an array replicated over the sub-mesh, so gradients never mix plain tensors
    and arrays; else ``v``."""
    if not _active or not isinstance(v, torch.Tensor) or isinstance(v, ShardedArray):
        return v
    return _Replicas.apply(v, _active[-1])


class _Replicas(torch.autograd.Function):
    """A plain value replicated over the sub-mesh -> that array. Backward: the whole
    cotangent on the sub-mesh's first device only (zeros elsewhere), the convention for an
    invariant value whose collectives' transposes sum over the devices (``_boundary``)."""

    @staticmethod
    def forward(t: torch.Tensor, sub: Mesh) -> ShardedArray:
        return wrap(t.detach().clone(), Layout(sub, ((),) * t.dim(), ()), tuple(t.shape), t.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.sub = inputs[1]

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        from ...arrays.redistribute import gather

        g = gather(g) if isinstance(g, ShardedArray) else g
        if _rank(ctx.sub) != 0:
            g = backend_for(ctx.sub).zero_cotangent(g)
        return g, None


class _SubBody:
    """The lax implementation inside a dist partial-manual body: the dist collectives,
    with the varying manual axes of each result tagged for check_vma."""

    leader = True

    def __init__(self, mesh: Mesh) -> None:
        from .dist import DistBody

        self.mesh = mesh
        self._dist = DistBody(mesh)

    def _tagged(self, out: torch.Tensor, x: torch.Tensor, axes: tuple, varying: bool) -> torch.Tensor:
        vma = _per_device.vma_of(x)
        if out.requires_grad:
            out = _PlainGrad.apply(out)
        return _per_device.tag(out, (vma | set(axes)) if varying else (vma - set(axes)))

    def reduce(self, x: torch.Tensor, axes: tuple[str, ...], op: str) -> torch.Tensor:
        return self._tagged(self._dist.reduce(x, axes, op), x, axes, False)

    def all_gather(self, x: torch.Tensor, axes: tuple[str, ...], axis: int) -> torch.Tensor:
        return self._tagged(self._dist.all_gather(x, axes, axis), x, axes, False)

    def psum_scatter(self, x: torch.Tensor, axes: tuple[str, ...], dim: int) -> torch.Tensor:
        return self._tagged(self._dist.psum_scatter(x, axes, dim), x, axes, True)

    def all_to_all(self, x: torch.Tensor, axes: tuple[str, ...], split_axis: int, concat_axis: int) -> torch.Tensor:
        return self._tagged(self._dist.all_to_all(x, axes, split_axis, concat_axis), x, axes, True)

    def ppermute(self, x: torch.Tensor, axes: tuple[str, ...], perm: tuple) -> torch.Tensor:
        return self._tagged(self._dist.ppermute(x, axes, perm), x, axes, True)

    def axis_index(self, axes: tuple[str, ...]) -> torch.Tensor:
        return _per_device.tag(self._dist.axis_index(axes), frozenset(axes))


class _SubClosures(torch.overrides.TorchFunctionMode):
    """Values the body uses without receiving them as arguments: an array on the whole
    mesh becomes its sub-mesh view (made whole over the manual axes first, its gradient
    summed over them); a plain tensor that requires grad passes through an identity whose
    backward sums the gradient over the manual axes (the bodies of the other manual
    coordinates use it too)."""

    def __init__(self, mesh: Mesh, sub: Mesh, manual: frozenset, inputs: list) -> None:
        from .dist import _next_sequence_nr

        super().__init__()
        self.mesh, self.sub, self.manual = mesh, sub, manual
        self.start = _next_sequence_nr()
        self.seen: dict[int, Any] = {id(t): None for t in inputs if isinstance(t, torch.Tensor)}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        args = tuple(self._swap(a) for a in args)
        kwargs = {k: self._swap(v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        for o in (out,) if isinstance(out, torch.Tensor) else out if isinstance(out, (tuple, list)) else ():
            if isinstance(o, torch.Tensor) and id(o) not in self.seen:
                self.seen[id(o)] = None
        return out

    def _swap(self, a: Any) -> Any:
        if isinstance(a, (list, tuple)) and any(isinstance(b, torch.Tensor) for b in a):
            return type(a)(self._swap(b) for b in a)
        if not isinstance(a, torch.Tensor):
            return a
        key = id(a)
        if key in self.seen:
            hit = self.seen[key]
            return a if hit is None else hit[1]
        # (a TorchFunctionMode is off inside its own handler: these calls are not intercepted)
        if isinstance(a, ShardedArray):
            if a.mesh != self.mesh:
                return a
            whole = Layout(self.mesh, tuple(tuple(x for x in d if x not in self.manual) for d in a._layout.dims),
                           tuple(p for p in a._layout.partial if p[0] not in self.manual))
            rep = _Enter.apply(reshard(a, whole), self.sub, self.manual)
        elif a.requires_grad and (a.grad_fn is None or a.grad_fn._sequence_nr() < self.start):
            from .dist import _Replicated

            rep = _Replicated.apply(a, self.mesh, tuple(sorted(self.manual, key=self.mesh.axis_names.index)))
        else:
            if a.requires_grad:
                self.seen[key] = None
            return a
        self.seen[id(rep)] = None
        self.seen[key] = (a, rep)
        return rep


register_submesh_collective(on_submesh, collective)  # sf.lax routes a body's collectives here
