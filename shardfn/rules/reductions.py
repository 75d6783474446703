"""Reductions and ops along one dim (DTensor's ``_math_ops``).

A reduction over a sharded dim leaves the result Partial when the reduction is
associative (``sum``, ``mean`` as an average of the shards' means, ``amax``, ``amin``, ...); others
(var/std, argmax, max with indices, norms, prod) need the reduced dims whole. Ops along a
dim (softmax, cumsum, sort, topk) need that dim whole and keep every other sharding.
Each device runs the op itself on its shard, except a mean over sharded dims of uneven
shards (each device sums ``x / n``, n the global count) and amax/amin on a shard empty
along a reduced dim (the reduction's identity).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import attrs
import torch

from ..values.layout import is_even, local_shapes
from .base import Candidate, OpCall, bind, letters, norm_dims
from .dims import LINEAR_OPS, Dims, compile_dims

aten = torch.ops.aten


def _lowest(dtype: torch.dtype) -> Any:
    if dtype == torch.bool:
        return False
    return -math.inf if dtype.is_floating_point else torch.iinfo(dtype).min


def _highest(dtype: torch.dtype) -> Any:
    if dtype == torch.bool:
        return True
    return math.inf if dtype.is_floating_point else torch.iinfo(dtype).max


@attrs.frozen
class Reduction:
    """Reduce ``dim`` (all dims when absent) of the first input. ``reduce_op``: what a
    reduction over a sharded dim leaves pending (None: the reduced dims must be whole);
    ``mean``: the op is a mean (pending avg over even shards, else a sum of ``x / n``);
    ``identity``: the value of an empty reduction (amax/amin on an empty shard); ``dense``: the
    candidates' (``Candidate.dense``)."""

    reduce_op: str | None = None
    linear: tuple[str, ...] = ()
    mean: bool = False
    identity: Callable[[torch.dtype], Any] | None = None
    dense: bool | str = False

    def candidates(self, call: OpCall) -> list[Candidate]:
        if len(call.arrays) != 1:
            return []
        b = bind(call.func, call.args, call.kwargs)
        shape = call.shapes[0]
        ndim = len(shape)
        dims = norm_dims(b.get("dim"), ndim) if ndim else ()
        keep = bool(b.get("keepdim", False))
        ls = letters(ndim)
        out = tuple(None if i in dims else L for i, L in enumerate(ls)) if keep else tuple(
            L for i, L in enumerate(ls) if i not in dims)
        outs = tuple(out[: m.dim()] if isinstance(m, torch.Tensor) else None for m in call.out_metas)

        def spec(op: str | None) -> Dims:
            return Dims((ls,), outs, tuple((ls[d], op) for d in dims) if op else (), self.linear)

        if not self.mean:
            op = self.reduce_op
            if op in ("max", "min") and call.arrays[0][1].dtype.is_complex:
                op = None  # complex values have no order to leave pending (torch reduces only empty ones)
            cands = compile_dims(call, spec(op))
            if self.dense:
                cands = [attrs.evolve(c, dense=self.dense) for c in cands]
            if self.identity is None:
                return cands
            fn = _EmptyIdentity(call.func, dims, keep, self.identity)
            return [c if not _empty_reduced(c, shape, dims) else attrs.evolve(c, local_fn=fn) for c in cands]
        # a mean over even shards is the average of the shards' means; over uneven ones
        # each device sums x / n with n the global count
        count = math.prod(shape[d] for d in dims)
        uneven = _PartialMean(call.func, dims, keep, count)
        summed = {c.in_layouts: c for c in compile_dims(call, spec("sum"))}
        return [c if is_even(c.in_layouts[0], shape) else attrs.evolve(summed[c.in_layouts], local_fn=uneven)
                for c in compile_dims(call, spec("avg"))]


def _empty_reduced(c: Candidate, shape: tuple, dims: tuple) -> bool:
    """Whether some device's shard is empty along a reduced dim."""
    return any(s[d] == 0 for s in local_shapes(c.in_layouts[0], shape) for d in dims)


@attrs.frozen
class _PartialMean:
    """One device's share of a mean over sharded dims: its sum of ``x / count``. 16-bit
    floats sum in float32 and divide before rounding, as torch's mean accumulates: a share's
    16-bit sum overflowed where the mean did not (float16 rows of -16000: -inf where torch
    gave -32000, fuzzer seed 5816770550 --gen 5)."""

    func: Any
    dims: tuple[int, ...]
    keep: bool
    count: int

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        b = bind(self.func, args, kwargs)
        x = b["self"]
        if not self.dims:
            return x.clone()
        dtype = b.get("dtype") or x.dtype
        wide = {torch.float16: torch.float32, torch.bfloat16: torch.float32}.get(dtype)
        if wide is None:
            return torch.sum(x, self.dims, keepdim=self.keep, dtype=dtype) / self.count
        return (torch.sum(x.to(wide), self.dims, keepdim=self.keep) / self.count).to(dtype)


