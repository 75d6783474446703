"""The fused kernels of ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer``'s inference
fast path: ``aten._native_multi_head_attention``, ``aten._transformer_encoder_layer_fwd`` and
``aten._transform_bias_rescale_qkv`` (the first two call the third and ``_masked_softmax``
inside their kernels).

Sequences are independent: the batch dim of every activation splits with no communication,
the outputs (and the attention weights, averaged or per head) following it. The mask follows
the batch where it has one, as ``MultiheadAttention.merge_masks`` builds it: ``mask_type`` 1 a
(B, S) padding mask, 2 (or none) a (B, H, L, S) mask; a ``mask_type`` 0 (L, S) attention mask
stays whole. ``_transform_bias_rescale_qkv`` (qkv (B, T, 3E) -> q, k, v (B, H, T, D), each
token on its own) also splits the tokens.

Heads stay whole: the packed projection's rows (``qkv_weight`` (3E, E), ``qkv`` 's last dim) are
``[q | k | v]`` blocks, each heads-major, so one device's heads are three strided row ranges,
which no block split of that dim holds (a Megatron split of the packed rows cuts q, k and v
apart). A weight laid out so is gathered; the plan stays correct.

torch has no meta kernel for ``_transform_bias_rescale_qkv``, and the meta kernel of
``_native_multi_head_attention`` gives an empty tensor where the device kernels return no
weights (``need_weights=False``): the rules give the outputs' metadata (``out_meta``) as the
CPU and CUDA kernels make them, and on a meta mesh the local call gives its shard's.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from .base import Candidate, OpCall, _schema_info, bind
from .dims import Dims, compile_dims

aten = torch.ops.aten

_BATCHED = ("query", "key", "value", "src")
"""The (B, L, E) activations."""


def _mask_letters(mask: torch.Tensor, batch: int, mask_type: int | None) -> tuple:
    """The mask's letters: the batch letter on its batch dim where it has one (a (B, S) padding
    mask of type 1, a (B, H, L, S) mask of type 2 or none); otherwise whole."""
    whole = (None,) * mask.dim()
    if mask.dim() == 2 and mask_type == 1 and mask.shape[0] == batch:
        return ("b", None)
    if mask.dim() == 4 and mask_type in (2, None) and mask.shape[0] == batch:
        return ("b", None, None, None)
    return whole


def _arg_name(names: tuple, path: Any) -> str:
    return names[path] if isinstance(path, int) else path if isinstance(path, str) else names[path[0]]


@attrs.frozen
class BatchSplit:
    """``_native_multi_head_attention`` / ``_transformer_encoder_layer_fwd``: the batch dim of
    the activations, the mask and the outputs split alike; the weights whole."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        b = bind(call.func, call.args, call.kwargs)
        acts = [b[n] for n in _BATCHED if isinstance(b.get(n), torch.Tensor)]
        if not acts or any(a.dim() != 3 or a.shape[0] != acts[0].shape[0] for a in acts):
            return []
        batch = acts[0].shape[0]
        names = _schema_info(call.func)[0]
        ins = []
        for path, v in call.arrays:
            name = _arg_name(names, path)
            if name in _BATCHED:
                ins.append(("b", None, None))
            elif name == "mask":
                ins.append(_mask_letters(v, batch, b.get("mask_type")))
            else:  # the projections' and norms' weights
                ins.append((None,) * v.dim())
        outs = tuple(None if not isinstance(m, torch.Tensor) else
                     ("b",) + (None,) * (m.dim() - 1) if m.dim() >= 3 and m.shape[0] == batch else
                     (None,) * m.dim()
                     for m in call.out_metas)
        w = call.out_metas[1] if len(call.out_metas) > 1 else None
        fn = _Local(call.func, w.dtype if isinstance(w, torch.Tensor) else None)
        return [attrs.evolve(c, dense=True, local_fn=fn) for c in compile_dims(call, Dims(tuple(ins), outs))]

    @staticmethod
    def out_meta(func: Any, args: tuple, kwargs: dict) -> Any:
        """The meta kernel's outputs, with no weights (None) where the CPU and CUDA kernels return
        an undefined tensor: ``need_weights=False``, and an empty query (they stop before
        the attention; the meta kernel gives an empty tensor). Torch before 2.13 has no meta
        kernel for ``_transformer_encoder_layer_fwd``: :func:`encoder_layer_meta` stands in."""
        try:
            out = func(*args, **kwargs)
        except NotImplementedError:
            if func is not aten._transformer_encoder_layer_fwd.default:
                raise
            return encoder_layer_meta(func, args, kwargs)
        if func is aten._native_multi_head_attention.default and not _weights_wanted(func, args, kwargs):
            return out[0], None
        return out


