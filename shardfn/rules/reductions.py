"""Reductions and ops along one dim (DTensor's ``_math_ops``).

A reduction over a sharded dim leaves the result Partial when the reduction is
associative (``sum``, ``mean`` as a sum of ``x / n``, ``amax``, ``amin``, ...); others
(var/std, argmax, max with indices, norms, prod) need the reduced dims whole. Ops along a
dim (softmax, cumsum, sort, topk) need that dim whole and keep every other sharding.
The local computation runs once on stacked shards with dims made negative, so the same
code serves every device; empty shards (uneven layouts) yield the reduction's identity.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import attrs
import torch

from .base import Candidate, OpCall, bind, letters, neg_dim, norm_dims, replace_arg, same_args
from .dims import LINEAR_OPS, Dims, compile_dims

aten = torch.ops.aten

Local = Callable[[torch.Tensor, tuple[int, ...], bool, dict], Any]


def _sum(x: torch.Tensor, dims: tuple[int, ...], keep: bool, b: dict) -> torch.Tensor:
    if not dims:
        return x if b.get("dtype") is None else x.to(b["dtype"])
    return torch.sum(x, dims, keepdim=keep, dtype=b.get("dtype"))


def _nansum(x: torch.Tensor, dims: tuple[int, ...], keep: bool, b: dict) -> torch.Tensor:
    if not dims:
        return torch.nan_to_num(x, nan=0.0)
    return torch.nansum(x, dims, keepdim=keep, dtype=b.get("dtype"))


def _mean(x: torch.Tensor, dims: tuple[int, ...], keep: bool, b: dict) -> torch.Tensor:
    """Sum of ``x / n`` with ``n`` the *global* count: exact for uneven shards too."""
    s = _sum(x, dims, keep, b)
    return s / b["_count"] if dims else s.clone()


def _extreme(fn: Callable, identity: Callable[[torch.dtype], Any]) -> Local:
    """amax/amin that give the identity on a shard with no elements along ``dims``."""

    def run(x: torch.Tensor, dims: tuple[int, ...], keep: bool, b: dict) -> torch.Tensor:
        if not dims:
            return x.clone()
        if any(x.shape[d] == 0 for d in dims):
            shape = [1 if i - x.dim() in dims else n for i, n in enumerate(x.shape)]
            out = torch.full(shape, identity(x.dtype), dtype=x.dtype, device=x.device)
            return out if keep else out.squeeze(tuple(d for d in dims))
        return fn(x, dims, keepdim=keep)

    return run


def _lowest(dtype: torch.dtype) -> Any:
    if dtype == torch.bool:
        return False
    return -math.inf if dtype.is_floating_point else torch.iinfo(dtype).min


def _highest(dtype: torch.dtype) -> Any:
    if dtype == torch.bool:
        return True
    return math.inf if dtype.is_floating_point else torch.iinfo(dtype).max


def _count_nonzero(x: torch.Tensor, dims: tuple[int, ...], keep: bool, b: dict) -> torch.Tensor:
    return torch.count_nonzero(x, dims) if dims else (x != 0).long()


def _flat_then(fn: Callable) -> Local:
    """Ops whose ``dim=None`` means the flattened tensor (argmax, max/min all)."""

    def run(x: torch.Tensor, dims: tuple[int, ...], keep: bool, b: dict) -> Any:
        if b.get("dim") is None:
            nd = len(dims)
            flat = x.flatten(x.dim() - nd) if nd else x.unsqueeze(-1)
            out = fn(flat, -1, keep)
            return out.reshape(*out.shape[:-1], *([1] * nd)) if keep else out
        return fn(x, dims[0], keep)

    return run


def _by_name(name: str, **fixed: Any) -> Local:
    """Call ``torch.<name>(x, dims, keepdim=..., <other bound args>)``."""
    fn = getattr(torch, name)

    def run(x: torch.Tensor, dims: tuple[int, ...], keep: bool, b: dict) -> Any:
        extra = {k: b[k] for k in fixed.get("pass", ()) if k in b}
        d = dims[0] if fixed.get("single") else list(dims)
        return fn(x, d, keepdim=keep, **extra)

    return run


@attrs.frozen
class Reduction:
    """Reduce ``dim`` (all dims when absent) of the first input."""

    local: Local
    reduce_op: str | None = None
    linear: tuple[str, ...] = ()
    single_dim: bool = False

    def candidates(self, call: OpCall) -> list[Candidate]:
        if len(call.arrays) != 1:
            return []
        b = bind(call.func, call.args, call.kwargs)
        shape = call.shapes[0]
        ndim = len(shape)
        dim = b.get("dim")
        dims = norm_dims(dim, ndim) if ndim else ()
        keep = bool(b.get("keepdim", False))
        ls = letters(ndim)
        out = tuple(None if i in dims else L for i, L in enumerate(ls)) if keep else tuple(
            L for i, L in enumerate(ls) if i not in dims)
        outs = tuple(out[: m.dim()] if isinstance(m, torch.Tensor) else None for m in call.out_metas)
        reduce = tuple((ls[d], self.reduce_op) for d in dims) if self.reduce_op else ()
        spec = Dims((ls,), outs, reduce, self.linear)
        if ndim == 0:
            return compile_dims(call, spec)  # dim 0 / -1 of a scalar: the op itself, per device
        count = math.prod(shape[d] for d in dims)
        fn = _Run(self.local, tuple(neg_dim(d, ndim) for d in dims), keep, count, call.func)
        return compile_dims(call, spec, stacked_args=same_args, stacked_fn=fn, device_fn=fn)


@attrs.frozen
class _Run:
    local: Local
    dims: tuple[int, ...]
    keep: bool
    count: int
    func: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        b = bind(self.func, args, kwargs)
        b["_count"] = self.count
        return self.local(args[0], self.dims, self.keep, b)


@attrs.frozen
class AlongDim:
    """Ops needing the dims named by ``arg`` whole (softmax, cumsum, sort, topk...);
    every tensor input and output of the input's rank keeps the other shardings."""

    arg: str = "dim"
    default_all: bool = False
    fixed: tuple[int, ...] = ()

    def candidates(self, call: OpCall) -> list[Candidate]:
        ndim = len(call.shapes[0])
        if any(len(s) != ndim for s in call.shapes):
            return []
        shift: Any = same_args
        if self.fixed:
            dims = norm_dims(self.fixed, ndim) if ndim else ()
        else:
            raw = bind(call.func, call.args, call.kwargs).get(self.arg)
            if raw is None and not self.default_all:
                raw = -1
            dims = norm_dims(raw, ndim) if ndim else ()
            if ndim == 0 or isinstance(raw, (list, tuple)) and not raw:
                shift = None  # "all dims" (flattened) has no stacked spelling
            elif raw is not None:
                shift = _NegDim(call.func, self.arg, ndim)
        ls = tuple(None if i in dims else L for i, L in enumerate(letters(ndim)))
        outs = tuple(
            (ls if m.dim() == ndim else (None,) * m.dim()) if isinstance(m, torch.Tensor) else None
            for m in call.out_metas
        )
        spec = Dims((ls,) * len(call.arrays), outs)
        return compile_dims(call, spec, stacked_args=shift)


