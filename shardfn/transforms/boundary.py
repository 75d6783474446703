"""Differentiable crossings between ShardedArrays and per-device local tensors.

Used by shard_map, local_map and with_sharding_constraint. Every Function here has a
separate ``setup_context`` so it composes with torch.func transforms, and its backward
works on raw backend values (no nested autograd).

Gradient conventions (they make gradients through a transform equal those of the
unsharded computation):

- An input replicated over an axis is used by every device of it, so its per-device
  gradients are summed (they form a Partial(sum) gradient).
- An output replicated over an axis is one value: its cotangent goes to one replica
  (the device with coordinate 0 there); the other replicas get zero. An output that is
  Partial over an axis is a sum, so every device gets the cotangent.
"""

from __future__ import annotations

import math

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch._C._functorch as _ft

from ..arrays.array import ShardedArray, wrap
from ..arrays.functorch import insert_dim
from ..arrays.local_shards import part_weights
from ..arrays.redistribute import moved, raw_reshard
from ..backends.registry import backend_for
from ..backends.local_values import full, settle
from ..values.layout import Layout, local_shapes
from ..values.mesh import Mesh

aten = torch.ops.aten


def used_axes(layout: Layout) -> set[str]:
    """Mesh axes a layout shards a dim over or holds a pending reduction over."""
    return set(layout.axis_dim) | set(layout.partial_ops)


def summed_grad_layout(layout: Layout) -> Layout:
    """Layout of the per-device gradients of an input read with ``layout``: replicated
    axes become Partial(sum); pending reductions become replicated."""
    free = [a for a in layout.mesh.axis_names if a not in used_axes(layout) and layout.mesh.axis_size(a) > 1]
    return layout.without_partial().with_partial({a: "sum" for a in free})


def unwrapped(t: Any) -> Any:
    """``t`` without torch.func wrappers (cotangents reach backward wrapped under
    torch.func.grad; the backward here only moves data, first order)."""
    while isinstance(t, torch.Tensor) and _ft.is_functorch_wrapped_tensor(t):
        t = _ft.get_unwrapped(t)
    return t


def grad_value(ct: Any, layout: Layout) -> Any:
    """The backend value of cotangent ``ct`` (a ShardedArray or a full tensor) in ``layout``."""
    from ..arrays.redistribute import raw_distribute

    ct = unwrapped(ct)
    if isinstance(ct, ShardedArray):
        return raw_reshard(ct, layout)
    return raw_distribute(ct, layout)


def my_devices(mesh: Mesh) -> list[int]:
    """Devices whose shards this process holds (all on local, this rank on dist)."""
    return list(backend_for(mesh).devices(mesh))


@functools.lru_cache(maxsize=4096)
def first_replica(layout: Layout, dev: int) -> int:
    """The device holding the first replica of ``dev``'s shard: coordinate 0 on every
    mesh axis the layout neither shards nor reduces over."""
    mesh = layout.mesh
    keep = used_axes(layout)
    d = 0
    for a, n, c in zip(mesh.axis_names, mesh.shape, mesh.coords(dev)):
        d = d * n + (c if a in keep else 0)
    return d


def first_replicas(outs: Sequence[Any], layout: Layout) -> list:
    """Per held device, its entry of ``outs`` (one per held device) or, when this
    process also holds the first replica of its shard, that replica's entry."""
    held = my_devices(layout.mesh)
    pos = {d: i for i, d in enumerate(held)}
    return [outs[pos.get(first_replica(layout, d), i)] for i, d in enumerate(held)]


def _float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


# -- stacked (even) crossings: ShardedArray <-> canonical tensor ---------------------------------
#
# EnterStacked and ExitStacked are each other's transposes, so their backwards are built
# from each other (differentiable to any order), and each has jvp and vmap rules: the
# crossings compose with torch.func.grad/jvp/vmap/jacfwd and nested autograd.


def stacked_modes(layout: Layout, dims: tuple[int, ...]) -> tuple[str, ...]:
    """How each mesh dim of a stacked value in ``layout`` becomes the canonical dim of
    size ``dims[k]``: "keep" it, take the "first" replica (an axis the layout neither
    shards nor reduces over), or "sum" the copies (tiled or pending-sum copies of an
    invariant value)."""
    mesh = layout.mesh
    keep = used_axes(layout)
    return tuple(
        "keep" if d == n else ("sum" if a in keep else "first")
        for a, n, d in zip(mesh.axis_names, mesh.shape, dims)
    )


