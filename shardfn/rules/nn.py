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

from .base import Candidate, OpCall, _schema_info, bind, letters
from .dims import LINEAR_OPS, Dims, compile_dims

aten = torch.ops.aten

LeadFn = Callable[[dict], tuple[int, bool]]


@attrs.frozen
class Leading:
    """The first ``lead`` dims of the ``batched`` arguments share letters (a dim of
    another size, e.g. a broadcast mask dim, is whole); all other dims are whole.
    ``lead_fn(bound_args) -> (lead, reduce)``: with ``reduce``, outputs lacking the
    batch dims are Partial(sum) over them. ``linear``: arguments a pending sum may
    pass through."""

    batched: tuple[str, ...]
    lead_fn: LeadFn
    linear: tuple[str, ...] = ()

    def candidates(self, call: OpCall) -> list[Candidate]:
        b = bind(call.func, call.args, call.kwargs)
        lead, reduce = self.lead_fn(b)
        names = _schema_info(call.func)[0]
        by_name = [names[p] if isinstance(p, int) else p if isinstance(p, str) else names[p[0]]
                   for p, _ in call.arrays]
        ref = next((tuple(v.shape) for n, (_, v) in zip(by_name, call.arrays) if n in self.batched), None)
        if ref is None or len(ref) < lead:
            return []
        ls = letters(lead)
        ins = tuple(_lettered(tuple(v.shape), ref, ls) if n in self.batched else (None,) * v.ndim
                    for n, (_, v) in zip(by_name, call.arrays))
        outs = tuple(_lettered(tuple(m.shape), ref, ls) if isinstance(m, torch.Tensor) else None
                     for m in call.out_metas)
        partial_ins = tuple(i for i, n in enumerate(by_name) if n in self.linear)
        spec = Dims(ins, outs, tuple((L, "sum") for L in ls) if reduce else (),
                    LINEAR_OPS if partial_ins else (), partial_ins=partial_ins)
        return compile_dims(call, spec)


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


_LN = Leading(("input",), _layer_norm_lead(False))
_LN_BWD = Leading(("grad_out", "input", "mean", "rstd"), _layer_norm_lead(True))
_NLL = Leading(("self", "target"), _nll_lead)
_NLL_BWD = Leading(("grad_output", "self", "target"), _nll_lead, linear=("grad_output",))
_ATTN = ("query", "key", "value", "attn_mask", "grad_out", "out", "logsumexp", "attn_bias")

TABLE = {
    aten.native_layer_norm: _LN,
    aten.native_layer_norm_backward: _LN_BWD,
    aten.nll_loss_forward: _NLL,
    aten.nll_loss2d_forward: _NLL,
    aten.nll_loss_backward: _NLL_BWD,
    aten.nll_loss2d_backward: _NLL_BWD,
    aten._scaled_dot_product_flash_attention_for_cpu: Leading(_ATTN, _heads_lead),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: Leading(_ATTN, _heads_lead),
    aten.embedding: Embedding(),
    aten.embedding_dense_backward: Leading(("grad_output", "indices"), _embedding_bwd_lead),
}
