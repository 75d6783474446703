"""Plan steps on the dist backend: each step of a plan run on this rank's shard through the
mesh group's collectives (``dist_collectives``); uneven pieces are padded where a collective
needs equal sizes, and an exchange sends exact per-piece routes in one all_to_all."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from ..plans.planner import Step
from ..values.layout import device_box, local_shapes, split_range
from ..values.mesh import Mesh
from .dist_collectives import _all_gather, _all_to_all, _native_reduce, _ordered, _scatter_ordered
from .dist_groups import Group, _group, _state
from .local_values import reduce_dim, sum_neutral


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
    reduced = reduce_dim(buf.view(group.size, mine), 0, step.op).view(-1)
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
    return reduce_dim(buf.view(group.size, *mine), 0, step.op).squeeze(0)


def _reduce_local_step(step: Step, x: torch.Tensor, shape: tuple, mesh: Mesh) -> torch.Tensor:
    if step.dim is not None:
        return _pad_local_step(step, x, shape, mesh)
    if step.op == "sum" and _axis_pos(step, mesh) != 0:
        return torch.full_like(x, sum_neutral(x.dtype))
    return x


def _pad_local_step(step: Step, x: torch.Tensor, shape: tuple, mesh: Mesh) -> torch.Tensor:
    """reduce_local of a shard (``step.dim`` set): this device's piece of that dim in place
    in the group's whole extent, zeros around it (a pending sum over the axis)."""
    rank, d = _state(mesh).rank, step.dim
    (lo, hi), (base, end) = device_box(step.src, shape, rank)[d], device_box(step.dst, shape, rank)[d]
    before, after = lo - base, end - hi
    return torch.constant_pad_nd(x, (0, 0) * (x.dim() - 1 - d) + (before, after), sum_neutral(x.dtype))


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
