"""Fresh arrays: the buffers torch code allocates and then fills in place.

An array made by a factory op (``new_zeros`` / ``new_empty`` / ..., ``zeros_like`` /
``empty_like`` / ..., ``clone``) is *fresh* until its value is first read: no result
anywhere was computed from it yet, so writing into it changes nothing anyone has seen.
The in-place policy (``inplace.py``) runs such a write as a functional update of the
array's value (views of it see the write, as torch's do): torch.func's Jacobian basis
(``new_zeros`` then ``diagonal().fill_(1)``), ``matrix_power(x, 0)`` (``clone`` then
``copy_``), an MoE layer's ``zeros_like`` buffer filled by ``index_add_``.

Freshness belongs to the root array (a view of a fresh array is fresh through its
``_view_of`` link). It ends for good at the first read of the root or of any view of it:
an op other than a view op or a write into it takes it as an input, or ``reshard`` moves
it. A write into it reads it only as part of that write, so a buffer stays fresh while it
is filled piece by piece. A fresh array's key fragment stays unset (``fragments._fragment``),
so no read slips past dispatch's fast path: a read ends the freshness first (on the slow path,
or in ``dispatch`` itself, which then builds the fast key again and runs warm).

A torch.compile'd region's outputs are never fresh, even a buffer the region made: whether the
graph read it, aliased it or returned it twice is not known outside the graph. A write into one
(after a graph break) raises ImmutableError saying so (``inplace_errors.COMPILED``).
"""

from __future__ import annotations

import threading
from typing import Any

from torch import Tensor as _Tensor

_state = threading.local()  # ``writing``: the in-place policy is running a write (its ops read nothing)


def fresh_root(x: Any) -> Any:
    """The array ``x`` is (or is a view of) while that array is fresh, else None (also for
    an array handed out as observable, such as a ``.grad``)."""
    d = x.__dict__
    if "_aliases_observable" in d:
        return None
    link = d.get("_view_of")
    while link is not None:
        x = link[0]
        d = x.__dict__
        if "_aliases_observable" in d:
            return None
        link = d.get("_view_of")
    return x if "_fresh" in d else None


def mark_fresh(out: Any) -> None:
    """Mark a factory op's output(s) fresh (no fast-key fragment: its first read takes the slow path)."""
    for o in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(o, _Tensor) and "_layout" in o.__dict__:  # a ShardedArray
            o.__dict__["_fresh"] = True
            o._kf = None


def end_fresh(x: Any) -> None:
    """``x``'s value is read: its root is fresh no longer."""
    if isinstance(x, _Tensor) and ("_fresh" in x.__dict__ or "_view_of" in x.__dict__):
        r = fresh_root(x)
        if r is not None and not getattr(_state, "writing", 0):
            del r.__dict__["_fresh"]


def note_reads(args: tuple, kwargs: dict, keep: Any = ()) -> bool:
    """An op reads these arguments: each fresh root among them (except those in ``keep``,
    by id: the roots the op writes) is fresh no longer. Whether any was."""
    if getattr(_state, "writing", 0):
        return False
    ended = False
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, (list, tuple)):
            for b in a:
                ended = _read(b, keep) or ended
        else:
            ended = _read(a, keep) or ended
    return ended


def _read(a: Any, keep: Any) -> bool:
    if isinstance(a, _Tensor):
        d = a.__dict__
        if "_fresh" in d or "_view_of" in d:
            r = fresh_root(a)
            if r is not None and id(r) not in keep:
                del r.__dict__["_fresh"]
                return True
    return False


class writing:
    """While the in-place policy runs a write: the ops it issues on the target are no reads."""

    def __enter__(self) -> None:
        _state.writing = getattr(_state, "writing", 0) + 1

    def __exit__(self, *exc: Any) -> None:
        _state.writing -= 1
