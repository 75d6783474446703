"""``sf.smap``: shard_map over one mesh axis, with vmap-style ``in_axes``/``out_axes``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import optree
import torch

from ..values.errors import ShardingError, ShardingTypeError
from ..values.mesh import Mesh
from ..values.spec import P
from .shard_map.api import shard_map

__all__ = ["smap"]


def smap(f: Callable | None = None, *, in_axes: Any = 0, out_axes: Any = 0, axis_name: str,
         mesh: Mesh | None = None) -> Callable:
    """``shard_map`` manual over the single mesh axis ``axis_name`` (JAX's ``smap``).

    Each positional argument is split over ``axis_name`` along dim ``in_axes`` (an int,
    ``None`` for replicated, or a pytree prefix of those, one entry per argument);
    outputs are concatenated along ``out_axes`` (same forms; ``None``: the output is
    replicated over the axis). Over the mesh's other axes the body sees whole values.

    Without ``f`` it returns a decorator. Example::

        y = sf.smap(lambda a: a * sf.lax.axis_index('x'), axis_name='x', mesh=mesh)(x)
    """
    if f is None:  # as a decorator: @sf.smap(axis_name='x', ...)
        return functools.partial(smap, in_axes=in_axes, out_axes=out_axes, axis_name=axis_name, mesh=mesh)
    if not callable(f):
        raise ShardingTypeError(f"sf.smap: f={f!r} ({type(f).__name__}) is not callable; pass the function to map")
    if not isinstance(axis_name, str):  # a TypeError in JAX too
        raise ShardingTypeError(f"sf.smap: axis_name must be one mesh axis name (a str), got {axis_name!r}")

    @functools.wraps(f)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        in_specs = _in_specs(in_axes, args, axis_name)
        out_specs = optree.tree_map(lambda a: _spec(a, None, axis_name, "out_axes"), out_axes, none_is_leaf=True)
        return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={axis_name})(*args, **kwargs)

    return mapped


def _in_specs(in_axes: Any, args: tuple, axis_name: str) -> tuple:
    prefix = tuple(in_axes for _ in args) if not isinstance(in_axes, (tuple, list)) else tuple(in_axes)
    if len(prefix) != len(args):
        raise ShardingError(
            f"sf.smap in_axes {in_axes!r} has {len(prefix)} entries but the function was called with "
            f"{len(args)} positional arguments; give one per argument (or a single int/None)"
        )
    try:
        full = optree.tree_broadcast_prefix(prefix, args, none_is_leaf=True)
    except ValueError as e:
        raise ShardingError(f"sf.smap in_axes {in_axes!r} is not a prefix of the arguments: {e}") from None
    specs = optree.tree_map(lambda a, v: _spec(a, v, axis_name, "in_axes"), full, args, none_is_leaf=True)
    return tuple(specs)


def _spec(a: Any, v: Any, axis_name: str, what: str) -> P | None:
    if a is None:
        return P() if v is None or isinstance(v, torch.Tensor) else None
    if not isinstance(a, int) or isinstance(a, bool):
        raise ShardingTypeError(f"sf.smap {what} entries must be ints or None, got {a!r}")
    if v is not None and not isinstance(v, torch.Tensor):
        return None
    if a < 0:
        if v is None:
            raise ShardingError(f"sf.smap {what}={a}: negative out_axes are not supported; count dims from 0")
        if a < -v.dim():
            raise ShardingError(f"sf.smap {what}={a} is out of range for an argument of rank {v.dim()}")
        a += v.dim()
    if v is not None and a >= v.dim():
        raise ShardingError(f"sf.smap {what}={a} is out of range for an argument of rank {v.dim()}")
    return P(*([None] * a), axis_name)
