"""Fresh arrays: the buffers and results torch code makes and then fills in place.

An array an op made (a factory such as ``new_zeros`` / ``zeros_like`` / ``empty_like``, a
``clone``, or any other op's result that is not a view of its input) is *fresh* until its
value is first read: no result anywhere was computed from it yet, so writing into it changes
nothing anyone has seen. The in-place policy (``inplace/policy.py``) runs such a write as a functional
update of the array's value (views of it see the write, as torch's do): torch.func's Jacobian
basis (``new_zeros`` then ``diagonal().fill_(1)``), ``matrix_power(x, 0)`` (``clone`` then
``copy_``), an MoE layer's ``zeros_like`` buffer filled by ``index_add_``, Llama 4's
``out = shared_expert(h); out.add_(routed)``, an experts bias added into ``bmm(..).squeeze(1)``.

Freshness belongs to the root array (a view of a fresh array is fresh through its
``_view_of`` link). It ends for good at the first read of the root or of any view of it:
an op other than a view op or a write into it takes it as an input, or ``reshard`` moves
it. A write into it reads it only as part of that write, so a buffer stays fresh while it
is filled piece by piece. A fresh array's key fragment stays unset (``fragments._fragment``)
and is held back (in ``_fresh``, a view's in ``_kfh``), so no read slips past dispatch's fast
path: the first read's fast key (``dispatch._held_back``) ends the freshness and puts the
fragment back (the slow path ends it in ``note_reads``).

A torch.compile'd region's outputs are never fresh, even a buffer the region made: whether the
graph read it, aliased it or returned it twice is not known outside the graph. A write into one
(after a graph break) raises ImmutableError saying so (``inplace/messages.COMPILED``).
"""

from __future__ import annotations

import threading
from typing import Any

from torch import Tensor as _Tensor

class _State(threading.local):
    writing = 0  # the in-place policy is running a write (its ops read nothing)


_state = _State()


def held_fragment(x: Any) -> Any:
    """``x``'s fast-key fragment, or the one it holds back while fresh (None if neither)."""
    k = x._kf
    if k is None:
        d = x.__dict__
        k = d.get("_kfh") if "_view_of" in d else d.get("_fresh")
    return k


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
    """Mark an op's output(s) fresh. Its key fragment is held back (``_fresh`` keeps it) so that
    no read slips past dispatch's fast path; the first read puts it back."""
    for o in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(o, _Tensor) and "_layout" in o.__dict__:  # a ShardedArray
            d = o.__dict__
            if "_fresh" not in d:
                d["_fresh"] = d.get("_kf")
                o._kf = None


def end_fresh(x: Any) -> None:
    """``x``'s value is read: its root is fresh no longer."""
    if isinstance(x, _Tensor) and ("_fresh" in x.__dict__ or "_view_of" in x.__dict__):
        r = fresh_root(x)
        if r is not None and not _state.writing:
            _end(r)


def note_reads(args: tuple, kwargs: dict, keep: Any = ()) -> bool:
    """An op reads these arguments: each fresh root among them (except those in ``keep``,
    by id: the roots the op writes) is fresh no longer. Whether any was."""
    if _state.writing:
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
                _end(r)
                return True
    return False


def _end(r: Any) -> None:
    """Root ``r`` is fresh no longer: its held-back key fragment becomes its fragment (a view
    of a pending value, or one with reductions at hand, computes its own: ``_fragment``)."""
    d = r.__dict__
    k = d.pop("_fresh")
    if k is not None and "_derived" not in d and "_reduced" not in d:
        r._kf = k


class writing:
    """While the in-place policy runs a write: the ops it issues on the target are no reads."""

    def __enter__(self) -> None:
        _state.writing += 1

    def __exit__(self, *exc: Any) -> None:
        _state.writing -= 1
