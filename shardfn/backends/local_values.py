"""The local backend's values: every device of the mesh simulated in this process.

A value is either *stacked*, one tensor of shape ``(d_0, ..., d_{m-1}, *local_shape)``
when every shard has the same shape, or a tuple of per-device shards (row-major) for
uneven layouts. In a stacked value ``d_k`` is the size of mesh axis k, or 1 where the
layout does not vary over axis k (the axis shards no dim and is not pending a reduction):
each distinct shard is stored once, and an op on stacked values runs once, broadcasting
over the mesh dims, so a computation replicated over an axis costs what it costs once.
:func:`full` expands the size-1 mesh dims (a view) for code that needs every device's
shard; :func:`compact` cuts them back to size 1.
"""

from __future__ import annotations

import functools
from typing import Sequence, Union

import torch

from ..values.errors import ShardingError
from ..values.layout import Layout, is_even
from ..values.mesh import Mesh

Value = Union[torch.Tensor, tuple]


# -- what a device's part of a pending sum holds ---------------------------------------------

PENDING_PARTS = ("device", "shares")
SHARES = [False]  # the mode, read on every pending product and every call on pending parts (one list lookup)


def set_pending_parts(mode: str) -> str:
    """How the local backend stores a value pending a sum that a product over a contraction
    split across the pending axes made (a row-parallel product, a weight gradient of
    dp-split rows); returns the previous mode.

    - ``"device"`` (the default): each simulated device holds its own part, what a real
      device (and the dist backend) holds: one GEMM per device's block and, when the sum is
      needed, a sum of the parts.
    - ``"shares"``: the sum is computed by one GEMM over the whole contraction and every
      device holds an equal share of it (``sum / n``, one stored part expanded over the
      pending axes); calls on such parts run once, and a reduction adds nothing up. Sums,
      values, layouts and collectives are those of ``"device"``; ``local_shards()`` of a
      pending value shows the shares, not the parts a real device would hold.

    A compiled function keeps the mode it was traced in."""
    if mode not in PENDING_PARTS:
        raise ShardingError(f"set_pending_parts: mode {mode!r} is not one of {PENDING_PARTS}")
    old = PENDING_PARTS[SHARES[0]]
    SHARES[0] = mode == "shares"
    return old


def shares() -> bool:
    """Whether pending sums of split contractions are stored as equal shares (:func:`set_pending_parts`)."""
    return SHARES[0]


# -- conversions between the two forms ----------------------------------------------------


def varying(layout: Layout) -> tuple[bool, ...]:
    """Per mesh axis: whether shards differ along it (it shards a dim or is pending): ``Layout.varying``."""
    return layout.varying


