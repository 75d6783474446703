"""Matrix products as einsum strings (DTensor's ``_matrix_ops``).

Each op is one equation; contracted letters that end up sharded leave the result
Partial(sum), and a pending sum on one operand passes through (the product is linear in
each operand). Ops of the ``add*`` family take an addend (``self``) broadcast against
the product, which must carry the product's pending sums (free: a replicated addend is
split into a pending sum locally). On stacked shards the local op becomes one batched
``matmul`` for the whole mesh.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import torch

from ..backends import local as _local_backend
from .base import Candidate, OpCall, letters, same_args
from .dims import Dims, broadcast_letters, compile_dims, einsum_dims, with_addend

aten = torch.ops.aten


def _align(t: torch.Tensor, m: int, rank: int) -> torch.Tensor:
    """A stacked addend of lower rank, padded with singleton dims after the mesh dims."""
    r = t.dim() - m
    return t if r == rank else t.reshape(*t.shape[:m], *([1] * (rank - r)), *t.shape[m:])


def _mm(a: torch.Tensor, b: torch.Tensor, contract: tuple[int, ...] = ()) -> torch.Tensor:
    # leading (mesh) dims on which one operand is the same fold into the other's rows or
    # columns, and mesh dims the result is pending a sum over into the contraction: one
    # GEMM, no copy of a replicated operand per device
    return _local_backend.matmul(a, b, contract)


def _mv(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, v.unsqueeze(-1)).squeeze(-1)


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(-1, dtype=a.dtype)


def _vdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.conj() * b).sum(-1, dtype=a.dtype)


def _outer(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.unsqueeze(-1) * b.unsqueeze(-2)


def _bsum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b).sum(-3)


@attrs.frozen
class Einsum:
    """A matrix product given by an einsum equation (``addend``: arg 0 is added)."""

    eq: str
    product: Callable
    addend: bool = False

    def candidates(self, call: OpCall) -> list[Candidate]:
        n_ops = self.eq.count(",") + 1 + self.addend
        if len(call.arrays) != n_ops or any(not isinstance(p, int) for p, _ in call.arrays):
            return []
        spec = einsum_dims(self.eq)
        out_shape = tuple(call.out_metas[0].shape)
        if self.addend:
            spec = with_addend(spec, broadcast_letters(spec.outs[0], call.shapes[0], out_shape))
            stacked: Any = _AddendStacked(self.product, len(out_shape))
        else:
            stacked = _PlainStacked(self.product)
        cands = compile_dims(call, spec, stacked_args=same_args, stacked_fn=stacked)
        if self.product is not _mm:
            return cands
        names = call.mesh.axis_names
        out = []
        for c in cands:
            # mesh dims the product is pending a sum over (a contraction split over them)
            pending = tuple(names.index(a) for a, op in (c.out_layouts[0].partial if c.out_layouts[0] else ())
                            if op == "sum")
            out.append(attrs.evolve(c, stacked_fn=attrs.evolve(stacked, contract=pending)) if pending else c)
        return out


@attrs.frozen
class _PlainStacked:
    product: Callable
    contract: tuple[int, ...] = ()  # mesh dims the result is pending a sum over (_mm only)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.product(*args, contract=self.contract) if self.contract else self.product(*args)


@attrs.frozen
class _AddendStacked:
    """Addend ops on stacked shards; the mesh rank is recovered from the operand ranks."""

    product: Callable
    out_rank: int
    contract: tuple[int, ...] = ()  # mesh dims the product is pending a sum over (_mm only)

    def __call__(self, bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1, alpha: Any = 1) -> torch.Tensor:
        out = self.product(a, b, contract=self.contract) if self.contract else self.product(a, b)
        m = out.dim() - self.out_rank
        if alpha != 1:
            out = out * alpha
        if beta == 0:
            return out
        bias = _align(bias, m, self.out_rank)
        return out + (bias if beta == 1 else bias * beta)


@attrs.frozen
class BatchedLinalg:
    """Linear algebra on the last two dims of the first input: its leading (batch) dims
    keep their sharding in every input and output that starts with the same batch
    shape (pivots, tau, eigenvalues too); the matrix dims are whole."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        first = call.shapes[0]
        k = len(first) - 2
        if k < 1:
            return []
        batch, ls = first[:k], letters(k)

        def lettered(shape: tuple) -> tuple:
            head = ls if len(shape) >= k and tuple(shape[:k]) == batch else (None,) * min(k, len(shape))
            return tuple(head) + (None,) * (len(shape) - len(head))

        ins = tuple(lettered(s) for s in call.shapes)
        outs = tuple(lettered(tuple(m.shape)) if isinstance(m, torch.Tensor) else None for m in call.out_metas)
        return compile_dims(call, Dims(ins, outs))


_LINALG = (
    "cholesky", "linalg_cholesky_ex", "linalg_inv_ex", "_linalg_det", "_linalg_slogdet",
    "linalg_solve_triangular", "_linalg_solve_ex", "linalg_lu_factor_ex", "linalg_lu",
    "linalg_lu_solve", "_linalg_eigh", "_linalg_svd", "linalg_eig", "linalg_qr", "cholesky_solve",
    "cholesky_inverse", "triangular_solve", "linalg_householder_product", "linalg_matrix_exp",
    "lu_unpack", "linalg_pinv", "_linalg_eigvals",
    "linalg_eigvals", "geqrf", "ormqr", "linalg_lstsq", "logdet",
)

TABLE = {
    **{getattr(aten, n): BatchedLinalg() for n in _LINALG if hasattr(aten, n)},
    aten.mm: Einsum("mk,kn->mn", _mm),
    aten.bmm: Einsum("bmk,bkn->bmn", _mm),
    aten.mv: Einsum("mk,k->m", _mv),
    aten.dot: Einsum("k,k->", _dot),
    aten.vdot: Einsum("k,k->", _vdot),
    aten.addmm: Einsum("mk,kn->mn", _mm, addend=True),
    aten.baddbmm: Einsum("bmk,bkn->bmn", _mm, addend=True),
    aten.addmv: Einsum("mk,k->m", _mv, addend=True),
    aten.addbmm: Einsum("bmk,bkn->mn", _bsum, addend=True),
    aten.addr: Einsum("m,n->mn", _outer, addend=True),
    aten.outer: Einsum("m,n->mn", _outer),
    aten.ger: Einsum("m,n->mn", _outer),
}
