"""A fixed chain of view ops on a stacked value (permutes and reshapes that fold or unfold
mesh dims) replayed as one ``as_strided``: on a GPU each op of the chain is a dispatch from
Python, and the chain's output geometry is a pure function of its input's sizes and strides."""

from __future__ import annotations

from typing import Any, Callable

import torch

_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_TENSOR = torch.Tensor

_GEOMETRY: dict[tuple, tuple | None] = {}
_GEOMETRY_MAX = 4096


def replay(key: Any, x: torch.Tensor, chain: Callable[[torch.Tensor, Any], torch.Tensor]) -> torch.Tensor:
    """``chain(x, key)``; where that is a view of ``x`` (no op of it copied), later calls with an
    equal ``key`` (which must fix the chain's ops: a plan's tuple, compared by value) and ``x`` of the
    same sizes and strides run one ``as_strided`` instead. Only plain tensors: fake, functional and functorch tensors (tracing,
    transforms) run the chain, as do chains that copy (a reshape of a non-viewable layout)."""
    if type(x) is not _TENSOR or _is_wrapped(x):  # (``plain``, inlined: every warm regrid takes this)
        return chain(x, key)
    k = (key, x.shape, x.stride())
    g = _GEOMETRY.get(k, _GEOMETRY)
    if g is _GEOMETRY:
        y = chain(x, key)
        if len(_GEOMETRY) >= _GEOMETRY_MAX:
            _GEOMETRY.clear()
        _GEOMETRY[k] = geometry(x, y)
        return y
    if g is None:
        return chain(x, key)
    return x.as_strided(g[0], g[1], x.storage_offset() + g[2])


def plain(x: Any) -> bool:
    """Whether ``x`` is a plain tensor (not fake, functional or functorch-wrapped: those trace or
    transform the chain's ops themselves)."""
    return type(x) is torch.Tensor and not _is_wrapped(x)


def geometry(x: torch.Tensor, y: torch.Tensor) -> tuple | None:
    """``y``'s sizes, strides and storage offset relative to ``x``'s, if ``y`` views ``x``'s memory
    (the same storage: no op of the chain copied) with the same dtype and flags, else None. Meta
    tensors (whose storages all read address 0) and empty ones are never taken for views; nor is
    ``_base`` read: below ``__torch_dispatch__`` views record none."""
    if type(y) is not torch.Tensor or y.dtype != x.dtype or y.is_conj() != x.is_conj() or y.is_neg() != x.is_neg():
        return None
    if x.is_meta or x.numel() == 0 or y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
        return None
    return tuple(y.shape), y.stride(), y.storage_offset() - x.storage_offset()
