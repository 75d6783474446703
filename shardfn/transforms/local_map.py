"""``local_map`` (DTensor's): run a function of local tensors on each device's shards of
its ShardedArray arguments, and lay its outputs out as out_specs say."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import optree
import torch

from ..arrays.functorch import layout_of, static_int
from ..arrays.redistribute import distribute, reshard
from ..backends.registry import backend_for
from ..values.errors import ShardingError, ShardingTypeError
from ..values.graph_calls import graph_call
from ..values.layout import is_even
from ..values.mesh import Mesh, to_mesh_device
from ..values.spec import layout_to_spec
from . import boundary as B
from .shard_map.io import _global_shape
from .specs import _arg_specs, _layout, _match, _match_columns, _mesh_for


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
    if not callable(f):
        raise ShardingTypeError(f"local_map: f={f!r} ({type(f).__name__}) is not callable; pass the function "
                                f"to run on the local shards, e.g. sf.local_map(fn, out_specs=P('x'))")

    @functools.wraps(f)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        return _local_map(f, out_specs, in_specs, in_grad_specs, mesh, redistribute_inputs, args, kwargs)

    return graph_call(mapped, "local_map", f, (out_specs, in_specs, in_grad_specs, mesh, redistribute_inputs))


def _local_map(f: Callable, out_specs: Any, in_specs: Any, in_grad_specs: Any, mesh: Mesh | None,
               redistribute: bool, args: tuple, kwargs: dict) -> Any:
    specs = _arg_specs(in_specs, args, "local_map in_specs") if in_specs is not None else (None,) * len(args)
    paths, leaves, specs, treespec = _match(specs, args, "local_map in_specs", "args")
    gspecs = (None,) * len(args) if in_grad_specs is None else _arg_specs(in_grad_specs, args, "local_map in_grad_specs")
    _, _, gspecs, _ = _match(gspecs, args, "local_map in_grad_specs", "args")
    # (an array under torch.func wrappers, a vmap / grad of the local_map, is read at its level)
    layouts = [layout_of(v) if isinstance(v, torch.Tensor) else None for v in leaves]
    if all(l is None for l in layouts) and all(s is None for s in specs):
        return f(*args, **kwargs)
    mesh = _mesh_for(mesh, leaves, "local_map", paths)
    columns = [
        _local_inputs(p, v, l, s, g, mesh, redistribute)
        for p, v, l, s, g in zip(paths, leaves, layouts, specs, gspecs)
    ]
    devices = B.my_devices(mesh)
    outs = []
    with mesh:
        for i in range(len(devices)):
            outs.append(f(*optree.tree_unflatten(treespec, [col[i] for col in columns]), **kwargs))
    # (a dynamic size is specialised: shard shapes decide the body's layout, as in shard_map)
    uneven = any(l is not None and not is_even(l, tuple(static_int(n) for n in v.shape))
                 for v, l in zip(leaves, layouts))
    return _local_outputs(outs, out_specs, mesh, first_only=in_grad_specs is None, exchange=uneven)


def _local_inputs(path: str, v: Any, layout: Any, spec: Any, gspec: Any, mesh: Mesh, redistribute: bool) -> list:
    """Argument ``v``'s value on each device (``layout``: its own, None for a plain tensor)."""
    n = len(B.my_devices(mesh))
    if not isinstance(v, torch.Tensor) or (spec is None and layout is None):
        return [v] * n
    where = f"local_map in_specs for {path}"
    if layout is None:
        layout = _layout(spec, v.dim(), mesh, where)
        v = distribute(v, layout)
    elif spec is not None:
        want = _layout(spec, v.ndim, mesh, where)
        if want != layout:
            if not redistribute:
                raise ShardingError(
                    f"{where}: the argument is laid out as {layout_to_spec(layout)!r} but in_specs asks for "
                    f"{layout_to_spec(want)!r}; pass redistribute_inputs=True or reshard it first"
                )
            v, layout = reshard(v, want), want
    grad = (
        B.summed_grad_layout(layout) if gspec is None
        else _layout(gspec, v.ndim, mesh, f"local_map in_grad_specs for {path}")
    )
    return list(B.EnterParts.apply(v, grad, False))


def _local_outputs(outs: list, out_specs: Any, mesh: Mesh, first_only: bool, exchange: bool) -> Any:
    treespec, columns = _match_columns(outs, out_specs, "local_map out_specs")
    results = []
    for p, column, s in columns:
        if s is None or not isinstance(column[0], torch.Tensor):
            results.append(backend_for(mesh).pack_local(column, mesh) if isinstance(column[0], torch.Tensor) else column[0])
            continue
        layout = _layout(s, column[0].dim(), mesh, f"local_map out_specs for {p}")
        column = [to_mesh_device(o, mesh) for o in column]  # the mesh owns the device: a body's new tensors move there
        results.append(B.ExitParts.apply(layout, _global_shape(p, column, layout, exchange), first_only, *column))
    return optree.tree_unflatten(treespec, results)
