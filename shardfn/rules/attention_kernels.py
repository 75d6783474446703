"""CUDA's attention kernels below the SDPA ops: ``aten._flash_attention_forward`` /
``_backward`` and ``aten._efficient_attention_forward`` / ``_backward`` (what the SDPA
backends, ``torch.nn.attention.varlen`` and custom attention code call on CUDA).

They take (batch, seq, heads, head_dim) -- or packed (total, heads, head_dim) with
cumulative sequence lengths -- so batch and heads may stay sharded and sequence and
head_dim must be whole. Grouped-query kv heads split like the query heads when the number
of pieces divides the kv head count (see ``rules/nn.py``'s ``Attention``); one kv head
(multi-query) stays whole under split query heads, its gradients pending sums over them. Packed
sequences keep the batch whole (the offsets are global). The logsumexp follows batch and
heads; RNG state, philox seed/offset and the unused output are per-call constants
(replicated); a bias broadcast over batch or heads gets a pending-sum gradient.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from ..values.layout import local_shapes
from .base import Candidate, OpCall, _schema_info, bind, replicated
from .dims import Dims, compile_dims

aten = torch.ops.aten

_QKV = ("query", "key", "value", "out", "grad_out", "grad_out_")


def _qkv_letters(ndim: int, packed: bool, whole_heads: bool = False) -> tuple:
    """(batch, seq, heads, head_dim) or packed (total, heads, head_dim); ``whole_heads``: the
    heads dim unlettered (a multi-query key or value, or their gradients)."""
    h = None if whole_heads else "h"
    if ndim == 4:
        return (None if packed else "b", None, h, None)
    if ndim == 3:
        return (None, h, None)
    return (None,) * ndim


def _bh_led(shape: tuple[int, ...], batch: int, heads: int, packed: bool) -> tuple:
    """(batch, heads, ...) tensors (logsumexp, bias, debug mask): the leading dims that have
    the query's batch / head count keep its letters; broadcast (size-1) dims are whole."""
    n = len(shape)
    if n == 2:  # packed logsumexp: (heads, total)
        return ("h" if shape[0] == heads else None, None)
    if n < 3:
        return (None,) * n
    b = "b" if shape[0] == batch and not packed else None
    h = "h" if shape[1] == heads else None
    return (b, h) + (None,) * (n - 2)


def _bias_led(shape: tuple[int, ...], batch: int, heads: int, packed: bool) -> tuple:
    """A bias (or its gradient) broadcasts against the scores (batch, heads, seq_q, seq_k):
    right-aligned, so a (heads, seq_q, seq_k) bias carries the heads letter and a
    (seq_q, seq_k) one none; broadcast (size-1) dims are whole."""
    n = len(shape)
    out = [None] * n
    if n >= 3 and shape[n - 3] == heads:
        out[n - 3] = "h"
    if n >= 4 and not packed and shape[n - 4] == batch:
        out[n - 4] = "b"
    return tuple(out)


@attrs.frozen
class HeadsAttention:
    """Rule for one BSHD attention kernel. ``q_like``/``k_like``: output indices shaped like
    the query / the key; ``bh_outs``: outputs led by (batch, heads); the others are per-call
    constants. ``grad_bias``: the output that is the bias gradient (pending sum where the
    bias broadcasts)."""

    q_like: tuple[int, ...]
    k_like: tuple[int, ...] = ()
    bh_outs: tuple[int, ...] = ()
    grad_bias: int | None = None

    def candidates(self, call: OpCall) -> list[Candidate]:
        b = bind(call.func, call.args, call.kwargs)
        q, k = b["query"], b["key"]
        if q.dim() not in (3, 4) or k.dim() != q.dim():
            return []
        packed = q.dim() == 3 or any(b.get(n) is not None for n in ("cum_seq_q", "cu_seqlens_q"))
        heads, kv_heads = q.shape[-2], k.shape[-2]
        if kv_heads == 0 or heads % kv_heads:
            return []
        batch = q.shape[0] if q.dim() == 4 else -1
        names = _schema_info(call.func)[0]
        mqa = kv_heads == 1 < heads  # every query head reads the one kv head: it stays whole
        ins = []
        for path, v in call.arrays:
            name = names[path] if isinstance(path, int) else path if isinstance(path, str) else names[path[0]]
            shape = tuple(v.shape)
            if name in _QKV:
                ins.append(_qkv_letters(len(shape), packed, mqa and name in ("key", "value")))
            elif name == "logsumexp":
                ins.append(_bh_led(shape, batch, heads, packed))
            elif name in ("bias", "attn_bias"):
                ins.append(_bias_led(shape, batch, heads, packed))
            elif name == "alibi_slopes":  # (heads,) or (batch, heads)
                ins.append(("h",) if len(shape) == 1 else ("b" if not packed else None, "h"))
            else:  # sequence offsets, RNG state, block tables: whole
                ins.append((None,) * len(shape))
        outs: list = []
        loose = []
        for i, m in enumerate(call.out_metas):
            if not isinstance(m, torch.Tensor):
                outs.append(None)
            elif i in self.q_like or i in self.k_like:
                outs.append(_qkv_letters(m.dim(), packed, mqa and i in self.k_like))
            elif i == self.grad_bias:  # a pending sum over the letters it lacks
                outs.append(_bias_led(tuple(m.shape), batch, heads, packed))
            elif i in self.bh_outs:
                lettered = _bh_led(tuple(m.shape), batch, heads, packed)
                if lettered[:2] == ("b", "h") or (packed and "h" in lettered):
                    outs.append(lettered)
                else:
                    outs.append(None)
                    loose.append(i)
            else:
                outs.append(None)
                loose.append(i)
        # the key/value gradients of multi-query: sums over the devices of the query heads
        reduce = (("b", "sum"), ("h", "sum")) if self.grad_bias is not None else (("h", "sum"),) if mqa else ()
        cands = compile_dims(call, Dims(tuple(ins), tuple(outs), reduce))
        if self.grad_bias is not None:
            pending = {self.grad_bias, *(self.k_like if mqa else ())}
            cands = [c for c in cands if not _partial_besides(c, pending)]
        if kv_heads != heads:
            mesh = call.mesh
            qi = next(i for i, (p, _) in enumerate(call.arrays) if p in (names.index("query"), "query"))
            if mqa:  # the query heads split only as the query comes (see rules/nn.py's Attention)
                cands = [c for c in cands if c.in_layouts[qi].dims[-2] in ((), q._layout.dims[-2])]
            else:
                cands = [c for c in cands
                         if kv_heads % math.prod(mesh.axis_size(a) for a in c.in_layouts[qi].dims[-2]) == 0]
        fill = {i: replicated(call.mesh, call.out_metas[i].dim()) for i in loose}
        meta_fn = _META_FNS.get(call.func) if call.mesh.device_type == "meta" else None
        fn = _EmptyProblems(call.func, meta_fn)
        return [attrs.evolve(c, dense="last",
                             local_fn=fn if meta_fn is not None or _empty_somewhere(call, c, names, packed) else None,
                             out_layouts=tuple(fill.get(i, o) for i, o in enumerate(c.out_layouts)))
                for c in cands]


