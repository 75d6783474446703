"""One local call for every device of the local backend (its stacked values).

A stacked value has the mesh dims in front: ``(d_0, ..., d_{m-1}, *local_shape)``. Most
ops batch over leading dims once their dim arguments name the same logical dims: this
module turns a strategy's local call (``device_call``: the op or ``local_op``, localised
sizes, dense inputs) into a call on stacked values, computed once per cache entry:

- *schema-driven dim arguments*: a non-negative ``dim``/``dims``/``dim0``/``dim1``/
  ``dim2``/``dimension`` becomes negative (it then names the same logical dim with the
  mesh dims prepended); for reductions an absent dim list ("all dims") becomes the
  explicit logical dims;
- *size arguments* (``local_sizes``) get the input's mesh dims prepended;
- *elementwise* calls (``broadcast``) pad lower-rank operands with size-1 dims after
  the mesh dims, so broadcasting lines up the logical dims;
- *batched forms* for ops that do not batch over leading dims (``mm`` and friends as
  ``matmul``, ``t``, ``permute``, ``repeat``, ``expand``, ``new_*`` factories, reductions
  without a dim argument, layer norm and embedding with their replicated weights
  unstacked, convolution and flash attention with the mesh dims folded into the batch).

:func:`batched_call` returns None where no batched form is known (custom ops, indexing,
nn kernels, a ``local_fn``): the local backend then runs the call once per device.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from . import custom_ops as _contract  # noqa: F401  (registers torch.ops.shardfn.*, whose kernels batch)
from ..values.schema import _schema_info
from ..values.sharded import Sharded
from ..values.layout import local_shapes
from . import device_call as dc
from . import kernel_layouts
from . import stacked_matmul
from .local_values import SHARES
from .view_replay import geometry

aten = torch.ops.aten

_DIM_NAMES = frozenset({"dim", "dims", "dim0", "dim1", "dim2", "dimension"})
_DIM_TYPES = frozenset({"int", "int?", "int[]", "int[1]", "int[]?", "int[1]?", "List[int]", "Optional[int]",
                        "Optional[List[int]]"})


def _packets(*names: str) -> frozenset:
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


# Ops whose dim list means "all dims" when it is None or empty.
_ALL_DIMS = _packets(
    "sum", "nansum", "mean", "amax", "amin", "count_nonzero", "var", "std", "var_mean", "std_mean",
    "logsumexp", "linalg_vector_norm", "any", "all",
)
# Ops for which an empty dim list means the flattened tensor.
_FLAT_WHEN_EMPTY = _packets("roll")
# Ops whose dim arguments count the output's dims (a new dim is inserted).
_OUT_RANK = _packets("unsqueeze", "unsqueeze_copy", "stack", "select_backward", "slice_backward", "diag_embed")
# Ops that batch over leading dims once their dim arguments are negative.
_LEADING = _ALL_DIMS | _OUT_RANK | _packets(
    "max", "min", "argmax", "argmin", "prod", "median", "nanmedian", "mode", "kthvalue",
    "_softmax", "_safe_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
    "cumsum", "cumprod", "logcumsumexp", "cummax", "cummin", "sort", "linalg_cross", "topk",
    "flip", "roll", "tril", "triu", "gather", "scatter", "scatter_add", "scatter_reduce",
    "transpose", "transpose_copy", "select", "select_copy", "slice", "slice_copy", "split",
    "split_copy", "split_with_sizes", "split_with_sizes_copy", "unsafe_split", "unsafe_split_with_sizes",
    "unbind", "unbind_copy", "diagonal", "diagonal_copy", "unfold", "unfold_copy", "cat",
    "constant_pad_nd", "view_as_complex", "view_as_real", "zeros_like", "ones_like", "empty_like",
    "full_like", "view", "_unsafe_view", "reshape", "view_copy",
) | {aten.squeeze.dims, aten.squeeze_copy.dims, torch.ops.shardfn.contract.default,
     torch.ops.shardfn.rms_norm.default, torch.ops.shardfn.rms_norm_backward.default}


class Info:
    """What a batched form may read about the call: the first call's arguments by
    schema name (static values; sharded ones replaced by their logical shapes), logical
    ranks and shapes of the sharded arguments by path, output shapes, the mesh rank,
    and each localised size argument's splits (pieces per dim) and local shape."""

    def __init__(self, func: Any, op: Any, cand: Any, call: Any, out_shapes: Sequence[Any]) -> None:
        self.func, self.op, self.cand = func, op, cand
        self.m = call.mesh.ndim
        self.shapes = {p: tuple(v.shape) for p, v in call.arrays}
        self.layouts = {p: l for (p, _), l in zip(call.arrays, cand.in_layouts)}
        self.out_shapes = list(out_shapes)

        def static(v: Any) -> Any:
            if isinstance(v, Sharded):
                return tuple(v.shape)
            if isinstance(v, (list, tuple)):
                return type(v)(static(x) for x in v)
            return v

        self.dtypes = {p: v.dtype for p, v in call.arrays}
        self.args, self.kwargs = call.args, call.kwargs
        self.out_dtypes = [getattr(o, "dtype", None) for o in call.out_metas]
        names, defaults = _schema_info(func)
        self.bound = dict(defaults)
        self.bound.update(zip(names, (static(a) for a in call.args)))
        self.bound.update({k: static(v) for k, v in call.kwargs.items()})
        first = next(iter(self.shapes.items()), (None, ()))
        lists = [s for p, s in self.shapes.items() if isinstance(p, tuple) and p[0] == 0]
        self.rank = max(len(s) for s in lists) if lists and isinstance(first[0], tuple) else len(first[1])
        self.sizes = []
        for name, i in cand.local_sizes:
            lay = cand.out_layouts[i]
            self.sizes.append((name, dc.size_splits(lay), tuple(local_shapes(lay, tuple(out_shapes[i]))[0])))


