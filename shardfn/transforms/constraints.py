"""``with_sharding_constraint``: lay a value (or a pytree of them) out as given, and
constrain the gradient flowing back through that point to the same layout."""

from __future__ import annotations

from typing import Any

import optree
import torch

from ..arrays.array import ShardedArray
from ..arrays.functorch import base_array
from ..arrays.redistribute import distribute
from ..values.errors import ShardingError
from ..values.graph_calls import surfaces_in_compile
from ..values.spec import NamedSharding, P, Sharding
from . import boundary as B
from .coalesce import reshard_tree
from .lax import _bodies, _in_shard_map, _manual_stack
from .specs import _layout, _match


@surfaces_in_compile
def with_sharding_constraint(x: Any, sharding: Any) -> Any:
    """Lay ``x`` out as ``sharding`` (free when it already is); the gradient flowing
    back through this point is constrained to the same layout.

    ``x`` may be a pytree and ``sharding`` a prefix of it (a NamedSharding, a P or a
    placements tuple per leaf). Plain tensors are distributed.

    Example::

        h = sf.with_sharding_constraint(h, P('dp', None))
    """
    paths, leaves, specs, treespec = _match(sharding, x, "with_sharding_constraint sharding", "x")
    if _in_shard_map():
        out = [_constrain_in_body(p, v, s) for p, v, s in zip(paths, leaves, specs)]
        return optree.tree_unflatten(treespec, out)
    if len(leaves) > 1:
        leaves = _coalesced_moves(leaves, specs)
    out = [_constrain(p, v, s) for p, v, s in zip(paths, leaves, specs)]
    return optree.tree_unflatten(treespec, out)


def _constrain_in_body(path: str, v: Any, sharding: Any) -> Any:
    """A constraint inside a shard_map body: over its automatic axes only (``axis_names=``),
    where the body's values are ShardedArrays over those axes (whole values under torch.func,
    where the layout is not observable and the constraint is a no-op)."""
    body = _bodies()[-1]
    manual = _manual_stack()[-1] if _manual_stack() else frozenset(body.mesh.axis_names)
    auto = [a for a in body.mesh.axis_names if a not in manual]
    if sharding is None or not isinstance(v, torch.Tensor):
        return v
    if isinstance(sharding, NamedSharding):
        spec = sharding.spec
    elif isinstance(sharding, P):
        spec = sharding
    else:
        raise ShardingError(
            f"with_sharding_constraint for {path} inside a shard_map body: give a P or a NamedSharding "
            f"naming axes (placements are per mesh axis, and the body's mesh has only its automatic axes {auto!r})"
        )
    named = [a for e in (*spec, *spec.partial) if e is not None for a in ((e,) if isinstance(e, str) else e)]
    bad = [a for a in named if a in manual]
    if not auto or bad:
        what = f"names manual mesh axis {bad[0]!r}" if bad else "is inside a body manual over every mesh axis"
        raise ShardingError(
            f"with_sharding_constraint for {path} {what}: inside a shard_map body the manual axes "
            f"({sorted(manual)!r}) are per-device, so only automatic axes (axis_names= leaves out: {auto!r}) "
            f"can be constrained; constrain the arguments or results of the shard_map instead"
        )
    if not isinstance(v, ShardedArray) and base_array(v) is None:
        return v
    return _constrain(path, v, P(*spec, partial=spec.partial or None))


def _coalesced_moves(leaves: list, specs: list) -> list:
    """Leaves moved towards their shardings together (one collective per shared plan
    step and bucket); the per-leaf constraint that follows is then free."""
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