def _sum_partial(layout: Layout, modes: tuple[str, ...]) -> Layout:
    """``layout`` with a pending sum over each "sum" axis it does not use (the layout in
    which expanding a cotangent transposes summing the copies)."""
    extra = {a: "sum" for a, m in zip(layout.mesh.axis_names, modes) if m == "sum" and a not in used_axes(layout)}
    return layout.with_partial(extra) if extra else layout


def _as_sharded(t: Any, layout: Layout) -> Any:
    """A cotangent or tangent as an array in ``layout`` (plain tensors are full values)."""
    from ..arrays.functorch import base_array
    from ..arrays.redistribute import distribute, reshard

    if not isinstance(t, ShardedArray) and base_array(t) is None:
        t = distribute(t, Layout(layout.mesh, ((),) * t.dim()))
    return reshard(t, layout)


class EnterStacked(torch.autograd.Function):
    """ShardedArray (even) -> canonical tensor: the stacked shards, each mesh dim kept,
    cut to its first replica, or summed over (``modes``, see :func:`stacked_modes`)."""

    @staticmethod
    def forward(x: ShardedArray, modes: tuple[str, ...]) -> torch.Tensor:
        t = full(x._local, x.mesh)
        for k, mode in enumerate(modes):
            if mode == "first":
                t = t.narrow(k, 0, 1)
            elif mode == "sum":
                t = t.sum(k, keepdim=True, dtype=t.dtype)
        # the body may write into its inputs: a copy-on-write clone (no copy until then)
        # keeps that write from reaching the array's shards
        return aten._lazy_clone.default(t)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        from ..arrays.functorch import layout_of

        x, modes = inputs
        ctx.meta = (layout_of(x), tuple(x.shape), modes)
        if not _float(x):
            ctx.mark_non_differentiable(output)

    @staticmethod
    def backward(ctx: Any, ct: torch.Tensor) -> Any:
        layout, shape, modes = ctx.meta
        return ExitStacked.apply(ct, _sum_partial(layout.without_partial(), modes), shape), None

    @staticmethod
    def jvp(ctx: Any, t: Any, _: Any) -> Any:
        layout, _, modes = ctx.meta
        return EnterStacked.apply(_as_sharded(t, layout), modes)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: Any, modes: tuple[str, ...]) -> tuple:
        from ..arrays.functorch import layout_of
        from ..arrays.redistribute import reshard

        b = in_dims[0]
        if b is None:
            return EnterStacked.apply(x, modes), None
        layout = layout_of(x)
        if layout.dims[b]:  # the vmapped dim is sharded: gather it (the body maps over it)
            x = reshard(x, Layout(layout.mesh, layout.dims[:b] + ((),) + layout.dims[b + 1:], layout.partial))
        return EnterStacked.apply(x, modes), layout.mesh.ndim + b


def _pending_sums(layout: Layout) -> Layout:
    """``layout`` with each pending reduction a sum (that of its parts' weighted shares)."""
    return Layout(layout.mesh, layout.dims, tuple((a, "sum") for a, _ in layout.partial))


def _stacked_weights(value: Any, modes: tuple[str, ...]) -> torch.Tensor | None:
    """The shares of a pending avg / max / min output's parts (``part_weights``) in the
    stacked form of ``modes``; a "sum" axis (identical copies, whose cotangents are
    summed) takes its first copy's share, as every copy has the same."""
    value = unwrapped(value)  # the array under torch.func's wrappers
    if not value._layout.partial:
        return None
    weights = part_weights(value)
    if weights is None:
        return None
    return EnterStacked.forward(weights, tuple("first" if m == "sum" else m for m in modes))