def encoder_layer_meta(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """``_transformer_encoder_layer_fwd``'s output on meta as its kernels make it (torch 2.11 on
    an H100 has no meta kernel for it, so the call fell back to replication there): ``src``'s
    shape and dtype, contiguous."""
    src = bind(func, args, kwargs)["src"]
    return torch.empty(src.shape, dtype=src.dtype, device="meta")


def _weights_wanted(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``_native_multi_head_attention``'s device kernels return the attention weights."""
    b = bind(func, args, kwargs)
    return bool(b.get("need_weights", True)) and b["query"].numel() > 0


@attrs.frozen
class _Local:
    """The op on one device's shards. ``weights``: the dtype of the attention weights the call
    returns (None: it returns none, as the device kernels where none are asked for, which the
    meta kernel gives as an empty tensor). A device whose batch shard is empty gets empty
    weights of its shard's shape (the kernels return none for an empty query)."""

    op: Any
    weights: torch.dtype | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.op is aten._transformer_encoder_layer_fwd.default:
            src = bind(self.op, args, kwargs)["src"]
            if src.device.type == "meta":  # (a meta mesh: torch before 2.13 has no meta kernel)
                return encoder_layer_meta(self.op, args, kwargs)
        if self.op is not aten._native_multi_head_attention.default:
            return self.op(*args, **kwargs)
        b = bind(self.op, args, kwargs)
        q, k = b["query"], b["key"]
        if self.weights is None:
            return self.op(*args, **kwargs)[0], None
        if q.numel() == 0:
            heads = () if b.get("average_attn_weights", True) else (b["num_head"],)
            shape = (q.shape[0], *heads, q.shape[1], k.shape[1])
            return torch.empty_like(q), torch.zeros(shape, dtype=self.weights, device=q.device)
        return self.op(*args, **kwargs)


@attrs.frozen
class TransformBiasRescaleQkv:
    """``_transform_bias_rescale_qkv(qkv, qkv_bias, num_heads)``: q, k, v (B, H, T, D) from qkv
    (B, T, 3E) plus the bias (q also scaled by 1/sqrt(D)), token by token: batch and tokens
    split, the packed dim and the bias whole."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        names = _schema_info(call.func)[0]
        ins = []
        for path, v in call.arrays:
            if _arg_name(names, path) == "qkv":
                if v.dim() != 3:
                    return []
                ins.append(("b", "t", None))
            else:
                ins.append((None,) * v.dim())
        outs = (("b", None, "t", None),) * 3
        fn = _TransformOnMeta(call.func)
        return [attrs.evolve(c, dense=True, local_fn=fn) for c in compile_dims(call, Dims(tuple(ins), outs))]

    @staticmethod
    def out_meta(func: Any, args: tuple, kwargs: dict) -> tuple:
        """q, k, v's metadata as the CPU and CUDA kernels make them (torch has no meta kernel):
        three contiguous (B, H, T, D) tensors of qkv's dtype, after the kernels' checks."""
        b = bind(func, args, kwargs)
        qkv, bias, heads = b["qkv"], b["qkv_bias"], b["num_heads"]
        if qkv.dim() != 3 or bias.dim() != 1 or qkv.shape[2] != bias.shape[0] or qkv.shape[2] % 3:
            raise RuntimeError(f"_transform_bias_rescale_qkv: expected qkv (B, T, 3E) and qkv_bias (3E,), "
                               f"got {tuple(qkv.shape)} and {tuple(bias.shape)}")
        embed = qkv.shape[2] // 3
        if heads <= 0 or embed % heads:
            raise RuntimeError(f"_transform_bias_rescale_qkv: embedding dim {embed} not divisible by "
                               f"num_heads {heads}")
        B, T = qkv.shape[:2]
        return tuple(torch.empty((B, heads, T, embed // heads), dtype=qkv.dtype, device="meta") for _ in range(3))


@attrs.frozen
class _TransformOnMeta:
    """``_transform_bias_rescale_qkv`` on one device's shards; on a meta mesh its metadata, and
    on an empty shard empty results (torch's CPU kernel crashes the process on an empty batch)."""

    op: Any

    def __call__(self, *args: Any, **kwargs: Any) -> tuple:
        qkv = bind(self.op, args, kwargs)["qkv"]
        if qkv.device.type == "meta" or qkv.numel() == 0:
            metas = TransformBiasRescaleQkv.out_meta(self.op, args, kwargs)
            return tuple(torch.empty(m.shape, dtype=m.dtype, device=qkv.device) for m in metas)
        return self.op(*args, **kwargs)


TABLE = {
    aten._native_multi_head_attention: BatchSplit(),
    aten._transformer_encoder_layer_fwd: BatchSplit(),
    aten._transform_bias_rescale_qkv: TransformBiasRescaleQkv(),
}
