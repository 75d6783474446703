"""Neural-network ops and their backward ops (DTensor's ``_math_ops``/``_attention``).

Most of them are *batched*: some leading dims (batch, sequence, heads) are independent
and may stay sharded, the rest (normalized dims, classes, head dims) must be whole.
Weight gradients lack the batch dims, so sharding those leaves them Partial(sum) —
exactly what data parallelism needs. Activations (gelu, silu, relu, ...) are pointwise.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import attrs
import torch

from .base import Candidate, OpCall, _schema_info, bind, letters, same_args
from .dims import LINEAR_OPS, Dims, compile_dims
from .loss import ClassSharded

aten = torch.ops.aten

LeadFn = Callable[[dict], tuple[int, bool]]


@attrs.frozen
class Leading:
    """The first ``lead`` dims of the ``batched`` arguments and outputs (all outputs, or
    those in ``batched_outs``) share letters (a dim of another size, e.g. a broadcast
    mask dim, is whole); all other dims are whole.
    ``lead_fn(bound_args) -> (lead, reduce)``: with ``reduce``, outputs lacking the
    batch dims are Partial(sum) over them. ``linear``: arguments a pending sum may
    pass through."""

    batched: tuple[str, ...]
    lead_fn: LeadFn
    linear: tuple[str, ...] = ()
    batched_outs: tuple[int, ...] | None = None
    grouped: tuple[str, ...] = ()
    grouped_outs: tuple[int, ...] = ()

    def candidates(self, call: OpCall) -> list[Candidate]:
        b = bind(call.func, call.args, call.kwargs)
        lead, reduce = self.lead_fn(b)
        names = _schema_info(call.func)[0]
        by_name = [names[p] if isinstance(p, int) else p if isinstance(p, str) else names[p[0]]
                   for p, _ in call.arrays]
        ref = max((tuple(v.shape) for n, (_, v) in zip(by_name, call.arrays) if n in self.batched),
                  key=len, default=None)
        if ref is None or len(ref) < lead:
            return []
        ls = letters(lead)
        ins = tuple(_lettered(tuple(v.shape), ref, ls, n in self.grouped) if n in self.batched and not (
                        n in _BROADCAST and v.ndim != len(ref)) else (None,) * v.ndim
                    for n, (_, v) in zip(by_name, call.arrays))
        outs = tuple(
            None if not isinstance(m, torch.Tensor)
            else _lettered(tuple(m.shape), ref, ls, i in self.grouped_outs)
            if self.batched_outs is None or i in self.batched_outs
            else (None,) * m.dim()
            for i, m in enumerate(call.out_metas))
        partial_ins = tuple(i for i, n in enumerate(by_name) if n in self.linear)
        spec = Dims(ins, outs, tuple((L, "sum") for L in ls) if reduce else (),
                    LINEAR_OPS if partial_ins else (), partial_ins=partial_ins)
        return compile_dims(call, spec)


_BROADCAST = ("attn_mask", "attn_bias")  # right-aligned against the batch: lettered at full rank only


@attrs.frozen
class _FoldMesh:
    """Run ``func`` with the (broadcast) mesh dims of every tensor merged into its dim 0
    (made contiguous only for grouped-query heads, which the CPU kernel misreads from
    transposed strides; other layouts it reads as they are, as unsharded torch does)."""

    func: Any
    m: int

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        m = self.m
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        # the mesh dims of the inputs are 1 or the axis size: their broadcast is the max
        lead = [max(t.shape[i] for t in tensors) for i in range(m)]
        heads = [t.shape[m + 1] for t in tensors if t.dim() == m + 4]
        grouped = any(h != heads[0] for h in heads[1:])

        def fold(a: Any) -> Any:
            if not isinstance(a, torch.Tensor):
                return a
            a = a.expand(*lead, *a.shape[m:]).reshape(-1, *a.shape[m + 1:])
            return a.contiguous() if grouped else a

        outs = self.func(*[fold(a) for a in args], **kwargs)
        return tuple(o.reshape(*lead, -1, *o.shape[1:]) if isinstance(o, torch.Tensor) else o for o in outs)


def _lettered(shape: tuple[int, ...], ref: tuple[int, ...], ls: tuple[str, ...], grouped: bool = False) -> tuple:
    """Letters for the leading dims of the same size as ``ref``'s; with ``grouped`` the
    last leading dim (grouped-query kv heads) is lettered whatever its size."""
    k = len(ls)
    if len(shape) < k:
        return (None,) * len(shape)
    return tuple(L if shape[i] == ref[i] or (grouped and i == k - 1) else None
                 for i, L in enumerate(ls)) + (None,) * (len(shape) - k)


def _layer_norm_lead(reduce: bool) -> LeadFn:
    def lead(b: dict) -> tuple[int, bool]:
        x = b["input"]
        return x.dim() - len(b["normalized_shape"]), reduce

    return lead


def _nll_lead(b: dict) -> tuple[int, bool]:
    x = b["self"]
    if x.dim() < 2 or b.get("reduction", 1) == 1 and "grad_output" not in b:
        return 0, False  # "mean" divides by the global total weight: rows must be whole
    return 1, True


def _heads_lead(b: dict) -> tuple[int, bool]:
    return 2, False


@attrs.frozen
class Attention:
    """Fused attention (and its backward) with grouped-query kv heads: query head ``h``
    reads kv head ``h // (Hq // Hkv)``, so kv heads are split like query heads, over the
    same axes. That pairs every query head with its own kv head exactly when the number
    of pieces divides ``Hkv`` (contiguous blocks then line up); other splits of the heads
    are dropped (the heads stay whole: a correct, costlier plan)."""

    forward: bool

    def candidates(self, call: OpCall) -> list[Candidate]:
        b = bind(call.func, call.args, call.kwargs)
        q, k = b["query"], b["key"]
        fn = _empty_heads_safe(call.func)
        if q.dim() != 4 or k.dim() != 4 or q.shape[1] == k.shape[1]:
            cands = _ATTN_RULE.candidates(call)
        else:
            hq, hkv = q.shape[1], k.shape[1]
            if hkv == 0 or hq % hkv:
                return []
            rule = _ATTN_GQA if self.forward else _ATTN_GQA_BWD
            qi = 0 if self.forward else 1
            mesh = call.mesh
            cands = [c for c in rule.candidates(call)
                     if hkv % math.prod(mesh.axis_size(a) for a in c.in_layouts[qi].dims[1]) == 0]
        if b.get("attn_mask") is not None:
            return [attrs.evolve(c, device_fn=fn) for c in cands]
        # without a mask every tensor starts with the batch dim: on stacked shards the mesh
        # dims fold into it and the kernel runs once for the whole mesh
        fold = _FoldMesh(call.func, call.mesh.ndim)
        return [attrs.evolve(c, device_fn=fn, stacked_args=same_args, stacked_fn=fold) for c in cands]


def _empty_heads_safe(op: Any) -> Callable:
    """``op`` run on one device's shards, made contiguous (the CPU kernel reads
    grouped-query heads wrongly from transposed strides, which gathers produce); a
    device holding no heads (more pieces than heads) gets empty results (the kernel
    divides by the head count)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {n: a.contiguous() if isinstance(a, torch.Tensor) else a for n, a in kwargs.items()}
        b = bind(op, args, kwargs)
        q, k = b["query"], b["key"]
        if k.shape[1] and q.shape[1]:
            return op(*args, **kwargs)
        meta = op(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args],
                  **{n: a.to("meta") if isinstance(a, torch.Tensor) else a for n, a in kwargs.items()})
        return tuple(torch.zeros(m.shape, dtype=m.dtype, device=q.device) for m in meta)

    return run


