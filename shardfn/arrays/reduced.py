"""Pending reductions already at hand: the layouts a pending value (or the pending base it
is a view of) has been reduced to, which reading it in costs nothing. ``raw_reshard`` keeps
them on the array; dispatch keys and costs strategies with them."""

from __future__ import annotations

from typing import Any


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
