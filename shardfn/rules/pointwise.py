"""Pointwise ops: the output follows one input's layout, broadcasting dims stay whole.

Pending reductions (Partial) pass through ops that are linear in their sharded
operands (add/sub of partials, scaling a partial by a replicated factor); anything else
reduces first.
"""

from __future__ import annotations

import cmath
from typing import Any

import attrs
import torch

from ..values.layout import Layout
from ..values.mesh import check_mesh_device
from .base import Candidate, OpCall, bind, finite_factor, sum_passes
from .loss import ELEMENTWISE_LOSSES

aten = torch.ops.aten

# Ops linear in all tensor operands jointly: sum over devices commutes with them.
_LINEAR = {aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.positive.default}
# Ops linear in each operand separately: a Partial operand may meet replicated ones;
# the value is the index of the only operand allowed to be Partial, or None for any.
_MULTILINEAR = {aten.mul.Tensor: None, aten.mul.Scalar: 0, aten.div.Tensor: 0, aten.div.Scalar: 0}
_LINEAR_PARTIAL_OPS = {"sum", "avg"}
# Activation backwards ``op(grad_output, x, ...)``: ``grad_output`` times a derivative bounded
# for every ``x`` (nan only where ``x`` is ±inf or nan: a nan factor is nan in every part and in
# the total alike), or a selection of ``grad_output``: a pending ``grad_output`` passes, as
# through ``mul`` by a known-finite factor. (A replicated parameter applied to split
# activations, e.g. xIELU's ``softplus(alpha)`` in Apertus: its gradient stays pending, as other
# parameters' do, rather than being reduced at every such op.)
_BOUNDED_GRAD = {getattr(aten, n).default for n in (
    "softplus_backward", "silu_backward", "gelu_backward", "mish_backward", "hardswish_backward",
    "hardsigmoid_backward", "hardtanh_backward", "threshold_backward", "leaky_relu_backward",
) if hasattr(aten, n)}
# ... and those whose factor is computed from the op's result (``sigmoid_backward(g, y)`` is
# ``g * y * (1 - y)``, ``tanh_backward`` ``g * (1 - y**2)``): finite exactly where ``y`` is
_RESULT_GRAD = {aten.sigmoid_backward.default, aten.tanh_backward.default}
# Selections, linear in their value operands jointly (``where(c, sum(a), sum(b))`` is the sum
# of the parts' ``where``, exactly, inf and nan included: nothing is computed): op -> the
# argument positions of those operands. A pending operand passes where the others are arrays
# (made pending locally: autograd's ``where(c, grad, 0)``, its zero lifted to a replicated
# array) or zero numbers (``masked_fill(grad, mask, 0)``); the condition or mask is never
# pending (bool).
_SELECT = {aten.where.self: (1, 2), aten.masked_fill.Scalar: (0, 2), aten.masked_fill.Tensor: (0, 2)}
# Casts: linear between floating (or complex) dtypes up to rounding, as a reduction in
# another order is; a cast to an integer or bool dtype is not.
_CASTS = {aten._to_copy.default}


def _float_cast(call: OpCall) -> bool:
    out = call.out_metas[0]
    src = call.arrays[0][1].dtype
    return (isinstance(out, torch.Tensor) and (out.dtype.is_floating_point or out.dtype.is_complex)
            and (src.is_floating_point or src.is_complex))


def _map_dims(base: Layout, out_shape: tuple[int, ...], shape: tuple[int, ...]) -> tuple:
    """The dims of an operand of ``shape`` broadcast into an output laid out as ``base``."""
    off = len(out_shape) - len(shape)
    return tuple(base.dims[k + off] if shape[k] == out_shape[k + off] else () for k in range(len(shape)))


def _broadcast_base(layout: Layout, shape: tuple[int, ...], out_shape: tuple[int, ...]) -> Layout | None:
    """The output layout that keeps a broadcast operand's sharded dims (None where it has
    none: its dims that broadcast stay whole in the output)."""
    off = len(out_shape) - len(shape)
    dims = tuple(d if shape[k] == out_shape[k + off] else () for k, d in enumerate(layout.dims))
    if not any(dims):
        return None
    return Layout(layout.mesh, ((),) * off + dims)


