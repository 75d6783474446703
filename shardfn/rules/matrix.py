"""Matrix products as einsum strings (DTensor's ``_matrix_ops``).

Each op is one equation; contracted letters that end up sharded leave the result
Partial(sum), and a pending sum on one operand passes through (the product is linear in
each operand). Ops of the ``add*`` family take an addend (``self``) broadcast against
the product, which must carry the product's pending sums (free: a replicated addend is
split into a pending sum locally). Each device runs the op itself on its shards.
"""

from __future__ import annotations

import math

import attrs
import torch

from .base import Candidate, OpCall, bind, letters
from .dims import LINEAR_OPS, Dims, broadcast_letters, compile_dims, einsum_dims, with_addend

aten = torch.ops.aten


@attrs.frozen
class Einsum:
    """A matrix product given by an einsum equation (``addend``: arg 0 is added)."""

    eq: str
    addend: bool = False

    def candidates(self, call: OpCall) -> list[Candidate]:
        n_ops = self.eq.count(",") + 1 + self.addend
        if len(call.arrays) != n_ops or any(not isinstance(p, int) for p, _ in call.arrays):
            return []
        spec = einsum_dims(self.eq)
        out_shape = tuple(call.out_metas[0].shape)
        if self.addend:
            spec = with_addend(spec, broadcast_letters(spec.outs[0], call.shapes[0], out_shape))
        cands = compile_dims(call, spec)
        if self.addend and _float_scalars_on_integers(call):
            fn = _TruncatedScalars(call.func)
            cands = [attrs.evolve(c, local_fn=fn) for c in cands]
        return cands

    @staticmethod
    def out_meta(func: object, args: tuple, kwargs: dict) -> torch.Tensor:
        """The op's meta, and torch's error where its integral kernel scales the addend by a
        float ``beta`` (an empty contraction: ``self * beta``); the meta kernel does not check."""
        out = func(*args, **kwargs)
        if func.overloadpacket in _SCALED_WHEN_EMPTY:
            b = bind(func, args, kwargs)
            beta = b.get("beta", 1)
            if _integral(out.dtype) and isinstance(beta, float) and beta != 0 and _no_terms(func, b):
                torch.zeros((), dtype=out.dtype).mul_(beta)  # torch's RuntimeError: Float can't be cast
        return out