def full(value: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """A stacked value with every mesh dim at its axis size (size-1 dims expanded)."""
    m = mesh.ndim
    if tuple(value.shape[:m]) == mesh.shape:
        return value
    return value.expand(*mesh.shape, *value.shape[m:])


def compact(value: Value, layout: Layout) -> Value:
    """A stacked value with the mesh dims ``layout`` does not vary over cut to size 1."""
    if isinstance(value, tuple):
        return value
    for k, v in enumerate(layout.varying):
        if not v and value.shape[k] != 1:
            value = value.narrow(k, 0, 1)
    return value


def settle(value: torch.Tensor, layout: Layout) -> torch.Tensor:
    """An op's stacked output in its canonical form for ``layout``: size 1 on the axes
    the layout does not vary over, the axis size on the others (a size-1 output there
    was computed from inputs that are the same on every device, so it is too)."""
    mesh = layout.mesh
    for k, v in enumerate(layout.varying):
        n = value.shape[k]
        if v and n == 1 and mesh.shape[k] != 1:
            value = value.expand(*value.shape[:k], mesh.shape[k], *value.shape[k + 1:])
        elif not v and n != 1:
            value = value.narrow(k, 0, 1)
    return value


def canonical_sizes(layout: Layout) -> tuple[int, ...]:
    """The mesh-dim sizes of a stacked value in :func:`settle`'s form for ``layout`` (``Layout.varying_sizes``)."""
    return layout.varying_sizes


def is_canonical(value: Value, layout: Layout) -> bool:
    """Whether ``value`` is stored as op outputs are (:func:`settle`; per-device tuples
    have one form)."""
    return isinstance(value, tuple) or tuple(value.shape[:layout.mesh.ndim]) == layout.varying_sizes


def batch_consistent(ins: Sequence[torch.Tensor], outs: Sequence[torch.Tensor | None], mesh: Mesh,
                     layouts: Sequence[Layout | None] | None = None) -> bool:
    """Whether outputs of a local op run on size-1-compacted stacked inputs broadcast like
    the inputs: each mesh dim 1 or the axis size, and never 1 where an input varies and
    the output's layout does too (an op that does not broadcast over leading dims would
    have dropped devices; an output the same on every device, such as a ``new_zeros``,
    may be size 1 there)."""
    wides = [any(t.shape[k] != 1 for t in ins) for k in range(mesh.ndim)]
    for i, o in enumerate(outs):
        if o is None:
            continue
        if o.dim() < mesh.ndim:  # the op reduced the mesh dims too (an all-dims reduction unbatched)
            return False
        vary = layouts[i].varying if layouts is not None and layouts[i] is not None else (True,) * mesh.ndim
        for k, g in enumerate(mesh.shape):
            n = o.shape[k]
            if g != 1 and (n != 1 and n != g or (wides[k] and vary[k] and n == 1)):
                return False
    return True


def parts(value: Value, mesh: Mesh) -> tuple[torch.Tensor, ...]:
    """Per-device shards (row-major), as views when the value is stacked."""
    if isinstance(value, tuple):
        return value
    out = [full(value, mesh)]
    for _ in range(mesh.ndim):
        out = [t for v in out for t in v.unbind(0)]
    return tuple(out)


def stack(shards: Sequence[torch.Tensor], mesh: Mesh) -> torch.Tensor:
    return torch.stack(list(shards)).view(*mesh.shape, *shards[0].shape)


@functools.lru_cache(maxsize=4096)
def replica_of(layout: Layout) -> tuple[int, ...]:
    """Per device: the device with coordinate 0 on the axes ``layout`` does not vary over
    (the one whose shard it replicates; itself when it holds a distinct shard)."""
    mesh = layout.mesh
    vary = layout.varying
    return tuple(mesh.device_at([c if v else 0 for c, v in zip(mesh.coords(d), vary)]) for d in range(mesh.size))


def from_parts(shards: Sequence[torch.Tensor], layout: Layout, shape: tuple[int, ...]) -> Value:
    """Store shards in the preferred form for this layout, each distinct shard once (even:
    the shards of :func:`replica_of`'s devices stacked at :func:`canonical_sizes`, a lone
    one viewed, not copied: per-call constants such as a fused kernel's RNG state, which
    torch may return on another device, never meet in a kernel; uneven: replicas share
    their first device's tensor)."""
    first = replica_of(layout)
    if is_even(layout, shape):
        own = [s for d, s in enumerate(shards) if first[d] == d]
        if len(own) == 1:
            return own[0].view(*layout.varying_sizes, *own[0].shape)
        return torch.stack(own).view(*layout.varying_sizes, *own[0].shape)
    return tuple(shards[first[d]] for d in range(len(shards)))


def replicated(whole: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """A stacked value in which every device holds ``whole`` (size 1 on every mesh dim). It
    keeps ``whole`` as its squeezed form (``local_calls.StackedCall._once`` reads it instead
    of indexing device 0's part: ``whole`` is its base, so no reference cycle)."""
    value = whole.view((1,) * mesh.ndim + tuple(whole.shape))
    value._squeezed = whole
    return value


def device_view(value: Value, mesh: Mesh, device: int) -> torch.Tensor:
    if isinstance(value, tuple):
        return value[device]
    return value[tuple(c if n > 1 else 0 for c, n in zip(mesh.coords(device), value.shape))]


# -- reductions -----------------------------------------------------------------------


def reduce_dim(x: torch.Tensor, dim: int, op: str) -> torch.Tensor:
    """Reduce ``x`` over ``dim`` (kept, size 1) by ``op``: sum, avg (floor division for
    integers), max or min. complex32 has no CPU sum kernel: its parts add in complex64 (torch's
    own sum of empty complex32 shards succeeds, so the pending parts must add too)."""
    if x.dtype == torch.complex32 and op in ("sum", "avg"):
        return reduce_dim(x.to(torch.complex64), dim, op).to(x.dtype)
    if op == "sum":
        if x.dtype in _CHAINED and 2 <= x.shape[dim] <= 8:
            if x.is_complex():  # component by component, as torch.sum and a collective add
                dim = dim % x.dim()
                return torch.view_as_complex(_added(torch.view_as_real(x.resolve_conj().resolve_neg()), dim))
            return _added(x, dim)
        return added_sign(x.sum(dim, keepdim=True, dtype=x.dtype), x, dim)
    if op == "avg":
        if x.dtype in _CHAINED and not x.is_complex() and 2 <= x.shape[dim] <= 8:
            # the parts added as a collective adds them, then divided (dist's average of a native
            # sum): no mean kernel and no sign pass over the parts (7 ops where 2 parts take 3)
            return _added(x, dim).div_(x.shape[dim])
        if x.is_floating_point() or x.is_complex():
            return added_sign(x.mean(dim, keepdim=True), x, dim)
        return torch.div(x.sum(dim, keepdim=True, dtype=x.dtype), x.shape[dim], rounding_mode="floor")
    if op == "max":
        return x.amax(dim, keepdim=True)
    return x.amin(dim, keepdim=True)


_CHAINED = frozenset({torch.float32, torch.float64, torch.complex64, torch.complex128})


def _added(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The parts of ``x`` over ``dim`` (2 to 8 of them) added as a collective adds them, so with
    IEEE's zero signs and no pass to fix them (``added_sign`` reads every part again: 5 ops and a
    second read of the parts on every all-reduce). Up to 4 parts add one by one, the order of
    torch's sum kernel (its bits); more add in halves (log2 ops, one add each), as a
    reduction tree would. 16-bit floats take the sum kernel (it accumulates in float32).
    Complex parts add as their real views: torch's complex ``add`` computes ``a + alpha * b``, and
    the product by ``alpha = 1+0j`` turns ``-inf j`` into ``nan - inf j`` (fuzzer seed 35004348)."""
    g = x.shape[dim]
    if g <= 4:
        first, second, *rest = x.split_with_sizes((1,) * g, dim)  # the parts as views: one op, not a narrow each
        total = torch.add(first, second)
        for part in rest:
            total.add_(part)
        return total
    h = g // 2
    if g % 2:
        low, mid, high = x.split_with_sizes((h, 1, h), dim)
        total = torch.cat([torch.add(low, high), mid], dim)
    else:
        low, high = x.split_with_sizes((h, h), dim)
        total = torch.add(low, high)
    return _added(total, dim) if total.shape[dim] > 1 else total


def added_many(xs: Sequence[torch.Tensor], dim: int) -> list[torch.Tensor] | None:
    """:func:`_added` of several values at once (a coalesced bucket's leaves, each with the
    same number of parts over ``dim``): the same adds in the same order, on each value's parts
    viewed by one split, every level's adds of every value one ``_foreach_add`` (one
    multi-tensor kernel on a GPU, not one add per value and level), and no concatenation of
    the values into one buffer. Real floating dtypes of :data:`_CHAINED`; None otherwise."""
    g = xs[0].shape[dim]
    if xs[0].dtype not in _CHAINED or xs[0].is_complex() or not 2 <= g <= 8:
        return None
    n = len(xs)
    cut = [x.split_with_sizes((1,) * g, dim) for x in xs]  # each value's parts as views: one op
    cols = [[c[j] for c in cut] for j in range(g)]  # part j of every value
    while len(cols) > 4:  # halves added (a middle part, of an odd count, kept), as ``_added``
        h = len(cols) // 2
        low = [t for c in cols[:h] for t in c]
        high = [t for c in cols[len(cols) - h:] for t in c]
        summed = torch._foreach_add(low, high)
        cols = [summed[j * n:(j + 1) * n] for j in range(h)] + ([cols[h]] if len(cols) % 2 else [])
    total = torch._foreach_add(cols[0], cols[1])  # then one by one, the order of torch's sum kernel
    for c in cols[2:]:
        torch._foreach_add_(total, c)
    return total


def added_sign(total: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
    """``total`` (a sum or mean of ``x`` over ``dim``, kept) with the zero sign of adding the parts
    up: torch's sum kernel starts from +0, so parts that are all -0 total +0, where their sum by
    additions (IEEE: -0 + -0 = -0), which a collective's ring computes, is -0. ``-(a.sum())`` of a
    pending ``a`` (each part +0, negated) then keeps torch's -0, and both backends agree.
    Only all -0 parts change: a total of parts all signed negative is -0 or negative."""
    if not (x.is_floating_point() or x.is_complex()):
        return total
    if x.is_conj() or x.is_neg():  # lazy flags: the bits read below are the memory's
        x = x.resolve_conj().resolve_neg()
    if x.is_complex():
        dim = dim % x.dim()
        return torch.view_as_complex(added_sign(torch.view_as_real(total), torch.view_as_real(x), dim))
    # every part's sign bit set: the largest of their bits as integers is negative (one max over
    # the parts; a bool all() over a leading dim is many times slower than the sum itself)
    neg = x.view(_BITS[x.dtype]).amax(dim, keepdim=True) < 0
    return total.copysign(torch.where(neg, -1.0, total))


_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def sum_neutral(dtype: torch.dtype) -> complex | float | int:
    """What the devices that hold no part of a pending sum hold: -0.0 for floats (IEEE's additive
    identity: x + -0 is x for every x, where +0 turns a -0 into +0, so ``pending + y`` of a
    replicated -0 stays -0 as torch's ``total + y`` does), ``-0.0-0.0j`` for complex, else 0."""
    if dtype.is_complex:
        return complex(-0.0, -0.0)
    return -0.0 if dtype.is_floating_point else 0


def sum_of_copies(x: torch.Tensor, n: int) -> torch.Tensor:
    """The sum of ``n`` copies of ``x`` (a part the same on every device of an axis) without
    adding them up: ``x * n``, complex component by component (as a sum of the copies, and a
    collective, add them: ``(inf+0j) * 4`` is ``inf+nanj`` where the sum is ``inf+0j``)."""
    if x.is_complex() and x.dtype != torch.complex32:
        return torch.view_as_complex(torch.view_as_real(x) * n)
    return x * n


def reduce_parts(shards: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """Reduce a list of same-shape parts (used by the uneven path and by gathers)."""
    return reduce_dim(torch.stack(list(shards)), 0, op).squeeze(0)
