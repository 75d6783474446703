"""Coalesced resharding of a pytree: leaves whose plans are the same all_reduces move
together, one collective per step and size bucket (flatten, concatenate, run, split),
as DDP buckets gradients (~25 MB). It works on backend values through the backend
protocol (``shard_list``/``from_shards``), so it runs on either backend, and is an
autograd Function; every other leaf is resharded on its own."""

from __future__ import annotations

import math
from typing import Any

import optree
import torch

from .array import ShardedArray, reshard
from .layout import Layout, is_even
from .plan import plan_layouts
from .spec import to_layout

BUCKET_BYTES = 25 * 2**20
"""Largest coalesced buffer (bytes): DDP's default bucket size."""

_LINEAR = ("sum", "avg")


def reshard_tree(tree: Any, shardings: Any) -> Any:
    """``tree`` with every leaf laid out as its sharding (``shardings``: a matching tree or
    a prefix of it); same-plan all_reduces of many leaves run as one per bucket."""
    with torch._C.DisableTorchFunctionSubclass():  # metadata reads below skip __torch_function__
        return _reshard_tree(tree, shardings)


def _leaves_and_specs(tree: Any, shardings: Any) -> tuple[list, list, Any]:
    """(leaves, one sharding per leaf, treespec); ``transforms._match`` for the error."""
    from .transforms import _is_spec, _match

    try:
        full = optree.tree_broadcast_prefix(shardings, tree, is_leaf=_is_spec, none_is_leaf=True)
    except ValueError:
        _match(shardings, tree, "reshard shardings", "tree")  # raises the ShardingError
        raise
    specs = optree.tree_leaves(full, is_leaf=_is_spec, none_is_leaf=True)
    leaves, treespec = optree.tree_flatten(tree, none_is_leaf=True)
    return leaves, specs, treespec


def _reshard_tree(tree: Any, shardings: Any) -> Any:
    leaves, specs, treespec = _leaves_and_specs(tree, shardings)
    out = list(leaves)
    groups: dict[tuple, list[tuple[int, Layout]]] = {}
    # many leaves share a spec, a layout and a dtype: normalise and classify each once
    layouts: dict[tuple, Layout] = {}
    keys: dict[tuple, list | bool] = {}
    for i, (v, s) in enumerate(zip(leaves, specs)):
        if s is None or not isinstance(v, torch.Tensor):
            continue
        if not isinstance(v, ShardedArray):
            out[i] = reshard(v, s)
            continue
        src, ndim = v._layout, v.ndim
        try:
            dst = layouts.get((s, ndim, src.mesh))
        except TypeError:  # an unhashable sharding spelling
            dst = None
        if dst is None:
            dst = to_layout(s, ndim, src.mesh)
            try:
                layouts[(s, ndim, src.mesh)] = dst
            except TypeError:
                pass
        whole = not any(src.dims)  # the group then depends on layouts and dtype only
        kk = (src, dst, v.dtype)
        members = keys.get(kk) if whole else None
        if members is None:
            key = _group_key(v, dst)
            # (a key holds the mesh, whose hash is slow: hash it once per layout pair)
            members = False if key is None else groups.setdefault(key, [])
            if whole:
                keys[kk] = members
        if members is False:
            out[i] = reshard(v, s)
        else:
            members.append((i, dst))
    for key, members in groups.items():
        for bucket in _buckets(members, leaves):
            _move_bucket(bucket, leaves, out, Layout(key[0], (key[4],), key[3]))
    return optree.tree_unflatten(treespec, out)


