"""Seeing through torch.func wrappers.

Inside ``torch.func.grad``/``vjp``/``jvp``/``vmap`` a ShardedArray reaches Python wrapped
in functorch tensors (GradTrackingTensor, BatchedTensor), which are plain ``torch.Tensor``
objects there. Aten ops still reach ``__torch_dispatch__`` below the wrappers; shardfn's
own functions (reshard, gather, ...) use these helpers to find the array underneath and
its *logical* layout (the layout minus the vmapped dims).
"""

from __future__ import annotations

from typing import Any

import torch

from ..values import torch_compat
from ..values.layout import Layout
from ..values.sharded import Sharded

_F = torch._C._functorch


def unwrap(x: Any) -> tuple[Any, list[int]]:
    """The value under every functorch wrapper of ``x``, and the batch dims met on the
    way (outermost first, each counted in the dims of the value it wraps)."""
    bdims: list[int] = []
    while isinstance(x, torch.Tensor) and _F.is_functorch_wrapped_tensor(x):
        if _F.is_batchedtensor(x):
            bdims.append(_F.maybe_get_bdim(x))
        x = _F.get_unwrapped(x)
    return x, bdims


def is_wrapped(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and _F.is_functorch_wrapped_tensor(x)


def base_array(x: Any) -> Any:
    """The ShardedArray under ``x`` (or ``x`` itself), else None."""
    base = unwrap(x)[0]
    return base if isinstance(base, Sharded) else None


def layout_of(x: Any) -> Layout | None:
    """The layout ``x`` has as seen at this functorch level, or None for a plain tensor."""
    base, bdims = unwrap(x)
    if not isinstance(base, Sharded):
        return None
    layout = base._layout
    for b in reversed(bdims):
        layout = drop_dim(layout, b)
    return layout


def drop_dim(layout: Layout, d: int) -> Layout:
    dims = layout.dims[:d] + layout.dims[d + 1:]
    return Layout(layout.mesh, dims, layout.partial)


def insert_dim(layout: Layout, d: int) -> Layout:
    """``layout`` with a new unsharded dim at ``d`` (a vmapped dim, physically present)."""
    return Layout(layout.mesh, layout.dims[:d] + ((),) + layout.dims[d:], layout.partial)


def static_int(n: Any) -> int:
    """``n`` as an int; a SymInt is specialised to its value (torch.compile guards on each
    symbol it is built of: ``torch_compat.specialise_symint``)."""
    return n if isinstance(n, int) else torch_compat.specialise_symint(n)


def constant_int(n: Any) -> int | None:
    """``n``'s value where it is a constant (an int, or a SymInt whose symbols have all been
    specialised), else None; guards on nothing."""
    if isinstance(n, int):
        return n
    return n.node.maybe_as_int() if isinstance(n, torch.SymInt) else None


def is_symbolic(shape: Any) -> bool:
    """Whether any size in ``shape`` is a SymInt (a dynamic dim under torch.compile)."""
    return any(isinstance(n, torch.SymInt) for n in shape)


def hint_int(n: Any) -> int:
    """``n`` as an int without guarding: a SymInt gives its example value (hint)."""
    if isinstance(n, int):
        return n
    return torch_compat.symint_hint(n)


def hint_shape(shape: Any) -> tuple[int, ...]:
    return tuple(hint_int(n) for n in shape)
