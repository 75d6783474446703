"""``aten._foreach_*`` ops on ShardedArrays: the element-wise ones (what torch.optim's
``foreach=True`` paths and ``clip_grad_norm_`` call) shard each list position like a
pointwise op, and the p-norms of many arrays at once (``aten._foreach_norm``, also
``sf.optim.clip_grad_norm``'s).

Each process reduces the distinct shards it stores (``Backend.shard_reduce``: a replica
counts once); the partial results of all arrays on one mesh travel as one vector pending a
reduction over every mesh axis, so the norms cost one all_reduce per mesh (none on the
local backend), whatever the layouts.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..arrays.array import ShardedArray, wrap
from ..arrays.redistribute import distribute, reshard
from ..backends.registry import backend_for
from ..arrays.strategies import Candidate, OpCall
from ..values.layout import Layout
from .pointwise import _map_dims

aten = torch.ops.aten


def reducer(p: float) -> Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]:
    """``fn(t, dims)``: the per-shard part of a p-norm over ``dims`` (a sum of |x|^p, a
    max/min of |x| for +-inf, a count of nonzeros for 0), accumulated in float32 or wider."""
    def fn(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
        acc = torch.promote_types(t.dtype, torch.float32)
        a = t.abs().to(acc)
        batch = [n for i, n in enumerate(t.shape) if i not in dims]
        if math.isinf(p):
            if a.numel() == 0:
                return torch.full(batch, 0.0 if p > 0 else math.inf, dtype=acc, device=t.device)
            return a.amax(dims) if p > 0 else a.amin(dims)
        if p == 2:
            return (a * a).sum(dims)
        if p == 1:
            return a.sum(dims)
        return a.pow(p).sum(dims) if p != 0 else (a != 0).to(acc).sum(dims)
    return fn


def combine(p: float) -> str:
    """How the per-shard parts of a p-norm combine across devices."""
    return ("max" if p > 0 else "min") if math.isinf(p) else "sum"


def finish(part: torch.Tensor, p: float) -> torch.Tensor:
    """The p-norm from its combined part."""
    return part if math.isinf(p) or p == 0 else part.pow(1.0 / p)


def reduced_parts(arrays: list[ShardedArray], p: float) -> dict[Any, tuple[list[int], torch.Tensor]]:
    """Per mesh: the positions in ``arrays`` of its arrays, and a plain vector of their
    combined p-norm parts, the same on every process (one all_reduce). ``arrays`` have no
    pending reductions."""
    by_mesh: dict[Any, list[int]] = {}
    for i, x in enumerate(arrays):
        by_mesh.setdefault(x.mesh, []).append(i)
    fn = reducer(p)
    neutral = math.inf if p == -math.inf else 0.0
    op = combine(p)
    out = {}
    for mesh, idx in by_mesh.items():
        backend = backend_for(mesh)
        vals = [backend.shard_reduce(arrays[i]._local, arrays[i]._layout, tuple(arrays[i].shape), fn, neutral)
                for i in idx]
        dtype = vals[0].dtype
        for v in vals[1:]:
            dtype = torch.promote_types(dtype, v.dtype)
        stacked = torch.stack([v.to(dtype) for v in vals], dim=-1)
        flat = mesh
        if len(mesh.axis_names) > 1:  # one axis over every device: one all_reduce, not one per axis
            flat = mesh.flatten(mesh.axis_names, "_".join(mesh.axis_names) + "_norm")
            stacked = backend.relabel(stacked, mesh, flat)
        pending = Layout(flat, ((),), tuple((a, op) for a in flat.axis_names))
        summed = reshard(wrap(stacked, pending, (len(idx),), dtype), Layout(flat, ((),)))
        out[mesh] = (idx, summed.full_tensor())
    return out


def _foreach_norm(func: Any, args: tuple, kwargs: dict) -> Any:
    """``aten._foreach_norm.Scalar(tensors, ord=2, dtype=None)``: 0-d norms, replicated
    arrays on their input's mesh for ShardedArray inputs, plain tensors for plain ones."""
    tensors = list(args[0])
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    p = float(ord_)
    arrays = [t for t in tensors if isinstance(t, ShardedArray)]
    if not arrays:
        return NotImplemented
    pend = [i for i, t in enumerate(tensors) if isinstance(t, ShardedArray) and t._layout.partial]
    if pend:
        resolved = reshard([tensors[i] for i in pend], [tensors[i]._layout.without_partial() for i in pend])
        for i, t in zip(pend, resolved):
            tensors[i] = t
    sharded = [i for i, t in enumerate(tensors) if isinstance(t, ShardedArray)]
    results: list[Any] = [None] * len(tensors)
    with torch.no_grad():
        for i, t in enumerate(tensors):
            if not isinstance(t, ShardedArray):
                results[i] = torch.linalg.vector_norm(t, p, dtype=dtype)
        for mesh, (idx, vec) in reduced_parts([tensors[i] for i in sharded], p).items():
            norms = finish(vec, p)
            for k, j in enumerate(idx):
                i = sharded[j]
                results[i] = distribute(norms[k].to(dtype or tensors[i].dtype), Layout(mesh, ()))
    return results