class ExitStacked(torch.autograd.Function):
    """Canonical tensor -> ShardedArray in ``layout`` (stored in the local backend's
    canonical form for the layout)."""

    @staticmethod
    def forward(c: torch.Tensor, layout: Layout, shape: tuple[int, ...]) -> ShardedArray:
        return wrap(settle(c, layout), layout, shape, c.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        c, layout, shape = inputs
        modes = stacked_modes(layout, tuple(c.shape[:layout.mesh.ndim]))
        ctx.meta = (layout, shape, modes, _stacked_weights(output, modes))
        if not _float(c):
            ctx.mark_non_differentiable(output)

    @staticmethod
    def backward(ctx: Any, ct: Any) -> Any:
        layout, _, modes, weights = ctx.meta
        # an invariant value: tiled / summed copies add up, replicas count once
        g = EnterStacked.apply(_as_sharded(ct, layout.without_partial()), modes)
        return (g if weights is None else g * weights), None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, _: Any, __: Any) -> Any:
        layout, shape, _, weights = ctx.meta
        if weights is None:
            return ExitStacked.apply(t, layout, shape)
        return ExitStacked.apply(t * weights, _pending_sums(layout), shape)  # the parts' weighted sum

    @staticmethod
    def vmap(info: Any, in_dims: tuple, c: torch.Tensor, layout: Layout, shape: tuple[int, ...]) -> tuple:
        from ..arrays.functorch import insert_dim

        b = in_dims[0]
        if b is None:
            return ExitStacked.apply(c, layout, shape), None
        c = c.movedim(b, layout.mesh.ndim)
        return ExitStacked.apply(c, insert_dim(layout, 0), (info.batch_size, *shape)), 0


# -- per-device crossings: ShardedArray <-> list of local tensors ------------------------------------


class EnterParts(torch.autograd.Function):
    """ShardedArray -> this process's local shards (one per device it holds).

    The per-device gradients are read with ``grad_layout``; with ``resolve`` they are
    then resharded to the input's layout. The backward is built from differentiable
    crossings (ExitParts, reshard), so derivatives of any order work; jvp and vmap rules
    make it compose with torch.func.
    """

    @staticmethod
    def forward(x: ShardedArray, grad_layout: Layout, resolve: bool) -> tuple:
        return tuple(s.view(s.shape) for s in x.local_shards())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        from ..arrays.functorch import layout_of

        x, grad_layout, resolve = inputs
        ctx.meta = (layout_of(x), grad_layout, resolve, tuple(x.shape), x.dtype)
        if not _float(x):
            ctx.mark_non_differentiable(*output)

    @staticmethod
    def backward(ctx: Any, *cts: Any) -> Any:
        from ..arrays.redistribute import reshard

        layout, grad_layout, resolve, shape, dtype = ctx.meta
        shapes = local_shapes(grad_layout, shape)
        cts = [torch.zeros(shapes[d], dtype=dtype) if c is None else c for d, c in zip(my_devices(layout.mesh), cts)]
        grad = ExitParts.apply(grad_layout, shape, False, *cts)
        if resolve and grad_layout != layout.without_partial():
            grad = reshard(grad, layout.without_partial())
        return grad, None, None

    @staticmethod
    def jvp(ctx: Any, t: Any, _: Any, __: Any) -> Any:
        layout, grad_layout, resolve, _, _ = ctx.meta
        return EnterParts.apply(_as_sharded(t, layout), grad_layout, resolve)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: Any, grad_layout: Layout, resolve: bool) -> tuple:
        from ..arrays.functorch import insert_dim, layout_of
        from ..arrays.redistribute import reshard

        b = in_dims[0]
        if b is None:
            outs = EnterParts.apply(x, grad_layout, resolve)
            return outs, (None,) * len(outs)
        layout = layout_of(x)
        if layout.dims[b]:  # the vmapped dim is sharded: gather it (the body maps over it)
            x = reshard(x, Layout(layout.mesh, layout.dims[:b] + ((),) + layout.dims[b + 1:], layout.partial))
        outs = EnterParts.apply(x, insert_dim(grad_layout, b), resolve)
        return outs, (b,) * len(outs)


