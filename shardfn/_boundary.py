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

import functools
from typing import Any

import torch
import torch._C._functorch as _ft

from .array import ShardedArray, raw_reshard, wrap
from .backends import backend_for, execute
from .backends.local import full, settle
from .layout import Layout, local_shapes
from .mesh import Mesh
from .plan import plan_layouts


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
    from .array import raw_distribute

    ct = unwrapped(ct)
    if isinstance(ct, ShardedArray):
        return raw_reshard(ct, layout)
    return raw_distribute(ct, layout)


def my_devices(mesh: Mesh) -> list[int]:
    """Devices whose shards this process holds (all on local, this rank on dist)."""
    if mesh.backend == "local":
        return list(range(mesh.size))
    return [backend_for(mesh).rank_of(mesh)]


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


def _float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


# -- stacked (even) crossings: ShardedArray <-> canonical tensor ---------------------------------


class EnterStacked(torch.autograd.Function):
    """ShardedArray (even) -> canonical tensor: the stacked shards, mesh dims the value
    is replicated over cut to size 1."""

    @staticmethod
    def forward(x: ShardedArray, varying: tuple[bool, ...]) -> torch.Tensor:
        t = x._local
        for k, v in enumerate(varying):
            if not v:
                t = t.narrow(k, 0, 1)
        return t.view(t.shape)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        x, _ = inputs
        ctx.meta = (x._layout, tuple(x.shape), x.dtype)

    @staticmethod
    def backward(ctx: Any, ct: torch.Tensor) -> Any:
        layout, shape, dtype = ctx.meta
        mesh = layout.mesh
        stacked = ct.expand(*mesh.shape, *ct.shape[mesh.ndim:])
        return wrap(stacked, layout, shape, dtype), None


