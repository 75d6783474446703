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
    per device (``device_args(args, kwargs, device)``). ``stacked_fn``/``device_fn``
    replace the op itself in those runs (e.g. batched matmul for ``mm`` on stacked
    shards, a masked lookup for a vocabulary-sharded embedding)."""

    in_layouts: tuple[Layout, ...]
    out_layouts: tuple[Layout | None, ...]
    stacked_args: Callable | None = None
    device_args: Callable | None = None
    stacked_fn: Callable | None = None
    device_fn: Callable | None = None


class Rule(Protocol):
    def candidates(self, call: OpCall) -> list[Candidate]: ...


def replicated(mesh: Mesh, ndim: int) -> Layout:
    return Layout(mesh, ((),) * ndim)


def out_layouts_for(call: OpCall, fn: Callable[[torch.Tensor], Layout]) -> tuple:
    return tuple(fn(m) if isinstance(m, torch.Tensor) else None for m in call.out_metas)


def same_args(args: tuple, kwargs: dict, n: int) -> tuple[tuple, dict]:
    """A ``stacked_args`` for ops whose local call needs no change."""
    return args, kwargs


def neg_dim(d: int, ndim: int) -> int:
    """``d`` as a negative dim: it then names the same local dim of a stacked value."""
    ndim = max(ndim, 1)
    return d - ndim if d >= 0 else d


def norm_dims(dim: Any, ndim: int) -> tuple[int, ...]:
    """Normalised, sorted dims from an int, a list, or None (None/[] = all dims)."""
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = [dim]
    n = max(ndim, 1)
    return tuple(sorted({d % n for d in dim}))


def _schema_info(func: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    info = _SCHEMAS.get(func)
    if info is None:
        args = func._schema.arguments
        names = tuple(a.name for a in args)
        defaults = {a.name: a.default_value for a in args if a.has_default_value()}
        info = _SCHEMAS[func] = (names, defaults)
    return info


_SCHEMAS: dict[Any, tuple] = {}


def bind(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Arguments by schema name, defaults filled in."""
    names, defaults = _schema_info(func)
    b = dict(defaults)
    b.update(zip(names, args))
    b.update(kwargs)
    return b


def replace_arg(func: Any, args: tuple, kwargs: dict, name: str, value: Any) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with the argument called ``name`` set to ``value``."""
    names, _ = _schema_info(func)
    i = names.index(name)
    if i < len(args):
        return args[:i] + (value,) + args[i + 1:], kwargs
    return args, {**kwargs, name: value}


def letters(n: int, start: int = 0) -> tuple[str, ...]:
    """``n`` distinct dim letters."""
    return tuple(chr(ord("a") + start + i) for i in range(n))
