"""What a refused in-place write says: ImmutableError's message names the out-of-place form to
call instead."""

from __future__ import annotations

from typing import Any

import torch

from ...values.errors import ImmutableError

# what to call instead of the in-place ops whose out-of-place names torch's do not give
_HINTS = {
    "copy": "sf.reshard(x, sharding) to change a layout, or build a new array",
    "index_put": "x.index_put(indices, values) or torch.where(mask, values, x)",
    "fill": "torch.full_like(x, value) or x.masked_fill(mask, value)",
    "zero": "torch.zeros_like(x)",
    "bernoulli": "torch.bernoulli(x, p)",
    "uniform": "torch.rand_like(x) * (high - low) + low",
    "normal": "torch.randn_like(x) * std + mean",
    "exponential": "torch.ops.aten.exponential(x, lambd)",
    "random": "torch.randint_like(x, low, high)",
    "set": "a new array (sf.distribute / ShardedArray.from_local)",
    "resize": "x.reshape(...) or torch.nn.functional.pad(...)",
}


# torch's error for a write into a tensor some of whose elements share memory (``expand``)
OVERLAP = ("unsupported operation: more than one element of the written-to tensor refers to a single memory "
           "location. Please clone() the tensor before performing the operation.")


# a fresh buffer made in a compiled region comes out of the graph as an output rebuilt around
# the graph's tensors: whether nothing in the graph read it, aliased it or returned it twice is
# not known there, so it is not fresh (writing it could leave a view or a result stale)
COMPILED = ("would modify a ShardedArray in place that a torch.compile'd region returned: a graph's outputs are "
            "never fresh (whether the graph read or aliased a buffer it made is not known outside it), so they "
            "are immutable like any other array; clone it before the write (w = w.clone(): a fresh buffer may be "
            "written in place)")


def immutable_error(func: Any, why: str | None = None) -> ImmutableError:
    """The error refusing ``func``'s write (``why``, or the array's immutability), with what to call instead."""
    name = func.overloadpacket.__name__
    base = name[:-1] if name.endswith("_") else name
    what = why or "would modify a ShardedArray in place, but ShardedArrays are immutable"
    return ImmutableError(f"aten.{name} {what}; {_advice(base)}. {_TRAINING}")


# in-place updates of parameters and gradients: what a training loop uses instead
_TRAINING = ("To train, step parameters with sf.optim (sf.optim.SGD / Adam / AdamW, or sf.optim.from_torch(cls) "
             "for another torch.optim optimizer) and clip with sf.optim.clip_grad_norm in place of "
             "torch.nn.utils.clip_grad_norm_")


def _advice(base: str) -> str:
    """What to call instead of the in-place op whose functional name is ``base``."""
    if base in _HINTS:
        return f"use the out-of-place form {_HINTS[base]} and rebind the result"
    if base.startswith("_fused_"):
        return "this is an optimizer kernel that updates its inputs in place"
    forms = [f"torch.{base}(...)"] if hasattr(torch, base) else []
    if hasattr(torch.Tensor, base):
        forms.append(f"x.{base}(...)")
    if not forms:
        return "use the op's out-of-place form and rebind the result"
    what = " (it returns new tensors)" if base.startswith("_foreach_") else ""
    return f"use the out-of-place form {' / '.join(forms)}{what} and rebind the result"