@attrs.frozen
class _EmptyIdentity:
    """amax/amin on one device's shard, the identity where the shard is empty along a
    reduced dim (torch refuses an empty reduction)."""

    func: Any
    dims: tuple[int, ...]
    keep: bool
    identity: Callable[[torch.dtype], Any]

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        x = args[0]
        if not any(x.shape[d] == 0 for d in self.dims):
            return self.func(*args, **kwargs)
        shape = [1 if i in self.dims else n for i, n in enumerate(x.shape) if i not in self.dims or self.keep]
        return torch.full(shape, self.identity(x.dtype), dtype=x.dtype, device=x.device)


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
        if self.fixed:
            dims = norm_dims(self.fixed, ndim) if ndim else ()
        else:
            raw = bind(call.func, call.args, call.kwargs).get(self.arg)
            if raw is None and not self.default_all:
                raw = -1
            dims = norm_dims(raw, ndim) if ndim else ()
        ls = tuple(None if i in dims else L for i, L in enumerate(letters(ndim)))
        outs = tuple(
            (ls if m.dim() == ndim else (None,) * m.dim()) if isinstance(m, torch.Tensor) else None
            for m in call.out_metas
        )
        # an input's dim of size 1 that the op broadcasts (``linalg_cross(a[1, 3], b[5, 3])``) is
        # whole: split like the output's, its pieces were empty beside the other input's rows
        out = next((tuple(m.shape) for m in call.out_metas if isinstance(m, torch.Tensor) and m.dim() == ndim), None)
        ins = tuple(
            tuple(None if out is not None and n == 1 != out[i] else L for i, (n, L) in enumerate(zip(shape, ls)))
            for shape in call.shapes
        )
        spec = Dims(ins, outs)
        return compile_dims(call, spec)


@attrs.frozen
class Histogram:
    """``histc`` over fixed bins (``min < max``): the counts of the shards add up to the
    whole's, so any sharding of the input leaves the bins a pending sum. Bins from the
    data's own range (``min == max``) need the input whole."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        if len(call.arrays) != 1 or call.arrays[0][0] != 0:
            return []
        b = bind(call.func, call.args, call.kwargs)
        ls = letters(len(call.shapes[0]))
        if b.get("min", 0) >= b.get("max", 0):
            return compile_dims(call, Dims(((None,) * len(ls),), ((None,),)))
        return compile_dims(call, Dims((ls,), ((None,),), tuple((L, "sum") for L in ls)))


_SUM = Reduction("sum", LINEAR_OPS)
_AMAX = Reduction("max", ("max",), identity=_lowest)
_AMIN = Reduction("min", ("min",), identity=_highest)
_WHOLE = Reduction()
# torch's CPU median / nanmedian read a dim of stride 0 (an ``expand``) wrongly: values from other
# positions along it (``x.expand(3, 9).median(0)`` is not x), where the contiguous copy's are right;
# each device's shard of an expanded array is such a view, so it reaches them copied ("distinct":
# only a tensor whose elements share memory). Fuzzer seed 5829536839; also the all-dims overloads,
# whose batched form (``backends/batching._median_all``) runs ``median.dim`` on a flattened
# stacked value, a stride-0 view still where the whole array is one expanded element.
_MEDIAN = Reduction(dense="distinct")
_ALONG = AlongDim()

TABLE = {
    aten.sum: _SUM,
    aten.nansum: Reduction("sum"),
    aten.mean: Reduction("sum", LINEAR_OPS, mean=True),
    aten.amax: _AMAX,
    aten.amin: _AMIN,
    aten.max.default: _AMAX,
    aten.min.default: _AMIN,
    aten.count_nonzero: Reduction("sum"),
    aten.histc: Histogram(),
    **{op: _WHOLE for op in (
        aten.max.dim, aten.min.dim, aten.argmax, aten.argmin, aten.var, aten.std, aten.var_mean,
        aten.std_mean, aten.logsumexp, aten.linalg_vector_norm, aten.prod.default, aten.prod.dim_int,
        aten.any, aten.all, aten.mode, aten.kthvalue, aten.aminmax, aten.norm)},
    **{op: _MEDIAN for op in (aten.median.default, aten.median.dim, aten.nanmedian.default, aten.nanmedian.dim)},
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
    # FFTs over the dims named by ``dim`` (whole; their sizes may change: onesided halves, c2r's
    # last_dim_size): the other dims keep their shardings
    aten._fft_r2c: _ALONG,
    aten._fft_c2c: _ALONG,
    aten._fft_c2r: _ALONG,
    aten.glu: _ALONG,  # halves along dim: the other dims keep their shardings
    aten.glu_backward: _ALONG,
}
