"""Arguments some CUDA kernels read with strides of their own, whatever the tensor says.

Mem-efficient attention's backward (xformers' kernel) reads ``out`` as its forward wrote it,
(batch, seq, heads, dim) dense: the row stride it uses is heads * dim (``o_strideM``), not
``out``'s. A shard the local backend restacked per device is (batch, heads, seq, dim) dense,
and was read wrongly, silently: the query and key gradients came out wrong in bfloat16 on an
H100. Flash attention's backward reads the logsumexp by a bare pointer, as (batch, heads,
seq) dense; a device's slice of a logsumexp replicated over the heads is not. Mem-efficient
attention rejects a bias whose strides (but the last, which must be 1) are not multiples of 8
elements ("attn_bias is not correctly aligned"): torch's SDPA pads the user's mask so, and a
bias shard gathered or restacked is dense again. Such an argument is put in the kernel's
layout before the call (a copy only where it is not in it already)."""

from __future__ import annotations

from typing import Any, Callable

import torch

aten = torch.ops.aten


def _seq_major(t: Any) -> Any:
    """(batch, heads, seq, dim) whose (batch, seq, heads, dim) transpose is dense."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        return t
    bshd = t.transpose(1, 2)
    return t if bshd.is_contiguous() else bshd.contiguous().transpose(1, 2)


def _dense(t: Any) -> Any:
    return t.contiguous() if isinstance(t, torch.Tensor) else t


_BIAS_ALIGN = 8  # elements: what torch's SDPA pads a mask to for mem-efficient attention (preprocess_mask)


def _aligned_bias(t: Any) -> Any:
    """An attention bias whose strides but the last are multiples of ``_BIAS_ALIGN`` and whose
    last is 1: a size-1 dim's stride set to 0 (never stepped over, no copy), else a copy padded as
    torch pads the mask (the last dim's row rounded up) and sliced back, broadcast dims kept."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return t
    shape = tuple(t.shape)
    strides = [0 if n == 1 else st for n, st in zip(shape[:-1], t.stride()[:-1])]
    strides.append(1 if shape[-1] == 1 else t.stride(-1))
    if strides[-1] == 1 and all(st % _BIAS_ALIGN == 0 for st in strides[:-1]):
        return t if list(t.stride()) == strides else t.as_strided(shape, strides, t.storage_offset())
    base = t[tuple(slice(0, 1) if st == 0 else slice(None) for st in strides[:-1])]
    n = shape[-1]
    rows = torch.empty((*base.shape[:-1], n + -n % _BIAS_ALIGN), dtype=t.dtype, device=t.device)
    rows[..., :n].copy_(base)
    return rows[..., :n].expand(shape)


# op -> (argument position, argument name, what puts it in the kernel's layout)
_READ_AS_WRITTEN: dict[Any, tuple[tuple[int, str, Callable[[Any], Any]], ...]] = {
    aten._scaled_dot_product_efficient_attention.default: ((3, "attn_bias", _aligned_bias),),
    aten._scaled_dot_product_efficient_attention_backward.default: ((4, "attn_bias", _aligned_bias),
                                                                    (5, "out", _seq_major)),
    aten._efficient_attention_forward.default: ((3, "bias", _aligned_bias),),
    aten._efficient_attention_backward.default: ((4, "bias", _aligned_bias),
                                                 (5, "out", _dense)),  # already (b, s, h, d)
    aten._scaled_dot_product_flash_attention_backward.default: ((5, "logsumexp", _dense),),
    aten._flash_attention_backward.default: ((5, "logsumexp", _dense),),
}


def laid_out(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``func``'s arguments with each one its kernel reads by its own strides in that layout
    (the same objects where nothing needed it)."""
    for pos, name, fix in _READ_AS_WRITTEN.get(func, ()):
        if pos < len(args):
            a = fix(args[pos])
            if a is not args[pos]:
                args = (*args[:pos], a, *args[pos + 1:])
        elif name in kwargs:
            a = fix(kwargs[name])
            if a is not kwargs[name]:
                kwargs = {**kwargs, name: a}
    return args, kwargs


def with_kernel_layouts(func: Any, fn: Callable) -> Callable:
    """``fn`` (a device's call of ``func``), its arguments first put in the layouts ``func``'s
    kernel reads; ``fn`` itself for every other op."""
    if func not in _READ_AS_WRITTEN:
        return fn

    def call(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = laid_out(func, args, kwargs)
        return fn(*args, **kwargs)

    return call
