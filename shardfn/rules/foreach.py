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
from ..arrays.local_shards import _from_local
from ..arrays.redistribute import distribute, reshard
from ..backends.registry import backend_for
from ..arrays.strategies import Candidate, OpCall
from ..values.layout import Layout
from ..values.schema import bind
from .indexing import Replicated
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


def reduced_parts(arrays: list[ShardedArray], p: float,
                  part: tuple[Callable, float, str] | None = None) -> dict[Any, tuple[list[int], torch.Tensor]]:
    """Per mesh: the positions in ``arrays`` of its arrays, and a plain vector of their
    combined p-norm parts, the same on every process (one all_reduce). ``arrays`` have no
    pending reductions. ``part``: (per-shard fn, neutral value, combining op) in place of the
    p-norm's (``_foreach_max``)."""
    by_mesh: dict[Any, list[int]] = {}
    for i, x in enumerate(arrays):
        by_mesh.setdefault(x.mesh, []).append(i)
    fn, neutral, op = part or (reducer(p), math.inf if p == -math.inf else 0.0, combine(p))
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


def _foreach_norm(func: Any, args: tuple, kwargs: dict, root: bool = True) -> Any:
    """``aten._foreach_norm.Scalar(tensors, ord=2, dtype=None)``: 0-d norms, replicated
    arrays on their input's mesh for ShardedArray inputs, plain tensors for plain ones.
    ``root=False``: ``_foreach_powsum`` (the sums of ``|x|^ord``, for finite ``ord > 0``)."""
    tensors = list(args[0] if args else kwargs["self"])
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    p = float(ord_)
    arrays = [t for t in tensors if isinstance(t, ShardedArray)]
    if not arrays or (not root and not (0 < p < math.inf)):
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
                results[i] = torch.linalg.vector_norm(t, p, dtype=dtype) if root else func([t], ord_, dtype)[0]
        for mesh, (idx, vec) in reduced_parts([tensors[i] for i in sharded], p).items():
            norms = finish(vec, p) if root else vec
            for k, j in enumerate(idx):
                i = sharded[j]
                results[i] = distribute(norms[k].to(dtype or tensors[i].dtype), Layout(mesh, ()))
    return results


