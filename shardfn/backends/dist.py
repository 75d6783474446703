"""The dist backend: one process per mesh device on an initialised torch.distributed world.

A value is this rank's shard, a plain tensor. The mesh maps onto the world row-major
(device ``i`` is rank ``i``). At first use of a mesh every rank creates, in the same
order, one process group per mesh axis and per set of axes an exchange spans (cached per
mesh). Plan steps run through torch's functional collectives and are waited on before
``run_step`` returns, so every value a user sees is ready. Shard sizes of uneven layouts
come from the layout math; collectives that need equal sizes are padded.

Reductions come in three modes (``configure(reductions=...)`` or ``SHARDFN_DIST_REDUCTIONS``):
``"ordered"`` (also on while ``torch.use_deterministic_algorithms(True)``): floating sums
and averages over more than two ranks are done by an all_to_all of the pieces, which each
rank then adds in mesh order (and an all_gather for replicated results): the bytes of a
ring reduce-scatter / all-reduce, results bit-identical to the local backend's.
``"native"``: the library's all_reduce / reduce_scatter (a ring adds in a rank-dependent
order). ``"auto"`` (default): all_reduce native; reduce_scatter ordered on CPU, where it
is also faster than gloo's, native on GPUs. Max/min and integer sums are exact in any mode.

Collectives time out after the default process group's timeout (``init_process_group(timeout=)``),
overridden by ``SHARDFN_DIST_TIMEOUT`` (seconds) or ``configure(timeout=)``; a timed-out or
failed collective raises :class:`CollectiveError` naming the step, the mesh axes and the ranks.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..values.errors import ShardingError
from ..values.torch_compat import funcol_gather_scatter
from ..values.layout import Layout, describe, local_shapes, split_range
from ..values.mesh import Mesh
from ..plans.planner import Step
from .device_call import DeviceCall, raw_op, substitute, with_locals
from .hooks import SHARD_MAP_RUNNERS
from .local import _reduce

_all_gather_single, _reduce_scatter_single = funcol_gather_scatter()  # torch 2.11 / 2.13 names

# dtypes every backend's collectives take; others move as raw bytes, or reduce widened
_WIRE = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                   torch.int32, torch.int64})


class CollectiveError(RuntimeError):
    """A collective of the dist backend failed or timed out."""


# -- configuration ---------------------------------------------------------------------------


def _env_timeout() -> datetime.timedelta | None:
    raw = os.environ.get("SHARDFN_DIST_TIMEOUT")
    return datetime.timedelta(seconds=float(raw)) if raw else None


_MODES = ("auto", "ordered", "native")


def _env_mode() -> str:
    mode = os.environ.get("SHARDFN_DIST_REDUCTIONS", "auto")
    if mode not in _MODES:
        raise ValueError(f"SHARDFN_DIST_REDUCTIONS={mode!r}; use one of {_MODES}")
    return mode


_config: dict[str, Any] = {"timeout": _env_timeout(), "reductions": _env_mode()}


def configure(*, timeout: datetime.timedelta | float | None = None, reductions: str | None = None) -> None:
    """Set the collective timeout (a timedelta or seconds; applies to meshes first used
    afterwards) and the reduction mode: ``"auto"``, ``"ordered"`` (bit-identical to the
    local backend) or ``"native"`` (see the module docstring)."""
    if timeout is not None:
        _config["timeout"] = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
    if reductions is not None:
        if reductions not in _MODES:
            raise ValueError(f"reductions={reductions!r}; use one of {_MODES}")
        _config["reductions"] = reductions


@contextlib.contextmanager
def reductions(mode: str) -> Iterator[None]:
    """Use reduction ``mode`` inside the block, e.g. ``with reductions("ordered"):`` for
    results bit-identical to the local backend."""
    old = _config["reductions"]
    configure(reductions=mode)
    try:
        yield
    finally:
        _config["reductions"] = old


def _mode() -> str:
    if torch.are_deterministic_algorithms_enabled():
        return "ordered"
    return _config["reductions"]


def _default_timeout() -> datetime.timedelta | None:
    if _config["timeout"] is not None:
        return _config["timeout"]
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        return backend.options._timeout
    except (AttributeError, RuntimeError):
        return None


# -- per-mesh state ------------------------------------------------------------------------------


@attrs.frozen
class Group:
    """The devices that differ from this rank only on ``axes``: ``pg`` is their process
    group and ``ranks`` their global ranks in process-group order (ascending, which is
    row-major over ``axes`` taken in mesh order)."""

    axes: tuple[str, ...]
    ranks: tuple[int, ...]  # global ranks, in group order (row-major over ``axes``)
    pg: Any
    timeout: datetime.timedelta | None

    @property
    def size(self) -> int:
        return len(self.ranks)


@attrs.frozen
class _State:
    mesh: Mesh
    rank: int
    coords: tuple[int, ...]
    groups: dict  # axes tuple (mesh order) -> Group


_states: dict[Mesh, _State] = {}
_pgs: dict[tuple, Any] = {}


def _state(mesh: Mesh) -> _State:
    st = _states.get(mesh)
    if st is None:
        st = _states[mesh] = _make_state(mesh)
    return st


def _check_world(mesh: Mesh) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        raise ShardingError(
            f"{mesh!r} uses backend='dist' but torch.distributed is not initialised; launch with "
            f"torchrun and call torch.distributed.init_process_group() first, or use backend='local'"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != mesh.size:
        raise ShardingError(
            f"{mesh!r} has {mesh.size} devices but the torch.distributed world has {world} ranks "
            f"(this is rank {rank}); on the dist backend the mesh size must equal the world size "
            f"(launch torchrun with --nproc-per-node={mesh.size}, or reshape the mesh)"
        )
    return rank


def _make_state(mesh: Mesh) -> _State:
    """Create the groups of every non-empty set of mesh axes; collective over all ranks."""
    if mesh.within is not None:
        return _view_state(mesh)
    rank = _check_world(mesh)
    timeout = _default_timeout()
    groups = {}
    for k in range(1, mesh.ndim + 1):
        for axes in itertools.combinations(mesh.axis_names, k):
            groups[axes] = _make_group(mesh, axes, rank, timeout)
    return _State(mesh, rank, mesh.coords(rank), groups)


def _view_state(mesh: Mesh) -> _State:
    """A sub-mesh view (``mesh.submesh``): this rank's place in it, and the parent's groups
    over its axes with members renumbered as the view's devices (no new process group)."""
    parent, fixed = mesh.within
    pst = _state(parent)
    for a, c in fixed:
        if pst.coords[parent.axis_index(a)] != c:
            raise ShardingError(
                f"{mesh!r} is a view at {a}={c}, but this rank (coords {pst.coords} on {parent!r}) is not in it"
            )
    pos = [parent.axis_index(a) for a in mesh.axis_names]

    def device(r: int) -> int:
        c = parent.coords(r)
        return mesh.device_at(tuple(c[i] for i in pos))

    groups = {
        axes: Group(axes, tuple(device(r) for r in g.ranks), g.pg, g.timeout)
        for axes, g in pst.groups.items() if all(a in mesh.axis_names for a in axes)
    }
    return _State(mesh, device(pst.rank), tuple(pst.coords[i] for i in pos), groups)