def batched_call(func: Any, cand: Any, call: Any, out_shapes: Sequence[Any]) -> Callable | None:
    """``(args, kwargs, symbolic) -> op result`` on stacked values (sharded arguments
    already substituted), or None when the call has no batched form."""
    if cand.local_fn is not None:
        return None  # written against one device's shard
    op = dc.local_op(func, cand)
    info = Info(func, op, cand, call, out_shapes)
    target = cand.local_op or func
    form = _FORMS.get(target) or _FORMS.get(getattr(target, "overloadpacket", None))
    if form is not None:
        return form(info)
    if cand.broadcast:
        return _elementwise(info, op)
    if target in _LEADING or getattr(target, "overloadpacket", None) in _LEADING:
        return _generic(info, op)
    return None


def _generic(info: Info, fn: Callable) -> "_Call | None":
    """``fn`` with the dim arguments translated and sizes localised."""
    fixes = _dim_fixes(info)
    return None if fixes is None else _Call(info, fn, fixes, info.sizes)


class _Call:
    """The local call on stacked values: local_op rebinding, static argument fixes
    (translated dims), sizes with the mesh dims prepended, dense inputs, then ``fn``."""

    def __init__(self, info: Info, fn: Callable, fixes: Sequence[tuple[str, Any]], sized: Sequence,
                 align: Sequence[tuple[Any, int]] = (), dense_inside: bool = False) -> None:
        if dc.is_complex_call([*info.dtypes.values(), *info.out_dtypes]):
            fn = dc.with_flag_keys(fn)
        self.fn = fn
        self.rebind = dc.rebinder(info.func, info.cand)
        target = info.cand.local_op or info.func
        self.names = _schema_info(target)[0]
        self.kw_only = {a.name for a in target._schema.arguments if a.kwarg_only}
        self.fixes = [(self._where(n), v) for n, v in fixes]
        self.sized = [(self._where(n), splits, local) for n, splits, local in sized]
        self.align = list(align)
        self.dense = None if dense_inside else info.cand.dense  # (``dense_inside``: ``fn`` makes its operands dense)
        self.m = info.m
        # nothing to adapt: callers may call ``fn(*args, **kwargs)`` directly
        self.direct = fn if self.rebind is None and not (self.fixes or self.sized or self.align or self.dense) else None

    def _where(self, name: str) -> tuple[int, str]:
        """Argument ``name`` of the local op: (position or -1 if keyword-only, name)."""
        return (-1 if name in self.kw_only else self.names.index(name)), name

    @property
    def static(self) -> bool:
        """Whether ``adapt`` changes only dim and size arguments (no rebinding, no operand
        reshapes, no dense copies): for canonical stacked inputs, whose mesh-dim sizes are
        fixed, and static other arguments, its result is fixed but for the operands."""
        return self.rebind is None and not self.align and not self.dense

    def __call__(self, args: tuple, kwargs: dict, symbolic: bool = False) -> Any:
        args, kwargs = self.adapt(args, kwargs, symbolic)
        return self.fn(*args, **kwargs)

    def adapt(self, args: tuple, kwargs: dict, symbolic: bool = False) -> tuple[Any, dict]:
        """The arguments ``fn`` is called with."""
        if self.rebind is not None:
            args, kwargs = self.rebind(args, kwargs)
        if self.fixes or self.sized or self.align or self.dense:
            args, kwargs = list(args), dict(kwargs)
            for where, v in self.fixes:
                _set(args, kwargs, where, v)
            m = self.m
            for where, splits, local in self.sized:
                if symbolic:
                    local = dc.symbolic_local(_get(args, kwargs, where), splits)
                _set(args, kwargs, where, [*args[0].shape[:m], *local])
            for where, pad in self.align:
                x = _get(args, kwargs, where)
                if not symbolic and x.shape[:m].numel() == 1:
                    # every mesh dim 1 (a replicated weight or bias): torch's broadcasting, aligned
                    # from the right, reads it as the padded view would (a reshape less per call)
                    continue
                _set(args, kwargs, where, x.reshape(*x.shape[:m], *([1] * pad), *x.shape[m:]))
            if self.dense:
                args = [dc.dense(a, self.dense) for a in args]
                kwargs = {k: dc.dense(v, self.dense) for k, v in kwargs.items()}
        return args, kwargs


def _get(args: list, kwargs: dict, where: tuple[int, str]) -> Any:
    i, name = where
    return args[i] if 0 <= i < len(args) else kwargs[name]


def _set(args: list, kwargs: dict, where: tuple[int, str], v: Any) -> None:
    i, name = where
    if 0 <= i < len(args):
        args[i] = v
    else:
        kwargs[name] = v


