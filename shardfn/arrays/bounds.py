"""Values known to lie in [-1, 1] (or be nan) by the op that made them, without reading them.

A pending sum times a factor that may hold inf is not the sum of the parts times it (``0 * inf``
is nan in a part; parts of both signs give nan where the total's sign gives a signed inf), so
``rules/pointwise.py`` reduces a pending operand first unless its factors are known finite. Knowing
that from the values would take a device-to-host sync on every product; the op that made a factor
often knows it (the backward of RoPE's ``cos``/``sin`` multiplies by ``-sin``/``cos``). The mark
is carried by the output's key fragment (``fragments.is_unit``): dispatch keys see it, and an
in-place write, which drops the fragment, drops the mark with it.
"""

from __future__ import annotations

from typing import Any

import torch

from .fragments import is_unit

aten = torch.ops.aten

# real ops whose every output element is in [-1, 1] or nan, whatever the input
_UNIT = {aten.sin.default, aten.cos.default, aten.tanh.default, aten.sigmoid.default, aten.erf.default}
# ops whose output is in [-1, 1] where their first input is
_KEEPS = {aten.neg.default}


def output_units(func: Any, call: Any, out_layouts: tuple, out_dtypes: list) -> list[bool]:
    """Per output of ``call`` (an ``OpCall`` run by a compiled entry): whether it is known to lie
    in [-1, 1]. Only a lone, real floating output that is not pending a reduction is marked."""
    marks = [False] * len(out_dtypes)
    if len(out_dtypes) != 1 or out_layouts[0] is None or out_layouts[0].partial:
        return marks
    dtype = out_dtypes[0]
    if dtype is None or not dtype.is_floating_point or not call.arrays:
        return marks
    _, x = call.arrays[0]
    if func in _UNIT:
        marks[0] = not x.dtype.is_complex
    elif func in _KEEPS:
        marks[0] = call.arrays[0][0] == 0 and is_unit(x)
    return marks
