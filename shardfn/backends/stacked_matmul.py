"""``matmul`` of stacked operands (the local backend's kernel of mm / bmm / addmm on
stacked shards): broadcast leading dims folded into rows or columns, one GEMM, no copies."""

from __future__ import annotations

from typing import Sequence

import torch

from .view_replay import geometry, plain

_TENSOR = torch.Tensor
_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def matmul(a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``torch.matmul(a, b)`` of stacked operands (both at least 2-d, leading dims
    broadcasting), without materialising a broadcast operand where that can be avoided.

    A leading dim on which only ``a`` varies (``b`` is the same there: e.g. a weight
    replicated over 'dp') is folded into ``a``'s rows, one on which only ``b`` varies (an
    activation replicated over 'tp' times a column-split weight) into ``b``'s columns, and
    the product runs as one mm / bmm over the dims both vary on. ``torch.matmul`` would
    instead copy each broadcast operand once per replica and run many small GEMMs. The
    result is a view of the folded product (not contiguous where a fold interleaves).
    ``alpha`` scales the product inside the GEMM (no kernel of its own where a plan folds)."""
    ra, rb = a.dim(), b.dim()
    if ra < 2 or rb < 2 or (ra < 3 and rb < 3):
        return _scaled(torch.matmul(a, b), alpha)
    if ra < rb:
        a = a.view((1,) * (rb - ra) + tuple(a.shape))
    elif rb < ra:
        b = b.view((1,) * (ra - rb) + tuple(b.shape))
    key = (a.shape, b.shape, a.stride(), b.stride())
    try:  # (``_cached_plan``'s hit, inline: every warm simulated product asks)
        plan = _PLANS.get(key, _UNSET)
    except TypeError:  # symbolic sizes do not hash; _fold_plan leaves them to torch.matmul
        plan = None
    if plan is _UNSET:
        plan = _cached_plan(a, b, key)
    if plan is None:
        if all(type(n) is int and n == 1 for n in (*a.shape[:-2], *b.shape[:-2])):  # (no guard on a symbolic size)
            # one GEMM (a replicated product's single stored copy): the 2-d mm a device runs, not
            # torch.matmul's bmm of one matrix, whose CPU kernel for small ones (< 400 products)
            # multiplies complex values another way: inf+nanj where mm gives nan+nanj (then
            # cholesky of the product returned where torch's raised; fuzzer seed 5824102146)
            out = _mm(a.view(a.shape[-2:]), b.view(b.shape[-2:]), alpha)
            return out.view(*a.shape[:-2], *out.shape)
        return _scaled(torch.matmul(a, b), alpha)
    a_order, a_shape, b_order, b_shape, out_shape, out_order, direct = plan  # orders: None where no permute is needed
    if direct:  # ``a``'s rows only: torch.matmul folds them itself (the same mm, in C++)
        if alpha == 1:
            return torch.matmul(a, b.reshape(b_shape[1:]))
        rows = a.reshape(-1, a.shape[-1])  # a view: ``direct`` says the leading dims chain
        return _mm(rows, b.reshape(b_shape[1:]), alpha).view(*a.shape[:-1], b.shape[-1])
    folds = _FOLDS.get(key) if type(a) is _TENSOR and type(b) is _TENSOR and not (_wrapped(a) or _wrapped(b)) else None
    if folds is not None:  # an operand's permute and reshape, and the output's view and permute, as one view each
        ga, gb, (so, to) = folds
        fa = _fold(a, a_order, a_shape) if ga is None else a.as_strided(ga[0], ga[1], a.storage_offset() + ga[2])
        fb = _fold(b, b_order, b_shape) if gb is None else b.as_strided(gb[0], gb[1], b.storage_offset() + gb[2])
        if a_shape[0] != 1:
            out = torch.bmm(fa, fb) if alpha == 1 else torch.baddbmm(fa.new_empty(()), fa, fb, beta=0, alpha=alpha)
        else:
            out = torch.mm(fa, fb) if alpha == 1 else _mm(fa, fb, alpha)
        if out.is_contiguous():  # (a GEMM's fresh output: always)
            return out.as_strided(so, to)
        out = out.view(out_shape)
        return out if out_order is None else out.permute(out_order)
    fa = _fold(a, a_order, a_shape)
    fb = _fold(b, b_order, b_shape)
    out = _gemm(fa, fb, alpha)
    res = out.view(out_shape)
    res = res if out_order is None else res.permute(out_order)
    if plain(a) and plain(b) and out.is_contiguous() and out.storage_offset() == 0:
        if len(_FOLDS) >= _PLANS_MAX:
            _FOLDS.clear()
        # (an operand whose fold copies, a reshape of dims that do not merge: None, folded as above)
        _FOLDS[key] = (geometry(a, fa), geometry(b, fb), (tuple(res.shape), res.stride()))
    return res


def _fold(x: torch.Tensor, order: Sequence[int] | None, shape: tuple) -> torch.Tensor:
    """An operand's leading dims folded (a view where the plan was made: ``mergeable``); one
    GEMM's operand (no batch dim) where the plan has no common dims."""
    if order is not None:
        x = x.permute(order)
    return x.reshape(shape if shape[0] != 1 else shape[1:])


