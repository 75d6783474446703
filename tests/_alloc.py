"""Test helper: record the size of every tensor that plain torch ops create."""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import shardfn as sf
from shardfn.values.layout import max_local_numel

aten = torch.ops.aten
SCALARS = 8  # constant-size temporaries (bounds, scalars) are not shard data


class Allocations(TorchDispatchMode):
    """Records ``(op, numel)`` for every non-view plain tensor an op returns (meta tensors
    hold no memory and are skipped).

    On the local backend one process holds every simulated device, and an even layout
    keeps all shards in one stacked buffer (``aten.stack``); those buffers are recorded
    under ``.storage``, everything else under ``.temps``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.temps: list[tuple[str, int]] = []
        self.storage: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            where = self.storage if func is aten.stack.default else self.temps
            for t in tree_leaves(out):
                if type(t) is torch.Tensor and not t.is_meta:
                    where.append((str(func), t.numel()))
        return out

    def largest_temp(self) -> int:
        return max((n for _, n in self.temps), default=0)


def assert_shard_sized(rec: Allocations, x: sf.ShardedArray) -> None:
    """No temporary exceeded one shard of ``x`` (or a few scalars); stacked storage holds
    at most every shard."""
    shape = tuple(x.shape)
    local = max_local_numel(x._layout, shape)
    assert rec.largest_temp() <= max(local, SCALARS), (
        f"a temporary of {rec.largest_temp()} elements exceeds the {local}-element shard of "
        f"{x!r} (full size {math.prod(shape)}): {sorted(rec.temps, key=lambda t: -t[1])[:3]}"
    )
    for op, n in rec.storage:
        assert n <= local * x.mesh.size, (op, n)
