"""Low-precision matrix products CUDA reaches: ``_scaled_mm`` (float8 GEMM with scales),
``_int_mm`` (int8 x int8 -> int32), ``_weight_int8pack_mm`` and ``_weight_int4pack_mm``
(weight-only quantized linears).

Rows and columns shard like ``mm``'s. A scale follows the dim it scales: a tensor-wise
scale (one element) is replicated, ``_scaled_mm``'s row-wise ``scale_a`` (m, 1) follows
the rows and ``scale_b`` (1, n) the columns, ``_weight_int8pack_mm``'s per-channel scales
(n,) the columns. The contraction may stay split (a pending sum) only where the scales
apply after it uniformly (tensor-wise, or per output channel) and nothing is added; scales
of any other shape (block-wise) keep every dim whole. CUDA's ``_int_mm`` needs more than 16
rows and multiples of 8 for the other dims on each device, ``_scaled_mm`` multiples of 16 for
the contraction and the columns: layouts that would break that are not offered (the call
gathers instead).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from ..values.layout import local_shapes
from .base import Candidate, OpCall, _schema_info, bind
from .dims import Dims, compile_dims

aten = torch.ops.aten


def _names(call: OpCall) -> list[str]:
    """The schema name of each array argument of ``call``."""
    names = _schema_info(call.func)[0]
    return [names[p] if isinstance(p, int) else p for p, _ in call.arrays]


def _one(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.numel() == 1


@attrs.frozen
class ScaledMm:
    """``_scaled_mm(self, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
    use_fast_accum=False)``. Each device's call gets ``self`` row-major and ``mat2``
    column-major, as cuBLASLt requires (a shard of a column-major ``mat2`` is copied into that
    layout only where it is not already)."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        b = bind(call.func, call.args, call.kwargs)
        a, m = b["self"], b["mat2"]
        if a.dim() != 2 or m.dim() != 2:
            return []
        sa, sb = b["scale_a"], b["scale_b"]
        rows = sa.dim() == 2 and tuple(sa.shape) == (a.shape[0], 1) and a.shape[0] > 1
        cols = sb.dim() == 2 and tuple(sb.shape) == (1, m.shape[1]) and m.shape[1] > 1
        known = (_one(sa) or rows) and (_one(sb) or cols)
        out_dtype = call.out_metas[0].dtype
        split_k = (known and _one(sa) and _one(sb) and b.get("bias") is None and b.get("scale_result") is None
                   and out_dtype in (torch.float32, torch.bfloat16))
        letters = {"self": ("m", "k"), "mat2": ("k", "n"), "bias": ("n",),
                   "scale_a": ("m", None) if rows else None, "scale_b": (None, "n") if cols else None}
        ins = []
        for name, (_, v) in zip(_names(call), call.arrays):
            got = letters.get(name) if known else None
            ins.append(got if got is not None else (None,) * v.dim())
        spec = Dims(tuple(ins), (("m", "n") if known else (None, None),), (("k", "sum"),) if split_k else ())
        return [attrs.evolve(c, local_fn=_scaled_mm_local) for c in compile_dims(call, spec) if _scaled_mm_sizes_ok(call, c)]


def _scaled_mm_sizes_ok(call: OpCall, c: Candidate) -> bool:
    """Whether every device's shards keep the sizes CUDA's ``_scaled_mm`` needs where the global
    call has them: ``self``'s columns and both dims of ``mat2`` multiples of 16."""
    names = _names(call)
    ia, ib = names.index("self"), names.index("mat2")
    a, b = tuple(call.arrays[ia][1].shape), tuple(call.arrays[ib][1].shape)
    if a[1] % 16 or b[1] % 16:
        return True  # the global call itself is not one CUDA takes: nothing to keep
    return (all(s[1] % 16 == 0 for s in local_shapes(c.in_layouts[ia], a))
            and all(s[0] % 16 == 0 and s[1] % 16 == 0 for s in local_shapes(c.in_layouts[ib], b)))