def _make_group(mesh: Mesh, axes: tuple[str, ...], rank: int, timeout: datetime.timedelta | None) -> Group:
    idx = [mesh.axis_index(a) for a in axes]
    partitions: dict[tuple, list[int]] = {}
    for dev in range(mesh.size):
        c = mesh.coords(dev)
        partitions.setdefault(tuple(c[i] for i in range(mesh.ndim) if i not in idx), []).append(dev)
    mine = None
    for ranks in partitions.values():
        key = (tuple(ranks), timeout)
        if key not in _pgs:  # every rank creates every group, in the same order
            kwargs = {"timeout": timeout} if timeout is not None else {}
            _pgs[key] = dist.new_group(ranks, **kwargs)
        if rank in ranks:
            mine = Group(axes, tuple(ranks), _pgs[key], timeout)
    return mine


def _group(step: Step, mesh: Mesh) -> Group:
    st = _state(mesh)
    axes = (step.axis,) if isinstance(step.axis, str) else tuple(step.axis)
    return st.groups[tuple(a for a in mesh.axis_names if a in axes)]


def axis_group(mesh: Mesh, axes: Sequence[str]) -> Group:
    """This rank's :class:`Group` over mesh ``axes`` (a non-empty collection of axis names)."""
    st = _state(mesh)
    key = tuple(a for a in mesh.axis_names if a in axes)
    if len(key) != len(set(axes)) or not key:
        raise ShardingError(f"axes {tuple(axes)!r} are not distinct axes of {mesh!r}")
    return st.groups[key]


def rank_of(mesh: Mesh) -> int:
    """This process's device index on ``mesh`` (its global rank)."""
    return _state(mesh).rank


# -- collectives: issue, wait, and turn failures into clear errors --------------------------------


def _issued(op: Any, *args: Any) -> torch.Tensor:
    """A functional collective and its wait as one graph node that FX treats as side-
    effecting (neither dead-code eliminated nor constant folded)."""
    return funcol.wait_tensor(op(*args))


torch.fx.node.has_side_effect(_issued)