def _target(info: Info) -> Any:
    return info.cand.local_op or info.func


def _dim_fixes(info: Info) -> list | None:
    """(name, value) for each dim argument of the local op, made negative (the logical
    dims keep their names once the mesh dims are prepended); None when some dim cannot
    be named that way (a 0-d value, roll's empty dim list meaning "flattened")."""
    target = _target(info)
    packet = getattr(target, "overloadpacket", None)
    ref = len(info.out_shapes[0]) if packet in _OUT_RANK else info.rank
    b = {**info.bound, **dict(info.cand.local_args)}
    fixes = []
    for a in target._schema.arguments:
        if a.name not in _DIM_NAMES or str(a.type) not in _DIM_TYPES:
            continue
        v = b.get(a.name)
        empty = v is None or isinstance(v, (list, tuple)) and not v
        if empty and packet not in _ALL_DIMS:
            if v is None or packet not in _FLAT_WHEN_EMPTY:
                continue  # the op's own default, or no dims
            return None
        if ref == 0:
            return None
        if empty:
            v = list(range(-ref, 0))
        elif isinstance(v, int):
            v = v - ref if v >= 0 else v
        else:
            v = [d - ref if d >= 0 else d for d in v]
        fixes.append((a.name, v))
    return fixes


def _elementwise(info: Info, fn: Callable) -> "_Call | None":
    """An elementwise call: lower-rank operands padded after the mesh dims."""
    outs = [len(s) for s in info.out_shapes if s is not None]
    if not outs:
        return None
    rank = max(outs)
    if any(len(s) == 0 for s in info.shapes.values()) and rank > 0 and _promotes_apart(info):
        return None  # a 0-d operand with mesh dims would take part in type promotion as dimensioned
    names = _schema_info(_target(info))[0]
    align = []
    for p, shape in info.shapes.items():
        pad = rank - len(shape)
        if pad <= 0:
            continue
        if isinstance(p, tuple):
            return None
        align.append(((p, names[p]) if isinstance(p, int) else (-1, p), pad))
    return _Call(info, fn, (), (), align)


def _promotes_apart(info: Info) -> bool:
    """Whether the op, run on operands that carry mesh dims, gives other dtypes than on
    the logical ones: torch promotes a 0-d tensor below dimensioned ones (``int32 *
    tensor(3)`` is int32), which a stacked 0-d value (shape ``(1,) * m``) is not."""
    def stacked(v: Any) -> Any:
        if isinstance(v, Sharded):
            return torch.empty((1,) * info.m + tuple(v.shape), dtype=v.dtype, device="meta")
        if isinstance(v, (list, tuple)):
            return type(v)(stacked(x) for x in v)
        return v.to("meta") if isinstance(v, torch.Tensor) else v

    try:
        with torch.no_grad():
            out = info.func(*(stacked(a) for a in info.args), **{k: stacked(v) for k, v in info.kwargs.items()})
    except Exception:  # noqa: BLE001 - no batched form then; the per-device path decides
        return True
    outs = out if isinstance(out, (tuple, list)) else [out]
    if [getattr(o, "dtype", None) for o in outs] != info.out_dtypes:
        return True
    # a fixed output dtype (comparisons, logical ops) hides the dtype the kernel computes in
    # (float16 with a 0-d complex64 computes in complex32, which logical_and rejects)
    logical = [a for a in info.args if isinstance(a, torch.Tensor)][:2]
    return len(logical) == 2 and torch.result_type(*map(_meta, logical)) != torch.result_type(*map(stacked, logical))


