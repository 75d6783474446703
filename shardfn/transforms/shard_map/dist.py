"""shard_map bodies on the dist backend: each rank runs the body on plain tensors.

Collectives are torch functional collectives on the per-axis process groups that
``backends/dist_groups.py`` creates (``_group_of`` is the hook). Each is an autograd Function
whose backward is its transpose over the group (psum <-> psum, all_gather <->
psum_scatter, all_to_all <-> all_to_all, ppermute <-> inverse ppermute); with the
boundary conventions of ``transforms/boundary.py`` this makes gradients those of the unsharded
computation. No tensor subclass is active in the body; one TorchFunctionMode
(:class:`_Closures`) finds the values the body closes over, whose gradients must be summed
over ranks (one Python call per op, plain torch otherwise). ``check_vma`` is inferred once
per signature by tracing the body on meta tensors with the local backend's vmap machinery.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
import torch.distributed._functional_collectives as funcol
from torch.overrides import TorchFunctionMode

from ...arrays.array import ShardedArray
from ...arrays.redistribute import into_layout
from ...arrays.functorch import base_array, is_wrapped
from ...values import replica_checks as _replicas
from ...values.errors import ShardingError
from ...values.layout import Layout
from ...values.mesh import Mesh
from .. import boundary as B
from ..lax import _entered
from ..specs import _match
from . import recompute as _recompute
from . import stacked as _stacked
from .io import assemble_parts
from .io import _subs

def _group_of(mesh: Mesh, axes: tuple[str, ...]) -> tuple[Any, list[int]]:
    """Hook into backends/dist_groups.py: the :class:`Group` over ``axes`` containing this rank,
    and ``order[i]``: the group-order position (row-major over ``axes`` in mesh order)
    of the member ranked ``i`` row-major over ``axes`` as given."""
    from ...backends.dist_groups import _state

    mesh_order = tuple(a for a in mesh.axis_names if a in axes)
    group = _state(mesh).groups[mesh_order]
    sizes = {a: mesh.axis_size(a) for a in axes}
    order = []
    for i in range(group.size):
        coord, rest = {}, i
        for a in reversed(axes):
            rest, coord[a] = divmod(rest, sizes[a])
        pos = 0
        for a in mesh_order:
            pos = pos * sizes[a] + coord[a]
        order.append(pos)
    return group, order


def _rank_in(mesh: Mesh, axes: tuple[str, ...]) -> int:
    from ...backends.dist_groups import rank_of

    c = mesh.coords(rank_of(mesh))
    r = 0
    for a in axes:
        r = r * mesh.axis_size(a) + c[mesh.axis_index(a)]
    return r


def _chunks_to(x: torch.Tensor, dim: int, order: list[int], inverse: bool = False) -> torch.Tensor:
    """Reorder the ``len(order)`` equal chunks of ``dim`` between given and mesh order."""
    if order == sorted(order):
        return x
    parts = x.chunk(len(order), dim)
    if inverse:  # mesh-order chunks -> given order
        return torch.cat([parts[order[i]] for i in range(len(order))], dim)
    out = [None] * len(order)
    for i, pos in enumerate(order):
        out[pos] = parts[i]
    return torch.cat(out, dim)


# -- raw collectives (no autograd), in given-axes order ------------------------------------------------
# Through the backend's collectives: any dtype (those the wire lacks move as bytes or reduce
# widened), lazy conj/neg flags applied, and a failure or timeout is a CollectiveError naming it.


def _all_reduce(x: torch.Tensor, mesh: Mesh, axes: tuple, op: str) -> torch.Tensor:
    from ...backends.dist_collectives import _native_reduce

    group, _ = _group_of(mesh, axes)
    return _native_reduce(x, op, group, None)


def _all_gather(x: torch.Tensor, mesh: Mesh, axes: tuple, dim: int) -> torch.Tensor:
    from ...backends.dist_collectives import _all_gather as gather

    group, order = _group_of(mesh, axes)
    return _chunks_to(gather(x, dim, group), dim, order, inverse=True)


def _reduce_scatter(x: torch.Tensor, mesh: Mesh, axes: tuple, dim: int) -> torch.Tensor:
    from ...backends.dist_collectives import _native_reduce

    group, order = _group_of(mesh, axes)
    return _native_reduce(_chunks_to(x, dim, order), "sum", group, dim)


def _all_to_all(x: torch.Tensor, mesh: Mesh, axes: tuple, split: int, concat: int) -> torch.Tensor:
    from ...backends.dist_collectives import _all_to_all as exchange

    group, order = _group_of(mesh, axes)
    g = len(order)
    send = _chunks_to(x, split, order).movedim(split, 0)
    splits = [send.numel() // g] * g
    recv = exchange(send.reshape(-1), splits, splits, group).view(send.shape).movedim(0, split)
    pieces = recv.chunk(g, split)
    return torch.cat([pieces[order[i]] for i in range(g)], concat)


def _ppermute(x: torch.Tensor, mesh: Mesh, axes: tuple, perm: tuple) -> torch.Tensor:
    from ...backends.dist_collectives import _from_bytes, _bytes, run_collective

    group, order = _group_of(mesh, axes)
    if len(perm) == len(order):  # a full permutation, in group (mesh-order) positions
        dst_of = [0] * len(order)
        for s, d in perm:
            dst_of[order[s]] = order[d]
        wire, _ = _bytes(x.reshape(-1))
        y = run_collective("ppermute", group, funcol.permute_tensor, wire, dst_of)
        return _from_bytes(y, x.dtype).view(x.shape)
    gathered = _all_gather(x.unsqueeze(0), mesh, axes, 0)  # a partial permutation
    src = {d: s for s, d in perm}
    me = _rank_in(mesh, axes)
    return gathered[src[me]] if me in src else torch.zeros_like(x)


_MAX_NDIM = 64  # torch's limit on a tensor's dims


def _group_shapes(x: torch.Tensor, mesh: Mesh, axes: tuple) -> list[tuple[int, ...]]:
    """Every group member's local shape of ``x`` (in the group's order), by one small
    all_gather: an uneven body's ranks hold blocks of different shapes, which a collective
    of the wrong sizes would hang or abort on."""
    enc = torch.full((1 + _MAX_NDIM,), -1, dtype=torch.int64, device=x.device)
    enc[0] = x.dim()
    enc[1:1 + x.dim()] = torch.tensor(tuple(x.shape), dtype=torch.int64)
    rows = _all_gather(enc, mesh, axes, 0).view(-1, 1 + _MAX_NDIM).tolist()
    return [tuple(r[1:1 + r[0]]) for r in rows]


def _gather_sized(x: torch.Tensor, mesh: Mesh, axes: tuple, dim: int, sizes: tuple) -> torch.Tensor:
    """all_gather of pieces whose lengths along ``dim`` are ``sizes`` (group order): each
    padded to the longest, gathered, cut back and concatenated."""
    top = max(sizes)
    pad = x.new_zeros(x.shape[:dim] + (top - x.shape[dim],) + x.shape[dim + 1:])
    full = _all_gather(torch.cat([x, pad], dim), mesh, axes, dim)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(full.split(top, dim), sizes)], dim)


def _slice_summed(x: torch.Tensor, mesh: Mesh, axes: tuple, dim: int, sizes: tuple) -> torch.Tensor:
    """The transpose of :func:`_gather_sized`: the group's sum, this member's piece of it."""
    me = _rank_in(mesh, axes)
    return _all_reduce(x, mesh, axes, "sum").narrow(dim, sum(sizes[:me]), sizes[me])


# -- differentiable collectives -------------------------------------------------------------------------------


class _Psum(torch.autograd.Function):
    """psum over ``axes``; its transpose is itself (backward and jvp reuse it, so any
    order of derivatives works)."""

    @staticmethod
    def forward(x: torch.Tensor, mesh: Mesh, axes: tuple) -> torch.Tensor:
        return _all_reduce(x, mesh, axes, "sum")

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.meta = inputs[1:]

    @staticmethod
    def backward(ctx: Any, ct: torch.Tensor) -> Any:
        return _Psum.apply(ct, *ctx.meta), None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, _: Any, __: Any) -> torch.Tensor:
        return _Psum.apply(t, *ctx.meta)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: torch.Tensor, mesh: Mesh, axes: tuple) -> tuple:
        return _Psum.apply(x, mesh, axes), in_dims[0]


class _Pextreme(torch.autograd.Function):
    """pmax / pmin; derivatives flow to the devices attaining the extreme, shared evenly."""

    @staticmethod
    def forward(x: torch.Tensor, mesh: Mesh, axes: tuple, op: str) -> torch.Tensor:
        return _all_reduce(x, mesh, axes, op)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        x, mesh, axes, _ = inputs
        hit = (x == output).to(x.dtype)
        share = hit / _all_reduce(hit, mesh, axes, "sum")
        ctx.save_for_backward(share)
        ctx.save_for_forward(share)
        ctx.meta = (mesh, axes)

    @staticmethod
    def backward(ctx: Any, ct: torch.Tensor) -> Any:
        (share,) = ctx.saved_tensors
        return _Psum.apply(ct, *ctx.meta) * share, None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        (share,) = ctx.saved_tensors
        return _Psum.apply(t * share, *ctx.meta)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: torch.Tensor, mesh: Mesh, axes: tuple, op: str) -> tuple:
        return _Pextreme.apply(x, mesh, axes, op), in_dims[0]


class _Move(torch.autograd.Function):
    """all_gather / psum_scatter / all_to_all / ppermute, each with its transpose."""

    @staticmethod
    def forward(x: torch.Tensor, kind: str, mesh: Mesh, axes: tuple, a: Any, b: Any) -> torch.Tensor:
        return _MOVES[kind](x, mesh, axes, a, b)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.meta = inputs[1:]

    @staticmethod
    def backward(ctx: Any, ct: torch.Tensor) -> Any:
        kind, mesh, axes, a, b = ctx.meta
        back, a2, b2 = _TRANSPOSE[kind](a, b)
        return (_Move.apply(ct, back, mesh, axes, a2, b2),) + (None,) * 5

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        return _Move.apply(t, *ctx.meta)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: torch.Tensor, kind: str, mesh: Mesh, axes: tuple, a: Any, b: Any) -> tuple:
        bd = in_dims[0]
        if bd is None:
            return _Move.apply(x, kind, mesh, axes, a, b), None
        x = x.movedim(bd, 0)
        if kind in ("gather_sized", "slice_summed"):
            return _Move.apply(x, kind, mesh, axes, a + 1, b), 0
        if kind != "ppermute":  # a and b are dims of the local tensor: shift past the batch dim
            a, b = a + 1, (None if b is None else b + 1)
        return _Move.apply(x, kind, mesh, axes, a, b), 0


_MOVES: dict[str, Callable] = {
    "all_gather": lambda x, mesh, axes, dim, _: _all_gather(x, mesh, axes, dim),
    "psum_scatter": lambda x, mesh, axes, dim, _: _reduce_scatter(x, mesh, axes, dim),
    "all_to_all": _all_to_all,
    "ppermute": lambda x, mesh, axes, perm, _: _ppermute(x, mesh, axes, perm),
    "gather_sized": _gather_sized,
    "slice_summed": _slice_summed,
}
_TRANSPOSE: dict[str, Callable] = {
    "all_gather": lambda dim, _: ("psum_scatter", dim, None),
    "psum_scatter": lambda dim, _: ("all_gather", dim, None),
    "all_to_all": lambda split, concat: ("all_to_all", concat, split),
    "ppermute": lambda perm, _: ("ppermute", tuple((d, s) for s, d in perm), None),
    "gather_sized": lambda dim, sizes: ("slice_summed", dim, sizes),
    "slice_summed": lambda dim, sizes: ("gather_sized", dim, sizes),
}


class DistBody:
    """The lax implementation on the dist backend (plain tensors, one rank). In an ``uneven``
    body (blocks of different shapes on different ranks) each collective first compares the
    group's shapes: pieces of different lengths along the gathered dim are gathered padded,
    shapes no collective can combine raise a ShardingError on every rank (as the local
    backend does) instead of hanging or aborting in the process group."""

    leader = True

    def __init__(self, mesh: Mesh, uneven: bool = False) -> None:
        self.mesh, self.uneven = mesh, uneven

    def _same_shapes(self, x: torch.Tensor, axes: tuple[str, ...], what: str, gather: int | None = None) -> Any:
        """None where every member's ``x`` has one shape; the lengths along ``gather`` where
        only those differ; else a ShardingError (on every rank alike)."""
        if not self.uneven:
            return None
        shapes = _group_shapes(x, self.mesh, axes)
        if len(set(shapes)) == 1:
            return None
        if gather is not None and len({len(s) for s in shapes}) == 1 and len(
                {s[:gather] + s[gather + 1:] for s in shapes}) == 1:
            return tuple(s[gather] for s in shapes)
        raise ShardingError(f"sf.lax.{what} over {axes}: the devices' local tensors have shapes {shapes}, "
                            "which this collective cannot combine (shard_map with uneven blocks)")

    def reduce(self, x: torch.Tensor, axes: tuple[str, ...], op: str) -> torch.Tensor:
        self._same_shapes(x, axes, {"sum": "psum"}.get(op, f"p{op}"))
        if op == "sum":
            return _Psum.apply(x, self.mesh, axes)
        return _Pextreme.apply(x, self.mesh, axes, op)

    def all_gather(self, x: torch.Tensor, axes: tuple[str, ...], axis: int) -> torch.Tensor:
        sizes = self._same_shapes(x, axes, "all_gather", axis)
        if sizes is not None:
            return _Move.apply(x, "gather_sized", self.mesh, axes, axis, sizes)
        return _Move.apply(x, "all_gather", self.mesh, axes, axis, None)

    def psum_scatter(self, x: torch.Tensor, axes: tuple[str, ...], dim: int) -> torch.Tensor:
        self._same_shapes(x, axes, "psum_scatter")
        return _Move.apply(x, "psum_scatter", self.mesh, axes, dim, None)

    def all_to_all(self, x: torch.Tensor, axes: tuple[str, ...], split_axis: int, concat_axis: int) -> torch.Tensor:
        self._same_shapes(x, axes, "all_to_all")
        return _Move.apply(x, "all_to_all", self.mesh, axes, split_axis, concat_axis)

    def ppermute(self, x: torch.Tensor, axes: tuple[str, ...], perm: tuple) -> torch.Tensor:
        self._same_shapes(x, axes, "ppermute")
        return _Move.apply(x, "ppermute", self.mesh, axes, perm, None)

    def axis_index(self, axes: tuple[str, ...]) -> torch.Tensor:
        return torch.tensor(_rank_in(self.mesh, axes), device=self.mesh.device_type)


# -- shard_map on dist ---------------------------------------------------------------------------------------


def shard_map_call(f: Callable, inputs: Any, out_specs: Any, check_vma: bool, kwargs: dict) -> Any:
    """One rank's part of a shard_map call (see ``io._shard_map``)."""
    mesh = inputs.mesh
    if _replicas.checking():
        for p, v, l in zip(inputs.paths, inputs.leaves, inputs.layouts):
            if l is not None and isinstance(v, torch.Tensor) and not isinstance(v, ShardedArray):
                from ...backends.dist import check_replicas

                check_replicas(mesh, v, mesh.axis_names, f"shard_map: {p}, a plain tensor argument,")
    leaves = [_local_input(v, l) if l is not None else v for v, l in zip(inputs.leaves, inputs.layouts)]
    body = DistBody(mesh, uneven=not inputs.even())
    # closures matter only to gradients (values are right without the mode)
    closures = (_Closures(mesh, [v for v, l in zip(leaves, inputs.layouts) if l is not None])
                if torch.is_grad_enabled() else contextlib.nullcontext())
    with mesh, _entered(body), _recompute.body_context(lambda: _reopened(body, closures)), closures:
        out = f(*inputs.rebuild(leaves), **kwargs)
    flat, treespec = optree.tree_flatten(out, none_is_leaf=True)
    out_tree = optree.tree_unflatten(treespec, list(range(len(flat))))
    paths, idx, specs, _ = _match(out_specs, out_tree, "shard_map out_specs", "output")
    vma = _traced_vma(f, inputs, leaves, kwargs) if check_vma else None
    return optree.tree_unflatten(treespec, [
        assemble_parts(p, [flat[i]], s, mesh, check_vma, (lambda o, i=i: vma[i]) if vma else None,
                       exchange=not inputs.even())
        for p, i, s in zip(paths, idx, specs)
    ])


