"""Rules for shardfn's own ops (``shardfn/backends/custom_ops.py``): torch composites that
``_BatchedArray.__torch_function__`` runs as one op so that their sharding survives.

- ``shardfn::contract(equation, a, b)``: the equation is the rule, so every batch letter
  keeps its sharding (torch's ``matmul``/``einsum`` would fold the batch dims into one).
- ``shardfn::rms_norm`` / ``rms_norm_backward``: the normalized dims whole, every other
  dim keeps its sharding; the backward is linear in the gradient, so a pending sum passes
  through once, and the weight gradient is a pending sum over the sharded batch dims.

Every kernel broadcasts leading dims (``backends/_batching.py`` runs them once on the
local backend's stacked values).
"""

from __future__ import annotations

import attrs
import torch

from ..backends import custom_ops as _contract  # noqa: F401  (registers torch.ops.shardfn.*)
from .base import Candidate, OpCall, letters
from .dims import LINEAR_OPS, Dims, compile_dims, einsum_dims, parse_einsum

@attrs.frozen
class Contract:
    """``contract(equation, a, b)``: einsum letters."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        eq = call.arg(0, "equation")
        if [p for p, _ in call.arrays] != [1, 2]:
            return []
        ins, _ = parse_einsum(eq)
        if [len(s) for s in ins] != [len(s) for s in call.shapes]:
            return []
        return compile_dims(call, einsum_dims(eq))


@attrs.frozen
class RmsNorm:
    """Forward (x, weight) or backward (grad, x, weight): batch letters then whole dims."""

    backward: bool

    def candidates(self, call: OpCall) -> list[Candidate]:
        paths = [p for p, _ in call.arrays]
        if paths != ([0, 1, 3] if self.backward else [0, 2]):
            return []
        k = len(call.arg(2 if self.backward else 1))
        x = call.shapes[1 if self.backward else 0]
        n = len(x) - k
        lx = letters(n) + (None,) * k
        lw = (None,) * k
        if self.backward:
            # linear in the gradient, times the weight: a pending gradient passes only where the weight
            # is known finite (``dims._finite_factors``: ``sum(parts) * inf`` is not ``sum(parts * inf)``)
            spec = Dims((lx, lx, lw), (lx, lw), tuple((L, "sum") for L in letters(n)), LINEAR_OPS,
                        partial_ins=(0,), factors=(2,))
        else:
            spec = Dims((lx, lw), (lx,))
        return compile_dims(call, spec)


TABLE = {
    torch.ops.shardfn.contract.default: Contract(),
    torch.ops.shardfn.rms_norm.default: RmsNorm(False),
    torch.ops.shardfn.rms_norm_backward.default: RmsNorm(True),
}