def _scaled_mm_local(self: torch.Tensor, mat2: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``_scaled_mm`` on one device's shards, ``self`` row-major and ``mat2`` column-major."""
    if self.stride(-1) != 1:
        self = self.contiguous()
    if mat2.stride(0) != 1:
        mat2 = mat2.t().contiguous().t()
    return aten._scaled_mm.default(self, mat2, *args, **kwargs)


@attrs.frozen
class IntMm:
    """``_int_mm``: ``mm``'s rule (an int32 pending sum where the contraction is split), less
    the layouts whose shards CUDA's kernel rejects."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        if len(call.arrays) != 2 or any(v.dim() != 2 for _, v in call.arrays):
            return []
        cands = compile_dims(call, Dims((("m", "k"), ("k", "n")), (("m", "n"),), (("k", "sum"),)))
        return [c for c in cands if _int_mm_sizes_ok(call, c)]


def _int_mm_sizes_ok(call: OpCall, c: Candidate) -> bool:
    """Whether every device's shards keep the sizes CUDA's ``_int_mm`` needs where the global
    call has them: more than 16 rows, columns and contraction multiples of 8."""
    (m, k), (_, n) = (tuple(v.shape) for _, v in call.arrays)
    if not (m > 16 and k % 8 == 0 and n % 8 == 0):
        return True  # the global call itself is not one CUDA takes: nothing to keep
    a_shapes = local_shapes(c.in_layouts[0], (m, k))
    b_shapes = local_shapes(c.in_layouts[1], (k, n))
    return (all(s[0] > 16 and s[1] % 8 == 0 for s in a_shapes if s[0] * s[1])
            and all(s[1] % 8 == 0 for s in b_shapes if s[0] * s[1]))


@attrs.frozen
class WeightInt8Mm:
    """``_weight_int8pack_mm(self (m, k), mat2 (n, k) int8, scales (n,))``: ``self @ mat2.T``
    scaled per output channel, after the contraction (so it may stay split)."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        letters = {"self": ("m", "k"), "mat2": ("n", "k"), "scales": ("n",)}
        ins = []
        for name, (_, v) in zip(_names(call), call.arrays):
            if name not in letters or v.dim() != len(letters[name]):
                return []
            ins.append(letters[name])
        # (dense: the kernels take a contiguous weight, and a shard of its contraction is strided)
        return [attrs.evolve(c, dense=True) for c in compile_dims(call, Dims(tuple(ins), (("m", "n"),), (("k", "sum"),)))]


@attrs.frozen
class WeightInt4Mm:
    """``_weight_int4pack_mm(self (m, k), mat2 packed, qGroupSize, qScaleAndZeros)``: the rows
    of ``self`` split; the packed weight and its scales are whole (their tiling does not split
    along the columns in general)."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        ins = [("m", None) if name == "self" and v.dim() == 2 else (None,) * v.dim()
               for name, (_, v) in zip(_names(call), call.arrays)]
        cands = compile_dims(call, Dims(tuple(ins), (("m", None),)))
        return [attrs.evolve(c, local_fn=_int4_local) for c in cands] if call.mesh.device_type == "meta" else cands

    @staticmethod
    def out_meta(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        """(m, 8 * mat2.size(0)) of ``self``'s dtype, as CUDA's kernel gives: torch's meta kernel
        reads ``fake_device``, which only a FakeTensor has (an AttributeError on meta tensors)."""
        b = bind(func, args, kwargs)
        x, w = b["self"], b["mat2"]
        torch._check(x.dim() == 2, lambda: "x must be a 2D tensor")
        torch._check(w.dim() == 4, lambda: "w must be a 4D tensor")
        torch._check(x.dtype in (torch.float32, torch.float16, torch.bfloat16),
                     lambda: f"expected x to be f32/f16/bf16, got {x.dtype}")
        torch._check(w.dtype is torch.int32, lambda: f"expected w to be int32, got {w.dtype}")
        return torch.empty((x.shape[0], w.shape[0] * 8), dtype=x.dtype, device="meta")


def _int4_local(*args: Any, **kwargs: Any) -> torch.Tensor:
    """The op on one meta device's shards: :meth:`WeightInt4Mm.out_meta` (its meta kernel fails there)."""
    return WeightInt4Mm.out_meta(aten._weight_int4pack_mm.default, args, kwargs)


TABLE = {
    aten._scaled_mm: ScaledMm(),
    aten._int_mm: IntMm(),
    aten._weight_int8pack_mm: WeightInt8Mm(),
    aten._weight_int4pack_mm: WeightInt4Mm(),
}