class ExitParts(torch.autograd.Function):
    """Local outputs (one per device this process holds) -> ShardedArray in ``layout``.

    Replicas are taken from the first replica. With ``first_only`` the cotangent of a
    replicated output goes to that replica alone (see the module docstring); without,
    every replica receives it (DTensor's from_local convention); with ``"mean"`` every
    replica receives it divided by their number (JAX's transpose of a check_vma=False
    output, whose replicas may differ).
    """

    @staticmethod
    def forward(layout: Layout, shape: tuple[int, ...], first_only: bool, *outs: torch.Tensor) -> ShardedArray:
        mesh = layout.mesh
        value = backend_for(mesh).from_shards([o.detach() for o in first_replicas(outs, layout)], layout, shape)
        return ShardedArray(value, layout, shape, outs[0].dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        layout, shape, first_only = inputs[:3]
        weights = part_weights(unwrapped(output)) if layout.partial else None
        ctx.meta = (layout, shape, first_only, None if weights is None else weights.local_shards())
        ctx.zeros = [(tuple(o.shape), o.dtype) for o in inputs[3:]]
        if not _float(output):
            ctx.mark_non_differentiable(output)

    @staticmethod
    def backward(ctx: Any, ct: Any) -> Any:
        layout, _, first_only, weights = ctx.meta
        mesh = layout.mesh
        plain = layout.without_partial()
        # the cotangent copied to every part: its transpose (a jvp, a second derivative)
        # sums the parts' cotangents over the replicas, as each part used it whole
        parts = EnterParts.apply(_as_sharded(ct, plain), summed_grad_layout(plain), True)
        if weights is not None:  # avg / max / min: each part's share of the reduced value
            parts = [p * w for p, w in zip(parts, weights)]
        # a later replica's cotangent: None, or zeros built from the cotangent where a
        # traced backward must keep the collectives it feeds (Backend.zero_cotangent)
        zero = backend_for(mesh).zero_cotangent
        if first_only == "mean":  # JAX's transpose of an unchecked (check_vma=False) output
            n = math.prod(mesh.axis_size(a) for a in mesh.axis_names if a not in used_axes(layout))
            return (None, None, None, *[p / n if n > 1 else p for p in parts])
        cts = [
            zero(parts[i]) if first_only and first_replica(layout, d) != d else parts[i]
            for i, d in enumerate(my_devices(mesh))
        ]
        return (None, None, None, *cts)

    @staticmethod
    def jvp(ctx: Any, _: Any, __: Any, ___: Any, *ts: Any) -> Any:
        layout, shape, first_only, weights = ctx.meta
        ts = [torch.zeros(z[0], dtype=z[1]) if t is None else t for t, z in zip(ts, ctx.zeros)]
        if weights is not None:  # the tangent of a pending avg / max / min: its parts' weighted sum
            return ExitParts.apply(_pending_sums(layout), shape, first_only, *[t * w for t, w in zip(ts, weights)])
        return ExitParts.apply(layout, shape, first_only, *ts)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, layout: Layout, shape: tuple, first_only: bool, *outs: torch.Tensor) -> tuple:
        from ..arrays.functorch import insert_dim

        if all(b is None for b in in_dims[3:]):
            return ExitParts.apply(layout, shape, first_only, *outs), None
        n = info.batch_size
        outs = tuple(o.unsqueeze(0).expand(n, *o.shape) if b is None else o.movedim(b, 0)
                     for o, b in zip(outs, in_dims[3:]))
        return ExitParts.apply(insert_dim(layout, 0), (n, *shape), first_only, *outs), 0


class Opaque(torch.autograd.Function):
    """``run(*inputs)`` (tensors in, a list of tensors out) as one node whose derivatives
    are Opaque nodes again: backward re-runs ``run`` and differentiates it (the vjp
    program :class:`_Vjp`), jvp is the transpose of that vjp (:class:`_Jvp`) and vmap runs
    ``run`` once per batch element. So every order of reverse and forward mode, and
    vmap, compose; each derivative level costs a re-run of ``run``."""

    @staticmethod
    def forward(run: Any, *inputs: torch.Tensor) -> tuple:
        # detached: under forward AD the inputs arrive as duals; inside, only closures may be
        return tuple(run(*[x.detach() for x in inputs]))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.run = inputs[0]
        ctx.save_for_backward(*inputs[1:])
        ctx.save_for_forward(*inputs[1:])
        ctx.mark_non_differentiable(*[o for o in output if not _float(o)])

    @staticmethod
    def backward(ctx: Any, *cts: Any) -> Any:
        xs = ctx.saved_tensors
        wrt = tuple(i for i, x in enumerate(xs) if _float(x) and ctx.needs_input_grad[1 + i])
        present = tuple(i for i, c in enumerate(cts) if c is not None)
        if not wrt or not present:
            return (None,) * (1 + len(xs))
        grads = Opaque.apply(_Vjp(ctx.run, wrt, present), *xs, *[cts[i] for i in present])
        out: list = [None] * len(xs)
        for i, g in zip(wrt, grads):
            out[i] = g
        return (None, *out)

    @staticmethod
    def jvp(ctx: Any, _: Any, *tangents: Any) -> Any:
        xs = ctx.saved_tensors
        along = tuple(i for i, t in enumerate(tangents) if t is not None and _float(xs[i]))
        return Opaque.apply(_Jvp(ctx.run, along), *xs, *[tangents[i] for i in along])

    @staticmethod
    def vmap(info: Any, in_dims: tuple, run: Any, *inputs: torch.Tensor) -> tuple:
        dims = in_dims[1:]
        per = []
        for b in range(info.batch_size):
            sel = [x if d is None else x.select(d, b) for x, d in zip(inputs, dims)]
            per.append(Opaque.apply(run, *sel))
        return tuple(torch.stack(col) for col in zip(*per)), (0,) * len(per[0])


