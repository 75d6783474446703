"""Arrays known to hold no ±inf (nan may be) from the op that made them, without reading them.

A pending sum times a factor that may hold inf is not the sum of the parts times it (``0 * inf``
is nan in a part; parts of both signs give nan where the total's sign gives a signed inf), so
products (``rules/pointwise.py``'s ``mul``, the contractions of ``rules/dims.py``) reduce a pending
operand first unless its factors are known finite. Knowing that from the values would take a
device-to-host sync on every product; the op that made a factor often knows it (the backward of
RoPE's ``cos``/``sin`` multiplies by ``-sin``/``cos``; positions cast from integers; attention
probabilities from ``softmax``). The mark is carried by the output's key fragment (``fragments.known_finite``):
dispatch keys see it, and an in-place write, which drops the fragment, drops the mark with it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .fragments import known_finite

aten = torch.ops.aten

# ops whose every output element is bounded (in [-pi/2, pi/2]) or nan, whatever the (real) input:
# softmax's weights (attention probabilities times the values) are in [0, 1]
_BOUNDED = {aten.sin.default, aten.cos.default, aten.tanh.default, aten.sigmoid.default, aten.erf.default,
            aten.atan.default, aten.sign.default, aten._softmax.default, aten._safe_softmax.default}
# ops bounded by their (number) arguments where those are finite: position -> default
_CLAMPS = {aten.clamp.default: ((1, "min", None), (2, "max", None)),
           aten.hardtanh.default: ((1, "min_val", -1.0), (2, "max_val", 1.0))}
# ops whose output elements are their first input's (signs aside): finite where it is
_KEEPS = {
    aten.neg.default, aten.clone.default, aten.alias.default, aten.detach.default,
    aten.view.default, aten._unsafe_view.default, aten.expand.default, aten.t.default, aten.transpose.int,
    aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.slice.Tensor,
    aten.select.int, aten._to_copy.default,
}


def output_marks(func: Any, call: Any, out_layouts: tuple, out_dtypes: list) -> list[bool]:
    """Per output of ``call`` (an ``OpCall`` compiled into a dispatch entry): whether it is
    known to hold no ±inf. Only a lone floating output not pending a reduction is marked."""
    marks = [False] * len(out_dtypes)
    if len(out_dtypes) != 1 or out_layouts[0] is None or out_layouts[0].partial or not call.arrays:
        return marks
    dtype = out_dtypes[0]
    path, x = call.arrays[0]
    if dtype is None or not (dtype.is_floating_point or dtype.is_complex) or path != 0:
        return marks
    if func in _BOUNDED:
        marks[0] = not (x.dtype.is_complex or dtype.is_complex)  # cos(1000j) overflows
    elif func in _CLAMPS:
        bounds = [call.arg(i, name, default) for i, name, default in _CLAMPS[func]]
        marks[0] = not dtype.is_complex and all(isinstance(b, (int, float)) and math.isfinite(b) for b in bounds)
    elif func is aten._to_copy.default and not (x.dtype.is_floating_point or x.dtype.is_complex):
        marks[0] = _int_fits(x.dtype, dtype)
    elif func in _KEEPS:
        # a cast to a narrower float may overflow: only within one dtype, or widening
        marks[0] = known_finite(x) and (x.dtype == dtype or _widens(x.dtype, dtype))
    return marks


def _int_fits(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every value of integer (or bool) dtype ``src`` is finite in floating ``dst``."""
    if src == torch.bool:
        return True
    real = dst.to_real() if dst.is_complex else dst
    return torch.iinfo(src).max <= torch.finfo(real).max


def _widens(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every finite value of floating ``src`` is finite in ``dst``."""
    if not (src.is_floating_point or src.is_complex) or not (dst.is_floating_point or dst.is_complex):
        return False
    s = src.to_real() if src.is_complex else src
    d = dst.to_real() if dst.is_complex else dst
    return torch.finfo(s).max <= torch.finfo(d).max
