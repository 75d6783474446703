"""``with_sharding_constraint``: lay a value (or a pytree of them) out as given, and
constrain the gradient flowing back through that point to the same layout."""

from __future__ import annotations

from typing import Any

import optree
import torch

from ..arrays.array import ShardedArray
from ..arrays.redistribute import distribute
from ..values.errors import ShardingError
from ..values.spec import Sharding
from . import boundary as B
from .coalesce import reshard_tree
from .lax import _in_shard_map
from .specs import _layout, _match


def with_sharding_constraint(x: Any, sharding: Any) -> Any:
    """Lay ``x`` out as ``sharding`` (free when it already is); the gradient flowing
    back through this point is constrained to the same layout.

    ``x`` may be a pytree and ``sharding`` a prefix of it (a NamedSharding, a P or a
    placements tuple per leaf). Plain tensors are distributed.

    Example::

        h = sf.with_sharding_constraint(h, P('dp', None))
    """
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