def _max_part(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """The largest entry of one shard over ``dims`` (-inf for an empty shard of an uneven layout)."""
    if t.numel() == 0:
        return torch.full([n for i, n in enumerate(t.shape) if i not in dims], -math.inf, dtype=t.dtype, device=t.device)
    return t.amax(dims)


def _foreach_max(func: Any, args: tuple, kwargs: dict) -> Any:
    """``aten._foreach_max(tensors)``: each tensor's largest entry, 0-d, replicated on its
    input's mesh; the per-shard maxima of all arrays on one mesh travel as one vector (one
    all_reduce per mesh, none on the local backend). Floating arrays with entries only;
    others run as torch does (torch raises for an empty tensor)."""
    tensors = list(args[0] if args else kwargs["self"])
    arrays = [t for t in tensors if isinstance(t, ShardedArray)]
    if not arrays or any(not t.dtype.is_floating_point or t.numel() == 0 for t in tensors):
        return NotImplemented
    pend = [i for i, t in enumerate(tensors) if isinstance(t, ShardedArray) and t._layout.partial]
    if pend:
        for i, t in zip(pend, reshard([tensors[i] for i in pend], [tensors[i]._layout.without_partial() for i in pend])):
            tensors[i] = t
    sharded = [i for i, t in enumerate(tensors) if isinstance(t, ShardedArray)]
    results: list[Any] = [t.amax() if not isinstance(t, ShardedArray) else None for t in tensors]
    with torch.no_grad():
        for mesh, (idx, vec) in reduced_parts([tensors[i] for i in sharded], 0.0, (_max_part, -math.inf, "max")).items():
            for k, j in enumerate(idx):
                i = sharded[j]
                results[i] = distribute(vec[k].to(tensors[i].dtype), Layout(mesh, ()))
    return results


def _nonfinite_part(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """1.0 where one shard holds an inf or nan over ``dims``, else 0.0."""
    flags = torch.isfinite(t).logical_not().to(torch.float32)
    if t.numel() == 0:
        return torch.zeros([n for i, n in enumerate(t.shape) if i not in dims], device=t.device)
    return flags.amax(dims)


def _amp_unscale(func: Any, args: tuple, kwargs: dict) -> Any:
    """``aten._amp_foreach_non_finite_check_and_unscale(grads, found_inf, inv_scale)`` (the
    functional form of GradScaler's unscale): each gradient times ``inv_scale`` in its own
    layout, and ``found_inf`` set to 1 where any shard of any gradient holds an inf or nan
    (one vector of per-shard flags per mesh, max-reduced), replicated."""
    b = bind(func, args, kwargs)
    grads, found, inv = list(b["self"]), b["found_inf"], b["inv_scale"]
    arrays = [t for t in grads if isinstance(t, ShardedArray)]
    if not arrays or any(not isinstance(t, ShardedArray) for t in (*grads, found, inv)) or found.numel() != 1:
        return NotImplemented
    pend = [i for i, t in enumerate(grads) if t._layout.partial]
    if pend:
        for i, t in zip(pend, reshard([grads[i] for i in pend], [grads[i]._layout.without_partial() for i in pend])):
            grads[i] = t
    scale = aten.view.default(inv, [])  # (0-d: a 0-d gradient stays 0-d)
    out = [g * scale for g in grads]
    flags = [vec.amax() for _, (_, vec) in reduced_parts(grads, 0.0, (_nonfinite_part, 0.0, "max")).items()]
    hit = torch.stack(flags).amax().reshape(found.shape).to(found.dtype)
    return out, torch.maximum(found, distribute(hit.to(found.device), Layout(found.mesh, ((),) * found.dim())))


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


# -- the functional fused optimizer kernels ------------------------------------------------------
# ``aten._fused_adam`` / ``_fused_adamw`` / ``_fused_sgd`` / ``_fused_adagrad`` (what
# functionalisation makes of torch.optim's ``fused=True`` kernels) update every tensor of a
# parameter element-wise, returning lists of lists, which the rule table (one level of
# outputs) cannot describe: they ran replicated, and the nested outputs came back plain tensors.


def _fused_optimizer(func: Any, args: tuple, kwargs: dict) -> Any:
    """A functional fused optimizer step: position ``j`` of every tensor list is laid out like
    parameter ``j`` (pending sums resolved first), each device runs the kernel on its shards
    (0-d step counts, ``lr``, ``grad_scale`` and ``found_inf`` whole), and each output list
    ``X_out`` comes out laid out like the parameters (0-d step counts whole)."""
    b = bind(func, args, kwargs)
    params = list(b["self"])
    arrays = [t for v in b.values() for t in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(t, ShardedArray)]
    if not arrays:
        return NotImplemented
    mesh = arrays[0].mesh
    backend = backend_for(mesh)
    whole = lambda t: Layout(mesh, ((),) * t.dim())  # noqa: E731
    targets = [p._layout.without_partial() if isinstance(p, ShardedArray) else whole(p) for p in params]

    def layout_at(t: torch.Tensor, j: int | None) -> Layout:
        return targets[j] if j is not None and t.dim() else whole(t)

    def shards(t: Any, j: int | None) -> Any:
        """``t`` laid out for position ``j`` (None: whole), as each device's shards."""
        if not isinstance(t, torch.Tensor):
            return None
        want = layout_at(t, j)
        t = distribute(t, want) if not isinstance(t, ShardedArray) else t if t._layout == want else reshard(t, want)
        return backend.shard_list(t._local, mesh)

    lists = {n for n, v in b.items() if isinstance(v, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in v)}
    per = {n: [shards(t, j if len(b[n]) == len(params) else None) for j, t in enumerate(b[n])] if n in lists
           else shards(v, None) for n, v in b.items()}
    outs = []
    for d in range(len(backend.shard_list(arrays[0]._local, mesh))):
        call = {n: [x[d] for x in per[n]] if n in lists else per[n][d] if per[n] is not None else v
                for n, v in b.items()}
        outs.append(func(**call) if mesh.device_type != "meta" else _meta_step(func, call))
    result = []
    for i, ret in enumerate(func._schema.returns):
        src = list(b[ret.name.removesuffix("_out")])
        result.append([
            _from_local(backend.pack_local([o[i][j] for o in outs], mesh),
                        layout_at(src[j], j if len(src) == len(params) else None), None, tuple(src[j].shape), None)
            for j in range(len(src))])
    return tuple(result)


def _meta_step(func: Any, call: dict) -> tuple:
    """One meta device's outputs: each output list shaped like its input list (torch has meta
    kernels for few of these ops: ``_fused_sgd``, ``_fused_adagrad`` and the ``tensor_lr`` forms
    raised NotImplementedError on a meta mesh)."""
    return tuple([torch.empty_like(t) for t in call[r.name.removesuffix("_out")]] for r in func._schema.returns)


FOREACH = ForeachPointwise()
TABLE = {getattr(aten, f"_foreach_{n}"): FOREACH for n in _ELEMENTWISE if hasattr(aten, f"_foreach_{n}")}
TABLE[aten._amp_update_scale] = Replicated()  # GradScaler's scale update: one-element tensors, whole
SPECIAL = {aten._foreach_norm.Scalar: _foreach_norm, aten._foreach_max.default: _foreach_max,
           aten._amp_foreach_non_finite_check_and_unscale.default: _amp_unscale}
if hasattr(aten, "_foreach_powsum"):
    SPECIAL[aten._foreach_powsum.Scalar] = lambda func, args, kwargs: _foreach_norm(func, args, kwargs, root=False)
SPECIAL.update({getattr(getattr(aten, op), ov): _fused_optimizer
                for op in ("_fused_adam", "_fused_adamw", "_fused_sgd", "_fused_adagrad") if hasattr(aten, op)
                for ov in ("default", "tensor_lr") if hasattr(getattr(aten, op), ov)})
