"""``as_strided`` and ``as_strided_scatter`` of a dense input, read as a linear map of indices.

Autograd reads and writes a view of a ShardedArray through these ops where it cannot replay the
view (``CopySlices`` of an in-place op on a view under ``torch.func``): a slice, a step slice, a
select, a transpose or permute, a diagonal, an unsqueeze, a flatten or any chain of them. Each
output dim steps along the input's dims (or along a group of dims adjacent in memory that it runs
across, as a flatten does); an input dim that one output dim takes whole, step 1, keeps its
sharding, the others are whole, and every device runs the op on its shard with its own strides.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import attrs
import torch

from ..values.layout import Layout
from .base import Candidate, OpCall, bind

aten = torch.ops.aten


@attrs.frozen
class StridedMap:
    """``as_strided(size, stride, at)`` of a dense, non-overlapping tensor as index arithmetic:
    its live (size > 1) dims in ``groups`` (dims adjacent in memory, smallest stride first; one
    dim each unless an output dim runs across several), the view's first index ``starts`` along
    each group, ``coef[j][g]`` the step of output dim ``j`` along group ``g`` (0 for size-1
    output dims), and ``kept``: (output dim, input dim) pairs where the output dim is the input
    dim whole (step 1 from 0: its sharding can stay)."""

    groups: tuple[tuple[int, ...], ...]
    starts: tuple[int, ...]
    coef: tuple[tuple[int, ...], ...]
    kept: tuple[tuple[int, int], ...]


def strided_map(shape: Sequence[int], strides: Sequence[int], offset: int, size: Sequence[int],
                stride: Sequence[int], at: int) -> StridedMap | None:
    """The map of ``as_strided(size, stride, at)`` on a tensor of ``shape``, ``strides`` and
    storage ``offset``; None unless that tensor is dense and non-overlapping, the view is not
    empty and lies within its elements."""
    if len(size) != len(stride) or not all(isinstance(n, int) for n in (*size, *stride, at)):
        return None
    if any(s < 0 for s in stride) or 0 in size or 0 in shape:
        return None
    live = sorted((i for i in range(len(shape)) if shape[i] > 1), key=lambda i: strides[i])
    expect = 1
    for i in live:  # dense and non-overlapping: each stride the product of the smaller dims' sizes
        if strides[i] != expect:
            return None
        expect *= shape[i]
    rem = at - offset
    if rem < 0:
        return None
    groups = [[i] for i in live]
    moving = [j for j in range(len(size)) if size[j] > 1]
    while True:
        gshape = [math.prod(shape[i] for i in g) for g in groups]
        gstride = [strides[g[0]] for g in groups]
        starts, coef = _digits(rem, gstride), {j: _digits(stride[j], gstride) for j in moving}
        if starts is None or any(c is None for c in coef.values()):
            return None
        over = [k for k in range(len(groups))
                if starts[k] + sum((size[j] - 1) * coef[j][k] for j in moving) >= gshape[k]]
        if not over:
            break
        k = over[0]
        if k == len(groups) - 1:
            return None  # past the tensor's last element
        groups[k: k + 2] = [groups[k] + groups[k + 1]]  # an output dim runs across dims k, k + 1
    kept = []
    for g, dims in enumerate(groups):
        users = [j for j in moving if coef[j][g]]
        if len(dims) == 1 and starts[g] == 0 and len(users) == 1:
            j = users[0]
            if coef[j][g] == 1 and size[j] == shape[dims[0]] and not any(coef[j][h] for h in range(len(groups)) if h != g):
                kept.append((j, dims[0]))
    zero = (0,) * len(groups)
    return StridedMap(tuple(tuple(g) for g in groups), tuple(starts),
                      tuple(tuple(coef[j]) if j in coef else zero for j in range(len(size))), tuple(kept))


def _digits(value: int, gstride: list[int]) -> list[int] | None:
    """``value`` in the mixed radix of the groups' strides (largest first; the largest group's
    digit unbounded)."""
    out = [0] * len(gstride)
    for k in reversed(range(len(gstride))):
        out[k], value = divmod(value, gstride[k])
    return None if value else out


@attrs.frozen
class _Strided:
    """One device's ``as_strided`` view of its shard: the map applied with the shard's own
    strides, the kept dims at their local lengths (a shard whose merged groups are not
    adjacent in its memory is made contiguous first)."""

    smap: StridedMap
    size: tuple[int, ...]

    def __call__(self, x: torch.Tensor, *rest: Any, **facts: Any) -> torch.Tensor:
        m = self.smap
        if not all(_adjacent(x, g) for g in m.groups):
            x = x.contiguous()
        gstride = [x.stride(g[0]) for g in m.groups]
        size = list(self.size)
        for j, i in m.kept:
            size[j] = x.shape[i]
        stride = [sum(c * s for c, s in zip(cj, gstride)) for cj in m.coef]
        at = x.storage_offset() + sum(s * st for s, st in zip(m.starts, gstride))
        return x.as_strided(size, stride, at)


def _adjacent(x: torch.Tensor, dims: tuple[int, ...]) -> bool:
    """Whether ``dims`` (smallest stride first) are one run of ``x``'s memory."""
    return all(x.stride(b) == x.stride(a) * x.shape[a] for a, b in zip(dims, dims[1:]))


