"""Neural-network ops and their backward ops (DTensor's ``_math_ops``/``_attention``).

Most of them are *batched*: some leading dims (batch, sequence, heads) are independent
and may stay sharded, the rest (normalized dims, classes, head dims) must be whole.
Weight gradients lack the batch dims, so sharding those leaves them Partial(sum) —
exactly what data parallelism needs. Activations (gelu, silu, relu, ...) are pointwise.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import torch

from .base import Candidate, OpCall, _schema_info, bind, letters, same_args
from .dims import LINEAR_OPS, Dims, compile_dims

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
        ins = tuple(_lettered(tuple(v.shape), ref, ls) if n in self.batched and not (
                        n in _BROADCAST and v.ndim != len(ref)) else (None,) * v.ndim
                    for n, (_, v) in zip(by_name, call.arrays))
        outs = tuple(
            None if not isinstance(m, torch.Tensor)
            else _lettered(tuple(m.shape), ref, ls) if self.batched_outs is None or i in self.batched_outs
            else (None,) * m.dim()
            for i, m in enumerate(call.out_metas))
        partial_ins = tuple(i for i, n in enumerate(by_name) if n in self.linear)
        spec = Dims(ins, outs, tuple((L, "sum") for L in ls) if reduce else (),
                    LINEAR_OPS if partial_ins else (), partial_ins=partial_ins)
        return compile_dims(call, spec)


_BROADCAST = ("attn_mask", "attn_bias")  # right-aligned against the batch: lettered at full rank only


@attrs.frozen
class Attention:
    """CPU flash attention (forward and backward): ``Leading`` over batch and heads; without
    a mask every tensor argument and output starts with the batch dim, so on stacked
    shards the mesh dims fold into it and the kernel runs once for the whole mesh."""

    rule: Leading

    def candidates(self, call: OpCall) -> list[Candidate]:
        cands = self.rule.candidates(call)
        if bind(call.func, call.args, call.kwargs).get("attn_mask") is not None:
            return cands
        fold = _FoldMesh(call.func, call.mesh.ndim)
        return [attrs.evolve(c, stacked_args=same_args, stacked_fn=fold) for c in cands]


@attrs.frozen
class _FoldMesh:
    """Run ``func`` with the (broadcast) mesh dims of every tensor merged into its dim 0."""

    func: Any
    m: int

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        m = self.m
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        lead = torch.broadcast_shapes(*(t.shape[:m] for t in tensors))

        def fold(a: Any) -> Any:
            if not isinstance(a, torch.Tensor):
                return a
            return a.expand(*lead, *a.shape[m:]).reshape(-1, *a.shape[m + 1:])

        outs = self.func(*[fold(a) for a in args], **kwargs)
        return tuple(o.reshape(*lead, -1, *o.shape[1:]) if isinstance(o, torch.Tensor) else o for o in outs)


def _lettered(shape: tuple[int, ...], ref: tuple[int, ...], ls: tuple[str, ...]) -> tuple:
    k = len(ls)
    if len(shape) < k:
        return (None,) * len(shape)
    return tuple(L if shape[i] == ref[i] else None for i, L in enumerate(ls)) + (None,) * (len(shape) - k)


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
_NLL = Leading(("self", "target"), _nll_lead, batched_outs=(0,))
_NLL_BWD = Leading(("grad_output", "self", "target"), _nll_lead, linear=("grad_output",), batched_outs=(0,))
_ATTN = ("query", "key", "value", "attn_mask", "grad_out", "out", "logsumexp", "attn_bias")

TABLE = {
    aten.native_layer_norm: _LN,
    aten.native_layer_norm_backward: _LN_BWD,
    aten.nll_loss_forward: _NLL,
    aten.nll_loss2d_forward: _NLL,
    aten.nll_loss_backward: _NLL_BWD,
    aten.nll_loss2d_backward: _NLL_BWD,
    aten._scaled_dot_product_flash_attention_for_cpu: Attention(Leading(_ATTN, _heads_lead)),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: Attention(Leading(_ATTN, _heads_lead)),
    aten.embedding: Embedding(),
    aten.convolution: Leading(("input",), _conv_lead, batched_outs=(0,)),
    aten.convolution_backward: Leading(("grad_output", "input"), _conv_lead, batched_outs=(0,)),
    aten.pixel_shuffle: Leading(("self",), _pixel_lead),
    aten.pixel_unshuffle: Leading(("self",), _pixel_lead),
    **{getattr(aten, n): _POOL for n in _POOL_OPS if hasattr(aten, n)},
    aten.embedding_dense_backward: Leading(("grad_output", "indices"), _embedding_bwd_lead, batched_outs=()),
}