def _embedding_bwd_lead(b: dict) -> tuple[int, bool]:
    return (0, False) if b.get("scale_grad_by_freq") else (b["indices"].dim(), True)


@attrs.frozen
class Embedding:
    """embedding(weight, indices): the output follows the indices' sharding and the
    weight's embedding dim; a vocabulary-sharded weight gives a Partial(sum) output
    (each device looks up the rows it holds, zeros elsewhere)."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        if [p for p, _ in call.arrays] != [0, 1]:
            return []
        (_, w), (_, idx) = call.arrays
        if w.ndim != 2:
            return []
        ls = letters(idx.ndim, start=2)
        spec = Dims((("V", "D"), ls), (ls + ("D",),), (("V", "sum"),))
        out = []
        for c in compile_dims(call, spec):
            axes = c.in_layouts[0].dims[0]
            if axes:
                c = attrs.evolve(c, stacked_args=None, device_args=_VocabShard(c.in_layouts[0], tuple(w.shape)),
                                 device_fn=_masked_embedding)
            out.append(c)
        return out


@attrs.frozen
class _VocabShard:
    layout: Any
    shape: tuple[int, ...]

    def __call__(self, args: tuple, kwargs: dict, dev: int) -> tuple[tuple, dict]:
        from ..layout import device_box

        lo, hi = device_box(self.layout, self.shape, dev)[0]
        return (args[0], args[1], lo, hi), {}


def _masked_embedding(weight: torch.Tensor, idx: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    inside = (idx >= lo) & (idx < hi)
    local = torch.where(inside, idx - lo, torch.zeros_like(idx))
    if weight.shape[0] == 0:
        return torch.zeros(*idx.shape, weight.shape[1], dtype=weight.dtype, device=weight.device)
    return torch.nn.functional.embedding(local, weight) * inside.unsqueeze(-1).to(weight.dtype)


def _conv_lead(b: dict) -> tuple[int, bool]:
    x, w = b.get("input"), b.get("weight")
    return (1 if x is not None and w is not None and x.dim() == w.dim() else 0), True


def _first_dim(b: dict) -> tuple[int, bool]:
    x = b.get("self", b.get("input"))
    return (1 if x is not None and x.dim() >= 3 else 0), False  # unbatched inputs reject empty dim 0


def _pixel_lead(b: dict) -> tuple[int, bool]:
    return b["self"].dim() - 3, False


_SPATIAL = ("self", "input", "grad_output", "indices")
_POOL = Leading(_SPATIAL, _first_dim)
_POOL_OPS = (
    "max_pool2d_with_indices", "max_pool2d_with_indices_backward", "max_pool3d_with_indices",
    "max_pool3d_with_indices_backward", "avg_pool2d", "avg_pool2d_backward", "avg_pool3d",
    "avg_pool3d_backward", "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward",
    "_adaptive_avg_pool3d", "_adaptive_avg_pool3d_backward", "adaptive_max_pool2d",
    "adaptive_max_pool2d_backward", "adaptive_max_pool3d", "adaptive_max_pool3d_backward",
    "reflection_pad1d", "reflection_pad2d", "reflection_pad3d", "reflection_pad1d_backward",
    "reflection_pad2d_backward", "reflection_pad3d_backward", "replication_pad1d",
    "replication_pad2d", "replication_pad3d", "replication_pad1d_backward",
    "replication_pad2d_backward", "replication_pad3d_backward", "upsample_nearest1d",
    "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d", "upsample_bilinear2d",
    "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
)

_LN = Leading(("input",), _layer_norm_lead(False))
_LN_BWD = Leading(("grad_out", "input", "mean", "rstd"), _layer_norm_lead(True), batched_outs=(0,))


@attrs.frozen
class _AnyOf:
    """The candidates of several rules."""

    rules: tuple

    def candidates(self, call: OpCall) -> list[Candidate]:
        return [c for r in self.rules for c in r.candidates(call)]


_NLL = _AnyOf((Leading(("self", "target"), _nll_lead, batched_outs=(0,)), ClassSharded(backward=False)))
_NLL_BWD = _AnyOf((Leading(("grad_output", "self", "target"), _nll_lead, linear=("grad_output",), batched_outs=(0,)),
                   ClassSharded(backward=True)))
_ATTN = ("query", "key", "value", "attn_mask", "grad_out", "out", "logsumexp", "attn_bias")
_ATTN_RULE = Leading(_ATTN, _heads_lead)
_ATTN_GQA = Leading(_ATTN, _heads_lead, grouped=("key", "value"))
_ATTN_GQA_BWD = Leading(_ATTN, _heads_lead, grouped=("key", "value"), grouped_outs=(1, 2))

TABLE = {
    aten.native_layer_norm: _LN,
    aten.native_layer_norm_backward: _LN_BWD,
    aten.nll_loss_forward: _NLL,
    aten.nll_loss2d_forward: _NLL,
    aten.nll_loss_backward: _NLL_BWD,
    aten.nll_loss2d_backward: _NLL_BWD,
    aten._scaled_dot_product_flash_attention_for_cpu: Attention(forward=True),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: Attention(forward=False),
    aten.embedding: Embedding(),
    aten.convolution: Leading(("input",), _conv_lead, batched_outs=(0,)),
    aten.convolution_backward: Leading(("grad_output", "input"), _conv_lead, batched_outs=(0,)),
    aten.pixel_shuffle: Leading(("self",), _pixel_lead),
    aten.pixel_unshuffle: Leading(("self",), _pixel_lead),
    **{getattr(aten, n): _POOL for n in _POOL_OPS if hasattr(aten, n)},
    aten.embedding_dense_backward: Leading(("grad_output", "indices"), _embedding_bwd_lead, batched_outs=()),
}