class ForeachPointwise:
    """An element-wise ``_foreach`` op: position ``j`` of every tensor list and output ``j``
    form one pointwise call, laid out like the first array at ``j`` of the output's shape
    (pending reductions resolved first; broadcast dims whole); tensors outside the lists
    (a 0-d scalar, ``addcdiv``'s per-position scalars) replicated."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        mesh = call.mesh
        at: dict[int, list[int]] = {}
        for i, (path, _) in enumerate(call.arrays):
            if isinstance(path, tuple):
                at.setdefault(path[1], []).append(i)
        ins: list[Layout | None] = [None] * len(call.arrays)
        outs: list[Layout | None] = []
        for j, m in enumerate(call.out_metas):
            if not isinstance(m, torch.Tensor):
                outs.append(None)
                continue
            shape = tuple(m.shape)
            idx = at.get(j, [])
            base = next((call.arrays[i][1]._layout.without_partial() for i in idx if call.shapes[i] == shape), None)
            if base is None:
                if any(call.arrays[i][1]._layout.dims != ((),) * len(call.shapes[i]) for i in idx):
                    return []  # every operand at j broadcast: no rule (the fallback warns)
                base = Layout(mesh, ((),) * len(shape))
            for i in idx:
                ins[i] = Layout(mesh, _map_dims(base, shape, call.shapes[i]))
            outs.append(base)
        final = tuple(lay if lay is not None else Layout(mesh, ((),) * len(call.shapes[i])) for i, lay in enumerate(ins))
        return [Candidate(final, tuple(outs), broadcast=all(isinstance(p, tuple) for p, _ in call.arrays))]


# the functional element-wise ``_foreach`` ops (not the reductions norm, max, powsum, nor mm)
_ELEMENTWISE = (
    "abs", "acos", "add", "addcdiv", "addcmul", "asin", "atan", "ceil", "clamp_max", "clamp_min", "clone",
    "copy", "cos", "cosh", "div", "erf", "erfc", "exp", "expm1", "floor", "frac", "lerp", "lgamma", "log",
    "log10", "log1p", "log2", "maximum", "minimum", "mul", "neg", "pow", "reciprocal", "round", "rsqrt",
    "sigmoid", "sign", "sin", "sinh", "sqrt", "sub", "tan", "tanh", "trunc", "zero",
)


FOREACH = ForeachPointwise()
TABLE = {getattr(aten, f"_foreach_{n}"): FOREACH for n in _ELEMENTWISE if hasattr(aten, f"_foreach_{n}")}
SPECIAL = {aten._foreach_norm.Scalar: _foreach_norm}
