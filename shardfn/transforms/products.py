"""``sf.matmul`` / ``sf.einsum`` with ``out_sharding=``: a product whose layout the code
states, so it is allowed under ``sf.explicit``.

The product is computed where propagation leaves it (a contraction over a sharded dim
stays a pending sum: no data moves), then resharded once to ``out_sharding`` by the
cheapest plan, so a pending sum asked to come out sharded is one reduce_scatter and
never an all_reduce followed by a slice.
"""

from __future__ import annotations

import torch

from ..arrays.explicit import explicit
from ..arrays.array import ShardedArray
from ..arrays.functorch import base_array
from ..arrays.redistribute import distribute, reshard
from ..values.errors import ShardingError, like_torch
from ..values.mesh import current_mesh
from ..values.spec import Sharding, to_layout

__all__ = ["einsum", "matmul"]


def matmul(a: torch.Tensor, b: torch.Tensor, *, out_sharding: Sharding | None = None) -> torch.Tensor:
    """``a @ b`` laid out as ``out_sharding`` (a P, placements or NamedSharding; ``None``:
    what propagation picks), by the cheapest plan that ends there.

    Example::

        y = sf.matmul(h, w2, out_sharding=P('dp', 'tp'))  # h: P('dp','tp'), w2: P('tp',None): one reduce_scatter
    """
    with explicit(mode="off"):
        out = torch.matmul(a, b)
    return _lay_out(out, out_sharding, (a, b), "sf.matmul")


def einsum(equation: str, *operands: torch.Tensor, out_sharding: Sharding | None = None) -> torch.Tensor:
    """``torch.einsum(equation, *operands)`` laid out as ``out_sharding`` (``None``: what
    propagation picks), by the cheapest plan that ends there.

    Example::

        y = sf.einsum('bd,df->bf', x, w, out_sharding=P('dp', None))
    """
    if not isinstance(equation, str):
        raise ShardingError(f"sf.einsum: the first argument must be the equation string, got {type(equation).__name__}")
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    with explicit(mode="off"):
        try:
            out = torch.einsum(equation, *operands)
        except RuntimeError as e:  # a bad equation, or operands that do not fit it
            shapes = ", ".join(str(list(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__ for t in operands)
            raise like_torch(e)(f"sf.einsum({equation!r}) on operands of shapes {shapes}: {e}") from None
    return _lay_out(out, out_sharding, operands, f"sf.einsum({equation!r})")


def _lay_out(out: torch.Tensor, out_sharding: Sharding | None, operands: tuple, what: str) -> torch.Tensor:
    if out_sharding is None:
        return out
    bases = (t if isinstance(t, ShardedArray) else base_array(t) if isinstance(t, torch.Tensor) else None for t in operands)
    mesh = next((b.mesh for b in bases if isinstance(b, ShardedArray)), None) or current_mesh()  # torch.func-wrapped too
    try:
        layout = to_layout(out_sharding, out.dim(), mesh, arg="out_sharding")
    except ShardingError as e:
        raise ShardingError(f"{what} out_sharding: {e}") from None
    if not isinstance(out, ShardedArray):
        return distribute(out, layout)
    return reshard(out, layout)
