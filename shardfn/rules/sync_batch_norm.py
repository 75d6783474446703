"""Batch norm in training over a split batch (or spatial dims): synchronised statistics, no gather.

A batch norm's statistics are per channel (dim 1) over every other dim, so an input split
over the batch needs the sums of all devices; run as one kernel (``rules/batch_norm.py``'s
rule) the batch is gathered whole: data-parallel CNN training would move every activation.
``SPECIAL`` handlers compose it from ops on ShardedArrays instead, each dispatched by its own rule:
the mean and the variance are pending sums over the split dims (two all_reduces of C
values), the normalisation is pointwise; the backward needs the sums of ``dy`` and
``dy * xhat`` (one all_reduce each), and the weight and bias gradients are those sums
themselves (pending, as any data-parallel gradient). This is SyncBatchNorm's arithmetic
(torch.nn.SyncBatchNorm), which single-device batch norm equals. Reduced-precision inputs
are computed in float32 as torch's kernels do. Evaluation, a channel split and replicated
inputs keep the kernel (``NotImplemented``: the table's rule, no communication).
"""

from __future__ import annotations

from typing import Any

import torch

from .base import bind

aten = torch.ops.aten


def _laid_out(x: Any) -> bool:
    """Whether ``x`` is a non-empty (N, C, ...) array split (or pending) over a dim the
    statistics sum over: the batch or a spatial dim (empty inputs go to torch's kernel)."""
    from ..arrays.array import ShardedArray

    if not isinstance(x, ShardedArray) or x.dim() < 2 or x.numel() == 0:
        return False
    lay = x._layout
    return bool(lay.partial) or any(axes for d, axes in enumerate(lay.dims) if d != 1)


def _cast(v: Any, dtype: torch.dtype) -> Any:
    return v if v.dtype == dtype else aten._to_copy.default(v, dtype=dtype)


def _per_channel(v: Any, ndim: int) -> Any:
    """A (C,) vector shaped to broadcast against an (N, C, ...) input."""
    return v.view((1, -1) + (1,) * (ndim - 2))


def _summed(v: Any) -> Any:
    """Per-channel sums with their pending partial sums reduced now, keeping the channel split
    (C values all-reduced): combined with the split input while pending, the planner would
    carry the pending sum into a full-size pending activation and all-reduce that instead."""
    from ..arrays.array import ShardedArray, wrap
    from ..arrays.redistribute import raw_reshard

    if not isinstance(v, ShardedArray):  # a plain tensor's sums (a plain gradient of a split input)
        return v
    lay = v._layout
    if not lay.partial:
        return v
    done = lay.without_partial()
    return wrap(raw_reshard(v, done), done, v.shape, v.dtype)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _out_dtypes(func: Any, args: tuple, kwargs: dict, device: torch.device) -> list[torch.dtype]:
    """The dtypes torch's kernel on ``device`` gives the outputs: a float16 input with float16
    parameters saves its statistics in float16 on the CPU, in float32 on CUDA (the op's meta
    kernel, which follows CUDA)."""
    from ..arrays.cpu_layouts import kernel_dtypes

    if device.type == "cpu" and func is not aten.cudnn_batch_norm.default:
        dtypes = kernel_dtypes(func, args, kwargs)
        if dtypes is not None:
            return dtypes

    def meta(v: Any) -> Any:
        return torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v

    with torch.no_grad():
        out = func(*(meta(a) for a in args), **{k: meta(v) for k, v in kwargs.items()})
    return [o.dtype for o in out]


def _statistics(x: Any) -> tuple[Any, Any, int]:
    """Per-channel mean and biased variance of ``x`` (two passes) and the count per channel."""
    dims = [0, *range(2, x.dim())]
    n = x.numel() // x.shape[1]
    mean = _summed(x.sum(dims)) / n
    centred = x - _per_channel(mean, x.dim())
    var = _summed((centred * centred).sum(dims)) / n
    return mean, var, n


def _normalise(x: Any, mean: Any, invstd: Any, weight: Any, bias: Any) -> Any:
    nd = x.dim()
    scale = invstd if weight is None else invstd * _cast(weight, invstd.dtype)
    out = (x - _per_channel(mean, nd)) * _per_channel(scale, nd)
    return out if bias is None else out + _per_channel(_cast(bias, out.dtype), nd)