def _merged_base(call: OpCall, out_shape: tuple[int, ...]) -> Layout | None:
    """The output layout keeping every operand's sharded dims at once, where no operand has
    the output's shape (one that has leads: its layout is what the next op most likely reads)
    and two or more shard different dims of the output on different axes: ``where(mask, bias,
    x)`` with a ``(batch, 1, q, k)`` mask split over dp and a ``(1, heads, q, k)`` bias split
    over tp is ``(dp, tp)``-split with no move, where taking one operand's dims gathers the
    other (None where they conflict or add nothing)."""
    dims: list[tuple[str, ...]] = [()] * len(out_shape)
    sources = 0
    for _, v in call.arrays:
        b = _broadcast_base(v._layout, tuple(v.shape), out_shape)
        if b is None:
            continue
        sources += 1
        for k, axes in enumerate(b.dims):
            if axes and dims[k] and dims[k] != axes:
                return None
            if axes:
                dims[k] = axes
    used = [a for axes in dims for a in axes]
    if sources < 2 or len(used) != len(set(used)):
        return None
    return Layout(call.mesh, tuple(dims))


def _keeps_partial(call: OpCall, base: int, partial: tuple) -> set[int]:
    """Indices (into call.arrays) of operands that may carry ``partial`` (operand ``base``'s
    pending reductions) into the output: every operand of an op linear in its operands
    jointly (a replicated one becomes pending locally, ``reduce_local``: no communication),
    or ``base`` alone for an op linear in each operand separately."""
    func = call.func
    if not partial or any(op not in _LINEAR_PARTIAL_OPS for _, op in partial):
        return set()
    if not all(sum_passes(call, v.dtype) for _, v in call.arrays if v._layout.partial):
        return set()
    if func in (aten.div.Tensor, aten.div.Scalar) and not _nonzero_number(call.args[1]):
        return set()  # parts / 0 are ±inf or nan, whose sum need not be the total's ±inf
    if func in (aten.mul.Tensor, aten.mul.Scalar) and not _finite_factors(call, call.arrays[base][0]):
        return set()  # parts * inf have mixed signs (or are 0 * inf) where the total's is one signed inf
    if func in _BOUNDED_GRAD or func in _RESULT_GRAD:
        return {base} if call.arrays[base][0] in (0, "grad_output") and _grad_factor_finite(call) else set()
    if func in _SELECT:
        return _select_keeps(call, base, _SELECT[func])
    n = len(call.arrays)
    if func in _CASTS:
        return set(range(n)) if _float_cast(call) else set()
    if func in _LINEAR:
        if call.kwargs.get("alpha", 1) is not None and not _scalar_operands(call):
            return set(range(n))
        return set()
    if func in _MULTILINEAR:
        only = _MULTILINEAR[func]
        return {base} if only is None or call.arrays[base][0] == only else set()
    return set()


def _select_keeps(call: OpCall, base: int, positions: tuple[int, ...]) -> set[int]:
    """``_SELECT``'s operands that carry operand ``base``'s pending sums: every array value
    operand (at ``positions``; a plain tensor there is lifted to a replicated array, made
    pending locally), where ``base`` is one and every number operand is zero (the zero part
    on every device sums to zero); none otherwise."""
    if call.arrays[base][0] not in positions:
        return set()
    arrays = {p for p, _ in call.arrays}
    for pos in positions:
        v = call.args[pos] if pos < len(call.args) else None
        if pos not in arrays and not (isinstance(v, (int, float, complex)) and v == 0):
            return set()
    return {j for j, (p, _) in enumerate(call.arrays) if p in positions}


def _finite_factors(call: OpCall, base_path: Any) -> bool:
    """Whether the factors of a product (every operand but ``base_path``'s) are known finite
    without reading them: numbers that are, integer or bool tensors, arrays that their op
    bounds (``arrays/bounds.py``: ``cos``, ``-sin``, ...). Another floating tensor may hold
    inf, and ``sum(parts) * inf`` is not ``sum(parts * inf)`` (``0 * inf`` is nan in a part,
    and parts of both signs give nan where the total's sign gives ±inf); knowing it is finite
    would take a device-to-host sync, so the pending operand is reduced first (nan factors
    need nothing: nan in every part is the total's nan)."""
    for i, a in enumerate(call.args[:2]):
        if i == base_path:
            continue
        if isinstance(a, torch.Tensor):
            if not finite_factor(a):
                return False
        elif isinstance(a, (float, complex)) and not cmath.isfinite(a):
            return False
    return True


def _grad_factor_finite(call: OpCall) -> bool:
    """Whether an activation backward's factor on ``grad_output`` is known finite (or nan):
    its numbers are finite (``leaky_relu``'s slope), and for ``_RESULT_GRAD`` the result it
    reads is known finite (``finite_factor``)."""
    if any(isinstance(a, (float, complex)) and not cmath.isfinite(a) for a in call.args[2:]):
        return False
    if call.func in _RESULT_GRAD:
        y = call.args[1] if len(call.args) > 1 else call.kwargs.get("output")
        return isinstance(y, torch.Tensor) and finite_factor(y)
    return True


def _nonzero_number(v: Any) -> bool:
    """A finite nonzero Python number (a divisor a pending sum may pass)."""
    return isinstance(v, (int, float, complex)) and not isinstance(v, bool) and v != 0 and cmath.isfinite(v)


