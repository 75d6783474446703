"""Pending reductions already at hand: the layouts a pending value (or the pending base it
is a view of) has been reduced to, which reading it in costs nothing. ``raw_reshard`` keeps
them on the array; dispatch keys and costs strategies with them."""

from __future__ import annotations

import functools
import itertools
import operator
import weakref
from typing import Any

import torch


def reduced_forms(x: Any) -> frozenset:
    """The layouts ``x``'s pending reductions have already been resolved to (reading ``x``
    in one of them is free): its own, and for a view of a pending value whose base (or
    the base's base) has been reduced, ``x``'s layout without the pending reductions."""
    cache = x.__dict__.get("_reduced")
    forms = [dst for dst, hit in cache.items() if hit[0] is x._local and hit[1] == x._layout] if cache else []
    plain = x._layout.without_partial()
    if plain not in forms and base_reduced(x):
        forms.append(plain)
    return frozenset(forms)


def link_of(x: Any) -> tuple | None:
    """``x``'s link to the pending base it is a view of (``redistribute.note_derived``), while
    ``x`` still holds the shards the link was made for."""
    link = x.__dict__.get("_derived")
    return link if link is not None and link[5] is x._local else None


def base_reduced(x: Any) -> bool:
    """Whether a base ``x`` is (transitively) a view of has its reduction at hand."""
    link = link_of(x)
    while link is not None:
        base = link[0]
        cache = base.__dict__.get("_reduced")
        hit = cache.get(base._layout.without_partial()) if cache else None
        if hit is not None and hit[0] is base._local and hit[1] == base._layout:
            return True
        link = link_of(base)
    return False


# -- recomputations: the same pure op on the same arrays is the same value -----------------

_SAME: dict[tuple, tuple] = {}  # key of a call -> (weakref to its pending output, its (layout, shape, dtype),
# its reductions {layout: value}, the input arrays' weakrefs and shards)
_SAME_MAX = 8  # recomputations come within a few ops


def note_recomputed(func: Any, args: tuple, kwargs: dict, out: Any, view: Any) -> None:
    """Link a pending output to the output of an earlier call of the same deterministic op
    on the same (immutable) arrays and arguments, so one reduction serves both: code that
    writes an expression twice (``(h - mean).pow(2)`` then ``(h - mean) * r`` in a layer
    norm) reads a pending sum once. The earlier output is held weakly and its reductions
    strongly (``keep_reduction``): a pending value's parts (every device's own, a row-parallel
    product's n-fold size) are not kept alive past their last reader for a recomputation
    that may never come, while the reduced value (its size once) serves one that does
    (at most the ``_SAME_MAX`` latest, while their inputs live). ``view``: the op re-viewing
    a live earlier output (``aten.view.default``), so the link has ``note_derived``'s form."""
    fid = id(func)  # ops keyed by id (``OpOverload`` hashes in Python); ``_RANDOM`` keeps each alive
    random = _RANDOM.get(fid)
    if random is None:
        random = _RANDOM[fid] = (func, _random_op(func))
    if random[1] or not _communicates(out._layout):
        return
    arrays: list = []
    try:
        key = (fid, _key_of(args, arrays), _key_of(kwargs, arrays) if kwargs else ())
        hit = _SAME.get(key)
    except (_Plain, TypeError):  # a plain tensor takes part, or an argument does not hash
        return
    if not arrays:
        return
    form = (out._layout, out.shape, out.dtype)
    if hit is not None and hit[1] == form and all(w() is v and v._local is loc for (w, loc), v in zip(hit[3], arrays)):
        prev = hit[0]()
        if prev is not None and prev is not out and _unchanged(prev):
            out._derived = (prev, view, (list(out.shape),), {}, None, out._local)
            out._kf = None
            return
        if prev is None and hit[2]:
            # the earlier output is gone, its reductions are at hand: ``out`` has them too
            cache = out.__dict__.setdefault("_reduced", {})
            for dst, value in hit[2].items():
                cache[dst] = (out._local, out._layout, value)
            out._kf = None  # its dispatch key fragment names the reduced forms it has
            return
    while len(_SAME) >= _SAME_MAX:
        del _SAME[next(iter(_SAME))]
    # an input died: the key can never match again (``_SAME.pop(key, the dead reference)``:
    # a C-level callback, no Python call at each input's death)
    drop = functools.partial(_SAME.pop, key)
    reductions: dict = {}
    out._same = (reductions, out._local, out._layout)
    _SAME[key] = (weakref.ref(out), form, reductions,
                  list(zip(map(weakref.ref, arrays, itertools.repeat(drop)), map(_LOCAL, arrays))))


_LOCAL = operator.attrgetter("_local")


def _unchanged(prev: Any) -> bool:
    """Whether an earlier output still holds the value it was computed with, for good: read
    (not fresh, so never written in place again: ``fresh.py``) and holding the shards it was
    noted with (``_same``), not new ones a write into it while fresh gave it."""
    d = prev.__dict__
    same = d.get("_same")
    return "_fresh" not in d and same is not None and same[1] is prev._local


def keep_reduction(x: Any, dst: Any, value: Any) -> None:
    """Remember ``x`` reduced to ``dst`` (``value``) for a recomputation of ``x`` that comes
    after ``x`` is gone (``note_recomputed``), while ``x`` holds the shards it was noted with."""
    same = x.__dict__.get("_same")
    if same is not None and same[1] is x._local and same[2] == x._layout:
        same[0][dst] = value


_RANDOM: dict[int, tuple] = {}  # id(op) -> (op, whether it is random)


def _random_op(func: Any) -> bool:
    """Whether two calls of ``func`` on the same inputs may differ (a random op)."""
    return torch.Tag.nondeterministic_seeded in func.tags


@functools.lru_cache(maxsize=1024)
def _communicates(layout: Any) -> bool:
    """Whether resolving ``layout``'s pending reductions moves data (some axis has more than
    one device); over size-1 axes there is nothing for a recomputation to share."""
    mesh = layout.mesh
    return any(mesh.axis_size(axis) > 1 for axis, _ in layout.partial)


class _Plain(Exception):
    """A plain tensor takes part in the call: it may change, so the call is not remembered."""


def _key_of(x: Any, arrays: list) -> Any:
    """A hashable stand-in for an argument tree: arrays by identity (collected in ``arrays``)."""
    if isinstance(x, torch.Tensor):
        if not hasattr(x, "_layout"):
            raise _Plain
        arrays.append(x)
        return ("array", id(x))
    if isinstance(x, (tuple, list)):  # one loop, no recursion for the usual flat leaves
        out = []
        for v in x:
            if isinstance(v, torch.Tensor):
                if "_layout" not in v.__dict__:  # (an array's layout is an instance attribute)
                    raise _Plain
                arrays.append(v)
                out.append(("array", id(v)))
            elif isinstance(v, (tuple, list, dict)):
                out.append(_key_of(v, arrays))
            else:
                out.append(v)
        return (type(x).__name__, tuple(out))
    if isinstance(x, dict):
        return ("dict", tuple((k, _key_of(v, arrays)) for k, v in sorted(x.items()))) if x else ("dict", ())
    return x