def _partial_besides(c: Candidate, keep: set[int]) -> bool:
    """Whether an output other than those in ``keep`` (the bias gradient, multi-query's key and
    value gradients) would be pending (never: dq carries every letter; a guard against a rule bug)."""
    return any(o is not None and o.partial for i, o in enumerate(c.out_layouts) if i not in keep)


def _empty_somewhere(call: OpCall, c: Candidate, names: list, packed: bool) -> bool:
    """Whether some device's query/key/value shard holds no heads, or (unpacked) no batch rows,
    of a call that has some (more pieces than heads or rows)."""
    return any(
        (s[-2] == 0 < v.shape[-2]) or (not packed and s[0] == 0 < v.shape[0])
        for (p, v), lay in zip(call.arrays, c.in_layouts)
        if (names[p] if isinstance(p, int) else p) in ("query", "key", "value") and v.ndim >= 3
        for s in local_shapes(lay, tuple(v.shape))
    )


@attrs.frozen
class _EmptyProblems:
    """``op`` on one device's shards, or zero results shaped as its meta kernel's where that
    device holds no heads or no batch rows (flash checks "batch size must be positive"; the
    device's share is empty, a bias gradient's pending share zeros). ``meta``: computes the
    outputs' metadata in place of a broken meta kernel."""

    op: Any
    meta: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        b = bind(self.op, args, kwargs)
        q, k = b["query"], b["key"]
        if self.meta is not None and q.device.type == "meta":
            return self.meta(self.op, args, kwargs)
        if k.shape[-2] and q.shape[-2] and (q.dim() != 4 or (q.shape[0] and k.shape[0])):
            return self.op(*args, **kwargs)
        meta = self.op(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args],
                       **{n: a.to("meta") if isinstance(a, torch.Tensor) else a for n, a in kwargs.items()})
        return tuple(torch.zeros(m.shape, dtype=m.dtype, device=q.device) if isinstance(m, torch.Tensor) else m
                     for m in meta)


def _efficient_backward_meta(func: Any, args: tuple, kwargs: dict) -> tuple:
    """``_efficient_attention_backward``'s outputs on meta: torch's meta kernel rejects the
    schema's own ``window_size`` keyword (which autograd passes), so the shapes are computed
    here as that kernel would (a bias gradient allocated with its last dim padded to 16, and
    none where no bias gradient is asked for)."""
    b = bind(func, args, kwargs)
    q, k, v, bias = b["query"], b["key"], b["value"], b.get("bias")
    dq, dk, dv = (torch.empty_like(t, device="meta") for t in (q, k, v))
    if bias is not None and b.get("bias_requires_grad", True):
        last = bias.shape[-1]
        padded = torch.empty((*bias.shape[:-1], -(-last // 16) * 16), dtype=bias.dtype, device="meta")
        db = padded[..., :last]
    else:  # undefined, as the CUDA kernel returns it (None in Python)
        db = None
    return dq, dk, dv, db


@attrs.frozen
class _EfficientBackward(HeadsAttention):
    """See :func:`_efficient_backward_meta`."""

    @staticmethod
    def out_meta(func: Any, args: tuple, kwargs: dict) -> tuple:
        return _efficient_backward_meta(func, args, kwargs)


_META_FNS = {aten._efficient_attention_backward.default: _efficient_backward_meta}

TABLE = {
    # (output, logsumexp, rng_state, unused, debug_attn_mask)
    aten._flash_attention_forward: HeadsAttention(q_like=(0,), bh_outs=(1, 4)),
    aten._flash_attention_backward: HeadsAttention(q_like=(0,), k_like=(1, 2)),
    # (output, logsumexp, philox_seed, philox_offset, max_seqlen_q, max_seqlen_k)
    aten._efficient_attention_forward: HeadsAttention(q_like=(0,), bh_outs=(1,)),
    # (grad_query, grad_key, grad_value, grad_bias)
    aten._efficient_attention_backward: _EfficientBackward(q_like=(0,), k_like=(1, 2), grad_bias=3),
}
