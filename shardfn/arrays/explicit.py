"""``sf.explicit``: make implicit redistribution an error (or a warning).

Propagation picks, for every op, the input layouts its cheapest strategy needs and
reshards the inputs to them. Under ``sf.explicit(mode="raise")`` an op whose chosen
strategy would move data (a plan with a collective, or the replicate fallback on
sharded inputs) raises :class:`ImplicitReshardError` before anything runs; ``"warn"``
runs it and warns once per op and input layouts. Explicit moves (``sf.reshard``,
``with_sharding_constraint``, shard_map/local_map boundaries, ``full_tensor``) do not
go through op dispatch and are never affected.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from ..values.context import ThreadStack
from ..plans.planner import COMM_KINDS, plan_layouts
from ..values.errors import ImplicitReshardError, ImplicitReshardWarning, ShardingError
from ..values.layout import Layout, describe
from ..values.schema import op_name
from .array import ShardedArray

__all__ = ["explicit"]

_MODES = ("raise", "warn", "off")
_stack: list[str] = []  # the active modes of every thread (dispatch's cheap "any active?" test)
_local = ThreadStack()  # this thread's modes, innermost last
_warned: set[tuple] = set()
_moves: dict[int, tuple[Any, list]] = {}


class explicit(contextlib.ContextDecorator):
    """Within this context (or decorated function), ops may not redistribute their
    inputs implicitly: ``mode="raise"`` raises ``ImplicitReshardError``, ``"warn"``
    warns ``ImplicitReshardWarning`` once per op and input layouts, ``"off"`` restores
    propagation. Contexts nest; the innermost wins.

    Example::

        with sf.explicit():
            y = sf.matmul(x, w, out_sharding=P('dp', None))   # allowed: says where data goes
            z = x @ w2                                           # raises if x, w2 disagree
    """

    def __init__(self, mode: str = "raise") -> None:
        if mode not in _MODES:
            raise ShardingError(f"sf.explicit mode={mode!r} is not one of {_MODES}")
        self.mode = mode

    def __enter__(self) -> explicit:
        _stack.append(self.mode)
        _local.items.append(self.mode)
        return self

    def __exit__(self, *exc: Any) -> None:
        _local.items.pop()
        _stack.remove(self.mode)


def current_mode() -> str:
    """The innermost active mode (``"off"`` outside any context)."""
    items = _local.items
    return items[-1] if items else "off"


def check(func: Any, entry: Any, leaves: list) -> None:
    """Raise or warn when running ``entry`` (a compiled dispatch strategy) on ``leaves``
    would move data between devices. Called by dispatch only while a mode is active."""
    mode = current_mode()
    if mode == "off" or _in_backward():
        return
    arrays = [(p, v) for p, v in leaves if isinstance(v, ShardedArray)]
    hit = _moves.get(id(entry))
    if hit is None or hit[0] is not entry:  # keyed by id, the entry kept alive with it
        hit = _moves[id(entry)] = (entry, _data_moves(entry, arrays))
    moves = hit[1]
    if not moves:
        return
    name = op_name(func)
    if mode == "raise":
        raise ImplicitReshardError(_message(name, entry, moves))
    key = (name, tuple((v._layout, tuple(v.shape)) for _, v in arrays))
    if key not in _warned:
        _warned.add(key)
        warnings.warn(_message(name, entry, moves), ImplicitReshardWarning, stacklevel=5)


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward: gradient layouts follow from
    the forward (constrain them with with_sharding_constraint), there is no code to edit."""
    return torch._C._current_graph_task_id() != -1


def _data_moves(entry: Any, arrays: list) -> list[tuple[int, Any, Any, Layout, tuple[str, ...]]]:
    """(input index, path, array, layout needed, collective kinds) for every input the
    strategy would move with a collective."""
    cand = getattr(entry, "cand", None)
    out = []
    for i, (path, v) in enumerate(arrays):
        want = cand.in_layouts[i] if cand is not None else Layout(v.mesh, ((),) * v.ndim)
        if want == v._layout:
            continue
        plan = plan_layouts(v._layout, want, tuple(int(n) for n in v.shape), v.dtype)
        kinds = tuple(s.kind for s in plan.steps if s.kind in COMM_KINDS)
        if kinds:
            out.append((i, path, v, want, kinds))
    return out


def _message(name: str, entry: Any, moves: list) -> str:
    fallback = getattr(entry, "cand", None) is None
    lines = []
    for i, path, v, want, kinds in moves:
        where = f"input {i}" + (f" (argument {path!r})" if isinstance(path, str) else "")
        lines.append(
            f"{where} is {describe(tuple(v.shape), v.dtype, v._layout)} but "
            f"{'the replicate fallback' if fallback else 'the op'} needs {want.spec_str()}, "
            f"which takes {' + '.join(kinds)}; write sf.reshard(input_{i}, {want.spec_str()}) first"
        )
    return (
        f"{name} would redistribute its inputs implicitly under sf.explicit: " + "; ".join(lines)
        + ". Make the move explicit with sf.reshard, give sf.matmul/sf.einsum an out_sharding=, "
        "or wrap the code in sf.explicit(mode='off')"
    )