def _scalar_operands(call: OpCall) -> bool:
    """Whether a plain tensor or number takes part besides the sharded operands."""
    return any(
        isinstance(a, (int, float, complex, torch.Tensor)) and not hasattr(a, "_layout")
        for a in call.args[:2]
    )


@attrs.frozen
class Pointwise:
    """Elementwise ops with broadcasting and type promotion."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        metas = [m for m in call.out_metas if isinstance(m, torch.Tensor)]
        if not metas:
            return []
        out_shape = tuple(metas[0].shape)
        mesh = call.mesh
        shapes = call.shapes
        seen, cands = set(), []
        # the output laid out like an operand of its shape, then (after, so that ties keep
        # those) like a broadcast operand's sharded dims: ``x * rstd`` with ``rstd`` split by
        # rows slices a replicated ``x`` rather than gathering ``rstd``
        bases = [v._layout for i, (_, v) in enumerate(call.arrays) if shapes[i] == out_shape]
        bases += [b for i, (_, v) in enumerate(call.arrays) if shapes[i] != out_shape
                  for b in (_broadcast_base(v._layout, shapes[i], out_shape),) if b is not None]
        merged = None if out_shape in shapes else _merged_base(call, out_shape)
        if merged is not None and merged not in bases:
            bases.append(merged)
        for base in bases:
            # the output takes this operand's dims, and the pending reductions of any operand
            # they may pass through (or none: those operands are reduced first)
            options = [(j, _keeps_partial(call, j, x._layout.partial)) for j, (_, x) in enumerate(call.arrays)]
            options = [(j, keep) for j, keep in options if keep] + [(None, set())]
            for j, keep in options:
                partial = call.arrays[j][1]._layout.partial if keep else ()
                key = (base.dims, partial, frozenset(keep))
                if key in seen:
                    continue
                seen.add(key)
                cands.append(self._candidate(call, base, out_shape, partial, keep))
        if not cands:
            # every sharded operand is broadcast: lay the output out like the largest one
            _, v = max(call.arrays, key=lambda pv: pv[1].numel())
            base = Layout(mesh, ((),) * (len(out_shape) - v.ndim) + v._layout.dims)
            ins = tuple(Layout(mesh, _map_dims(base, out_shape, s)) for s in shapes)
            cands.append(Candidate(ins, tuple(base if isinstance(m, torch.Tensor) else None for m in call.out_metas),
                                   broadcast=True))
        return cands

    @staticmethod
    def _candidate(call: OpCall, base: Layout, out_shape: tuple, partial: tuple, keep: set) -> Candidate:
        mesh, shapes = call.mesh, call.shapes
        axes = {a for a, _ in partial}
        dims = tuple(tuple(a for a in d if a not in axes) for d in base.dims)
        base = Layout(mesh, dims)
        ins = tuple(
            Layout(mesh, _map_dims(base, out_shape, s), partial if j in keep else ())
            for j, s in enumerate(shapes)
        )
        out = Layout(mesh, dims, partial)
        return Candidate(ins, tuple(out if isinstance(m, torch.Tensor) else None for m in call.out_metas),
                         broadcast=True)


@attrs.frozen
class Like:
    """``*_like`` factories: the output takes the input's layout (pending reductions
    dropped) and each device makes its own shard."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        (_, v), *_ = call.arrays
        layout = v._layout
        return [Candidate((layout,) + tuple(x._layout for _, x in call.arrays[1:]),
                          (layout.without_partial(),))]


@attrs.frozen
class ZerosLikeOther:
    """``_new_zeros_with_same_feature_meta(self, other, self_num_batch_dims)`` (forward AD: a new
    tangent made like its primal ``other``, under vmap/jacfwd with ``self``'s leading batch
    dims): zeros of ``self``'s batch sizes then ``other``'s shape, made on each device with no
    move (only ``self``'s sizes are read). Feature dims are laid out as ``other``, pending
    reductions dropped; a batch dim keeps ``self``'s sharding where its axes are free, else each
    device makes it whole (a batch sharded on an axis that also splits ``other``: seed
    5777923501's jacfwd of ``lu_factor`` over a split batch fell back)."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        arrays = dict(call.arrays)
        other = arrays.get(1, arrays.get("other"))
        if other is None:
            return []
        k = call.arg(2, "self_num_batch_dims", 0)
        feat = other._layout.dims
        if not k:
            return [Candidate(tuple(v._layout for _, v in call.arrays), (Layout(call.mesh, feat),))]
        me = arrays.get(0, arrays.get("self"))
        used = {a for axes in feat for a in axes}
        batch = []
        for axes in me._layout.dims[:k]:
            free = not used.intersection(axes)
            batch.append(axes if free else ())
            used.update(axes if free else ())
        out = Layout(call.mesh, (*batch, *feat))
        whole = tuple(j for j, axes in enumerate(me._layout.dims[:k]) if axes and not batch[j])
        fn = _BatchWhole(call.func, tuple(me.shape[:k]), whole) if whole else None
        return [Candidate(tuple(v._layout for _, v in call.arrays), (out,), local_fn=fn)]


@attrs.frozen
class _BatchWhole:
    """``_new_zeros_with_same_feature_meta`` on one device with the batch dims ``whole`` of
    their global sizes: ``self`` stands in as an expanded scalar of the output's batch sizes."""

    func: Any
    sizes: tuple[int, ...]
    whole: tuple[int, ...]

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        b = bind(self.func, args, kwargs)
        me = b["self"]
        sizes = [g if j in self.whole else n for j, (g, n) in enumerate(zip(self.sizes, me.shape))]
        return self.func(me.new_empty(()).expand(sizes), b["other"], self_num_batch_dims=b["self_num_batch_dims"])