def _meta(v: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")


def _masked_fill(x: torch.Tensor, mask: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """masked_fill with a stacked (per-device) value tensor."""
    return torch.where(mask, value.to(x.dtype), x)


def _fill_tensor(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """fill.Tensor with a stacked (per-device) value (torch's needs a 0-d one)."""
    return value.to(x.dtype).expand(torch.broadcast_shapes(x.shape, value.shape)).contiguous()


def _restrided(info: Info) -> "_Call | None":
    """gelu / gelu_backward (exact): torch's CPU kernel (its oneDNN path) corrupts memory on a
    "contiguous" input with two size-1 dims of stride 0, the replicated mesh dims of a stacked
    value (shape ``(2, 1, 1, ...)``, strides ``(n, 0, 0, ...)``; fuzzer seed 7200001366 on a
    (2, 1, 4) mesh: a wrong shape, then a crash). Those dims get contiguous strides first
    (``device_call.size_one_strided``)."""
    op = info.op

    def run(*args: Any, **kwargs: Any) -> Any:
        return op(*[dc.size_one_strided(a) for a in args], **{k: dc.size_one_strided(v) for k, v in kwargs.items()})

    return _elementwise(info, run)


def _pad_after_mesh(t: torch.Tensor, m: int, rank: int) -> torch.Tensor:
    """A stacked value of logical rank below ``rank``, padded with size-1 dims after the mesh dims."""
    r = t.dim() - m
    return t if r == rank else t.reshape(*t.shape[:m], *([1] * (rank - r)), *t.shape[m:])


# mm/bmm of stacked operands: leading (mesh) dims on which one operand is the same fold into
# the other's rows or columns (``stacked_matmul.matmul``): one GEMM, no copy of a replicated
# operand (the function itself: no Python frame around it on every warm product)
_mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = stacked_matmul.matmul


def _mv(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, v.unsqueeze(-1)).squeeze(-1)


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(-1, dtype=a.dtype)


def _vdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # conj_physical, not conj(): inside __torch_dispatch__ a lazy conj view's flag is ignored
    return (torch.conj_physical(a) * b).sum(-1, dtype=a.dtype)


def _outer(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.unsqueeze(-1) * b.unsqueeze(-2)


def _bsum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b).sum(-3, dtype=a.dtype)  # (sum widens integers; addbmm keeps the dtype)


def _product(product: Callable) -> Callable[[Info], "_Call"]:
    """A matrix product as a batched matmul-based function."""
    def build(info: Info) -> _Call:
        return _Call(info, product, (), ())

    return build


def _matrix_product(info: Info) -> _Call:
    """mm / bmm. In ``local_values.set_pending_parts("shares")`` mode, an output pending a sum
    over mesh axes on which both operands vary (their shards split the contraction: a
    row-parallel product, a weight gradient over dp-split rows) is computed as
    :func:`stacked_matmul.summed`: one GEMM over the whole contraction, its result held as
    equal shares (each ``1/n`` of the sum, one stored part expanded over the axes), parts
    of the pending sum that later calls run on once (``local_calls._copies``) and whose
    reduction adds nothing up. Otherwise, and where the fold would copy, :func:`_mm`: each
    device's own part."""
    out = info.cand.out_layouts[0]
    dtype = info.out_dtypes[0]
    if out is None or not out.partial or dtype is None or not (dtype.is_floating_point or dtype.is_complex):
        return _Call(info, _mm, (), ())
    ops = out.partial_ops
    names = out.mesh.axis_names
    if any(ops[a] != "sum" for a in ops):
        return _Call(info, _mm, (), ())
    dims = [names.index(a) for a in ops if out.mesh.axis_size(a) > 1]
    sizes = out.mesh.shape
    n = math.prod(sizes[d] for d in dims)
    if not dims:
        return _Call(info, _mm, (), ())

    def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if SHARES[0] and all(a.shape[d] == sizes[d] and b.shape[d] == sizes[d] for d in dims):
            s = stacked_matmul.summed(a, b, dims, 1.0 / n)
            if s is not None:
                return s.expand(*[sizes[d] if d in dims else k for d, k in enumerate(s.shape[:len(sizes)])],
                                *s.shape[len(sizes):])
        return _mm(a, b)

    return _Call(info, run, (), ())


def _addend(product: Callable) -> Callable[[Info], "_Call"]:
    """``beta * self + alpha * product(a, b)`` with ``self`` broadcast against the product."""
    def build(info: Info) -> _Call:
        m, rank = info.m, len(info.out_shapes[0])

        def run(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1, alpha: Any = 1) -> torch.Tensor:
            out = product(a, b)
            if not (out.is_floating_point() or out.is_complex()):
                alpha, beta = int(alpha), int(beta)  # torch's integral kernels truncate float scalars
            if alpha != 1:
                out = out * alpha
            if beta == 0:
                return out
            bias = _pad_after_mesh(bias, m, rank)
            return out + (bias if beta == 1 else bias * beta)

        return _Call(info, run, (), ())

    return build


def _t(info: Info) -> _Call:
    return _Call(info, (lambda x: x.transpose(-1, -2)) if info.rank == 2 else (lambda x: x), (), ())


def _permute(info: Info) -> _Call:
    m, n = info.m, info.rank
    dims = [*range(m), *(m + d % n for d in info.bound["dims"])] if n else list(range(m))
    return _Call(info, dc.local_op(info.func, info.cand), (("dims", dims),), ())


def _repeat(info: Info) -> _Call:
    m, n = info.m, info.rank

    def run(x: torch.Tensor, repeats: Sequence[int]) -> torch.Tensor:
        reps = list(repeats)
        x = x.reshape(*x.shape[:m], *([1] * (len(reps) - n)), *x.shape[m:])
        return x.repeat(*([1] * m), *reps)

    return _Call(info, run, (), ())


def _expand(info: Info) -> _Call:
    m = info.m

    def run(x: torch.Tensor, size: Sequence[int], *, implicit: bool = False) -> torch.Tensor:
        lead = len(size) - x.dim()
        if lead:  # (none: the reshape would be a no-op view, one op more on every warm call)
            x = x.reshape(*x.shape[:m], *([1] * lead), *x.shape[m:])
        return x.expand(size)

    return _Call(info, run, (), info.sizes)


def _new_factory(info: Info) -> _Call:
    """new_zeros/new_ones/new_empty/new_full: one replicated result (size 1 on the mesh dims)."""
    op, m = info.func, info.m

    def run(x: torch.Tensor, *rest: Any, **kwargs: Any) -> torch.Tensor:
        one = op(x[(0,) * m], *rest, **kwargs)
        return one.view(*(1,) * m, *one.shape)

    return _Call(info, run, (), ())


def _cat(info: Info) -> "_Call | None":
    """cat, skipping torch's legacy empty 1-D operands as torch does."""
    shapes = [s for p, s in info.shapes.items() if isinstance(p, tuple)]
    skip = frozenset(p[1] for p, s in info.shapes.items() if isinstance(p, tuple) and s == (0,)) \
        if any(s != (0,) for s in shapes) else frozenset()

    def run(tensors: Sequence[torch.Tensor], *rest: Any, **kwargs: Any) -> torch.Tensor:
        return aten.cat.default([t for j, t in enumerate(tensors) if j not in skip], *rest, **kwargs)

    return _generic(info, run if skip else aten.cat.default)


def _all_dims(reduce: Callable[[torch.Tensor, list, tuple, dict], Any]) -> Callable[[Info], "_Call | None"]:
    """A reduction overload without a dim argument (all dims): ``reduce(x, dims, rest, kwargs)``
    with the logical dims explicit."""
    def build(info: Info) -> "_Call | None":
        n = info.rank
        if n == 0:
            return None
        dims = list(range(-n, 0))
        return _Call(info, lambda x, *rest, **kwargs: reduce(x, dims, rest, kwargs), (), ())

    return build


def _median_all(op: Any, flat: torch.Tensor) -> torch.Tensor:
    """median() / nanmedian() of each device's flattened values: ``op.dim`` over the last dim,
    or where there are no elements what torch's all-dims overload gives (nan in the dtype),
    as ``op.dim`` raises on an empty dim."""
    if flat.shape[-1] == 0:
        return op.default(flat.new_empty(0)).expand(flat.shape[:-1]).clone()
    return op.dim(flat, -1)[0]


def _flat_index(op: Any) -> Callable[[Info], "_Call | None"]:
    """argmax/argmin: ``dim=None`` indexes the flattened logical dims."""
    def build(info: Info) -> "_Call | None":
        if info.bound.get("dim") is not None:
            return _generic(info, op)
        n = info.rank
        if n == 0:
            return None

        def run(x: torch.Tensor, dim: Any = None, keepdim: bool = False) -> torch.Tensor:
            out = op(x.flatten(-n), -1, keepdim)
            return out.reshape(*out.shape[:-1], *([1] * n)) if keepdim else out

        return _Call(info, run, (), ())

    return build


def _count_nonzero(info: Info) -> "_Call | None":
    if info.bound.get("dim") is not None:
        return _generic(info, aten.count_nonzero.default)
    return _all_dims(lambda x, d, r, k: aten.count_nonzero.dim_IntList(x, d))(info)


def _attention(info: Info) -> "_Call | None":
    """Fused attention without a mask, bias or dropout: every (batch, head) pair is its own
    problem, so the mesh dims fold into the batch dim or the heads dim and the kernel runs
    once for the whole mesh (a mesh dim the inputs are replicated on stays 1: computed once,
    not once per device). Each mesh dim goes where the inputs fold as views (a 'tp'-split
    projection's heads sit next to their mesh dim, its batch does not: ``_fold_plan``). Inputs
    are made contiguous only for grouped-query heads on the CPU kernel, which misreads them
    from transposed strides; other layouts are read as they are, as unsharded torch does.
    Outputs of two or more dims lead with (batch, heads) and unfold again (views: the kernels'
    own output layouts are kept); the others are per-call constants (CUDA's philox seed and
    offset, empty cumulative lengths or debug masks), the same on every device, which the
    rules lay out replicated."""
    b = info.bound
    if b.get("attn_mask") is not None or b.get("attn_bias") is not None or b.get("dropout_p", 0.0):
        return None  # a bias may broadcast over the batch; dropout draws per device
    op, m = info.func, info.m
    cpu = op in (aten._scaled_dot_product_flash_attention_for_cpu.default,
                 aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    # outputs not led by (batch, heads) must be per-call constants, laid out replicated
    const_ok = [l is None or not (any(l.dims) or l.partial) for l in info.cand.out_layouts]

    def chain(args: tuple, kwargs: dict) -> tuple:
        """The mesh dims folded into (batch, heads), the kernel, its outputs unfolded; also the
        folded arguments and the kernel's outputs (``run`` records their geometry)."""
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() > m + 1]
        # the mesh dims of the inputs are 1 or the axis size: their broadcast is the max
        lead = tuple(max(t.shape[i] for t in tensors) for i in range(m))
        heads = [t.shape[m + 1] for t in tensors if t.dim() == m + 4]
        grouped = cpu and any(h != heads[0] for h in heads[1:])
        to_batch, to_heads = _fold_plan(tensors, lead, m)
        nb = len(to_batch)

        def fold(a: Any) -> Any:
            if not isinstance(a, torch.Tensor):
                return a
            if a.dim() <= m + 1:  # a per-call constant (seed, offset), the same on every device
                return a[(0,) * m]
            if tuple(a.shape[:m]) != lead:
                a = a.expand(*lead, *a.shape[m:])
            if to_heads:
                a = a.permute(*to_batch, m, *to_heads, m + 1, *range(m + 2, a.dim()))
                return a.reshape(math.prod(a.shape[:nb + 1]), math.prod(a.shape[nb + 1:m + 2]), *a.shape[m + 2:])
            return _merged(a, m + 1)

        viewed = [fold(a) for a in (*args, *kwargs.values())]
        # the rule's ``dense``, on the folded operands (a logsumexp's transposed strides: a copy)
        folded = [dc.dense(a, True if grouped else "last") for a in viewed]
        batch = next(a.shape[0] for a in folded if isinstance(a, torch.Tensor) and a.dim() >= 3)
        # an argument the kernel reads by strides of its own, copied into them: a copy ``run``'s
        # replay would not remake, so such a call keeps no replay plan
        fa, fk = kernel_layouts.laid_out(op, tuple(folded[:len(args)]), dict(zip(kwargs, folded[len(args):])))
        relaid = any(x is not y for x, y in zip((*fa, *fk.values()), folded))
        outs = op(*fa, **fk)
        back = None
        if to_heads:  # (batch mesh dims, batch, heads mesh dims, heads, ...) -> mesh dims first
            where = {d: j for j, d in enumerate((*to_batch, "b", *to_heads, "h"))}
            back = [where[i] for i in range(m)] + [where["b"], where["h"]]

        def unfold(i: int, o: Any) -> Any:
            if not isinstance(o, torch.Tensor):
                return o
            if o.dim() >= 2 and o.shape[0] == batch:
                if back is None:
                    return o.reshape(*lead, o.shape[0] // math.prod(lead), *o.shape[1:])
                hm = [lead[d] for d in to_heads]
                lb = [lead[d] for d in to_batch]
                o = o.reshape(*lb, o.shape[0] // math.prod(lb), *hm, o.shape[1] // math.prod(hm), *o.shape[2:])
                return o.permute(*back, *range(m + 2, o.dim()))
            if not const_ok[i]:
                raise RuntimeError(f"{op}: output {i} is neither batch-led nor replicated")  # -> per device
            return o.view((1,) * m + tuple(o.shape))

        return tuple(unfold(i, o) for i, o in enumerate(outs)), viewed, folded, outs, relaid

    # per the tensors' (sizes, strides, flags): the geometry (``view_replay.geometry``) of each
    # argument's fold and whether ``dense`` then copied it, and of each output's unfold, relative
    # to the argument and the kernel's output, where every fold and unfold was a view (None where
    # one copied: ``chain`` runs each time). A warm call is then one ``as_strided`` per tensor (and
    # the copies ``dense`` makes) around the kernel, not a Python fold and unfold of each. The
    # kernel lays its outputs out by its inputs' geometry; each output's strides are checked.
    replays: dict[tuple, tuple | None] = {}

    def run(*args: Any, **kwargs: Any) -> Any:
        key = _replay_key(args, kwargs)
        plan = replays.get(key, _UNSET) if key is not None else None
        if plan is not None and plan is not _UNSET:
            ins, outs_at = plan
            vals = []
            for a, (g, copy) in zip((*args, *kwargs.values()) if kwargs else args, ins):
                if g is not None:
                    a = a.as_strided(g[0], g[1], a.storage_offset() + g[2])
                    if copy:
                        a = a.clone(memory_format=torch.contiguous_format)
                vals.append(a)
            outs = op(*vals[:len(args)], **dict(zip(kwargs, vals[len(args):]))) if kwargs else op(*vals)
            res = []
            for o, (stride, g) in zip(outs, outs_at):
                if g is not None:
                    if o.stride() != stride:  # (not seen: kernels lay out by their inputs' geometry)
                        break
                    o = o.as_strided(g[0], g[1], o.storage_offset() + g[2])
                res.append(o)
            else:
                return tuple(res)
            replays.pop(key, None)
            return chain(args, kwargs)[0]  # (the kernel again: never reached in practice)
        result, viewed, folded, outs, relaid = chain(args, kwargs)
        if plan is _UNSET:
            if len(replays) >= 64:
                replays.clear()
            replays[key] = None if relaid else _replay_plan((*args, *kwargs.values()), viewed, folded, outs, result)
        return result

    return _Call(info, run, (), (), dense_inside=True)


_UNSET = object()
_TENSOR = torch.Tensor
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _replay_key(args: tuple, kwargs: dict) -> tuple | None:
    """The keywords and the (sizes, strides, dtype, device, flags) of an attention call's tensors
    (in their places among the other arguments), or None where one is not a plain tensor (fake, functorch-wrapped: their
    chain runs each time) or has symbolic sizes."""
    key: list = [tuple(kwargs)] if kwargs else []
    for t in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(t, torch.Tensor):
            if type(t) is not _TENSOR or _is_wrapped(t):  # (``view_replay.plain``, inline)
                return None
            key.append((t.shape, t.stride(), t.dtype, t.device, t.is_conj(), t.is_neg()))
        else:
            key.append(None)
    return tuple(key)


def _replay_plan(args: tuple, viewed: list, folded: list, outs: Any, result: tuple) -> tuple | None:
    """``run``'s replay of one call: per argument its fold's geometry and whether ``dense`` copied
    the folded view ((None, False) for a non-tensor), per output its stride and unfold's geometry;
    None where a fold or unfold copied, or ``dense`` resolved a flag."""
    ins = []
    for a, v, f in zip(args, viewed, folded):
        if not isinstance(a, torch.Tensor):
            if f is not a:
                return None
            ins.append((None, False))
            continue
        g = geometry(a, v)
        if g is None or a.is_conj() or a.is_neg():
            return None
        ins.append((g, f is not v))
    outs_at = []
    for o, r in zip(outs, result):
        if isinstance(o, torch.Tensor):
            g = geometry(o, r)
            if g is None:
                return None
            outs_at.append((o.stride(), g))
        elif r is not o:
            return None
        else:
            outs_at.append((None, None))
    return tuple(ins), tuple(outs_at)


_FOLDS: dict[tuple, tuple] = {}


def _fold_plan(tensors: Sequence[torch.Tensor], lead: tuple, m: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Which mesh dims fold into the batch dim and which into the heads dim (dim ``m`` and
    ``m + 1`` of the stacked tensors): all into the batch unless some other choice folds
    every tensor as a view (remembered per shapes and strides)."""
    key: tuple | None = (lead, tuple((tuple(t.shape), t.stride()) for t in tensors))
    try:
        plan = _FOLDS.get(key)
    except TypeError:  # symbolic sizes (torch.compile's dynamic shards): planned each trace, guarded
        plan = key = None
    if plan is None:
        plan = (tuple(range(m)), ())
        for mask in range(1 << m):  # mask 0 first: everything into the batch
            to_heads = tuple(i for i in range(m) if mask >> i & 1)
            to_batch = tuple(i for i in range(m) if not mask >> i & 1)
            if all(stacked_matmul.mergeable(t, (*to_batch, m), lead) and stacked_matmul.mergeable(t, (*to_heads, m + 1), lead)
                   for t in tensors):
                plan = (to_batch, to_heads)
                break
        if key is not None:
            if len(_FOLDS) >= 1024:
                _FOLDS.clear()
            _FOLDS[key] = plan
    return plan


def _same_everywhere(info: Info, *names: str) -> bool:
    """Whether the sharded arguments called ``names`` are the same on every device
    (replicated, nothing pending): one copy of them serves the whole batch."""
    schema = _schema_info(info.func)[0]
    for p, lay in info.layouts.items():
        name = schema[p] if isinstance(p, int) else p if isinstance(p, str) else schema[p[0]]
        if name in names and (any(lay.dims) or lay.partial):
            return False
    return True


def _one(t: Any, m: int) -> Any:
    """A stacked value that is the same on every device, as one logical tensor."""
    return t[(0,) * m] if isinstance(t, torch.Tensor) else t


def _layer_norm(info: Info) -> "_Call | None":
    """native_layer_norm batches over leading dims; weight and bias (replicated) are unstacked."""
    if not _same_everywhere(info, "weight", "bias"):
        return None
    m = info.m

    def run(x: torch.Tensor, shape: Any, weight: Any, bias: Any, eps: float) -> Any:
        return aten.native_layer_norm.default(x, shape, _one(weight, m), _one(bias, m), eps)

    return _Call(info, run, (), ())


def _layer_norm_backward(info: Info) -> "_Call | None":
    """The input gradient from the kernel (batched over leading dims); the weight and
    bias gradients per device (each device's sum over its rows: a pending sum where the
    rows are sharded), which the kernel would sum over the mesh dims too."""
    if not _same_everywhere(info, "weight", "bias"):
        return None
    m, lead = info.m, info.rank - len(info.bound["normalized_shape"])
    rows = list(range(m, m + lead))

    def run(g: torch.Tensor, x: torch.Tensor, shape: Any, mean: torch.Tensor, rstd: torch.Tensor,
            weight: Any, bias: Any, mask: Sequence[bool]) -> Any:
        gi, _, _ = aten.native_layer_norm_backward.default(
            g, x, shape, mean, rstd, _one(weight, m), _one(bias, m), [mask[0], False, False])
        gw = gb = None
        if mask[1]:
            gw = g * ((x - mean) * rstd)
            gw = gw.sum(rows) if rows else gw
        if mask[2]:
            gb = g.sum(rows) if rows else g.clone()
        return gi, gw, gb

    return _Call(info, run, (), ())


def _merged(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` with its first ``k`` dims as one, sized explicitly (a -1 is ambiguous where ``x`` has
    no elements: a zero-channel conv1d under dynamic sizes raised, seed 5784045073)."""
    return x.reshape(math.prod(x.shape[:k]), *x.shape[k:])


def _embedding(info: Info) -> "_Call | None":
    """embedding with a replicated weight: one lookup of the stacked indices."""
    if not _same_everywhere(info, "weight"):
        return None
    m = info.m

    def run(weight: torch.Tensor, indices: torch.Tensor, *rest: Any, **kwargs: Any) -> torch.Tensor:
        return aten.embedding.default(_one(weight, m), indices, *rest, **kwargs)

    return _Call(info, run, (), ())


def _convolution(info: Info) -> "_Call | None":
    """convolution with replicated weight and bias: the mesh dims folded into the batch
    dim (an unbatched input's mesh dims become its batch)."""
    if not _same_everywhere(info, "weight", "bias"):
        return None
    m = info.m
    batched = info.rank == len(info.shapes.get(1, info.bound["weight"]))

    def run(x: torch.Tensor, weight: torch.Tensor, bias: Any, *rest: Any) -> torch.Tensor:
        mesh_dims = x.shape[:m]
        flat = _merged(x, m + 1 if batched else m)
        out = aten.convolution.default(flat, _one(weight, m), _one(bias, m), *rest)
        return out.reshape(*mesh_dims, x.shape[m], *out.shape[1:]) if batched else out.reshape(*mesh_dims, *out.shape[1:])

    return _Call(info, run, (), ())


def _convolution_backward_of_no_terms(info: Info) -> "_Call | None":
    """convolution_backward of an input with no elements (no channels, an empty batch): every
    gradient is zeros, as torch's kernel gives them (its forward ignores the bias then: an
    input of no channels gives an output of none). No kernel runs, so symbolic sizes stay
    symbolic: the per-device path, the kernel's only form, specialised them under
    torch.compile(dynamic=True), and AOTAutograd's joint pass then met concrete sizes where the
    forward had symbols. Any other call: None (per device)."""
    names = _schema_info(info.func)[0]
    shape = {names[p]: s for p, s in info.shapes.items() if isinstance(p, int)}
    if not {"grad_output", "input", "weight"} <= set(shape) or math.prod(shape["input"]):
        return None
    m = info.m

    def run(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias_sizes: Any, stride: Any, padding: Any,
            dilation: Any, transposed: bool, output_padding: Any, groups: int, mask: Sequence[bool]) -> Any:
        lead = torch.broadcast_shapes(g.shape[:m], x.shape[:m], w.shape[:m])
        gi = x.new_zeros((*lead, *x.shape[m:])) if mask[0] else None
        gw = w.new_zeros((*lead, *w.shape[m:])) if mask[1] else None
        gb = g.new_zeros((*lead, *bias_sizes)) if mask[2] and bias_sizes is not None else None
        return gi, gw, gb

    return _Call(info, run, (), ())


_FORMS: dict[Any, Callable[[Info], Any]] = {
    aten.mm: _matrix_product,
    aten.bmm: _matrix_product,
    aten.mv: _product(_mv),
    aten.dot: _product(_dot),
    aten.vdot: _product(_vdot),
    aten.outer: _product(_outer),
    aten.ger: _product(_outer),
    aten.addmm: _addend(_mm),
    aten.baddbmm: _addend(_mm),
    aten.addmv: _addend(_mv),
    aten.addbmm: _addend(_bsum),
    aten.addr: _addend(_outer),
    aten.masked_fill.Tensor: lambda info: _elementwise(info, _masked_fill),
    aten.gelu: _restrided,
    aten.gelu_backward: _restrided,
    aten.fill.Tensor: lambda info: _elementwise(info, _fill_tensor),
    aten.t: _t,
    aten.t_copy: _t,
    aten.permute: _permute,
    aten.permute_copy: _permute,
    aten.repeat: _repeat,
    aten.expand: _expand,
    aten.expand_copy: _expand,
    aten.new_zeros: _new_factory,
    aten.new_ones: _new_factory,
    aten.new_empty: _new_factory,
    aten.new_full: _new_factory,
    aten.cat: _cat,
    aten.argmax: _flat_index(aten.argmax.default),
    aten.argmin: _flat_index(aten.argmin.default),
    aten.count_nonzero.default: _count_nonzero,
    aten.sum.default: _all_dims(lambda x, d, r, k: aten.sum.dim_IntList(x, d, False, **k)),
    aten.mean.default: _all_dims(lambda x, d, r, k: aten.mean.dim(x, d, False, **k)),
    aten.max.default: _all_dims(lambda x, d, r, k: aten.amax.default(x, d)),
    aten.min.default: _all_dims(lambda x, d, r, k: aten.amin.default(x, d)),
    aten.any.default: _all_dims(lambda x, d, r, k: aten.any.dims(x, d)),
    aten.all.default: _all_dims(lambda x, d, r, k: aten.all.dims(x, d)),
    aten.prod.default: _all_dims(lambda x, d, r, k: aten.prod.dim_int(x.flatten(-len(d)), -1, False, **k)),
    aten.median.default: _all_dims(lambda x, d, r, k: _median_all(aten.median, x.flatten(-len(d)))),
    aten.nanmedian.default: _all_dims(lambda x, d, r, k: _median_all(aten.nanmedian, x.flatten(-len(d)))),
    aten.var.default: _all_dims(lambda x, d, r, k: aten.var.dim(x, d, *r)),
    aten.std.default: _all_dims(lambda x, d, r, k: aten.std.dim(x, d, *r)),
    aten.var_mean.default: _all_dims(lambda x, d, r, k: aten.var_mean.dim(x, d, *r)),
    aten.std_mean.default: _all_dims(lambda x, d, r, k: aten.std_mean.dim(x, d, *r)),
    aten.native_layer_norm.default: _layer_norm,
    aten.native_layer_norm_backward.default: _layer_norm_backward,
    aten.embedding.default: _embedding,
    aten.convolution.default: _convolution,
    aten.convolution_backward.default: _convolution_backward_of_no_terms,
    aten._scaled_dot_product_flash_attention_for_cpu: _attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention,
    aten._scaled_dot_product_flash_attention: _attention,
    aten._scaled_dot_product_flash_attention_backward: _attention,
    aten._scaled_dot_product_efficient_attention: _attention,
    aten._scaled_dot_product_efficient_attention_backward: _attention,
    aten._scaled_dot_product_cudnn_attention: _attention,
    aten._scaled_dot_product_cudnn_attention_backward: _attention,
}
