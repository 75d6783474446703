"""Coalesced resharding of a pytree: leaves whose plans are the same all_reduces move
together, one collective per step and size bucket (flatten, concatenate, run, split),
as DDP buckets gradients (~25 MB). It works on backend values through the backend
protocol (``shard_list``/``from_shards``), so it runs on either backend, and is an
autograd Function; every other leaf is resharded on its own.

What to do with a tree (which leaves move alone, the buckets, their flat layouts, the
outputs' layouts, shapes and key fragments) is a :class:`_TreePlan`, cached on the
tree's structure, each array leaf's interned (layout, shape, dtype) fragment, the kind
of every other leaf, the shardings and the bucket size; a warm call is a flatten, one
lookup, then per bucket one concatenation, the plan's collectives, one split and a
lean wrap of the outputs."""

from __future__ import annotations

import math
from typing import Any

import optree
import torch

from ..arrays import redistribute as _redistribute
from ..arrays.array import _BATCHED_NDIM, ARRAY_TYPES, ShardedArray, _BatchedArray, _make_wrapper, check_partial_dtype
from ..arrays.redistribute import reshard
from ..arrays.fragments import fragment_of
from ..arrays.fresh import end_fresh
from ..values.layout import Layout, is_even
from ..plans.planner import PLAN_CACHES, plan_layouts
from ..values.spec import to_layout
from .specs import _is_spec, _match

BUCKET_BYTES = 25 * 2**20
"""Largest coalesced buffer (bytes): DDP's default bucket size."""

_LINEAR = ("sum", "avg")
_PLANS_MAX = 256
_plans: dict[tuple, _TreePlan] = {}
PLAN_CACHES.append(_plans.clear)  # a new cost model may change which leaves group
_TENSOR, _OTHER = object(), object()  # key parts of plain-tensor and non-tensor leaves
_flatten = torch._C._nn.flatten_dense_tensors  # one contiguous 1-D buffer, in C++
_unflatten = torch._C._nn.unflatten_dense_tensors  # views of it shaped like the given tensors


def reshard_tree(tree: Any, shardings: Any) -> Any:
    """``tree`` with every leaf laid out as its sharding (``shardings``: a matching tree or
    a prefix of it); same-plan all_reduces of many leaves run as one per bucket."""
    with torch._C.DisableTorchFunctionSubclass():  # metadata reads below skip __torch_function__
        leaves, treespec = optree.tree_flatten(tree, none_is_leaf=True)
        key = _tree_key(treespec, leaves, shardings)
        try:
            plan = _plans.get(key) if key is not None else None
        except TypeError:  # an unhashable sharding spelling
            plan = key = None
        if plan is None:
            plan = _TreePlan(leaves, _specs(tree, shardings))
            if key is not None:
                if len(_plans) >= _PLANS_MAX:
                    _plans.clear()
                _plans[key] = plan
        for v in leaves:
            end_fresh(v)  # each array's value is read (``arrays/fresh.py``): a leaf may come back as itself
        return optree.tree_unflatten(treespec, plan.run(leaves))


def _tree_key(treespec: Any, leaves: list, shardings: Any) -> tuple | None:
    """What a tree plan depends on (None: not cacheable, e.g. symbolic shapes): the
    structure, each array leaf's fragment (others: tensor or not), the shardings (with
    their types: a tuple and a P may compare equal) and the bucket size."""
    parts = [v._kf if type(v) in ARRAY_TYPES and v._kf is not None else _leaf_part(v) for v in leaves]
    if None in parts:
        return None
    if _is_spec(shardings):
        specs: Any = (type(shardings), shardings)
    else:
        flat, spec_tree = optree.tree_flatten(shardings, is_leaf=_is_spec, none_is_leaf=True)
        specs = (spec_tree, tuple([(type(s), s) for s in flat]))
    return (treespec, specs, BUCKET_BYTES, *parts)