@attrs.frozen
class Materialised:
    """A rule whose local call is ``op`` (same arguments): lazy conj/neg views would
    leak a flag into the shards, so each device materialises its shard."""

    rule: Any
    op: Any

    def candidates(self, call: OpCall) -> list[Candidate]:
        return [attrs.evolve(c, local_op=self.op) for c in self.rule.candidates(call)]


POINTWISE = Pointwise()
LIKE = Like()


@attrs.frozen
class ToCopy:
    """``_to_copy`` (``.to``, ``.type``, casts): dtype, layout and memory format change
    shard by shard; the device type is the mesh's (the mesh owns the device), so a move to
    another device type is a ShardingError naming the ways to get there, and a device index
    leaves each shard on its device."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        check_mesh_device("_to_copy", call.kwargs.get("device"), call.mesh)
        cands = POINTWISE.candidates(call)
        if call.kwargs.get("device") is None:
            return cands
        # the device index is the mesh's business too: each shard stays on its device ("cuda:1"
        # does not move one simulated device's shard away from the others)
        return [attrs.evolve(c, local_args=(("device", None),)) for c in cands]


# Elementwise ops that torch does not tag as pointwise.
_UNTAGGED = (
    "copy", "fill", "hardtanh_backward", "elu_backward", "leaky_relu_backward",
    "softplus_backward", "hardswish_backward", "hardsigmoid_backward", "log_sigmoid_backward",
    "mish_backward", "rrelu_with_noise_backward", "conj_physical", "resolve_conj",
    "resolve_neg", "relu6", "rsub", "floor_divide", "log_sigmoid_forward",
    "softshrink_backward", "hardshrink_backward", "alias_copy", "detach_copy", "hardtanh", "elu", "leaky_relu", "softplus",
    "hardswish", "hardsigmoid", "mish", "logit_backward", "threshold", "celu", "selu",
    "silu_backward", "gelu_backward", "lift_fresh_copy", "masked_fill", "polar", "complex",
    "_prelu_kernel", "_prelu_kernel_backward",  # the weight already broadcast against the input (prelu reshapes it)
    "_masked_scale",  # x * mask * scale: CUDA's fused dropout's backward (no pending sum passes an unknown op)
    # losses, unreduced (rules/loss.py reduces the "mean" / "sum" of sharded inputs by ops)
    *ELEMENTWISE_LOSSES,
)

@attrs.frozen
class _KeepsStrides:
    """A pointwise op whose kernel clones ``self`` keeping its strides (``copy``, by
    ``clone_preserve_strides``): a shard whose elements share memory (the ``unfold`` view a
    ``clone`` of an array keeps) is made distinct first, else the copy lands on several
    elements (``x.unfold(0, 2, 1).clone().copy_(y)`` kept the last write of each; fuzzer seed
    5815264072 --gen 5)."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        return [attrs.evolve(c, dense="distinct") for c in POINTWISE.candidates(call)]


TABLE = {
    **{getattr(aten, n): POINTWISE for n in _UNTAGGED if hasattr(aten, n)},
    aten.copy: _KeepsStrides(),
    aten._to_copy: ToCopy(),
    aten._conj: Materialised(POINTWISE, aten.conj_physical.default),
    aten._neg_view: Materialised(POINTWISE, aten.neg.default),
    aten.zeros_like: LIKE,
    aten._new_zeros_with_same_feature_meta: ZerosLikeOther(),
    aten.ones_like: LIKE,
    aten.empty_like: LIKE,
    aten.full_like: LIKE,
    aten.zero: LIKE,  # zero_'s functional form (a write into a fresh buffer runs it)
}
