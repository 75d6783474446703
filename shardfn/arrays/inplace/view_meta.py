"""In-place view ops (``squeeze_``, ``unsqueeze_``, ``transpose_``, ``t_``, ``swapdims_``,
``as_strided_``) on private or fresh arrays: they change what the target's wrapper shows and
write no data, so they are run as the out-of-place view and the target rebound, its link to
its base and its own views' links re-expressed so a later write replays them right."""

from __future__ import annotations

from typing import Any

import torch

from ..aliases import live_views, rebind
from ..fresh import writing
from ...values.errors import ShardingError
from ...values.schema import functional_args, functional_overload

aten = torch.ops.aten

_NAMES = frozenset({"squeeze_", "unsqueeze_", "transpose_", "t_", "swapdims_", "swapaxes_", "as_strided_"})


def is_view_meta(func: Any) -> bool:
    """Whether ``func`` changes only its target's sizes and strides (an in-place view op)."""
    return func._schema.name.split("::")[-1] in _NAMES


class _Then:
    """A link's view followed by another view op: replayed as one (``aliases.replay`` calls a
    link's op with the base and its arguments)."""

    __slots__ = ("first", "op", "args", "kwargs")

    def __init__(self, first: tuple, op: Any, args: tuple, kwargs: dict) -> None:
        self.first, self.op, self.args, self.kwargs = first, op, args, kwargs

    def __call__(self, base: Any) -> Any:
        func, rest, kwargs, i = self.first
        v = func(base, *rest, **kwargs)
        return self.op(v if i is None else v[i], *self.args, **self.kwargs)


def run_view_meta(func: Any, args: tuple, kwargs: dict, target: Any) -> Any:
    """``target.op_(...)`` as ``target := target.op(...)``: the view's value, no data written;
    the target's link to its base gains the op, its own views' links its inverse."""
    op = functional_overload(func)
    fargs, fkwargs = functional_args(func, op, args, kwargs)
    old_shape = tuple(target.shape)
    children = [v for v in live_views(target) if v.__dict__.get("_view_of", (None,))[0] is target]
    inverse = _inverse(func, args, kwargs, old_shape) if children else None
    with writing():
        new = op(*fargs, **fkwargs)
    link = target.__dict__.get("_view_of")
    if link is not None:  # a view of a private base: replaying its link now gives the new view
        base, f, rest, kw, i = link
        target._view_of = (base, _Then((f, rest, kw, i), op, tuple(fargs[1:]), fkwargs), (), {}, None)
    for c in children:  # recorded on the old sizes: reached from the new ones through the inverse
        _, f, rest, kw, i = c._view_of
        inv_op, inv_args = inverse
        c._view_of = (target, _Then((inv_op, inv_args, {}, None), f, rest, kw) if i is None else
                      _Then((inv_op, inv_args, {}, None), _Index(f, i), rest, kw), (), {}, None)
    with writing():
        rebind(target, new)
    return target


class _Index:
    """A multi-output view op's ``i``-th output (a link's index, kept through ``_Then``)."""

    __slots__ = ("f", "i")

    def __init__(self, f: Any, i: int) -> None:
        self.f, self.i = f, i

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.f(*args, **kwargs)[self.i]


def _inverse(func: Any, args: tuple, kwargs: dict, old_shape: tuple) -> tuple:
    """The view op (and its arguments) that takes the target's new sizes back to ``old_shape``."""
    name = func._schema.name.split("::")[-1]
    if name in ("squeeze_", "unsqueeze_"):  # the same elements in the same order
        return aten.view.default, (list(old_shape),)
    if name in ("transpose_", "swapdims_", "swapaxes_", "t_"):  # its own inverse
        return (aten.t.default, ()) if name == "t_" else (aten.transpose.int, tuple(args[1:3]))
    raise ShardingError(f"{func}: an in-place as_strided_ of an array that has live views cannot be replayed "
                        "on them; use the out-of-place as_strided")
