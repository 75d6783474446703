"""Spec trees: a prefix tree of shardings matched against the leaves of arguments or
outputs, as shard_map, local_map, with_sharding_constraint and sf.reshard take them."""

from __future__ import annotations

from typing import Any

import optree
import torch

from ..arrays.array import ShardedArray
from ..arrays.functorch import base_array
from ..values.errors import ShardingError
from ..values.layout import Layout
from ..values.mesh import Mesh, current_mesh
from ..values.spec import NamedSharding, P, _is_placements, check_mesh, to_layout


def _is_spec(s: Any) -> bool:
    return s is None or isinstance(s, (P, NamedSharding, Layout)) or _is_placements(s)


def _path_str(root: str, path: tuple) -> str:
    return root + "".join(f"[{k!r}]" for k in path)


def _match(specs: Any, tree: Any, what: str, root: str) -> tuple[list, list, list, Any]:
    """Broadcast the spec prefix tree over ``tree``: (paths, leaves, specs, treespec)."""
    try:
        full = optree.tree_broadcast_prefix(specs, tree, is_leaf=_is_spec, none_is_leaf=True)
    except ValueError:
        path, sub_specs, sub_tree = _first_mismatch(specs, tree)
        where = "".join(f"[{k!r}]" for k in path)
        raise ShardingError(
            f"{what}{where} is {sub_specs!r} but {root}{where} has the structure "
            f"{optree.tree_structure(sub_tree, none_is_leaf=True)}: {what} must be a tree prefix of {root} "
            f"(one spec per leaf, or one spec for a whole subtree)"
        ) from None
    flat_specs = optree.tree_leaves(full, is_leaf=_is_spec, none_is_leaf=True)
    paths, leaves, treespec = optree.tree_flatten_with_path(tree, none_is_leaf=True)
    return [_path_str(root, p) for p in paths], leaves, flat_specs, treespec


def _first_mismatch(specs: Any, tree: Any, path: tuple = ()) -> tuple[tuple, Any, Any]:
    """Where the spec tree ``specs`` stops being a prefix of ``tree``: (path, specs, subtree)."""
    s = optree.tree_flatten_one_level(specs, is_leaf=_is_spec, none_is_leaf=True)
    is_node = optree.tree_structure(tree, none_is_leaf=True).num_nodes > 1
    t = optree.tree_flatten_one_level(tree, none_is_leaf=True) if is_node else None
    if t is None or type(specs) is not type(tree) or s.entries != t.entries:
        return path, specs, tree
    for key, sc, tc in zip(s.entries, s.children, t.children):
        if not _is_spec(sc):
            try:
                optree.tree_broadcast_prefix(sc, tc, is_leaf=_is_spec, none_is_leaf=True)
            except ValueError:
                return _first_mismatch(sc, tc, (*path, key))
    return path, specs, tree


def _match_columns(outs: list, out_specs: Any, what: str) -> tuple[Any, list[tuple[str, list, Any]]]:
    """``out_specs`` matched to the outputs of several bodies (one per device or run, each
    the same structure): their treespec and, per leaf, (path, every body's leaf, spec)."""
    flats = [optree.tree_flatten(o, none_is_leaf=True) for o in outs]
    treespec = flats[0][1]
    if any(t != treespec for _, t in flats):
        raise ShardingError(
            f"{what.split()[0]} devices returned differently structured outputs: {[t for _, t in flats]}"
        )
    out_tree = optree.tree_unflatten(treespec, list(range(treespec.num_leaves)))
    paths, idx, specs, _ = _match(out_specs, out_tree, what, "output")
    return treespec, [(p, [flat[i] for flat, _ in flats], s) for p, i, s in zip(paths, idx, specs)]


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


def _mesh_for(mesh: Mesh | None, leaves: list, fn: str, paths: list[str] | None = None) -> Mesh:
    """The mesh a transform runs on: ``mesh=``, else the first ShardedArray argument's, else
    the current one; every ShardedArray argument must live on it."""
    paths = paths if paths is not None else [f"argument {i}" for i in range(len(leaves))]
    # a ShardedArray under torch.func wrappers (vmap of the transform) counts
    bases = [v if isinstance(v, ShardedArray) else base_array(v) if isinstance(v, torch.Tensor) else None for v in leaves]
    arrays = [(p, v) for p, v in zip(paths, bases) if isinstance(v, ShardedArray)]
    if mesh is not None:
        check_mesh(mesh, f"{fn}(mesh=...)")
    given = mesh is not None
    if mesh is None:
        mesh = arrays[0][1].mesh if arrays else current_mesh()
    if mesh is None:
        raise ShardingError(f"{fn} needs a mesh: pass mesh=, pass ShardedArray arguments, or enter `with mesh:`")
    for p, v in arrays:
        if v.mesh != mesh:
            source = "mesh=" if given else f"{arrays[0][0]}'s mesh"
            raise ShardingError(
                f"{fn}: {p} lives on {v.mesh!r} but the transform runs on {mesh!r} ({source}); "
                f"move it first (sf.distribute(sf.gather(x), spec, mesh=...)) or run on its mesh"
            )
    return mesh