def pin_in_real_trace(out: torch.Tensor) -> torch.Tensor:
    """Under ``make_fx`` on real tensors (``torch.func.linearize`` traces so and then
    constant-folds the graph), fuse the collective that made ``out`` with its wait into
    one side-effecting node. Otherwise a collective on constants is folded apart from
    its wait: the folded copy is taken before the collective completes (wrong, rank-
    dependent values, then mismatched collectives: a hang)."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    if mode is None or is_fake(out):
        return out
    slot = get_proxy_slot(out, mode.tracer, None)
    node = slot.proxy.node if slot is not None else None
    wait = torch.ops._c10d_functional.wait_tensor.default
    while node is not None and node.target is wait and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    if node is not None and getattr(node.target, "namespace", None) == "_c10d_functional":
        node.args = (node.target, *node.args)
        node.target = _issued
    return out


def run_collective(what: str, group: Group, fn: Callable[..., Any], *args: Any) -> torch.Tensor:
    """``fn(*args, group.pg)`` (a functional collective), waited on; a failure or timeout
    becomes a :class:`CollectiveError` naming ``what``, the axes and the ranks."""
    try:
        return pin_in_real_trace(funcol.wait_tensor(fn(*args, group.pg)))
    except RuntimeError as e:
        timeout = group.timeout if group.timeout is not None else "torch's default"
        raise CollectiveError(
            f"shardfn dist backend: {what} over mesh axes {group.axes} (ranks {list(group.ranks)}) failed on "
            f"rank {dist.get_rank()}: {e}\nEvery rank must make the same shardfn calls in the same order; "
            f"a peer may have crashed, diverged or be slow. The collective timeout is {timeout} "
            f"(set it with SHARDFN_DIST_TIMEOUT=<seconds> or shardfn.backends.dist.configure(timeout=...) "
            f"before first using the mesh)."
        ) from e


def _bytes(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` contiguous, reinterpreted as bytes if its dtype is not on the wire, and the
    number of wire elements per element (for split sizes)."""
    x = x.contiguous()
    if x.dtype in _WIRE:
        return x, 1
    return x.view(torch.uint8), x.element_size()


def _all_gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    wire, _ = _bytes(x)
    return run_collective("all_gather", group, _all_gather_single, wire, dim).view(x.dtype)


def _all_to_all(send: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group) -> torch.Tensor:
    """all_to_all of a 1-D buffer: ``in_splits[j]`` elements go to member j."""
    wire, k = _bytes(send)
    y = run_collective("all_to_all", group, funcol.all_to_all_single, wire,
                       [n * k for n in out_splits], [n * k for n in in_splits])
    return y.view(send.dtype)


def _native_reduce(x: torch.Tensor, op: str, group: Group, scatter_dim: int | None) -> torch.Tensor:
    """all_reduce (``scatter_dim`` None) or reduce_scatter through the library's collective;
    an average is a sum divided here (floor division for integers, as on the local backend)."""
    wire_op = "sum" if op == "avg" else op
    wire = torch.view_as_real(x) if x.is_complex() else x if x.dtype in _WIRE else x.to(torch.int64)
    if scatter_dim is None:
        y = run_collective("all_reduce", group, funcol.all_reduce, wire.contiguous(), wire_op)
    else:
        y = run_collective("reduce_scatter", group, _reduce_scatter_single, wire.contiguous(), wire_op,
                           scatter_dim)
    y = torch.view_as_complex(y) if x.is_complex() else y.to(x.dtype)
    if op != "avg":
        return y
    if y.is_floating_point() or y.is_complex():
        return y / group.size
    return torch.div(y, group.size, rounding_mode="floor")


def _ordered(x: torch.Tensor, op: str, group: Group) -> bool:
    """Whether an all_reduce runs in mesh order (to match the local backend bit for bit;
    a sum of two terms is exact in either order, integer sums and max/min always are)."""
    floating = x.is_floating_point() or x.is_complex()
    return _mode() == "ordered" and floating and op in ("sum", "avg") and group.size > 2


def _scatter_ordered(x: torch.Tensor) -> bool:
    """Whether a reduce_scatter is an all_to_all plus a local reduction in mesh order."""
    mode = _mode()
    return mode == "ordered" or (mode == "auto" and x.device.type == "cpu")