def _native_batch_norm(func: Any, args: tuple, kwargs: dict) -> Any:
    """``native_batch_norm``, ``cudnn_batch_norm``, ``_native_batch_norm_legit.no_stats`` (no
    running statistics) and
    ``_native_batch_norm_legit_functional`` (which also returns the updated running statistics:
    momentum blend, unbiased variance), in training."""
    b = bind(func, args, kwargs)
    x = b["input"]
    rm, rv = b.get("running_mean"), b.get("running_var")  # (none in _native_batch_norm_legit.no_stats)
    if func is aten.cudnn_batch_norm.default and (rm is not None or rv is not None):
        return NotImplemented
    functional = func is aten._native_batch_norm_legit_functional.default
    if functional and not b["training"] and isinstance(rm, torch.Tensor) and isinstance(rv, torch.Tensor):
        # evaluation: the running statistics come back unchanged (as copies); the rest is
        # the evaluation kernel's, whose rule splits every dim (the table's rule would read
        # the returned statistics as sums over a split batch)
        out = aten._native_batch_norm_legit_no_training.default(
            x, b["weight"], b["bias"], rm, rv, b["momentum"], b["eps"])
        return (*out, aten.clone.default(rm), aten.clone.default(rv))
    if not b["training"] or not _laid_out(x) or (not functional and (rm is not None or rv is not None)):
        return NotImplemented  # (a kernel writing its running stats: the in-place policy's)
    dtypes = _out_dtypes(func, args, kwargs, x.device)
    eps = b["epsilon"] if "epsilon" in b else b["eps"]
    with torch.no_grad():
        xf = _cast(x, _compute_dtype(x.dtype))
        mean, var, n = _statistics(xf)
        invstd = (var + eps).rsqrt()
        out = _cast(_normalise(xf, mean, invstd, b["weight"], b["bias"]), dtypes[0])
        save_mean, save_invstd = _cast(mean, dtypes[1]), _cast(invstd, dtypes[2])
        if func is aten.cudnn_batch_norm.default:  # its reserve: scratch only its own backward reads
            return out, save_mean, save_invstd, x.new_empty((0,), dtype=dtypes[3])
        if not functional:
            return out, save_mean, save_invstd
        m = b["momentum"]
        unbiased = var * (n / max(n - 1, 1))
        rm = _cast(rm * (1 - m) + _cast(mean, rm.dtype) * m, dtypes[3])
        rv = _cast(rv * (1 - m) + _cast(unbiased, rv.dtype) * m, dtypes[4])
        return out, save_mean, save_invstd, rm, rv


def _native_batch_norm_backward(func: Any, args: tuple, kwargs: dict) -> Any:
    """``dx = w * invstd * (dy - mean(dy) - xhat * mean(dy * xhat))``, ``dw = sum(dy * xhat)``,
    ``db = sum(dy)`` (cuDNN's ``save_var`` is its saved inverse deviation, as torch's)."""
    b = bind(func, args, kwargs)
    cudnn = func is aten.cudnn_batch_norm_backward.default
    dy, x, w = b["grad_output" if cudnn else "grad_out"], b["input"], b["weight"]
    train, mask = (True, (True, True, True)) if cudnn else (b["train"], b["output_mask"])
    saved = (b["save_mean"], b["save_var" if cudnn else "save_invstd"])
    if not train or not (_laid_out(x) or _laid_out(dy)) or saved[0] is None or saved[1] is None:
        return NotImplemented  # (evaluation: the table's rule; missing statistics: torch's own error)
    with torch.no_grad():
        ct = _compute_dtype(x.dtype)
        xf, dyf = _cast(x, ct), _cast(dy, ct)
        nd, dims = x.dim(), [0, *range(2, x.dim())]
        mean, invstd = _cast(saved[0], ct), _cast(saved[1], ct)
        xhat = (xf - _per_channel(mean, nd)) * _per_channel(invstd, nd)
        sum_dy = _summed(dyf.sum(dims))
        sum_dy_xhat = _summed((dyf * xhat).sum(dims))
        grad_input = grad_weight = grad_bias = None
        if mask[0]:
            scale = invstd if w is None else invstd * _cast(w, ct)
            n = x.numel() // x.shape[1]
            inner = dyf - _per_channel(sum_dy / n, nd) - xhat * _per_channel(sum_dy_xhat / n, nd)
            grad_input = _cast(inner * _per_channel(scale, nd), x.dtype)
        wdtype = x.dtype if w is None else w.dtype
        if mask[1]:
            grad_weight = _cast(sum_dy_xhat, wdtype)
        if mask[2]:
            grad_bias = _cast(sum_dy, wdtype)
        return grad_input, grad_weight, grad_bias


SPECIAL = {
    aten.native_batch_norm.default: _native_batch_norm,
    aten.cudnn_batch_norm.default: _native_batch_norm,
    aten._native_batch_norm_legit_functional.default: _native_batch_norm,
    aten._native_batch_norm_legit.no_stats: _native_batch_norm,
    aten.native_batch_norm_backward.default: _native_batch_norm_backward,
    aten.cudnn_batch_norm_backward.default: _native_batch_norm_backward,
}