def _local_input(v: torch.Tensor, layout: Layout) -> torch.Tensor:
    """This rank's local tensor of argument ``v``. A plain tensor (the same on every rank)
    is distributed first, so its gradient is gathered from every rank's part."""
    v = into_layout(v, layout)
    return B.EnterParts.apply(v, B.summed_grad_layout(layout), True)[0]


@contextlib.contextmanager
def _reopened(body: DistBody, closures: Any) -> Iterator[None]:
    """The body's mesh, collectives and closures again, for a checkpoint recomputation."""
    with body.mesh, _entered(body), closures:
        yield


# -- closed-over values ----------------------------------------------------------------------------------------


def _save_mesh_axes(ctx: Any, inputs: tuple, output: Any) -> None:
    """setup_context of the functions applied as ``(x, mesh[, axes])``."""
    ctx.mesh = inputs[1]
    ctx.axes = inputs[2] if len(inputs) > 2 else None


class _Replicated(torch.autograd.Function):
    """A value the body uses without receiving it as a mapped argument (a closure, an
    unmapped argument, a module's parameter): the same on every rank, so, as JAX's
    implicit pbroadcast, its gradient is the sum of every rank's part (a psum over all
    mesh axes; differentiable, so higher orders hold too)."""

    @staticmethod
    def forward(x: torch.Tensor, mesh: Mesh, axes: tuple | None = None) -> torch.Tensor:
        return x.view_as(x)

    setup_context = staticmethod(_save_mesh_axes)

    @staticmethod
    def backward(ctx: Any, ct: torch.Tensor) -> Any:
        return _SumParts.apply(ct, ctx.mesh, ctx.axes), None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: torch.Tensor, mesh: Mesh, axes: tuple | None = None) -> tuple:
        return _Replicated.apply(x, mesh, axes), in_dims[0]