# -- helpers on shapes -------------------------------------------------------------------------


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` extended with zeros along ``dim`` to ``size``."""
    short = size - x.shape[dim]
    if short <= 0:
        return x
    fill = list(x.shape)
    fill[dim] = short
    return torch.cat([x, x.new_zeros(fill)], dim)


def _pieces(n: int, g: int) -> list[tuple[int, int]]:
    """(offset, length) of the g layout pieces of a dim of size n."""
    return [(lo, hi - lo) for lo, hi in (split_range(0, n, g, j) for j in range(g))]


def _concat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _pack(x: torch.Tensor, dim: int, pieces: list[tuple[int, int]]) -> torch.Tensor:
    """The pieces of ``x`` along ``dim``, flattened one after another."""
    if math.prod(x.shape[:dim]) == 1:
        return x.contiguous().view(-1)
    if len({n for _, n in pieces}) == 1:  # even: one strided copy
        return x.unflatten(dim, (len(pieces), pieces[0][1])).movedim(dim, 0).contiguous().view(-1)
    buf = x.new_empty(x.numel())
    start = 0
    for off, n in pieces:  # one copy per piece, straight into the send buffer
        piece = x.narrow(dim, off, n)
        buf[start:start + piece.numel()].view(piece.shape).copy_(piece)
        start += piece.numel()
    return buf


def _unpack(buf: torch.Tensor, shapes: list[tuple[int, ...]], dim: int) -> torch.Tensor:
    """Inverse of a pack: the concatenation along ``dim`` of pieces of the given shapes."""
    full = list(shapes[0])
    full[dim] = sum(s[dim] for s in shapes)
    if math.prod(full[:dim]) == 1:
        return buf.view(full)
    sizes = [math.prod(s) for s in shapes]
    return _concat([p.view(s) for p, s in zip(buf.split(sizes), shapes)], dim)


def _with(shape: Sequence[int], dim: int, n: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] = n
    return tuple(out)


# -- step implementations ---------------------------------------------------------------------


def run_step(step: Step, value: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Run one plan step on this rank's shard; collective steps are waited on."""
    mesh = step.src.mesh
    if any(isinstance(n, torch.SymInt) for n in value.shape):
        # torch.compile made the shard's sizes symbolic (automatic dynamic shapes): plans
        # are static, so specialise them to the layout's (this guards on them)
        value = value.view(local_shapes(step.src, shape)[_state(mesh).rank])
    if step.routes is not None:
        return _exchange(step, value, shape)
    return _STEPS[step.kind](step, value, shape, mesh)


def _axis_pos(step: Step, mesh: Mesh) -> int:
    return _state(mesh).coords[mesh.axis_index(step.axis)]


def _all_gather_step(step: Step, x: torch.Tensor, shape: tuple, mesh: Mesh) -> torch.Tensor:
    group, d = _group(step, mesh), step.dim
    n = local_shapes(step.dst, shape)[_state(mesh).rank][d]  # the group's common extent of dim d
    c = -(-n // group.size)
    if c == 0:
        return x.new_empty(_with(x.shape, d, 0))
    y = _all_gather(_pad(x, d, c), d, group)
    return y if c * group.size == n else y.narrow(d, 0, n)


def _all_to_all_step(step: Step, x: torch.Tensor, shape: tuple, mesh: Mesh) -> torch.Tensor:
    """Split dim ``dim2`` into the group's pieces, send piece j to member j, concatenate
    what arrives along ``dim`` (sizes from each member's layout box)."""
    group, d, e = _group(step, mesh), step.dim, step.dim2
    me = _axis_pos(step, mesh)
    src_shapes = local_shapes(step.src, shape)
    pieces = _pieces(x.shape[e], group.size)
    slab = math.prod(_with(x.shape, e, 1))
    recv_shapes = [_with(src_shapes[r], e, pieces[me][1]) for r in group.ranks]
    in_splits = [n * slab for _, n in pieces]
    out_splits = [math.prod(s) for s in recv_shapes]
    buf = _all_to_all(_pack(x, e, pieces), out_splits, in_splits, group)
    return _unpack(buf, recv_shapes, d)


def _slice_step(step: Step, x: torch.Tensor, shape: tuple, mesh: Mesh) -> torch.Tensor:
    g = mesh.axis_size(step.axis)
    lo, hi = split_range(0, x.shape[step.dim], g, _axis_pos(step, mesh))
    return x.narrow(step.dim, lo, hi - lo)


def _all_reduce_step(step: Step, x: torch.Tensor, shape: tuple, mesh: Mesh) -> torch.Tensor:
    group = _group(step, mesh)
    if x.numel() == 0:  # the group shares this shape, so every member skips alike
        return x
    if not _ordered(x, step.op, group):
        return _native_reduce(x, step.op, group, None)
    flat = x.reshape(-1)
    pieces = _pieces(flat.numel(), group.size)
    me = _axis_pos(step, mesh)
    mine = pieces[me][1]
    buf = _all_to_all(flat, [mine] * group.size, [n for _, n in pieces], group)
    reduced = _reduce(buf.view(group.size, mine), 0, step.op).view(-1)
    c = pieces[0][1]
    y = _all_gather(_pad(reduced, 0, c), 0, group)
    return y.narrow(0, 0, flat.numel()).view(x.shape)


def _reduce_scatter_step(step: Step, x: torch.Tensor, shape: tuple, mesh: Mesh) -> torch.Tensor:
    group, d = _group(step, mesh), step.dim
    pieces = _pieces(x.shape[d], group.size)
    me = _axis_pos(step, mesh)
    mine = _with(x.shape, d, pieces[me][1])
    if not _scatter_ordered(x):
        c = pieces[0][1]
        y = _native_reduce(_pad(x, d, c * group.size), step.op, group, d)
        return y if y.shape[d] == mine[d] else y.narrow(d, 0, mine[d])
    # all_to_all then a local reduction: the bytes of a ring reduce_scatter, any dtype, mesh order
    slab = math.prod(_with(x.shape, d, 1))
    buf = _all_to_all(_pack(x, d, pieces), [math.prod(mine)] * group.size,
                      [n * slab for _, n in pieces], group)
    return _reduce(buf.view(group.size, *mine), 0, step.op).squeeze(0)


def _reduce_local_step(step: Step, x: torch.Tensor, shape: tuple, mesh: Mesh) -> torch.Tensor:
    if step.op == "sum" and _axis_pos(step, mesh) != 0:
        return torch.zeros_like(x)
    return x


_STEPS = {
    "all_gather": _all_gather_step,
    "all_to_all": _all_to_all_step,
    "slice": _slice_step,
    "all_reduce": _all_reduce_step,
    "reduce_scatter": _reduce_scatter_step,
    "reduce_local": _reduce_local_step,
}


# -- exchanges: exact per-piece routes ----------------------------------------------------------


@attrs.frozen
class _Routing:
    """This rank's part of an exchange: pieces to send and receive, per group member."""

    send: tuple[tuple, ...]  # per member: ((src_slices), ...)
    recv: tuple[tuple, ...]  # per member: ((dst_slices, shape), ...)
    keep: tuple  # (src_slices, dst_slices) of pieces staying on this rank


_routings: dict[int, tuple[Step, int, _Routing]] = {}


def _routing(step: Step, group: Group, rank: int, shape: tuple) -> _Routing:
    hit = _routings.get(id(step))
    if hit is not None and hit[0] is step and hit[1] == rank:
        return hit[2]
    pos = {r: i for i, r in enumerate(group.ranks)}
    send: list[list] = [[] for _ in group.ranks]
    recv: list[list] = [[] for _ in group.ranks]
    keep = []
    for r in step.routes:
        if r.src == rank and r.dst == rank:
            keep.append((r.src_slices, r.dst_slices))
        elif r.src == rank:
            send[pos[r.dst]].append(r.src_slices)
        elif r.dst == rank:
            recv[pos[r.src]].append((r.dst_slices, tuple(s.stop - s.start for s in r.dst_slices)))
    routing = _Routing(tuple(map(tuple, send)), tuple(map(tuple, recv)), tuple(keep))
    if len(_routings) > 4096:
        _routings.clear()
    _routings[id(step)] = (step, rank, routing)
    return routing


def _exchange(step: Step, x: torch.Tensor, shape: tuple) -> torch.Tensor:
    mesh = step.src.mesh
    group, rank = _group(step, mesh), _state(mesh).rank
    rt = _routing(step, group, rank, shape)
    out_shape = local_shapes(step.dst, shape)[rank]
    pieces = [[x[sl] for sl in member] for member in rt.send]
    in_splits = [sum(p.numel() for p in member) for member in pieces]
    out_splits = [sum(math.prod(s) for _, s in member) for member in rt.recv]
    flat = [p for member in pieces for p in member]
    if len(flat) == 1:  # e.g. a permute: no copy when the piece is contiguous
        send = flat[0].reshape(-1)
    else:
        send = x.new_empty(sum(in_splits))
        start = 0
        for p in flat:
            send[start:start + p.numel()].view(p.shape).copy_(p)
            start += p.numel()
    buf = _all_to_all(send, out_splits, in_splits, group)
    incoming = [(sl, s) for member in rt.recv for sl, s in member]
    if not rt.keep and len(incoming) == 1 and incoming[0][1] == out_shape:
        return buf.view(out_shape)
    out = x.new_empty(out_shape)
    for src_sl, dst_sl in rt.keep:
        out[dst_sl] = x[src_sl]
    offset = 0
    for sl, s in incoming:
        n = math.prod(s)
        out[sl] = buf[offset:offset + n].view(s)
        offset += n
    return out


# -- protocol used by ShardedArray -----------------------------------------------------------------


def replicated(whole: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """This rank's copy of a replicated value (every rank passes the same ``whole``)."""
    _state(mesh)
    return whole


def one_replica(value: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """This rank's copy (a fresh alias, so autograd Functions can return it)."""
    return value.view(value.shape)


def from_shards(shards: Sequence[torch.Tensor], layout: Layout, shape: tuple[int, ...]) -> torch.Tensor:
    _state(layout.mesh)
    return shards[0]


def global_shape(shards: Sequence[torch.Tensor], layout: Layout, shape: Sequence[int] | None, *,
                 check_ranks: bool = True) -> tuple[int, ...]:
    """The global shape: ``shape`` if given, else the even one (local size times the sizes of
    the axes sharding each dim); this rank's shard is checked against it, and every rank's
    global shape and dtype against the others' (one small all_gather), so a mismatch is a
    ShardingError on every rank rather than a hang or abort in a later collective."""
    mesh, x = layout.mesh, shards[0]
    rank = _state(mesh).rank
    if shape is None:
        shape = tuple(
            n * math.prod(mesh.axis_size(a) for a in axes) for n, axes in zip(x.shape, layout.dims)
        )
    shape = tuple(int(n) for n in shape)
    error = None
    if len(shape) != x.dim():
        error = f"from_local: shape={shape} has rank {len(shape)} but the local tensor has rank {x.dim()}"
    elif local_shapes(layout, shape)[rank] != tuple(x.shape):
        error = (
            f"from_local: rank {rank} (mesh coords {mesh.coords(rank)}) has a local tensor of shape "
            f"{tuple(x.shape)}, but {describe(shape, x.dtype, layout)} on {mesh!r} puts a shard of shape "
            f"{local_shapes(layout, shape)[rank]} there; pass shape= with the global shape for uneven layouts"
        )
    if check_ranks:
        check_same_meta(mesh, shape, x.dtype, "from_local", error)
    elif error is not None:
        raise ShardingError(error)
    return shape


_DTYPE_CODE = {d: i for i, d in enumerate(sorted(
    {v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))}
_META_DIMS = 8  # shape entries sent as is; longer shapes also send a checksum


def check_same_meta(mesh: Mesh, shape: Sequence[int], dtype: torch.dtype, what: str, error: str | None = None) -> None:
    """Every rank of ``mesh`` passed one global shape and dtype to ``what`` and none hit a
    local ``error``; otherwise a ShardingError on every rank naming the ranks that differ."""
    if _tracing():
        if error is not None:
            raise ShardingError(error)
        return  # traced code: the eager run checked these inputs
    st = _state(mesh)
    shape = tuple(shape)
    meta = [int(error is not None), _DTYPE_CODE.get(dtype, -1), len(shape)]
    meta += list(shape[:_META_DIMS]) + [0] * (_META_DIMS - min(len(shape), _META_DIMS))
    meta.append(sum((i + 1) * 1_000_003 * n for i, n in enumerate(shape)) % (1 << 62))
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else "cpu"
    mine = torch.tensor(meta, dtype=torch.int64, device=device)
    rows = run_collective(
        f"{what} metadata check", st.groups[mesh.axis_names], _all_gather_single, mine, 0
    ).view(mesh.size, -1).tolist()
    if error is not None:
        raise ShardingError(error)
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        raise ShardingError(f"{what}: rank(s) {failed} rejected their input (see their error); every rank must pass a valid input")
    differ = [r for r, row in enumerate(rows) if row[1:] != rows[0][1:]]
    if differ:
        raise ShardingError(
            f"{what}: ranks disagree on the global shape/dtype: rank 0 has {_meta_str(rows[0])}, "
            + ", ".join(f"rank {r} has {_meta_str(rows[r])}" for r in differ[:4])
            + ". Every rank must pass tensors of one global shape and dtype"
        )


def _fingerprint(t: torch.Tensor) -> list[int]:
    """Dtype, shape and three position-weighted sums of the bytes of ``t``: equal tensors
    (bit for bit) give equal fingerprints, different ones almost surely not."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
    i = torch.arange(b.numel(), dtype=torch.int64, device=b.device)
    sums = [b.sum(), (b * (i % 65521 + 1)).sum(), (b * ((i * 40503) % 1000003 + 7)).sum()]
    shape = list(t.shape[:_META_DIMS]) + [0] * (_META_DIMS - min(t.dim(), _META_DIMS))
    return [_DTYPE_CODE.get(t.dtype, -1), t.dim(), *shape, *(int(s.item()) for s in sums)]


def check_replicas(mesh: Mesh, t: torch.Tensor, over: Sequence[str], what: str) -> None:
    """``t`` is claimed the same on the ranks that differ only along mesh axes ``over``:
    compare fingerprints (one all_gather over the mesh); a ShardingError on every rank
    naming ``what`` and the ranks that hold other values than the first of their group."""
    if _tracing() or not over:
        return
    st = _state(mesh)
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else "cpu"
    mine = torch.tensor(_fingerprint(t), dtype=torch.int64, device=device)
    rows = run_collective(
        f"{what} replica check", st.groups[mesh.axis_names], _all_gather_single, mine, 0
    ).view(mesh.size, -1).tolist()
    pos = [mesh.axis_index(a) for a in over]
    first: dict[tuple, int] = {}
    differ: list[tuple[int, int]] = []
    for r in range(mesh.size):
        key = tuple(c for i, c in enumerate(mesh.coords(r)) if i not in pos)
        ref = first.setdefault(key, r)
        if rows[r] != rows[ref]:
            differ.append((ref, r))
    if differ:
        pairs = ", ".join(f"rank {r} differs from rank {ref}" for ref, r in differ[:8])
        raise ShardingError(
            f"{what} is claimed replicated over mesh axes {tuple(over)!r} of {mesh!r}, but the ranks hold "
            f"different values: {pairs} (checked because sf.debug.check_replicas() / {_replica_env()}=1 is on). "
            f"Every rank must pass the same value there (seed random generators alike, or build the value "
            f"with sf.random / the factories), or shard it / declare it Partial"
        )


def _replica_env() -> str:
    from ..values.replica_checks import ENV

    return ENV


def _tracing() -> bool:
    """Whether torch.compile is tracing (no data-dependent collectives there)."""
    return torch.compiler.is_compiling() or torch._guards.detect_fake_mode() is not None


def _meta_str(row: list[int]) -> str:
    names = {i: d for d, i in _DTYPE_CODE.items()}
    ndim = row[2]
    shape = tuple(row[3:3 + min(ndim, _META_DIMS)]) + (("...",) if ndim > _META_DIMS else ())
    return f"{names.get(row[1], 'an unknown dtype')}{list(shape)}"


def all_local_shapes(t: torch.Tensor, mesh: Mesh) -> list[tuple[int, ...]]:
    """Every rank's shape of its tensor ``t`` (one small all_gather over the mesh)."""
    mine = torch.tensor([list(t.shape)], dtype=torch.int64)
    group = _state(mesh).groups[mesh.axis_names]
    every = pin_in_real_trace(funcol.wait_tensor(_all_gather_single(mine, 0, group.pg)))
    return [tuple(int(n) for n in row) for row in every]


def shard_list(value: torch.Tensor, mesh: Mesh) -> tuple[torch.Tensor, ...]:
    return (value,)


def all_true(flags: Sequence[bool], mesh: Mesh) -> bool:
    """Whether ``flags`` hold on every rank (a min all_reduce over the mesh)."""
    st = _state(mesh)
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else "cpu"
    ok = torch.tensor([int(all(flags))], dtype=torch.int32, device=device)
    return bool(run_collective("all_reduce", st.groups[mesh.axis_names], funcol.all_reduce, ok, "min").item())


# -- running an op's local call -------------------------------------------------------------


def compile_call(func: Any, call: Any, cand: Any, out_shapes: Sequence[Any], positional: tuple | None) -> Any:
    """The local computation of one strategy: the local call once, on this rank's shards
    (localised sizes and shard facts are this rank's). ``(args, kwargs, values,
    symbolic) -> flat outputs``."""
    return RankCall(func, cand, call, out_shapes, positional)


class RankCall:
    """The local call on this rank's shards."""

    keeps_symbolic = False

    def __init__(self, func: Any, cand: Any, call: Any, out_shapes: Sequence[Any], positional: tuple | None) -> None:
        self.rank = rank_of(call.mesh)
        self.device_call = DeviceCall(func, cand, [tuple(v.shape) for _, v in call.arrays], out_shapes, (self.rank,))
        self.positional = positional
        self.direct = raw_op(self.device_call.direct)  # the op itself when nothing needs adapting

    def lean(self, args: tuple, kwargs: dict) -> Any:
        """The lone output for arrays at ``positional`` needing no move (dispatch's fast path)."""
        a = with_locals(args, self.positional)
        if self.direct is not None:
            return self.direct(*a, **kwargs)
        return self.device_call(tuple(a), kwargs, self.rank)[0]

    def __call__(self, args: tuple, kwargs: dict, values: dict, symbolic: bool = False) -> list:
        a, k = substitute(args, kwargs, values, self.positional)
        if self.direct is not None:
            out = self.direct(*a, **k)
            return list(out) if isinstance(out, (tuple, list)) else [out]
        return self.device_call(a, k, self.rank)

# -- the Backend protocol ----------------------------------------------------------------------


class DistBackend:
    """One process per mesh device (see the module docstring); implements
    :class:`shardfn.backends.Backend`. This process holds one device, its rank."""

    def run_step(self, step: Step, value: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, *,
                 sym_shape: tuple | None = None) -> torch.Tensor:
        return run_step(step, value, shape, dtype)  # symbolic shard sizes are specialised there

    # the module's functions where they are the method (no wrapper on the hot path)
    rank_of = staticmethod(rank_of)  # not in the protocol: this process's device index
    shard_list = staticmethod(shard_list)
    one_replica = staticmethod(one_replica)
    replicated = staticmethod(replicated)
    from_shards = staticmethod(from_shards)
    global_shape = staticmethod(global_shape)
    all_true = staticmethod(all_true)
    axis_group = staticmethod(axis_group)
    check_replicas = staticmethod(check_replicas)
    compile_call = staticmethod(compile_call)  # dispatch: an op's local call, once per cache entry

    def is_canonical(self, value: torch.Tensor, layout: Layout) -> bool:
        return True  # a rank's shard has one form

    def devices(self, mesh: Mesh) -> tuple[int]:
        return (rank_of(mesh),)

    def storage(self, value: torch.Tensor, layout: Layout, shape: tuple[int, ...]) -> list[torch.Tensor]:
        return [value]

    def from_storage(self, tensors: Sequence[torch.Tensor], layout: Layout, shape: tuple[int, ...]) -> torch.Tensor:
        return tensors[0]

    def shard_reduce(self, value: torch.Tensor, layout: Layout, shape: tuple[int, ...], fn: Callable,
                     neutral: float) -> torch.Tensor:
        mesh = layout.mesh
        axes = set(layout.axis_dim) | set(layout.partial_ops)
        red = fn(value, tuple(range(value.dim()))) if value.dim() else fn(value.reshape(1), (0,))
        replica = any(c != 0 for a, c in zip(mesh.axis_names, mesh.coords(rank_of(mesh))) if a not in axes)
        return torch.full((), neutral, dtype=red.dtype, device=red.device) if replica else red

    def shard(self, value: torch.Tensor, mesh: Mesh, device: int) -> torch.Tensor:
        return value

    def build(self, layout: Layout, shape: tuple[int, ...], make: Callable[[int], torch.Tensor]) -> torch.Tensor:
        return from_shards([make(rank_of(layout.mesh))], layout, shape)

    def empty(self, layout: Layout, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(local_shapes(layout, shape)[rank_of(layout.mesh)], dtype=dtype, device=device)

    def relabel(self, value: torch.Tensor, src: Mesh, dst: Mesh) -> torch.Tensor:
        return value  # device i is rank i on both meshes

    def pack_local(self, shards: Sequence[Any], mesh: Mesh) -> Any:
        return shards[0]

    def unpack_local(self, local: Any, mesh: Mesh) -> list:
        if not isinstance(local, torch.Tensor):
            raise ShardingError(f"from_local on the dist backend takes this rank's tensor, got {type(local).__name__}")
        return [local]

    def output_shape(self, outs: Sequence[torch.Tensor], layout: Layout, exchange: bool) -> tuple[int, ...]:
        if not exchange:
            return global_shape(outs, layout, None)
        from . import local

        metas = [torch.empty(s, device="meta") for s in all_local_shapes(outs[0], layout.mesh)]
        return local.global_shape(metas, layout, None)

    def check_same_meta(self, mesh: Mesh, shape: Sequence[int], dtype: torch.dtype, what: str) -> None:
        check_same_meta(mesh, shape, dtype, what)

    def zero_cotangent(self, like: torch.Tensor) -> torch.Tensor:
        # built from the cotangent and still on its graph (a masked fill: exact zeros,
        # NaN included): a constant zero would let AOTAutograd's partitioner move the
        # collectives it feeds into the forward graph of some ranks only, and a cut edge
        # would make a second derivative skip collectives on some ranks (a gloo crash)
        return like.masked_fill(torch.ones((), dtype=torch.bool, device=like.device), 0)

    def keeps_symbolic(self, value: torch.Tensor) -> bool:
        return False  # plans run on concrete shard sizes

    def shard_map(self, f: Callable, inputs: Any, out_specs: Any, check_vma: bool, kwargs: dict) -> Any:
        """This rank's part of the body, collectives through ``transforms/shard_map/dist.py``."""
        return SHARD_MAP_RUNNERS["dist"](f, inputs, out_specs, check_vma, kwargs)

    def submesh(self, mesh: Mesh, axes: Sequence[str]) -> Mesh:
        from ..values.mesh import submesh

        coords = _state(mesh).coords
        fixed = tuple((a, coords[i]) for i, a in enumerate(mesh.axis_names) if a not in axes)
        return submesh(mesh, axes, fixed)

    def default_device_type(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"
