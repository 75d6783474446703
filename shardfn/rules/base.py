"""Helpers for writing rules, and the rule vocabulary (:class:`OpCall`, :class:`Candidate`,
defined with the dispatcher in ``arrays/strategies.py``)."""

from __future__ import annotations

from typing import Any, Callable

import torch

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