def _leaf_part(v: Any) -> Any:
    """A leaf's part of the tree key: an array's interned (layout, shape, dtype) fragment
    (None while its shape is symbolic; not kept on the array, which dispatch does only for
    canonical storage), else whether it is a tensor."""
    if isinstance(v, ShardedArray):
        try:
            return fragment_of(v._layout, tuple(v.shape), v.dtype)
        except TypeError:  # SymInts do not hash
            return None
    return _TENSOR if isinstance(v, torch.Tensor) else _OTHER


def _specs(tree: Any, shardings: Any) -> list:
    """One sharding per leaf of ``tree``; ``specs._match`` raises the error."""
    try:
        full = optree.tree_broadcast_prefix(shardings, tree, is_leaf=_is_spec, none_is_leaf=True)
    except ValueError:
        _match(shardings, tree, "reshard shardings", "tree")  # raises the ShardingError
        raise
    return optree.tree_leaves(full, is_leaf=_is_spec, none_is_leaf=True)


class _TreePlan:
    """How one kind of tree moves: leaves resharded alone (in leaf order), then the
    buckets, each a :class:`_Bucket` of leaves moving as one flat buffer."""

    __slots__ = ("alone", "buckets")

    def __init__(self, leaves: list, specs: list) -> None:
        self.alone: list[tuple[int, Any]] = []
        groups: dict[tuple, list[tuple[int, Layout]]] = {}
        layouts: dict[tuple, Layout] = {}  # many leaves share a spec: normalise each once
        for i, (v, s) in enumerate(zip(leaves, specs)):
            if s is None or not isinstance(v, torch.Tensor):
                continue
            if not isinstance(v, ShardedArray):
                self.alone.append((i, s))
                continue
            src = v._layout
            try:
                dst = layouts.get((s, v.ndim, src.mesh))
            except TypeError:  # an unhashable sharding spelling
                dst = None
            if dst is None:
                dst = to_layout(s, v.ndim, src.mesh)
                try:
                    layouts[(s, v.ndim, src.mesh)] = dst
                except TypeError:
                    pass
            key = _group_key(v, dst)
            if key is None:
                self.alone.append((i, s))
            else:
                groups.setdefault(key, []).append((i, dst))
        self.buckets = []
        for key, members in groups.items():
            flat_dst = Layout(key[0], (key[4],), key[3])
            for bucket in _buckets(members, leaves):
                if len(bucket) == 1:
                    self.alone.append(bucket[0])
                else:
                    self.buckets.append(_Bucket(bucket, leaves, flat_dst))
        self.alone.sort(key=lambda e: e[0])

    def run(self, leaves: list) -> list:
        """The moved leaves: the lone ones first (leaf order), then bucket by bucket (the
        same order of collectives on every rank)."""
        out = list(leaves)
        for i, s in self.alone:
            out[i] = reshard(leaves[i], s)
        grad = torch.is_grad_enabled()
        for b in self.buckets:
            xs = [leaves[i] for i in b.idx]
            if grad and any(x.requires_grad for x in xs):
                moved = _Coalesced.apply(b, *xs)
            else:  # nothing to differentiate (a gradient sync): skip the autograd node
                moved = b.move(xs)
            if b.whole:
                out = list(moved)
            else:
                for i, v in zip(b.idx, moved):
                    out[i] = v
        return out


def _group_key(v: ShardedArray, dst: Layout) -> tuple | None:
    """Leaves with equal keys move as one flat buffer: pending sums resolved with the dims
    unchanged. Whole-dim leaves make a true 1-D value (any plan); leaves with sharded
    dims only when their plan is all_reduces (elementwise on equal-sized even shards)."""
    src = v._layout
    if dst == src or src.dims != dst.dims or not src.partial or not v.is_contiguous():
        return None  # (a bucket's outputs are contiguous; a strided leaf keeps its strides alone)
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


