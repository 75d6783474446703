"""Helpers for writing rules, and the rule vocabulary (:class:`OpCall`, :class:`Candidate`,
defined with the dispatcher in ``arrays/strategies.py``)."""

from __future__ import annotations

import math

from typing import Any, Callable

import torch

from ..arrays.fragments import known_finite
from ..arrays.strategies import Candidate, OpCall, Rule, ShardFact  # noqa: F401  (rules use them)
from ..values.layout import Layout
from ..values.mesh import Mesh
from ..values.schema import _schema_info, bind, replace_arg  # noqa: F401  (rules use them)


def replicated(mesh: Mesh, ndim: int) -> Layout:
    return Layout(mesh, ((),) * ndim)


def out_layouts_for(call: OpCall, fn: Callable[[torch.Tensor], Layout]) -> tuple:
    return tuple(fn(m) if isinstance(m, torch.Tensor) else None for m in call.out_metas)


def norm_dims(dim: Any, ndim: int) -> tuple[int, ...]:
    """Normalised, sorted dims from an int, a list, or None (None/[] = all dims)."""
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = [dim]
    n = max(ndim, 1)
    return tuple(sorted({d % n for d in dim}))


def letters(n: int, start: int = 0) -> tuple[str, ...]:
    """``n`` distinct dim letters."""
    return tuple(chr(ord("a") + start + i) for i in range(n))


def out_of_range(index: torch.Tensor, size: int, allowed: int | None = None) -> Any:
    """The first entry of ``index`` outside ``[0, size)`` (other than ``allowed``), or None.
    A rule whose local call sees only part of an indexed dim checks the global range this
    way (torch's kernel would raise; the local one cannot tell). Traced values (fake or
    functional tensors): the check goes into the traced graph (a RuntimeError when it runs)."""
    if not isinstance(index, torch.Tensor) or index.device.type == "meta":
        return None
    if type(index) is not torch.Tensor:
        if not torch._C._functorch.is_functorch_wrapped_tensor(index):
            ok = (index >= 0) & (index < size) if allowed is None else ((index >= 0) & (index < size)) | (index == allowed)
            torch._assert_async(ok.all(), "index out of range in self")
        return None
    if torch._C._functorch.is_functorch_wrapped_tensor(index):
        return None
    bad = (index < 0) | (index >= size)
    if allowed is not None:
        bad &= index != allowed
    if not bad.any():
        return None
    return index[bad].flatten()[0].item()


def finite_factor(a: Any) -> bool:
    """Whether tensor ``a`` is known to hold no ±inf without reading it: an integer or bool
    dtype, or an array whose op bounds it (``arrays/bounds.py``). A pending sum may be
    multiplied by such a factor part by part; by another floating factor it may not
    (``sum(parts) * inf`` is not ``sum(parts * inf)``: ``0 * inf`` is nan in a part, parts of
    both signs give ``inf - inf``), and knowing it is finite would take a device-to-host sync."""
    if not (a.dtype.is_floating_point or a.dtype.is_complex):
        return True
    return hasattr(a, "_layout") and known_finite(a)


def sum_passes(call: OpCall, src: torch.dtype) -> bool:
    """Whether a pending sum in dtype ``src`` may pass through ``call`` unresolved. Not
    when the op widens the dtype (int8 ``(a @ b).sum()`` wraps the product's total in int8
    first, the parts would not), nor in float16, whose total may overflow to inf where
    the parts do not (the parts are summed in the dtype only when resolved)."""
    if src == torch.float16:
        return False
    return all(m.dtype == src or _float_cast_exact(src, m.dtype) for m in call.out_metas if isinstance(m, torch.Tensor))


def _float_cast_exact(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether a pending sum may be cast from ``src`` to ``dst`` part by part: both real
    floating dtypes and ``dst``'s exponent range covers ``src``'s, so no part overflows
    where the total would not (the parts are then summed in ``dst``, rounding like the
    reduction itself; bfloat16 <-> float32 qualify, float16 and float64 -> float32 do not)."""
    if not (src.is_floating_point and dst.is_floating_point) or dst == torch.float16:
        return False
    return math.frexp(torch.finfo(dst).max)[1] >= math.frexp(torch.finfo(src).max)[1]
