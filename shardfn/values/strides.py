"""Strides of dense tensors by torch's rule, for sizes that may be symbolic."""

from __future__ import annotations

from typing import Sequence

import torch


def dense_strides(shape: Sequence[int], order: Sequence[int] | None = None) -> tuple[int, ...]:
    """The strides of a dense tensor of ``shape`` whose dims lie in ``order`` (outermost first;
    None: contiguous), by torch's rule (a size of 0 steps as 1); sizes may be symbolic."""
    strides, acc = [0] * len(shape), 1
    for d in reversed(range(len(shape)) if order is None else order):
        strides[d] = acc
        acc = acc * torch.sym_max(shape[d], 1)
    return tuple(strides)
