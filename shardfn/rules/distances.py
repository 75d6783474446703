"""``torch.cdist``'s kernels: ``_cdist_forward(x1, x2, p)`` and ``_cdist_backward``.

``x1`` (*batch, P, M) and ``x2`` (*batch, R, M) give the distances (*batch, P, R) between
every row of ``x1`` and every row of ``x2``: the batch dims, ``x1``'s points (P) and ``x2``'s
points (R) split with no communication. The feature dim M is reduced, and only where the
reduction is one a pending output can carry: ``p = 0`` (a count of ``d != 0``) leaves
Partial(sum), ``p = inf`` (a max of ``|d|``) Partial(max); the root of ``p = 2`` and other
``p`` is not a sum of per-device parts, so M stays whole there. ``p = 1`` (a sum of ``|d|``)
would pass as a sum too, but dispatch caches a plan per float argument's *kind* (zero,
non-finite, other: ``arrays/dispatch._number_class``), so a rule may tell ``p = 1`` from
``p = 2`` only at the cost of a wrong cached plan: M stays whole for every finite nonzero ``p``.

The backward of ``x1`` is, feature by feature, ``grad * d * |d|^(p-2) / dist^(p-1)`` summed
over ``x2``'s points (``_cdist_backward(grad, x1, x2, p, cdist)``; autograd calls it with
the operands swapped for ``x2``): with the whole distances in hand each device's features
need only its own columns, for every ``p``; a split R leaves a pending sum.

Batch dims that broadcast (of different sizes in ``x1`` and ``x2``) stay whole; operands of\ndifferent ranks have no rule (replicated).
"""

from __future__ import annotations

import math

import attrs
import torch

from .base import Candidate, OpCall, letters, sum_passes
from .dims import Dims, compile_dims

aten = torch.ops.aten


def _batch_letters(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """Letters for the batch dims (all but the last two) of ``a`` and ``b``, of equal rank:
    one per dim of the same size in both, None where one broadcasts."""
    return tuple(L if a.shape[i] == b.shape[i] else None for i, L in enumerate(letters(a.dim() - 2)))


def _feature_reduce(p: float) -> str | None:
    """The pending reduction of a feature split, for the ``p`` a cached plan can tell apart."""
    if p == 0.0:
        return "sum"
    if p == math.inf:
        return "max"
    return None


@attrs.frozen
class CdistForward:
    """``_cdist_forward(x1, x2, p, compute_mode)``: see the module docstring."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        if [p for p, _ in call.arrays] != [0, 1]:
            return []
        (_, x1), (_, x2) = call.arrays
        if x1.dim() < 2 or x2.dim() < 2 or x1.dim() != x2.dim():
            return []
        b = _batch_letters(x1, x2)
        out = call.out_metas[0]
        op = _feature_reduce(float(call.arg(2, "p", 2.0)))
        if op == "sum" and not sum_passes(call, x1.dtype):
            op = None  # float16: the parts are summed in float16 only when resolved
        spec = Dims((b + ("P", "M"), b + ("R", "M")), (b + ("P", "R"),) if out.dim() == x1.dim() else (None,),
                    (("M", op),) if op else ())
        return [attrs.evolve(c, dense="last") for c in compile_dims(call, spec)]


@attrs.frozen
class CdistBackward:
    """``_cdist_backward(grad, x1, x2, p, cdist)`` -> the gradient of ``x1``."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        if [p for p, _ in call.arrays] != [0, 1, 2, 4]:
            return []
        (_, g), (_, x1), (_, x2), (_, d) = call.arrays
        if not (x1.dim() == x2.dim() == g.dim() == d.dim() >= 2) or tuple(g.shape) != tuple(d.shape):
            return []
        if tuple(x1.shape[:-2]) != tuple(x2.shape[:-2]) or tuple(g.shape[:-2]) != tuple(x1.shape[:-2]):
            return []  # broadcast batch dims: no rule
        b = letters(x1.dim() - 2)
        # R is summed over: a pending sum, but not in float16 (resolved in float16 only)
        spec = Dims((b + ("P", "R"), b + ("P", "M"), b + ("R", "M"), b + ("P", "R")), (b + ("P", "M"),),
                    (("R", "sum"),) if sum_passes(call, g.dtype) else ())
        # the CPU kernel reads its operands as contiguous
        return [attrs.evolve(c, dense=True) for c in compile_dims(call, spec)]


TABLE = {
    aten._cdist_forward: CdistForward(),
    aten._cdist_backward: CdistBackward(),
}