def _integral(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _float_scalars_on_integers(call: OpCall) -> bool:
    """An integral product with a float ``alpha``/``beta``: torch's kernel truncates them."""
    meta = call.out_metas[0]
    return isinstance(meta, torch.Tensor) and _integral(meta.dtype) and any(
        isinstance(call.kwargs.get(k), float) for k in ("alpha", "beta"))


def _no_terms(func: object, b: dict) -> bool:
    """Whether torch's kernel computes ``self * beta`` alone: the product has no terms (an
    empty contraction, or no batches for ``addbmm``) and a non-empty output."""
    x, y = b["batch1" if "batch1" in b else "mat1"], b["batch2" if "batch2" in b else "mat2"]
    k, out = x.shape[-1], (*x.shape[:-1], y.shape[-1])
    if func.overloadpacket is aten.addbmm:
        return x.shape[0] == 0 or (k == 0 and out[1] * out[2] > 0)
    return k == 0 and math.prod(out) > 0


@attrs.frozen
class _TruncatedScalars:
    """The op on one device's shards with float ``alpha``/``beta`` truncated to ints, as
    torch's integral kernel reads them (a shard with an empty piece of the contraction would
    otherwise scale its addend by the float: "result type Float can't be cast")."""

    func: object

    def __call__(self, *args: object, alpha: object = 1, beta: object = 1, **kwargs: object) -> torch.Tensor:
        alpha = int(alpha) if isinstance(alpha, float) else alpha
        beta = int(beta) if isinstance(beta, float) else beta
        return self.func(*args, alpha=alpha, beta=beta, **kwargs)


_SCALED_WHEN_EMPTY = frozenset({aten.addmm, aten.baddbmm, aten.addbmm})


@attrs.frozen
class Addmm(Einsum):
    """``addmm``: torch's meta kernel takes an addend that does not expand to the product's
    ``(m, n)`` and gives the addend's shape (a bias of 5 on a product of 1 column: (m, 5)),
    where the device kernels raise; the output meta checks it as they do."""

    @staticmethod
    def out_meta(func: object, args: tuple, kwargs: dict) -> torch.Tensor:
        out = Einsum.out_meta(func, args, kwargs)
        b = bind(func, args, kwargs)
        b["self"].expand(b["mat1"].shape[0], b["mat2"].shape[1])  # torch's RuntimeError where it does not expand
        return out


@attrs.frozen
class AddmmActivation:
    """``_addmm_activation`` (CUDA's fused ``addmm`` + relu/gelu): rows and columns shard
    like ``addmm``'s, but the activation is not linear, so the contraction stays whole (no
    pending sum may pass into it or come out of it)."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        if len(call.arrays) != 3 or any(not isinstance(p, int) for p, _ in call.arrays):
            return []
        out_shape = tuple(call.out_metas[0].shape)
        bias = broadcast_letters(("m", "n"), call.shapes[0], out_shape)
        return compile_dims(call, Dims((bias, ("m", "k"), ("k", "n")), (("m", "n"),)))


@attrs.frozen
class BatchedLinalg:
    """Linear algebra on the last two dims of matrices: the batch dims (those before an
    input's own matrix or vector dims) broadcast as torch broadcasts them, aligned from the
    right, and keep their sharding in every input and output holding them (pivots, tau,
    eigenvalues too); a broadcast size-1 dim and the matrix dims are whole."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        names = [a.name for a in call.func._schema.arguments]
        first = tuple(call.arrays[0][1].shape) if call.arrays else ()

        def trailing(path: object, shape: tuple) -> int:
            # an input's batch dims are those before its own matrix (or vector) dims: an
            # unbatched B next to a batched A broadcasts, its rows are no batch dim
            name = names[path] if isinstance(path, int) and path < len(names) else path
            if name in _VECTOR_ARGS:
                return _VECTOR_ARGS[name]
            if (call.func is aten.ormqr.default and name == "input2") or (  # tau
                    name in _RHS.get(call.func, ()) and (len(shape) == 1 or shape == first[:-1])):
                return 1  # a right-hand side of vectors (torch's linalg_solve_is_vector_rhs)
            return 2

        batches = [tuple(v.shape)[: max(v.dim() - trailing(p, tuple(v.shape)), 0)] for p, v in call.arrays]
        try:
            full = tuple(torch.broadcast_shapes(*batches))
        except RuntimeError:
            return []
        if not full:
            return []
        ls = letters(len(full))

        def lettered(shape: tuple, batch: tuple) -> tuple:
            # batch dims right-aligned against the broadcast batch; a size-1 dim broadcast is whole
            if tuple(shape[: len(batch)]) != batch:
                return (None,) * len(shape)
            off = len(full) - len(batch)
            head = tuple(ls[off + j] if n == full[off + j] else None for j, n in enumerate(batch))
            return head + (None,) * (len(shape) - len(batch))

        ins = tuple(lettered(tuple(v.shape), b) for (_, v), b in zip(call.arrays, batches))
        own = _FIRST_BATCH_OUTS.get(call.func, ())  # outputs of the first input's own batch
        outs = tuple(lettered(tuple(m.shape), batches[0] if i in own else full) if isinstance(m, torch.Tensor)
                     else None for i, m in enumerate(call.out_metas))
        cands = compile_dims(call, Dims(ins, outs))
        if call.func is aten.linalg_matrix_exp.default:  # torch's CPU kernel views its batch as one dim:
            return [attrs.evolve(c, dense=True) for c in cands]  # a shard strided within it raised
        if call.func is aten.linalg_lu_solve.default:
            # torch's CPU kernel steps through LU's batch by LU.stride(-3) (pivots': stride(-2)),
            # which a view of a stacked shard sets for a size-1 dim there to the next dim's
            # extent: it read the wrong matrices (fuzzer seed 5777338629), past the end too
            return [attrs.evolve(c, dense="size_one") for c in cands]
        return cands


# inputs of batched linear algebra that are not matrices: how many dims follow their batch dims
_VECTOR_ARGS = {"pivots": 1, "LU_pivots": 1, "tau": 1, "atol": 0, "rtol": 0, "rcond": 0}
# right-hand sides that are vectors where 1-D or of A's shape less its last dim
_RHS = {aten._linalg_solve_ex.default: ("B",), aten.linalg_lstsq.default: ("b",)}
# outputs that keep the first input's own batch, not the broadcast one (A's LU, pivots, info)
_FIRST_BATCH_OUTS = {aten._linalg_solve_ex.default: (1, 2, 3)}


@attrs.frozen
class GroupedMm:
    """``_grouped_mm``: ``offs`` (global row offsets of the groups) splits the rows of a 2-D
    operand into groups, so the grouped dim (rows of ``self`` against a 3-D ``mat2`` of
    experts, or the contracted dim of two 2-D operands) and the group/expert dim stay whole
    and ``offs`` replicated; the other matrix dims shard like ``mm``'s (a sharded
    contraction leaving a pending sum), and a pending sum on one operand passes through.
    Without ``offs`` it is ``bmm``; a 3-D ``self`` (groups, m, k) with a 2-D ``mat2`` whose
    columns ``offs`` groups (the backward of two grouped 2-D operands) keeps ``m`` and may split
    ``k``. A bias has no rule."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        b = bind(call.func, call.args, call.kwargs)
        a, m = b["self"], b["mat2"]
        if b.get("bias") is not None:
            return []
        grouped = b.get("offs") is not None
        if not grouped and a.dim() == m.dim() == 3:
            by_name = {"self": "bmk", "mat2": "bkn"}
            out = "bmn"
        elif grouped and (a.dim(), m.dim()) == (2, 3):
            by_name = {"self": "_k", "mat2": "_kn", "offs": "_"}
            out = "_n"
        elif grouped and (a.dim(), m.dim()) == (2, 2):
            by_name = {"self": "m_", "mat2": "_n", "offs": "_"}
            out = "_mn"
        elif grouped and (a.dim(), m.dim()) == (3, 2):  # the 2-D x 2-D case's input gradient
            by_name = {"self": "_mk", "mat2": "k_", "offs": "_"}
            out = "m_"
        else:
            return []
        names = [a_.name for a_ in call.func._schema.arguments]
        ins, linear_ins = [], []
        for i, (path, _) in enumerate(call.arrays):
            name = names[path] if isinstance(path, int) else path
            if name not in by_name:
                return []
            ins.append(tuple(None if L == "_" else L for L in by_name[name]))
            if name != "offs":
                linear_ins.append(i)
        reduce = (("k", "sum"),) if "k" not in out else ()
        spec = Dims(tuple(ins), (tuple(None if L == "_" else L for L in out),), reduce, LINEAR_OPS,
                    partial_ins=tuple(linear_ins))
        return compile_dims(call, spec)

    @staticmethod
    def out_meta(func: object, args: tuple, kwargs: dict) -> torch.Tensor:
        """The output's shape and dtype from the operands' shapes alone: torch's meta kernel
        checks CUDA's dtype (bfloat16 only) and alignment, while CPU's kernel takes any float
        dtype and checks its own alignment when it runs (each device's call)."""
        b = bind(func, args, kwargs)
        a, m, offs = b["self"], b["mat2"], b.get("offs")
        groups = None if offs is None else (offs.shape[0] if offs.dim() == 1 else -1)
        if (a.dim(), m.dim()) == (3, 3) and groups is None and a.shape[0] == m.shape[0] and a.shape[2] == m.shape[1]:
            shape = (a.shape[0], a.shape[1], m.shape[2])
        elif (a.dim(), m.dim()) == (2, 3) and groups == m.shape[0] and a.shape[1] == m.shape[1]:
            shape = (a.shape[0], m.shape[2])
        elif (a.dim(), m.dim()) == (2, 2) and groups is not None and groups >= 0 and a.shape[1] == m.shape[0]:
            shape = (groups, a.shape[0], m.shape[1])
        elif (a.dim(), m.dim()) == (3, 2) and groups == a.shape[0] and a.shape[2] == m.shape[0]:
            shape = (a.shape[1], m.shape[1])
        else:
            raise RuntimeError(
                f"_grouped_mm: operands of shapes {tuple(a.shape)} and {tuple(m.shape)} with offs of shape "
                f"{None if offs is None else tuple(offs.shape)}: the matrix sizes, the matrix batch sizes and "
                "the group count have to match")
        return torch.empty(shape, dtype=b.get("out_dtype") or a.dtype, device="meta")


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
    aten.mm: Einsum("mk,kn->mn"),
    aten.bmm: Einsum("bmk,bkn->bmn"),
    aten._grouped_mm: GroupedMm(),
    aten.mv: Einsum("mk,k->m"),
    aten.dot: Einsum("k,k->"),
    aten.vdot: Einsum("k,k->"),
    aten.addmm: Addmm("mk,kn->mn", addend=True),
    aten._addmm_activation: AddmmActivation(),
    aten.baddbmm: Einsum("bmk,bkn->bmn", addend=True),
    aten.addmv: Einsum("mk,k->m", addend=True),
    aten.addbmm: Einsum("bmk,bkn->mn", addend=True),
    aten.addr: Einsum("m,n->mn", addend=True),
    aten.outer: Einsum("m,n->mn"),
    aten.ger: Einsum("m,n->mn"),
}
