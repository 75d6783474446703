"""A ShardedArray moved between a mesh and a view of it (``Mesh.flatten`` / ``unflatten``):
relabel onto the common refinement, plan there, relabel onto the destination."""

from __future__ import annotations

from typing import Any

import torch

from ..backends.registry import backend_for
from ..values.layout import Layout
from ..values.mesh import Mesh
from ..values.mesh_views import not_a_view, refinement, to_fine
from .array import ShardedArray, raw_reshard, reshard, wrap


def relabel(value: Any, src: Mesh, dst: Mesh) -> Any:
    """The backend value of a layout on ``src`` as the same shards on ``dst``."""
    return backend_for(src).relabel(value, src, dst)


def reshard_across(x: Any, dst: Layout) -> Any:
    """``x`` laid out as ``dst`` on a view of its mesh (differentiable)."""
    return _Across.apply(x, dst)


def _move(x: Any, dst: Layout) -> Any:
    src_mesh = x._layout.mesh
    if backend_for(src_mesh) is not backend_for(dst.mesh):
        raise not_a_view(src_mesh, dst.mesh)
    fine, owner = refinement(src_mesh, dst.mesh)
    src_f = to_fine(x._layout, fine, owner)
    dst_f = to_fine(dst, fine, owner)
    value = relabel(x._local, src_mesh, fine)
    on_fine = ShardedArray(value, src_f, tuple(x.shape), x.dtype)
    value = raw_reshard(on_fine, dst_f)
    return wrap(relabel(value, fine, dst.mesh), dst, tuple(x.shape), x.dtype)


class _Across(torch.autograd.Function):
    @staticmethod
    def forward(x: Any, dst: Layout) -> Any:
        return _move(x, dst)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.src, ctx.dst = inputs[0]._layout, inputs[1]

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        if not isinstance(g, ShardedArray):
            return None, None
        return reshard_across(g, ctx.src.without_partial() if ctx.src.partial else ctx.src), None

    @staticmethod
    def jvp(ctx: Any, t: Any, _: Any) -> Any:
        return _move(reshard(t, ctx.src), ctx.dst)
