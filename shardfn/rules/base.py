"""What a rule sees (:class:`OpCall`) and what it proposes (:class:`Candidate`)."""

from __future__ import annotations

from typing import Any, Callable, Protocol

import attrs
import torch

from ..layout import Layout
from ..mesh import Mesh


@attrs.frozen
class OpCall:
    """One op call as rules see it: the sharded inputs in argument order, and the
    global output metadata (meta tensors) computed from the global input shapes."""

    func: Any
    args: tuple
    kwargs: dict
    arrays: list  # [(path, ShardedArray)]
    out_meta: Any
    mesh: Mesh

    @property
    def layouts(self) -> list[Layout]:
        return [v._layout for _, v in self.arrays]

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(v.shape) for _, v in self.arrays]

    @property
    def out_metas(self) -> list:
        o = self.out_meta
        return list(o) if isinstance(o, (tuple, list)) else [o]

    def arg(self, i: int, name: str | None = None, default: Any = None) -> Any:
        """Positional arg ``i``, else keyword ``name``, else ``default``."""
        if i < len(self.args):
            return self.args[i]
        return self.kwargs.get(name, default) if name else default


@attrs.frozen
class Candidate:
    """A strategy: the layout each sharded input must have (argument order), the layout
    of each output (None for non-tensor outputs), and how to adapt the arguments to run
    the local op once on stacked shards (``stacked_args(args, kwargs, mesh_ndim)``) or
    per device (``device_args(args, kwargs, device)``)."""

    in_layouts: tuple[Layout, ...]
    out_layouts: tuple[Layout | None, ...]
    stacked_args: Callable | None = None
    device_args: Callable | None = None


class Rule(Protocol):
    def candidates(self, call: OpCall) -> list[Candidate]: ...


def replicated(mesh: Mesh, ndim: int) -> Layout:
    return Layout(mesh, ((),) * ndim)


def out_layouts_for(call: OpCall, fn: Callable[[torch.Tensor], Layout]) -> tuple:
    return tuple(fn(m) if isinstance(m, torch.Tensor) else None for m in call.out_metas)
