"""Key fragments: one interned, identity-hashed object per (layout, shape, dtype), kept on
each ShardedArray, from which dispatch builds its fast cache keys."""

from __future__ import annotations

from typing import Any

import torch

from ..backends.registry import backend_for
from ..values.layout import Layout
from .fresh import fresh_root, held_fragment
from .reduced import reduced_forms
from ..values.strides import dense_strides


_fragments: dict[tuple, Any] = {}
_FRAGMENTS_MAX = 65536


def _fragment(x: Any, held: bool = False) -> Any:
    """``x``'s interned key fragment, kept on ``x`` (immutable: an in-place rebind clears
    it); None while its shape is symbolic or its storage is not in the canonical form. A
    pending value's fragment also names the reductions already at hand (free to read:
    strategies are costed with them), and is not kept on a view linked to its base. None
    for a fresh array (``fresh.py``: its first read must end the freshness), unless ``held``
    (dispatch's ``_held_back`` ends it): then computed and not kept."""
    d = x.__dict__
    if held:
        pass
    elif ("_fresh" in d or "_view_of" in d) and fresh_root(x) is not None:
        return None
    layout = x._layout
    if layout.partial:
        forms = reduced_forms(x)
        if forms:
            layout = (layout, forms)
    try:
        shape = tuple(x.shape)
        k = fragment_of(layout, shape, x.dtype, _odd_stride(shape, x.stride(), x.storage_offset()))
    except TypeError:  # SymInts do not hash
        return None
    if not backend_for(x._layout.mesh).is_canonical(x._local, x._layout):
        return None  # fast-path calls assume the canonical form (``_Entry.warm``)
    if "_derived" not in d and not held:
        x._kf = k
    return k


def fragment_of(layout: Layout | tuple, shape: tuple, dtype: torch.dtype, stride: tuple | None = None,
                finite: bool = False) -> Any:
    """A unique object per (layout (with the reductions at hand, if any), shape, dtype, stride;
    None: contiguous; ``finite``: see ``known_finite``): fast keys hash it by identity. Never
    reused for another tuple (dropping the table only makes new objects)."""
    key = (layout, shape, dtype) if stride is None else (layout, shape, dtype, stride)
    if finite:
        key += (_FINITE,)
    k = _fragments.get(key)
    if k is None:
        if len(_fragments) >= _FRAGMENTS_MAX:
            _fragments.clear()
        k = _fragments[key] = _Fragment()
        k.finite = finite
    return k


_FINITE = object()  # marks a known-finite fragment's key


def known_finite(x: Any) -> bool:
    """Whether no element of array ``x`` can be ±inf (nan may be), known from the op that made
    it (``bounds.py``) without reading it: a pending sum may be multiplied by it part by part.
    The mark is the fragment's: an in-place write, which drops the fragment, drops it too."""
    k = held_fragment(x)  # (a fresh array holds its fragment back until the first read)
    return k is not None and k.finite


_CONTIGUOUS: dict[tuple, tuple] = {}  # shape -> its contiguous strides


def _contiguous(shape: tuple) -> tuple:
    """The contiguous strides of ``shape`` (remembered per shape: every new array's fragment asks)."""
    try:
        strides = _CONTIGUOUS.get(shape)
    except TypeError:  # symbolic sizes do not hash
        strides = None
    if strides is None:
        strides = dense_strides(shape)
        try:
            if len(_CONTIGUOUS) >= _FRAGMENTS_MAX:
                _CONTIGUOUS.clear()
            _CONTIGUOUS[shape] = strides
        except TypeError:
            pass
    return strides


def _odd_stride(shape: tuple, stride: tuple, offset: int = 0) -> tuple | None:
    """``(stride, storage offset)`` unless they are the contiguous ones of ``shape`` (None
    then). An array reports the strides and offset torch would give the same op on a plain
    tensor (the meta run's), so ``x.t().is_contiguous()`` is False and autograd's
    ``as_strided`` on views reads the right elements; shards are stored however the backend
    likes."""
    return None if not offset and stride == _contiguous(shape) else (tuple(stride), offset)


class _Fragment:
    """An identity-hashed stand-in for one (layout, shape, dtype) in fast keys."""

    __slots__ = ("__weakref__", "finite")

    def __copy__(self) -> _Fragment:
        return self  # a copied array keeps hitting its original's entries

    def __deepcopy__(self, memo: dict) -> _Fragment:
        return self