def _leaves_for(xs: tuple, which: tuple) -> list:
    """``xs`` with the ones differentiated made differentiable leaves (an input that
    already requires grad stays connected, so the program can be differentiated again)."""
    out = list(xs)
    for i in which:
        if not out[i].requires_grad:
            out[i] = out[i].detach().requires_grad_()
    return out


class _Vjp:
    """The program (inputs, cotangents) -> gradients of the inputs in ``wrt``."""

    def __init__(self, run: Any, wrt: tuple, present: tuple) -> None:
        self.run, self.wrt, self.present = run, wrt, present

    def __call__(self, *tensors: torch.Tensor) -> list:
        n = len(tensors) - len(self.present)
        with torch.enable_grad():
            xs = _leaves_for(tensors[:n], self.wrt)
            outs = self.run(*xs)
            pairs = [(outs[i], c) for i, c in zip(self.present, tensors[n:]) if outs[i].requires_grad]
            wrt = [xs[i] for i in self.wrt]
            grads = (torch.autograd.grad([o for o, _ in pairs], wrt, [c for _, c in pairs], allow_unused=True,
                                         create_graph=True) if pairs else [None] * len(wrt))
        return [torch.zeros_like(x) if g is None else g for x, g in zip(wrt, grads)]


class _Jvp:
    """The program (inputs, tangents along ``along``) -> tangents of the outputs: the
    transpose of the vjp (differentiating ``vjp(u)`` in the cotangent ``u``)."""

    def __init__(self, run: Any, along: tuple) -> None:
        self.run, self.along = run, along

    def __call__(self, *tensors: torch.Tensor) -> list:
        n = len(tensors) - len(self.along)
        with torch.enable_grad():
            xs = _leaves_for(tensors[:n], self.along)
            outs = self.run(*xs)
            diff = [i for i, o in enumerate(outs) if o.requires_grad]
            us = [torch.zeros_like(outs[i]).requires_grad_() for i in diff]
            wrt = [xs[i] for i in self.along]
            grads = torch.autograd.grad([outs[i] for i in diff], wrt, us, allow_unused=True,
                                        create_graph=True) if diff else [None] * len(wrt)
            keep = [(g, t) for g, t in zip(grads, tensors[n:]) if g is not None]
            jv = torch.autograd.grad([g for g, _ in keep], us, [t for _, t in keep], allow_unused=True,
                                     create_graph=True) if keep and us else [None] * len(us)
        res = [torch.zeros_like(o) for o in outs]
        for i, t in zip(diff, jv):
            if t is not None:
                res[i] = t
        return res


# -- with_sharding_constraint ------------------------------------------------------------------------


class Constrain(torch.autograd.Function):
    """Reshard to ``dst``; the cotangent is constrained to ``dst`` (pending reductions
    replicated) on the way back."""

    @staticmethod
    def forward(x: ShardedArray, dst: Layout) -> ShardedArray:
        return moved(x, dst)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        x, dst = inputs
        ctx.meta = (dst.without_partial(), tuple(x.shape), x.dtype)

    @staticmethod
    def backward(ctx: Any, ct: Any) -> Any:
        layout, shape, dtype = ctx.meta
        return wrap(grad_value(ct, layout), layout, shape, dtype), None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: Any, dst: Layout) -> tuple:
        """Under ``torch.func.vmap`` the constraint applies to each example: a value the
        vmapped function captured rather than derived from its argument (no batch dim:
        ``is_contiguous`` of the argument einsummed with a sharded weight) is constrained
        as it is; a batched one keeps its batch dim, unsharded, beside ``dst``'s dims
        (torch calls this rule whenever a vmap is active, batched input or not)."""
        b = in_dims[0]
        return Constrain.apply(x, dst if b is None else insert_dim(dst, b)), b