@attrs.frozen
class _StridedScatter:
    """One device's ``as_strided_scatter``: a copy of its ``input`` shard with ``src`` written
    into its view."""

    view: _Strided

    def __call__(self, x: torch.Tensor, src: torch.Tensor, *rest: Any, **facts: Any) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        self.view(out).copy_(src)
        return out


def _dims(lay: Layout, kept: dict[int, int], n: int) -> tuple:
    """``lay``'s dims with every input dim not kept whole."""
    ins = set(kept.values())
    return tuple(d if i in ins else () for i, d in enumerate(lay.dims[:n]))


def _geometry(x: Any) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    with torch._C.DisableTorchFunctionSubclass():
        return tuple(x.shape), tuple(x.stride()), x.storage_offset()


@attrs.frozen
class AsStrided:
    """as_strided(x, size, stride, offset) of a dense ``x``: the dims an output dim takes whole
    keep their sharding (and pending sums pass: the view is linear), the others are whole."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        if len(call.arrays) != 1:
            return []
        (_, x), = call.arrays
        b = bind(call.func, call.args, call.kwargs)
        size, stride = list(b["size"]), list(b["stride"])
        shape, strides, offset = _geometry(x)
        at = b.get("storage_offset")
        smap = strided_map(shape, strides, offset, size, stride, offset if at is None else at)
        if smap is None:
            return []
        kept = dict(smap.kept)
        lay = x._layout
        src = Layout(call.mesh, _dims(lay, kept, len(shape)), lay.partial)
        out = Layout(call.mesh, tuple(lay.dims[kept[j]] if j in kept else () for j in range(len(size))), lay.partial)
        return [Candidate((src,), (out,), local_fn=_Strided(smap, tuple(size)))]


@attrs.frozen
class AsStridedScatter:
    """as_strided_scatter(input, src, size, stride, offset) whose view is one of a dense
    ``input`` with storage offset 0 (the write of CopySlices' gradient; torch applies the view
    to a copy of ``input``): ``input`` and the output sharded alike, ``src`` as the view maps
    it, on the dims the view takes whole (as ``input`` or as ``src`` is); the others whole."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        if len(call.arrays) != 2 or [p for p, _ in call.arrays] != [0, 1]:
            return []
        (_, x), (_, v) = call.arrays
        b = bind(call.func, call.args, call.kwargs)
        size, stride = list(b["size"]), list(b["stride"])
        shape, strides, offset = _geometry(x)
        at = b.get("storage_offset")
        if offset or tuple(v.shape) != tuple(size):
            return []
        smap = strided_map(shape, strides, 0, size, stride, 0 if at is None else at)
        if smap is None or any(n > 1 and not any(c) for n, c in zip(size, smap.coef)):
            return []  # (a stride-0 dim writes one element many times: torch raises)
        kept = dict(smap.kept)
        fn = _StridedScatter(_Strided(smap, tuple(size)))
        partial = x._layout.partial if v._layout.partial == x._layout.partial else ()
        source = {i: j for j, i in kept.items()}
        by_src = tuple(v._layout.dims[source[i]] if i in source else () for i in range(len(shape)))
        out = []
        for dims in (_dims(x._layout, kept, len(shape)), by_src):
            if any(c.in_layouts[0].dims == dims for c in out):
                continue
            inp = Layout(call.mesh, dims, partial)
            view = Layout(call.mesh, tuple(dims[kept[j]] if j in kept else () for j in range(len(size))), partial)
            out.append(Candidate((inp, view), (inp,), local_fn=fn))
        return out


TABLE = {
    aten.as_strided.default: AsStrided(),
    aten.as_strided_scatter.default: AsStridedScatter(),
}
