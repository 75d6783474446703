"""``segment_reduce`` (``torch.segment_reduce``) and ``_segment_reduce_backward``: ``data``
reduced over the segments of its ``axis`` that ``lengths`` (or ``offsets``) mark out.

Every dim but ``axis`` is independent and splits with no communication; the dims before
``axis`` index rows of ``lengths`` / ``offsets`` too (one set of segments per row), which
split alike. The segmented ``axis`` stays whole: where a segment ends is in the lengths'
values, not in the layout.
"""

from __future__ import annotations

import attrs
import torch

from .base import Candidate, OpCall, _schema_info, letters
from .dims import Dims, compile_dims

aten = torch.ops.aten

_SEGMENTS = ("lengths", "offsets", "indices")


@attrs.frozen
class SegmentReduce:
    """Both ops: ``data`` (and the backward's ``grad`` / ``output``) lettered on every dim but
    ``axis``; ``lengths`` / ``offsets`` on the dims before it."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        names = _schema_info(call.func)[0]
        got = [(names[p] if isinstance(p, int) else p, v) for p, v in call.arrays]
        data = dict(got).get("data")
        if data is None or data.dim() == 0:
            return []
        axis = call.kwargs.get("axis", 0) % data.dim()
        ls = tuple(None if i == axis else L for i, L in enumerate(letters(data.dim())))
        ins = []
        for n, v in got:
            if n in _SEGMENTS:
                if v.dim() != axis + 1 or tuple(v.shape[:axis]) != tuple(data.shape[:axis]):
                    return []
                ins.append(ls[:axis] + (None,))
            else:  # data, grad, output: the output has the data's dims, ``axis`` the segments'
                ins.append(ls)
        # the kernels index their operands as contiguous
        return [attrs.evolve(c, dense=True) for c in compile_dims(call, Dims(tuple(ins), (ls,)))]


TABLE = {
    aten.segment_reduce: SegmentReduce(),
    aten._segment_reduce_backward: SegmentReduce(),
}