class _Bucket:
    """Leaves of one group moving as one flat buffer: their positions, the flat buffer's
    layouts and global shape, and each output's layout, global shape and key fragment.
    ``held1``: the backend holds one device, whose shard is the backend value itself
    (dist), so the locals are concatenated and split directly, without ``shard_list`` /
    ``from_shards`` per leaf. ``stored``: the backend stores each leaf as one tensor whose
    leading dims (the local backend's mesh dims) are the same for every leaf, so the bucket
    is one concatenation of the stored tensors along their last dim (one kernel, not one
    per device), the plan runs on it, and the leaves come back as views of one split (decided by
    the first move, from the storage it reads: None until then)."""

    __slots__ = ("idx", "whole", "mesh", "dtype", "device", "flat_src", "flat_dst", "total",
                 "srcs", "dsts", "shapes", "classes", "frags", "sizes", "local_shapes", "held1", "stored")

    def __init__(self, bucket: list, leaves: list, flat_dst: Layout) -> None:
        from ..backends.registry import backend_for

        xs = [leaves[i] for i, _ in bucket]
        x0 = xs[0]
        self.idx = tuple(i for i, _ in bucket)
        self.whole = self.idx == tuple(range(len(leaves)))  # the bucket is the whole tree
        self.mesh, self.dtype = flat_dst.mesh, x0.dtype
        self.device = x0.device
        # the flat buffer varies over the axes the leaves shard (its "global" value is each
        # device's concatenation side by side); the plan's all_reduces are elementwise
        self.flat_src = Layout(self.mesh, flat_dst.dims, x0._layout.partial)
        self.flat_dst = flat_dst
        self.srcs = tuple(x._layout for x in xs)
        self.dsts = tuple(dst for _, dst in bucket)
        self.shapes = tuple(tuple(x.shape) for x in xs)
        self.classes = tuple(ShardedArray if len(s) < _BATCHED_NDIM else _BatchedArray for s in self.shapes)
        for dst in self.dsts:
            if dst.partial:
                check_partial_dtype(dst, self.dtype)
        backend = backend_for(self.mesh)
        shards = [backend.shard_list(x._local, self.mesh)[0] for x in xs]  # even (or whole) leaves
        self.local_shapes = tuple(tuple(p.shape) for p in shards)
        self.sizes = [p.numel() for p in shards]
        self.total = (sum(self.sizes) * math.prod(self.mesh.axis_size(a) for a in flat_dst.dims[0]),)
        probe = shards[0]
        self.held1 = (len(backend.devices(self.mesh)) == 1 and backend.shard_list(x0._local, self.mesh)[0] is x0._local
                      and backend.from_shards([probe], self.dsts[0], self.shapes[0]) is probe)
        self.stored = False if self.held1 else None  # None: decided by the first move, from the storage it reads
        # outputs carry dispatch's key fragment where their storage is canonical (always
        # for a lone held shard, and for the stored form's outputs, which are the backend's
        # own storage form; the generic path leaves it to dispatch's first use)
        canonical = self.held1 and all(backend.is_canonical(probe, d) for d in set(self.dsts))
        self.frags = self._fragments(canonical)

    def _fragments(self, canonical: bool) -> tuple:
        """The outputs' key fragments where their storage is canonical, else None each."""
        return tuple(fragment_of(d, s, self.dtype) if canonical else None for d, s in zip(self.dsts, self.shapes))

    def move(self, xs: list) -> list:
        """The leaves ``xs`` (this bucket's, in order) moved: their new ShardedArrays."""
        from ..backends.registry import backend_for, execute, execute_many

        plan = plan_layouts(self.flat_src, self.flat_dst, self.total, self.dtype)
        if self.held1:
            locs = [x._local for x in xs]
            return self._wrap(_unflatten(execute(plan, _flatten(locs)), locs))
        backend = backend_for(self.mesh)
        stored = None if self.stored is False else self._stored(backend, xs)
        if stored is not None:
            apart = execute_many(plan, stored)  # the plan on each leaf's stored tensor, where the backend can
            if apart is not None:
                return self._wrap([backend.from_storage([t], dst, shape) for t, dst, shape
                                   in zip(apart, self.dsts, self.shapes)])
            k = stored[0].dim() - len(self.local_shapes[0])  # the leading (mesh) dims, the same for every leaf
            lead = tuple(stored[0].shape[:k])
            flat = torch.cat([t.reshape(*lead, -1) for t in stored], k)
            out = backend.storage(execute(plan, backend.from_storage([flat], self.flat_src, self.total)),
                                  self.flat_dst, self.total)[0]
            lead = tuple(out.shape[:-1])
            pieces = [backend.from_storage([t.view(*lead, *ls)], dst, shape) for t, ls, dst, shape
                      in zip(out.split(self.sizes, k), self.local_shapes, self.dsts, self.shapes)]
        else:
            per_leaf = [backend.shard_list(x._local, self.mesh) for x in xs]
            flat = [_flatten([p[d] for p in per_leaf]) for d in range(len(per_leaf[0]))]
            value = execute(plan, backend.from_shards(flat, self.flat_src, self.total))
            moved = [t.split(self.sizes) for t in backend.shard_list(value, self.mesh)]
            pieces = [backend.from_shards([m[k].view(ls) for m in moved], dst, shape)
                      for k, (ls, dst, shape) in enumerate(zip(self.local_shapes, self.dsts, self.shapes))]
        return self._wrap(pieces)

    def _stored(self, backend: Any, xs: list) -> list | None:
        """Each leaf's one stored tensor (the stored form), or None; the first move reads each
        leaf's storage once, decides ``stored`` from what it read and keeps the decision."""
        if self.stored:
            return [backend.storage(x._local, src, shape)[0] for x, src, shape in zip(xs, self.srcs, self.shapes)]
        forms = [backend.storage(x._local, src, shape) for x, src, shape in zip(xs, self.srcs, self.shapes)]
        self.stored = _stored_alike(forms, self.local_shapes)
        if not self.stored:
            return None
        self.frags = self._fragments(True)
        return [f[0] for f in forms]

    def _wrap(self, pieces: list) -> list:
        """Contiguous arrays of the moved backend values (metadata checked when the bucket
        was made; ``_BatchedArray`` from 3 dims, as ``array._wrap_output`` makes them);
        positional wrapper args parse fastest."""
        out = []
        dtype, device, strided = self.dtype, self.device, torch.strided
        for p, dst, shape, cls, frag in zip(pieces, self.dsts, self.shapes, self.classes, self.frags):
            r = _make_wrapper(cls, shape, None, None, None, dtype, strided, device)
            r._local = p
            r._layout = dst
            r._kf = frag
            out.append(r)
        return out