class _SumParts(torch.autograd.Function):
    """Every rank's part of a closure's gradient -> their sum, on every rank. The sum
    leaves the body as a plain (replicated) tensor, whose cotangent every rank holds
    whole: the transpose is the identity."""

    @staticmethod
    def forward(x: torch.Tensor, mesh: Mesh, axes: tuple | None = None) -> torch.Tensor:
        return _all_reduce(x, mesh, mesh.axis_names if axes is None else axes, "sum")

    setup_context = staticmethod(_save_mesh_axes)

    @staticmethod
    def backward(ctx: Any, ct: torch.Tensor) -> Any:
        return ct.view_as(ct), None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        return _SumParts.apply(t, ctx.mesh, ctx.axes)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: torch.Tensor, mesh: Mesh, axes: tuple | None = None) -> tuple:
        return _SumParts.apply(x, mesh, axes), in_dims[0]


def _next_sequence_nr() -> int:
    """The autograd sequence number the next node made on this thread gets (nodes made
    earlier have smaller ones)."""
    with torch.enable_grad():
        return torch.empty(0, requires_grad=True).view(0).grad_fn._sequence_nr() + 1


class _Closures(TorchFunctionMode):
    """Active while a dist body runs: every tensor an op receives that the body did not
    make and was not given as a mapped argument is a closed-over value. One that
    requires grad passes through :class:`_Replicated` (once per body call), a
    ShardedArray becomes its full value (``gather``) first. Without this each rank's
    gradient of a closure would hold only its own devices' part."""

    def __init__(self, mesh: Mesh, inputs: list) -> None:
        super().__init__()
        self.mesh = mesh
        self.start = _next_sequence_nr()
        # id -> None (made by the body or given mapped) or (the closure, its stand-in).
        # Caching by id is safe: a closure outlives the body call (it existed before it),
        # so no tensor made during the call can share its id.
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {
            id(t): None for t in inputs if isinstance(t, torch.Tensor)
        }

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if any(self._standin(t) is not None for t in _tensor_args(args, kwargs)):
            args = tuple(self._swap(a) for a in args)
            kwargs = {k: self._swap(v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        seen = self.seen
        for o in (out,) if isinstance(out, torch.Tensor) else out if isinstance(out, (tuple, list)) else ():
            if isinstance(o, torch.Tensor) and id(o) not in seen:
                seen[id(o)] = None  # made by the body (its inputs were already swapped)
        return out

    def _standin(self, t: torch.Tensor) -> torch.Tensor | None:
        """The tensor the body's ops use for closure ``t``, or None if ``t`` is no closure."""
        key = id(t)
        if key in self.seen:
            hit = self.seen[key]
            return None if hit is None else hit[1]
        array = isinstance(t, ShardedArray) or (is_wrapped(t) and base_array(t) is not None)
        if array and _on_body_submesh(t if isinstance(t, ShardedArray) else base_array(t)):
            self.seen[key] = None  # a partial-manual body's own value over its automatic axes
            return None
        if not array and not (t.requires_grad and (t.grad_fn is None or t.grad_fn._sequence_nr() < self.start)):
            if t.requires_grad:  # made in the body (a closure that does not require grad is never cached)
                self.seen[key] = None
            return None
        from ...arrays.redistribute import gather

        full = gather(t) if array else t
        rep = _Replicated.apply(full, self.mesh, None) if full.requires_grad else full
        self.seen[id(rep)] = None
        self.seen[key] = (t, rep)
        return rep

    def _swap(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            rep = self._standin(a)
            return a if rep is None else rep
        if isinstance(a, (list, tuple)) and any(isinstance(b, torch.Tensor) for b in a):
            return type(a)(self._swap(b) for b in a)
        return a


def _on_body_submesh(array: ShardedArray) -> bool:
    """Whether ``array`` lives on the submesh of a partial-manual body running here (the
    body's arguments and results there are ShardedArrays over its automatic axes)."""
    return array.mesh in _subs()


def _tensor_args(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensors among an op's arguments (top level and inside lists / tuples)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


_traces: dict[tuple, list[frozenset[str]] | None] = {}


def _traced_vma(f: Callable, inputs: Any, leaves: list, kwargs: dict) -> list[frozenset[str]] | None:
    """Varying axes of each output, from one vmap trace of the body on meta tensors of
    this rank's local shapes (cached per signature); None if the trace fails."""
    sig = tuple(
        (tuple(x.shape), x.dtype, l) if l is not None else None for x, l in zip(leaves, inputs.layouts)
    )
    key = (f, inputs.mesh, sig, inputs.treespec, tuple(sorted(kwargs)))
    if key not in _traces:
        from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

        try:
            with disable_proxy_modes_tracing():  # not part of a make_fx trace of the caller (linearize)
                _traces[key] = _trace(f, inputs, sig, leaves, kwargs)
        except (RuntimeError, TypeError, ValueError, ShardingError, NotImplementedError):
            _traces[key] = None
    return _traces[key]


def _trace(f: Callable, inputs: Any, sig: tuple, leaves: list, kwargs: dict) -> list[frozenset[str]]:
    mesh = inputs.mesh
    local = Mesh(mesh.shape, mesh.axis_names, backend="local", device_type="meta")
    metas, mapped = [], []
    for v, s in zip(leaves, sig):
        if s is None:
            metas.append(v)
            mapped.append(False)
            continue
        shape, dtype, layout = s
        # a pending value's parts vary over its pending axes too (as per_device's vma says)
        dims = [n if a in layout.axis_dim or a in layout.partial_ops else 1 for a, n in zip(mesh.axis_names, mesh.shape)]
        metas.append(torch.empty(*dims, *shape, dtype=dtype, device="meta"))
        mapped.append(True)
    flat, _ = _stacked.run(local, f, metas, mapped, inputs.rebuild, kwargs, leader=False)
    return [
        frozenset(a for k, a in enumerate(mesh.axis_names) if isinstance(c, torch.Tensor) and c.shape[k] > 1)
        for c in flat
    ]
