"""Transforms: ``shard_map`` (JAX), ``local_map`` (DTensor) and ``with_sharding_constraint``.

shard_map on the local backend runs the body once for the whole mesh under vmap when
every shard has one shape (``_stacked``), else once per device in threads
(``_per_device``); on the dist backend each rank runs it on plain tensors
(``_dist_lax``). The crossings between ShardedArrays and local tensors, with their
gradient conventions, are in ``_boundary``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, overload

import optree
import torch

from . import boundary as B
from ...compile import dynamo as _dynamo
from ...arrays.array import ShardedArray, distribute, reshard
from ...backends.registry import backend_for
from ...values.errors import ShardingError
from ...values.layout import Layout, device_box, is_even
from ...values.mesh import Mesh, current_mesh
from ...values.spec import NamedSharding, P, Sharding, _is_placements, check_mesh, layout_to_spec, to_layout

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["local_map", "shard_map", "with_sharding_constraint"]


# -- spec trees ---------------------------------------------------------------------------------


def _is_spec(s: Any) -> bool:
    return s is None or isinstance(s, (P, NamedSharding, Layout)) or _is_placements(s)


def _path_str(root: str, path: tuple) -> str:
    return root + "".join(f"[{k!r}]" for k in path)


def _match(specs: Any, tree: Any, what: str, root: str) -> tuple[list, list, list, Any]:
    """Broadcast the spec prefix tree over ``tree``: (paths, leaves, specs, treespec)."""
    try:
        full = optree.tree_broadcast_prefix(specs, tree, is_leaf=_is_spec, none_is_leaf=True)
    except ValueError as e:
        raise ShardingError(
            f"{what} {specs!r} does not match the structure of {root}: {e} {what} must be a "
            f"prefix of {root} (one spec per leaf, or one spec for a whole subtree)"
        ) from None
    flat_specs = optree.tree_leaves(full, is_leaf=_is_spec, none_is_leaf=True)
    paths, leaves, treespec = optree.tree_flatten_with_path(tree, none_is_leaf=True)
    return [_path_str(root, p) for p in paths], leaves, flat_specs, treespec


def _arg_specs(in_specs: Any, args: tuple, what: str) -> Any:
    """in_specs for the positional args: one spec for all, or one entry per argument."""
    if _is_spec(in_specs):
        return tuple(in_specs for _ in args)
    if isinstance(in_specs, list):
        in_specs = tuple(in_specs)
    if not isinstance(in_specs, tuple):
        raise ShardingError(f"{what} must be a P, or a tuple with one entry per argument; got {in_specs!r}")
    if len(in_specs) != len(args):
        raise ShardingError(
            f"{what} has {len(in_specs)} entr{'y' if len(in_specs) == 1 else 'ies'} but the function "
            f"was called with {len(args)} positional argument{'' if len(args) == 1 else 's'}; "
            f"give one spec (or spec tree) per argument"
        )
    return in_specs


def _layout(spec: Any, ndim: int, mesh: Mesh, where: str) -> Layout:
    try:
        return to_layout(spec, ndim, mesh, arg=where)
    except ShardingError as e:
        raise ShardingError(f"{where}: {e}") from None


def _mesh_for(mesh: Mesh | None, leaves: list, fn: str) -> Mesh:
    arrays = [v for v in leaves if isinstance(v, ShardedArray)]
    if mesh is not None:
        check_mesh(mesh, f"{fn}(mesh=...)")
    if mesh is None:
        mesh = arrays[0].mesh if arrays else current_mesh()
    if mesh is None:
        raise ShardingError(f"{fn} needs a mesh: pass mesh=, pass ShardedArray arguments, or enter `with mesh:`")
    for v in arrays:
        if v.mesh != mesh:
            raise ShardingError(f"{fn}: an argument lives on {v.mesh!r} but the transform runs on {mesh!r}")
    return mesh


def _local_shape(shape: Sequence[int], layout: Layout) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in device_box(layout, tuple(shape), 0))


# -- shard_map --------------------------------------------------------------------------------------


@overload
def shard_map(f: F, *, mesh: Mesh | None = None, in_specs: Any = None, out_specs: Any, check_vma: bool = True,
              axis_names: Any = None) -> F: ...


@overload
def shard_map(f: None = None, *, mesh: Mesh | None = None, in_specs: Any = None, out_specs: Any,
              check_vma: bool = True, axis_names: Any = None) -> Callable[[F], F]: ...


def shard_map(f: Any = None, *, mesh: Mesh | None = None, in_specs: Any = None, out_specs: Any,
              check_vma: bool = True, axis_names: Any = None) -> Any:
    """Map ``f`` over the shards of its arguments (JAX's ``shard_map``).

    Args:
        f: the body; it sees each device's local tensors and may call ``sf.lax``
            collectives over the mesh axes.
        mesh: the mesh (default: that of the ShardedArray arguments, else the current one).
        in_specs: a P per positional argument, or a tree prefix of the arguments; a single
            P applies to all of them. ShardedArrays are resharded to their spec, plain
            tensors distributed. Non-tensor leaves are passed through unchanged.
            ``None``: each ShardedArray argument keeps its own spec (a plain tensor is
            then an error).
        out_specs: a tree prefix of the outputs; each output becomes a ShardedArray whose
            shards are the devices' local outputs. ``P(..., partial=axis)`` declares the
            local outputs pending sums over ``axis``.
        check_vma: raise a ShardingError when an output varies over a mesh axis its
            out_spec leaves out (psum / all_gather results count as replicated), or
            when ``partial=`` names an axis the output does not vary over.
        axis_names: the mesh axes the body is manual over (default: all). Collectives
            may name only these; over the other axes the body sees whole values (the
            arguments are gathered over them on entry and the results laid out as their
            out_specs say on exit, without communication).

    Returns:
        The mapped function. Results and gradients equal those of the unsharded
        computation the body describes.

    Example::

        @functools.partial(sf.shard_map, mesh=mesh, in_specs=(P('x', None), P()), out_specs=P())
        def loss(x, w):
            return sf.lax.psum(((x @ w) ** 2).sum(), 'x')
    """
    if f is None:
        return functools.partial(shard_map, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma,
                                 axis_names=axis_names)

    @functools.wraps(f)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        if axis_names is not None or _manual_context():
            from .manual import shard_map_manual

            return shard_map_manual(f, mesh, in_specs, out_specs, check_vma, axis_names, args, kwargs)
        return _shard_map(f, mesh, in_specs, out_specs, check_vma, args, kwargs)

    return _dynamo.in_graph(mapped)


class _Inputs:
    """The flattened arguments of one shard_map call and their layouts."""

    def __init__(self, in_specs: Any, args: tuple, mesh: Mesh | None) -> None:
        specs = _own_specs(args) if in_specs is None else _arg_specs(in_specs, args, "shard_map in_specs")
        self.paths, self.leaves, specs, self.treespec = _match(specs, args, "shard_map in_specs", "args")
        self.mesh = _mesh_for(mesh, self.leaves, "shard_map")
        self.layouts: list[Layout | None] = []
        for path, v, s in zip(self.paths, self.leaves, specs):
            self.layouts.append(self._layout(path, v, s))

    def _layout(self, path: str, v: Any, spec: Any) -> Layout | None:
        if not isinstance(v, torch.Tensor):
            check_scalar_spec(path, v, spec, "in_specs")
            return None
        if spec is None:
            return None
        layout = _layout(spec, v.dim(), self.mesh, f"shard_map in_specs for {path}")
        if layout.partial:
            raise ShardingError(
                f"shard_map in_specs for {path} is {layout_to_spec(layout)!r}; an in_spec cannot be "
                f"partial (the body sees values, not pending sums); reshard the argument first"
            )
        return layout

    def even(self) -> bool:
        return all(l is None or is_even(l, tuple(v.shape)) for v, l in zip(self.leaves, self.layouts))

    def rebuild(self, leaves: list) -> tuple:
        return optree.tree_unflatten(self.treespec, leaves)


def _own_specs(args: tuple) -> tuple:
    """in_specs=None: each ShardedArray argument's own spec (plain tensors are an error)."""
    paths, leaves, treespec = optree.tree_flatten_with_path(args, none_is_leaf=True)
    specs = []
    for path, v in zip(paths, leaves):
        if isinstance(v, torch.Tensor) and not isinstance(v, ShardedArray):
            raise ShardingError(
                f"shard_map with in_specs=None takes each argument's own spec, but {_path_str('args', path)} "
                f"is a plain tensor with no spec; pass in_specs=, or sf.distribute it first"
            )
        specs.append(v._layout if isinstance(v, ShardedArray) else None)
    return tuple(optree.tree_unflatten(treespec, specs))


def _manual_context() -> bool:
    from ..lax import _in_shard_map

    return _in_shard_map()


def _shard_map(f: Callable, mesh: Mesh | None, in_specs: Any, out_specs: Any, check_vma: bool,
               args: tuple, kwargs: dict) -> Any:
    from ..lax import _in_shard_map

    if _in_shard_map():
        raise ShardingError("shard_map inside a shard_map body is not supported; call collectives directly")
    inputs = _Inputs(in_specs, args, mesh)
    return backend_for(inputs.mesh).shard_map(f, inputs, out_specs, check_vma, kwargs)


def check_output_vma(path: str, spec: Any, layout: Layout, varying: set[str]) -> None:
    """The check_vma rule: an output may vary only over axes its out_spec names."""
    mesh = layout.mesh
    for a in mesh.axis_names:
        if a in varying and a not in B.used_axes(layout):
            hint = f"P({a!r})" if layout.ndim else f"P(partial={a!r})"
            raise ShardingError(
                f"shard_map {path} varies over mesh axis {a!r}, but its out_spec {spec!r} "
                f"leaves {a!r} out, so the devices along {a!r} would disagree on its value; "
                f"reduce it with sf.lax.psum(y, {a!r}) (or pmean / pmax / all_gather), or add "
                f"{a!r} to the out_spec (e.g. {hint}); check_vma=False takes device {a}=0's value"
            )
        if a in layout.partial_ops and a not in varying:
            raise ShardingError(
                f"shard_map {path} has out_spec {spec!r} with partial over mesh axis {a!r}, but it does "
                f"not vary over {a!r}: summing its identical copies would multiply it by "
                f"{mesh.axis_size(a)}; drop {a!r} from partial= (or psum over {a!r} in the body "
                f"only where the value really differs)"
            )


def check_scalar_spec(path: str, v: Any, spec: Any, what: str) -> None:
    """A non-tensor leaf (a Python number) is the same on every device: only a spec that
    shards nothing and sums nothing can hold for it."""
    if spec is None or _is_trivial(spec):
        return
    raise ShardingError(
        f"shard_map {what} for {path} is {spec!r}, but {path} is a {type(v).__name__}, not a tensor: "
        f"it has no dims to split and is the same on every device, so that spec cannot hold; use P() "
        f"(or None), or make it a tensor"
    )


def _is_trivial(spec: Any) -> bool:
    if isinstance(spec, NamedSharding):
        spec = spec.spec
    if isinstance(spec, Layout):
        return spec.is_replicated()
    if _is_placements(spec):
        from ...values.spec import Replicate

        return all(isinstance(p, Replicate) for p in spec)
    if isinstance(spec, P):
        return not spec.partial and all(e is None for e in spec)
    return False


def _out_layout(path: str, spec: Any, ndim: int, mesh: Mesh) -> Layout:
    if spec is None:
        raise ShardingError(f"shard_map out_specs for {path} is None; tensor outputs need a P(...)")
    return _layout(spec, ndim, mesh, f"shard_map out_specs for {path}")


# -- local backend, even shards -------------------------------------------------------------------------


def _to_canonical(v: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Canonical form (see ``_stacked``) of argument ``v`` laid out as ``layout``."""
    if isinstance(v, ShardedArray):
        v = reshard(v, layout)
        used = B.used_axes(layout)
        dims = tuple(n if a in used else 1 for a, n in zip(layout.mesh.axis_names, layout.mesh.shape))
        return B.EnterStacked.apply(v, B.stacked_modes(layout, dims))
    return _split_full(v, layout)


def _split_full(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Canonical form of a full tensor, by reshape and permute (plain autograd)."""
    mesh = layout.mesh
    sizes: list[int] = []
    pos: dict[str, int] = {}
    local: list[int] = []
    for n, axes in zip(x.shape, layout.dims):
        for a in axes:
            pos[a] = len(sizes)
            sizes.append(mesh.axis_size(a))
        local.append(len(sizes))
        sizes.append(n // max(1, math.prod(mesh.axis_size(a) for a in axes)))
    for a in mesh.axis_names:
        if a not in pos:
            pos[a] = len(sizes)
            sizes.append(1)
    return x.reshape(sizes).permute([pos[a] for a in mesh.axis_names] + local)


def _run_stacked(f: Callable, inputs: _Inputs, out_specs: Any, check_vma: bool, kwargs: dict) -> Any:
    from . import stacked as _stacked

    mesh = inputs.mesh
    mapped = [l is not None for l in inputs.layouts]
    leaves = [_to_canonical(v, l) if l is not None else v for v, l in zip(inputs.leaves, inputs.layouts)]
    flat, treespec = _stacked.run(mesh, f, leaves, mapped, inputs.rebuild, kwargs)
    out_tree = optree.tree_unflatten(treespec, flat)
    paths, outs, specs, _ = _match(out_specs, out_tree, "shard_map out_specs", "output")
    results = [_assemble_stacked(p, c, s, mesh, check_vma) for p, c, s in zip(paths, outs, specs)]
    return optree.tree_unflatten(treespec, results)


def _assemble_stacked(path: str, c: Any, spec: Any, mesh: Mesh, check_vma: bool) -> Any:
    if not isinstance(c, torch.Tensor):
        check_scalar_spec(path, c, spec, "out_specs")
        return c
    m = mesh.ndim
    layout = _out_layout(path, spec, c.dim() - m, mesh)
    varying = {a for k, a in enumerate(mesh.axis_names) if c.shape[k] > 1}
    if check_vma:
        check_output_vma(path, spec, layout, varying)
    used = B.used_axes(layout)
    for k, a in enumerate(mesh.axis_names):
        if a in varying and a not in used:
            c = c.narrow(k, 0, 1)
    shape = tuple(
        n * math.prod(mesh.axis_size(a) for a in axes) for n, axes in zip(c.shape[m:], layout.dims)
    )
    return B.ExitStacked.apply(c, layout, shape)


# -- local backend, uneven shards -----------------------------------------------------------------------


def _device_pieces(v: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """Each device's local tensor of argument ``v`` (differentiable)."""
    if isinstance(v, ShardedArray):
        v = reshard(v, layout)
        return list(B.EnterParts.apply(v, B.summed_grad_layout(layout), True))
    shape = tuple(v.shape)
    return [v[tuple(slice(lo, hi) for lo, hi in device_box(layout, shape, d))] for d in range(layout.mesh.size)]


def _run_per_device(f: Callable, inputs: _Inputs, out_specs: Any, check_vma: bool, kwargs: dict) -> Any:
    from torch.autograd.forward_ad import _current_level
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    if get_proxy_mode() is not None:
        raise ShardingError(
            "shard_map with uneven shards cannot be traced by make_fx (torch.func.linearize, "
            "torch.compile's tracing): its body runs once per device in threads the tracer does not "
            "see; use torch.func.jvp instead of linearize, or make every sharded dim divisible by its "
            "mesh axes"
        )
    if torch._C._are_functorch_transforms_active() or _current_level >= 0:
        return _run_per_device_opaque(f, inputs, out_specs, check_vma, kwargs)
    flat, treespec = _per_device_flat(f, inputs, inputs.leaves, out_specs, check_vma, kwargs)
    return optree.tree_unflatten(treespec, flat)


def _run_per_device_opaque(f: Callable, inputs: _Inputs, out_specs: Any, check_vma: bool, kwargs: dict) -> Any:
    """The per-device run as one autograd Function (``_boundary.Opaque``): its threads
    cannot see torch.func's thread-local transform state (nor forward-AD duals), so they
    work on plain tensors inside it; its derivatives and batching rule re-run it."""
    where = [i for i, v in enumerate(inputs.leaves) if isinstance(v, torch.Tensor)]
    result: dict = {}

    def run(*tensors: torch.Tensor) -> list[torch.Tensor]:
        leaves = list(inputs.leaves)
        for i, t in zip(where, tensors):
            leaves[i] = t
        result["flat"], result["spec"] = _per_device_flat(f, inputs, leaves, out_specs, check_vma, kwargs,
                                                          traced_closures=True)
        return [o for o in result["flat"] if isinstance(o, torch.Tensor)]

    outs = iter(B.Opaque.apply(run, *[inputs.leaves[i] for i in where]))
    flat = [next(outs) if isinstance(o, torch.Tensor) else o for o in result["flat"]]
    return optree.tree_unflatten(result["spec"], flat)


def _per_device_flat(f: Callable, inputs: _Inputs, leaves: list, out_specs: Any, check_vma: bool,
                     kwargs: dict, traced_closures: bool = False) -> tuple[list, Any]:
    from . import per_device as _per_device

    mesh = inputs.mesh
    columns = []
    for v, l in zip(leaves, inputs.layouts):
        if l is None:
            columns.append([v] * mesh.size)
            continue
        vma = frozenset(l.axis_dim)
        columns.append([_per_device.tag(p, vma) for p in _device_pieces(v, l)])
    per_device = [inputs.rebuild([col[d] for col in columns]) for d in range(mesh.size)]
    outs = _per_device.run(mesh, f, per_device, kwargs, traced_closures)
    flats = [optree.tree_flatten(o, none_is_leaf=True) for o in outs]
    treespec = flats[0][1]
    if any(t != treespec for _, t in flats):
        raise ShardingError(
            f"shard_map devices returned differently structured outputs: {[t for _, t in flats]}"
        )
    out_tree = optree.tree_unflatten(treespec, list(range(treespec.num_leaves)))
    paths, idx, specs, _ = _match(out_specs, out_tree, "shard_map out_specs", "output")
    results = [
        assemble_parts(p, [flat[i] for flat, _ in flats], s, mesh, check_vma, _per_device.vma_of)
        for p, i, s in zip(paths, idx, specs)
    ]
    return results, treespec


def assemble_parts(path: str, outs: list, spec: Any, mesh: Mesh, check_vma: bool,
                   vma_of: Callable[[Any], frozenset[str]] | None, exchange: bool = False) -> Any:
    """One ShardedArray from the local outputs of the devices this process holds."""
    if not isinstance(outs[0], torch.Tensor):
        check_scalar_spec(path, outs[0], spec, "out_specs")
        return outs[0]
    layout = _out_layout(path, spec, outs[0].dim(), mesh)
    if check_vma and vma_of is not None:
        check_output_vma(path, spec, layout, set().union(*(vma_of(o) for o in outs)))
    return B.ExitParts.apply(layout, _global_shape(path, outs, layout, exchange), True, *outs)


def _global_shape(path: str, outs: list, layout: Layout, exchange: bool = False) -> tuple[int, ...]:
    """The global shape the local outputs describe, from their actual sizes (see
    ``Backend.output_shape``: with ``exchange`` processes that hold one device's output
    swap their sizes, for uneven inputs; else the layout is taken to be even)."""
    if any(o.dim() != outs[0].dim() for o in outs):
        raise ShardingError(f"shard_map {path}: devices returned tensors of different ranks")
    try:
        return backend_for(layout.mesh).output_shape(B.first_replicas(outs, layout), layout, exchange)
    except ShardingError as e:
        raise ShardingError(f"{path}: {e}") from None


# -- local_map ----------------------------------------------------------------------------------------


def local_map(f: Callable, out_specs: Any, *, in_specs: Any = None, in_grad_specs: Any = None,
              mesh: Mesh | None = None, redistribute_inputs: bool = False) -> Callable:
    """Run ``f`` on the local shards of ShardedArray arguments (DTensor's ``local_map``).

    Args:
        f: a function of local tensors; it runs once per device (no collectives).
        out_specs: a spec per output (tree prefix); the local outputs are the shards of
            a ShardedArray with that layout, whose global shape comes from their actual
            sizes (uneven layouts need no gather). ``None``: the output is returned as
            is (tensors as the list of per-device values on the local backend).
        in_specs: optional spec per argument; a ShardedArray in another layout is an
            error unless ``redistribute_inputs``. Plain tensors with a spec are
            distributed; without one they are passed unchanged to every device.
        in_grad_specs: the layout in which the per-device gradients of each input are
            read. Default: Partial(sum) over the axes the input is replicated on (each
            device's gradient is a part), with each replicated output's cotangent
            given to one replica, which is exact. When given, every replica of an
            output receives its cotangent (DTensor's convention).
        mesh: default: the mesh of the ShardedArray arguments, else the current mesh.
        redistribute_inputs: reshard ShardedArrays whose layout differs from in_specs.

    Example::

        row_sum = sf.local_map(lambda x: x.sum(1), out_specs=P('x'))(x)  # x: P('x', None)
    """

    @functools.wraps(f)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        return _local_map(f, out_specs, in_specs, in_grad_specs, mesh, redistribute_inputs, args, kwargs)

    return _dynamo.in_graph(mapped)


def _local_map(f: Callable, out_specs: Any, in_specs: Any, in_grad_specs: Any, mesh: Mesh | None,
               redistribute: bool, args: tuple, kwargs: dict) -> Any:
    specs = _arg_specs(in_specs, args, "local_map in_specs") if in_specs is not None else (None,) * len(args)
    paths, leaves, specs, treespec = _match(specs, args, "local_map in_specs", "args")
    gspecs = (None,) * len(args) if in_grad_specs is None else _arg_specs(in_grad_specs, args, "local_map in_grad_specs")
    _, _, gspecs, _ = _match(gspecs, args, "local_map in_grad_specs", "args")
    if not any(isinstance(v, ShardedArray) for v in leaves) and all(s is None for s in specs):
        return f(*args, **kwargs)
    mesh = _mesh_for(mesh, leaves, "local_map")
    columns = [
        _local_inputs(p, v, s, g, mesh, redistribute) for p, v, s, g in zip(paths, leaves, specs, gspecs)
    ]
    devices = B.my_devices(mesh)
    outs = []
    with mesh:
        for i in range(len(devices)):
            outs.append(f(*optree.tree_unflatten(treespec, [col[i] for col in columns]), **kwargs))
    uneven = any(isinstance(v, ShardedArray) and not is_even(v._layout, tuple(v.shape)) for v in leaves)
    return _local_outputs(outs, out_specs, mesh, first_only=in_grad_specs is None, exchange=uneven)


def _local_inputs(path: str, v: Any, spec: Any, gspec: Any, mesh: Mesh, redistribute: bool) -> list:
    n = len(B.my_devices(mesh))
    if not isinstance(v, torch.Tensor) or (spec is None and not isinstance(v, ShardedArray)):
        return [v] * n
    where = f"local_map in_specs for {path}"
    if not isinstance(v, ShardedArray):
        v = distribute(v, _layout(spec, v.dim(), mesh, where))
    elif spec is not None:
        want = _layout(spec, v.ndim, mesh, where)
        if want != v._layout:
            if not redistribute:
                raise ShardingError(
                    f"{where}: the argument is laid out as {v.spec!r} but in_specs asks for "
                    f"{layout_to_spec(want)!r}; pass redistribute_inputs=True or reshard it first"
                )
            v = reshard(v, want)
    grad = (
        B.summed_grad_layout(v._layout) if gspec is None
        else _layout(gspec, v.ndim, mesh, f"local_map in_grad_specs for {path}")
    )
    return list(B.EnterParts.apply(v, grad, False))


def _local_outputs(outs: list, out_specs: Any, mesh: Mesh, first_only: bool, exchange: bool) -> Any:
    flats = [optree.tree_flatten(o, none_is_leaf=True) for o in outs]
    treespec = flats[0][1]
    out_tree = optree.tree_unflatten(treespec, list(range(treespec.num_leaves)))
    paths, idx, specs, _ = _match(out_specs, out_tree, "local_map out_specs", "output")
    results = []
    for p, i, s in zip(paths, idx, specs):
        column = [flat[i] for flat, _ in flats]
        if s is None or not isinstance(column[0], torch.Tensor):
            results.append(backend_for(mesh).pack_local(column, mesh) if isinstance(column[0], torch.Tensor) else column[0])
            continue
        layout = _layout(s, column[0].dim(), mesh, f"local_map out_specs for {p}")
        results.append(B.ExitParts.apply(layout, _global_shape(p, column, layout, exchange), first_only, *column))
    return optree.tree_unflatten(treespec, results)


# -- with_sharding_constraint ---------------------------------------------------------------------------


def with_sharding_constraint(x: Any, sharding: Any) -> Any:
    """Lay ``x`` out as ``sharding`` (free when it already is); the gradient flowing
    back through this point is constrained to the same layout.

    ``x`` may be a pytree and ``sharding`` a prefix of it (a NamedSharding, a P or a
    placements tuple per leaf). Plain tensors are distributed.

    Example::

        h = sf.with_sharding_constraint(h, P('dp', None))
    """
    from ..lax import _in_shard_map

    if _in_shard_map():
        raise ShardingError(
            "with_sharding_constraint inside a shard_map body: the body sees per-device local "
            "tensors; constrain the arguments or results of the shard_map instead"
        )
    paths, leaves, specs, treespec = _match(sharding, x, "with_sharding_constraint sharding", "x")
    if len(leaves) > 1:
        leaves = _coalesced_moves(leaves, specs)
    out = [_constrain(p, v, s) for p, v, s in zip(paths, leaves, specs)]
    return optree.tree_unflatten(treespec, out)


def _coalesced_moves(leaves: list, specs: list) -> list:
    """Leaves moved towards their shardings together (one collective per shared plan
    step and bucket); the per-leaf constraint that follows is then free."""
    from ..coalesce import reshard_tree

    pick = [i for i, (v, s) in enumerate(zip(leaves, specs)) if isinstance(v, ShardedArray) and s is not None]
    try:
        moved = reshard_tree([leaves[i] for i in pick], [specs[i] for i in pick])
    except ShardingError:
        return leaves  # the per-leaf pass reports the offending leaf by path
    out = list(leaves)
    for i, v in zip(pick, moved):
        out[i] = v
    return out


def _constrain(path: str, v: Any, sharding: Sharding | None) -> Any:
    if sharding is None or not isinstance(v, torch.Tensor):
        return v
    where = f"with_sharding_constraint for {path}"
    if not isinstance(v, ShardedArray):
        try:
            return distribute(v, sharding)
        except ShardingError as e:
            raise ShardingError(f"{where}: {e}") from None
    dst = _layout(sharding, v.ndim, v.mesh, where)
    return B.Constrain.apply(v, dst)