class ExitStacked(torch.autograd.Function):
    """Canonical tensor -> ShardedArray in ``layout`` (stored in the local backend's
    canonical form for the layout)."""

    @staticmethod
    def forward(c: torch.Tensor, layout: Layout, shape: tuple[int, ...]) -> ShardedArray:
        return wrap(settle(c, layout), layout, shape, c.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        c, layout, _ = inputs
        ctx.meta = (layout, tuple(c.shape[:layout.mesh.ndim]))

    @staticmethod
    def backward(ctx: Any, ct: Any) -> Any:
        layout, dims = ctx.meta
        mesh = layout.mesh
        g = full(grad_value(ct, layout.without_partial()), mesh)
        keep = used_axes(layout)
        for k, (a, d) in enumerate(zip(mesh.axis_names, dims)):
            if d == 1 and mesh.shape[k] > 1:
                # an invariant value: tiled / summed copies add up, replicas count once
                g = g.sum(k, keepdim=True) if a in keep else g.narrow(k, 0, 1)
        return g, None, None


# -- per-device crossings: ShardedArray <-> list of local tensors ------------------------------------


class EnterParts(torch.autograd.Function):
    """ShardedArray -> this process's local shards (one per device it holds).

    The per-device gradients are read with ``grad_layout``; with ``resolve`` they are
    then resharded to the input's layout.
    """

    @staticmethod
    def forward(x: ShardedArray, grad_layout: Layout, resolve: bool) -> tuple:
        return tuple(s.view(s.shape) for s in x.local_shards())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        x, grad_layout, resolve = inputs
        ctx.meta = (x._layout, grad_layout, resolve, tuple(x.shape), x.dtype)
        if not _float(x):
            ctx.mark_non_differentiable(*output)

    @staticmethod
    def backward(ctx: Any, *cts: Any) -> Any:
        layout, grad_layout, resolve, shape, dtype = ctx.meta
        mesh = layout.mesh
        shapes = local_shapes(grad_layout, shape)
        devices = my_devices(mesh)
        cts = [torch.zeros(shapes[d], dtype=dtype) if c is None else c for d, c in zip(devices, cts)]
        value = backend_for(mesh).from_shards(cts, grad_layout, shape)
        target = grad_layout
        if resolve and grad_layout != layout.without_partial():
            target = layout.without_partial()
            value = execute(plan_layouts(grad_layout, target, shape, dtype), value)
        return wrap(value, target, shape, dtype), None, None


class ExitParts(torch.autograd.Function):
    """Local outputs (one per device this process holds) -> ShardedArray in ``layout``.

    Replicas are taken from the first replica. With ``first_only`` the cotangent of a
    replicated output goes to that replica alone (see the module docstring); without,
    every replica receives it (DTensor's from_local convention).
    """

    @staticmethod
    def forward(layout: Layout, shape: tuple[int, ...], first_only: bool, *outs: torch.Tensor) -> ShardedArray:
        mesh = layout.mesh
        devices = my_devices(mesh)
        if mesh.backend == "local":
            outs = tuple(outs[first_replica(layout, d)] for d in devices)
        value = backend_for(mesh).from_shards(list(outs), layout, shape)
        return ShardedArray(value, layout, shape, outs[0].dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        layout, _, first_only = inputs[:3]
        ctx.meta = (layout, first_only)

    @staticmethod
    def backward(ctx: Any, ct: Any) -> Any:
        layout, first_only = ctx.meta
        mesh = layout.mesh
        parts = backend_for(mesh).shard_list(grad_value(ct, layout.without_partial()), mesh)
        # On dist the zero cotangent of a later replica is built from the cotangent, so a
        # traced backward keeps the collectives it feeds on the backward side (a constant
        # zero would let AOTAutograd's partitioner move them into the forward graph of
        # those ranks only, and the ranks' graphs would issue different collectives).
        zero = (lambda t: None) if mesh.backend == "local" else torch.zeros_like
        cts = [
            zero(parts[i]) if first_only and first_replica(layout, d) != d else parts[i]
            for i, d in enumerate(my_devices(mesh))
        ]
        return (None, None, None, *cts)


class Stash:
    """A plain attribute holder passed through autograd (not a pytree, so not copied)."""


class Opaque(torch.autograd.Function):
    """``run(*inputs)`` as one node: forward records its own graph on detached inputs,
    backward replays it with torch.autograd.grad (first order only)."""

    @staticmethod
    def forward(run: Any, saved: Stash, *inputs: torch.Tensor) -> tuple:
        xs = [x.detach().requires_grad_() if _float(x) else x.detach() for x in inputs]
        with torch.enable_grad():
            outs = run(*xs)
        saved.xs, saved.outs = xs, outs
        return tuple(o.detach() for o in outs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.saved = inputs[1]
        ctx.mark_non_differentiable(*[o for o in output if not _float(o)])

    @staticmethod
    def backward(ctx: Any, *cts: Any) -> Any:
        xs, outs = ctx.saved.xs, ctx.saved.outs
        pairs = [(o, unwrapped(c)) for o, c in zip(outs, cts) if c is not None and o.requires_grad]
        wrt = [x for x in xs if x.requires_grad]
        grads = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [c for _, c in pairs], allow_unused=True)
                     if pairs and wrt else [None] * len(wrt))
        return (None, None, *[next(grads) if x.requires_grad else None for x in xs])


# -- with_sharding_constraint ------------------------------------------------------------------------


class Constrain(torch.autograd.Function):
    """Reshard to ``dst``; the cotangent is constrained to ``dst`` (pending reductions
    replicated) on the way back."""

    @staticmethod
    def forward(x: ShardedArray, dst: Layout) -> ShardedArray:
        return wrap(raw_reshard(x, dst), dst, x.shape, x.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        x, dst = inputs
        ctx.meta = (dst.without_partial(), tuple(x.shape), x.dtype)

    @staticmethod
    def backward(ctx: Any, ct: Any) -> Any:
        layout, shape, dtype = ctx.meta
        return wrap(grad_value(ct, layout), layout, shape, dtype), None