def _group_key(v: ShardedArray, dst: Layout) -> tuple | None:
    """Leaves with equal keys move as one flat buffer: pending sums resolved with the dims
    unchanged. Whole-dim leaves make a true 1-D value (any plan); leaves with sharded
    dims only when their plan is all_reduces (elementwise on equal-sized even shards)."""
    src = v._layout
    if dst == src or src.dims != dst.dims or not src.partial:
        return None
    if any(op not in _LINEAR for _, op in src.partial) or not set(dst.partial) <= set(src.partial):
        return None
    if any(src.dims):
        if not is_even(src, tuple(v.shape)):
            return None
        plan = plan_layouts(src, dst, tuple(v.shape), v.dtype)
        if any(s.kind != "all_reduce" for s in plan.steps):
            return None
    axes = tuple(a for a in v.mesh.axis_names if a in src.axis_dim)
    return (v.mesh, v.dtype, src.partial, dst.partial, axes)


def _buckets(members: list, leaves: list) -> list[list]:
    """Members in order, cut into buckets of at most BUCKET_BYTES (a larger leaf alone)."""
    out: list[list] = [[]]
    size = 0
    for i, dst in members:
        n = leaves[i].numel() * leaves[i].element_size()
        if out[-1] and size + n > BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append((i, dst))
        size += n
    return [b for b in out if b]


def _move_bucket(bucket: list, leaves: list, out: list, flat_dst: Layout) -> None:
    if len(bucket) == 1:
        i, dst = bucket[0]
        out[i] = reshard(leaves[i], dst)
        return
    xs = [leaves[i] for i, _ in bucket]
    dsts = tuple(dst for _, dst in bucket)
    if torch.is_grad_enabled() and any(x.requires_grad for x in xs):
        moved = _Coalesced.apply(flat_dst, dsts, *xs)
    else:  # nothing to differentiate (a gradient sync): skip the autograd node
        moved = _Coalesced.forward(flat_dst, dsts, *xs)
    for (i, _), v in zip(bucket, moved):
        out[i] = v


class _Coalesced(torch.autograd.Function):
    """Reshard leaves of whole dims with one plan on the concatenation of each device's
    flattened shards (backend values, no per-leaf dispatch); the backward reshards each
    gradient back like ``reshard``'s."""

    @staticmethod
    def forward(flat_dst: Layout, dsts: tuple, *xs: ShardedArray) -> tuple:
        from .backends import backend_for, execute

        mesh = flat_dst.mesh
        backend = backend_for(mesh)
        per_leaf = [backend.shard_list(x._local, mesh) for x in xs]
        shapes = [tuple(p[0].shape) for p in per_leaf]  # local shapes: even (or whole) leaves
        sizes = [p[0].numel() for p in per_leaf]
        # the flat buffer varies over the axes the leaves shard (its "global" value is each
        # device's concatenation side by side); the plan's all_reduces are elementwise
        flat_src = Layout(mesh, flat_dst.dims, xs[0]._layout.partial)
        flat = [torch.cat([p[d].reshape(-1) for p in per_leaf]) for d in range(len(per_leaf[0]))]
        total = (sum(sizes) * math.prod(mesh.axis_size(a) for a in flat_dst.dims[0]),)
        value = backend.from_shards(flat, flat_src, total)
        value = execute(plan_layouts(flat_src, flat_dst, total, xs[0].dtype), value)
        moved = [t.split(sizes) for t in backend.shard_list(value, mesh)]
        out = []
        for k, (x, dst, shape) in enumerate(zip(xs, dsts, shapes)):
            parts = [m[k].view(shape) for m in moved]
            value = backend.from_shards(parts, dst, tuple(x.shape))
            # a leaf of whole dims: its shards have the global shape, so their strides too
            stride = parts[0].stride() if not any(dst.dims) else None
            out.append(ShardedArray(value, dst, x.shape, x.dtype, stride=stride))
        return tuple(out)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.srcs = [x._layout for x in inputs[2:]]
        ctx.dsts = inputs[1]

    @staticmethod
    def backward(ctx: Any, *gs: Any) -> tuple:
        from .array import _as_sharded

        back = tuple(None if g is None else reshard(_as_sharded(g, dst), src.without_partial())
                     for g, src, dst in zip(gs, ctx.srcs, ctx.dsts))
        return (None, None, *back)