@attrs.frozen
class _NegDim:
    func: Any
    arg: str
    ndim: int

    def __call__(self, args: tuple, kwargs: dict, m: int) -> tuple[tuple, dict]:
        v = bind(self.func, args, kwargs)[self.arg]
        new = neg_dim(v, self.ndim) if isinstance(v, int) else [neg_dim(d, self.ndim) for d in v]
        return replace_arg(self.func, args, kwargs, self.arg, new)


_SUM = Reduction(_sum, "sum", LINEAR_OPS)
_AMAX = Reduction(_extreme(torch.amax, _lowest), "max", ("max",))
_AMIN = Reduction(_extreme(torch.amin, _highest), "min", ("min",))
_ALONG = AlongDim()

TABLE = {
    aten.sum: _SUM,
    aten.nansum: Reduction(_nansum, "sum"),
    aten.mean: Reduction(_mean, "sum", LINEAR_OPS),
    aten.amax: _AMAX,
    aten.amin: _AMIN,
    aten.max.default: _AMAX,
    aten.min.default: _AMIN,
    aten.count_nonzero: Reduction(_count_nonzero, "sum"),
    aten.max.dim: Reduction(_by_name("max", single=True)),
    aten.min.dim: Reduction(_by_name("min", single=True)),
    aten.argmax: Reduction(_flat_then(torch.argmax)),
    aten.argmin: Reduction(_flat_then(torch.argmin)),
    aten.var: Reduction(_by_name("var", **{"pass": ("correction",)})),
    aten.std: Reduction(_by_name("std", **{"pass": ("correction",)})),
    aten.var_mean: Reduction(_by_name("var_mean", **{"pass": ("correction",)})),
    aten.std_mean: Reduction(_by_name("std_mean", **{"pass": ("correction",)})),
    aten.logsumexp: Reduction(_by_name("logsumexp")),
    aten.linalg_vector_norm: Reduction(lambda x, d, k, b: torch.linalg.vector_norm(
        x, b["ord"], list(d), k, dtype=b.get("dtype"))),
    aten.prod.default: Reduction(lambda x, d, k, b: torch.prod(
        x.flatten(x.dim() - len(d)) if d else x.unsqueeze(-1), -1, dtype=b.get("dtype"))),
    aten.prod.dim_int: Reduction(lambda x, d, k, b: torch.prod(x, d[0], k, dtype=b.get("dtype"))),
    aten.any: Reduction(lambda x, d, k, b: torch.any(x, d, keepdim=k) if d else x.bool()),
    aten.all: Reduction(lambda x, d, k, b: torch.all(x, d, keepdim=k) if d else x.bool()),
    aten.median.dim: Reduction(_by_name("median", single=True)),
    aten.nanmedian.dim: Reduction(_by_name("nanmedian", single=True)),
    aten.mode: Reduction(_by_name("mode", single=True)),
    aten._softmax: _ALONG,
    aten._safe_softmax: _ALONG,
    aten._log_softmax: _ALONG,
    aten._softmax_backward_data: _ALONG,
    aten._log_softmax_backward_data: _ALONG,
    aten.cumsum: _ALONG,
    aten.cumprod: _ALONG,
    aten.logcumsumexp: _ALONG,
    aten.cummax: _ALONG,
    aten.cummin: _ALONG,
    aten.sort: _ALONG,
    aten.linalg_cross: _ALONG,
    aten.topk: _ALONG,
    aten.kthvalue: Reduction(lambda x, d, k, b: torch.kthvalue(x, b["k"], d[0], k)),
}
