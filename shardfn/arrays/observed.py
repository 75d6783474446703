"""Whether Python holds a reference to an array: the in-place policy's test of observability.

"Python holds a reference" is read from the object's reference count, compared with the
count of a C++-only temporary measured once at import (:func:`calibrate`) on the same code
path: C++ holders own one reference to a tensor's Python object however many C++ handles
exist, while a Python holder adds its own reference and that of the code passing it on.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .array import _tf_call

_deref = weakref.ref.__call__  # (a base's live views: weak references without callbacks, ``aliases.py``)

# reference counts of a private (C++-only) array at the two measuring points
_BASE: dict[str, int] = {}


def is_observed(x: Any, count: int, args: tuple, kwargs: dict, point: str) -> bool:
    """Whether something other than C++ and this call holds ``x`` (see the module doc).
    ``count`` is its reference count taken as the op reached Python, before shardfn's
    own frames bound it to names: how many references those frames add depends on the
    interpreter's state (it grows by two after a torch.compile failed on a dynamic dim,
    whose frames change how CPython specialises calls), not on who holds ``x``."""
    n = 0  # how often ``x`` is an argument (itself or in a list) of this call: plain loops, inline
    for a in (*args, *kwargs.values()) if kwargs else args:
        if a is x:
            n += 1
        elif isinstance(a, (list, tuple)):
            for b in a:
                if b is x:
                    n += 1
    views = x.__dict__.get("_views")  # each live view holds a reference to ``x`` (``aliases.live_count``, inline)
    refs = count - n - (len(views) - list(map(_deref, views)).count(None) if views else 0)
    tf = getattr(_tf_call, "args", None)
    if tf is not None and tf == id(x):  # in the argument tuple of _BatchedArray.__torch_function__
        refs -= 1
    if _calibrating:
        _BASE[point] = min(_BASE.get(point, refs), refs)
        return False
    return refs > _BASE[point] + _SLACK


_calibrating = False


def calibrating() -> bool:
    """Whether ``calibrate`` is measuring (its private targets are judged by their counts)."""
    return _calibrating
# A C++-only array measures 0 over the calibrated count; an unnamed Python temporary
# (``(a - b).clamp_min_(0)``, which no one can see afterwards) measures 1; anything Python
# holds by a name, a container or an attribute measures at least 2 (the holder and the
# reference passing it on). One reference of slack separates the private from the held.
_SLACK = 1


def calibrate() -> None:
    """Measure the reference counts of C++-only arrays: ``matmul`` of a vector and a matrix
    updates its private ``mm`` result in place (``squeeze_``), and the backward of
    ``t().sum()`` takes a view (``t``) of a private gradient."""
    global _calibrating
    _BASE.clear()
    from .redistribute import distribute
    from ..values.mesh import Mesh
    from ..values.spec import P

    mesh = Mesh((1,), ("_calibrate",), backend="local")
    _calibrating = True
    try:
        v = distribute(torch.ones(2), P(), mesh=mesh)
        w = distribute(torch.ones(2, 2), P(), mesh=mesh)
        torch.matmul(v, w)
        leaf = distribute(torch.ones(2, 2), P(), mesh=mesh).requires_grad_()
        torch.autograd.grad(leaf.t().sum(), leaf)
    finally:
        _calibrating = False