def _stored_alike(forms: list, local_shapes: tuple) -> bool:
    """Whether the leaves' storage ``forms`` (``backend.storage`` of each) are one tensor each,
    its local shape behind leading dims that are the same for every leaf (the local backend's
    canonical stacked values of even layouts over the same varying axes): the bucket's stored form."""
    leads = set()
    for stored, ls in zip(forms, local_shapes):
        if len(stored) != 1:
            return False
        t = stored[0]
        k = t.dim() - len(ls)
        if k < 0 or tuple(t.shape[k:]) != ls:
            return False
        leads.add(tuple(t.shape[:k]))
    return len(leads) == 1


class _Coalesced(torch.autograd.Function):
    """A bucket's move as one autograd node; the backward reshards each gradient back
    like ``reshard``'s."""

    @staticmethod
    def forward(bucket: _Bucket, *xs: ShardedArray) -> tuple:
        return tuple(bucket.move(list(xs)))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.bucket = inputs[0]

    @staticmethod
    def backward(ctx: Any, *gs: Any) -> tuple:
        from ..arrays.redistribute import _as_sharded

        b = ctx.bucket
        back = tuple(None if g is None else reshard(_as_sharded(g, dst), src.without_partial())
                     for g, src, dst in zip(gs, b.srcs, b.dsts))
        return (None, *back)


_redistribute._reshard_tree = reshard_tree  # sf.reshard of a pytree (arrays cannot import this layer)