def _gemm(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """bmm of folded operands with a batch dim, else one mm (no batch dim to add and take off again)."""
    if a.dim() == 3:
        return torch.bmm(a, b) if alpha == 1 else torch.baddbmm(a.new_empty(()), a, b, beta=0, alpha=alpha)
    return _mm(a, b, alpha)


def _mm(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """``alpha * (a @ b)``, the scale applied by the GEMM (``beta=0``: the empty addend is never read)."""
    return torch.mm(a, b) if alpha == 1 else torch.addmm(a.new_empty(()), a, b, beta=0, alpha=alpha)


def _scaled(x: torch.Tensor, alpha: float) -> torch.Tensor:
    return x if alpha == 1 else x * alpha


def summed(a: torch.Tensor, b: torch.Tensor, dims: Sequence[int], scale: float = 1.0) -> torch.Tensor | None:
    """``matmul(a, b)`` summed over the leading dims ``dims`` (kept, size 1), as one product
    with those dims folded into the contraction (K): the parts' sum computed by the GEMM
    itself, as a real device's product over the whole K would, with no part written out
    and none added up. Both operands must vary on ``dims``. ``scale`` multiplies the result
    (inside the GEMM). None where the fold is
    not a view of either operand (a copy would cost what the parts do)."""
    ra, rb = a.dim(), b.dim()
    if ra < 3 or rb < 3:
        return None
    if ra < rb:
        a = a.view((1,) * (rb - ra) + tuple(a.shape))
    elif rb < ra:
        b = b.view((1,) * (ra - rb) + tuple(b.shape))
    r = a.dim()
    dims = sorted(dims)
    if not dims or any(d >= r - 2 or a.shape[d] != b.shape[d] for d in dims):
        return None
    for n in (*a.shape, *b.shape):
        if type(n) is not int:
            return None
    if not (mergeable(a, [*dims, r - 1]) and mergeable(b, [*dims, r - 2])):
        return None
    rest = [i for i in range(r - 2) if i not in dims]
    n = _prod_sizes(a.shape, dims)
    af = a.permute(*rest, r - 2, *dims, r - 1).reshape(*[a.shape[i] for i in rest], a.shape[-2], n * a.shape[-1])
    bf = b.permute(*rest, *dims, r - 2, r - 1).reshape(*[b.shape[i] for i in rest], n * b.shape[-2], b.shape[-1])
    for d in dims:
        af, bf = af.unsqueeze(d), bf.unsqueeze(d)
    return matmul(af, bf, scale)


_PLANS: dict[tuple, tuple | None] = {}
_PLANS_MAX = 4096
_UNSET = object()
# per plan key: the folded operands' and the output's geometry (``view_replay.geometry``), where
# every fold was a view, on plain tensors: warm calls run one ``as_strided`` per operand and output
_FOLDS: dict[tuple, tuple] = {}


def _cached_plan(a: torch.Tensor, b: torch.Tensor, key: tuple | None = None) -> tuple | None:
    """:func:`_fold_plan`, remembered per (shapes, strides) ``key``, of which it is a pure function
    (every warm simulated matmul would otherwise recompute it in Python)."""
    if key is None:
        key = (a.shape, b.shape, a.stride(), b.stride())
    try:
        plan = _PLANS.get(key, _UNSET)
    except TypeError:  # symbolic sizes do not hash; _fold_plan leaves them to torch.matmul
        return None
    if plan is _UNSET:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        plan = _PLANS[key] = _fold_plan(a, b)
    return plan


def _fold_plan(a: torch.Tensor, b: torch.Tensor) -> tuple | None:
    """How :func:`matmul` folds the leading dims of ``a`` and ``b`` (of one rank), or
    None when ``torch.matmul`` copies no more (no broadcast leading dim, symbolic sizes,
    or folds that would copy more)."""
    r = a.dim()
    sa, sb = a.shape, b.shape
    for n in (*sa, *sb):
        if type(n) is not int:  # symbolic sizes (torch.compile): leave them to torch.matmul
            return None
    lead = r - 2
    common = [i for i in range(lead) if sa[i] == sb[i]]
    rows = [i for i in range(lead) if sa[i] != sb[i] and sb[i] == 1]
    cols = [i for i in range(lead) if sa[i] != sb[i] and sa[i] == 1]
    if not rows and not cols or len(common) + len(rows) + len(cols) != lead:
        return None
    m, k, n = sa[-2], sa[-1], sb[-1]
    # the dims an operand is broadcast on (size 1 there) ride along with the common ones
    a_order = [*common, *cols, *rows, r - 2, r - 1]
    b_order = [*common, *rows, r - 2, *cols, r - 1]
    fold_copies = (0 if mergeable(a, common) and mergeable(a, [*rows, r - 2]) else a.numel()) + (
        0 if mergeable(b, common) and mergeable(b, [*cols, r - 1]) else b.numel())
    # torch.matmul expands each broadcast operand to the full batch and reshapes (copies) it
    matmul_copies = (a.numel() * _prod_sizes(sb, cols) if cols else 0) + (
        b.numel() * _prod_sizes(sa, rows) if rows else 0)
    if fold_copies > matmul_copies:
        return None
    c = _prod_sizes(sa, common)
    ma, nb = _prod_sizes(sa, rows), _prod_sizes(sb, cols)
    out_shape = (*[sa[i] for i in common], *[sa[i] for i in rows], m, *[sb[i] for i in cols], n)
    # position of each output dim (leading dims in order, then m, n) within out_shape
    where = {d: j for j, d in enumerate([*common, *rows, "m", *cols, "n"])}
    out_order = [where[i] for i in range(lead)] + [where["m"], where["n"]]
    # ``b`` the same on every leading dim: they all fold into a's rows, which torch.matmul of ``a`` and ``b``'s matrix
    # folds as a view too (its condition: each leading stride spans the dims after it)
    direct = (all(sb[i] == 1 for i in range(lead)) and all(a.stride(i) == a.stride(i + 1) * sa[i + 1] for i in range(r - 2))
              and a.numel() > 0)
    # a permute that moves only size-1 dims keeps the elements' order: the reshape after it
    # (or, for the output, one view to the permuted shape) does the same without it
    a_order, b_order = _moving(a_order, sa), _moving(b_order, sb)
    order, out_order = out_order, _moving(out_order, out_shape)
    if out_order is None:
        out_shape = tuple(out_shape[i] for i in order)
    return (a_order, (c, ma * m, k), b_order, (c, k, nb * n), out_shape, out_order, direct)


def _moving(order: list, shape: Sequence[int]) -> list | None:
    """``order``, or None where permuting by it moves only dims of size 1 (a no-op for the
    row-major order of the elements, which is all a reshape or view after it reads)."""
    kept = [i for i in order if shape[i] != 1]
    return None if kept == sorted(kept) else order


def _prod_sizes(shape: Sequence[int], dims: Sequence[int]) -> int:
    p = 1
    for i in dims:
        p *= shape[i]
    return p


def mergeable(t: torch.Tensor, dims: Sequence[int], lead: tuple = ()) -> bool:
    """Whether dims ``dims`` of ``t`` (major first) merge into one dim as a view; ``lead``: the
    sizes ``t``'s leading dims are expanded to first (the mesh's, where ``t`` has size 1: stride 0)."""
    expected = None
    for i in reversed(dims):
        n, s = t.shape[i], t.stride(i)
        if lead and i < len(lead) and lead[i] != n:
            n, s = lead[i], 0
        if n == 1:
            continue
        if expected is not None and s != expected:
            return False
        expected = s * n
    return True
