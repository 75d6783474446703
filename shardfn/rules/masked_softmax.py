"""The masked softmax of the transformer fast paths (``nn.TransformerEncoderLayer`` /
``nn.MultiheadAttention`` in inference, ``torch._masked_softmax``): ``_masked_softmax(x, mask,
dim, mask_type)`` and ``_masked_softmax_backward(grad, output, mask, dim)``.

Every dim but the softmax dim is independent: it splits with no communication, the mask
following it. How the mask lines up with ``x`` is the ``mask_type``'s: ``2`` (or none) a mask
of ``x``'s shape, every dim but the softmax dim split; ``0`` an (L, L) attention mask over a
4-d ``x``'s last two dims and ``1`` a (B, L) padding mask over its first and last, the batch
and heads split (the kernels check the mask's sizes against ``x``'s last two dims, which stay
whole). Other masks have no rule (replicated).

torch has no meta kernel for either op: the rule gives the outputs' metadata (``out_meta``),
and on a meta mesh the local call gives its shard's (``_OnMeta``).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from .base import Candidate, OpCall, letters
from .dims import Dims, compile_dims

aten = torch.ops.aten


def _mask_letters(x: torch.Tensor, mask: torch.Tensor, ls: tuple, mask_type: int | None) -> tuple | None:
    """The mask's letters (None: a mask this rule does not know how the kernel lines up)."""
    if tuple(mask.shape) == tuple(x.shape) and mask_type in (None, 2):
        return ls
    if x.dim() == 4 and mask.dim() == 2:
        # the kernels check the mask's sizes against x's last two dims: those stay whole
        if mask_type == 0 and tuple(mask.shape) == tuple(x.shape[2:]):
            return (None, None)
        if mask_type == 1 and (mask.shape[0], mask.shape[1]) == (x.shape[0], x.shape[3]):
            return (ls[0], None)
    return None


@attrs.frozen
class MaskedSoftmax:
    """Both ops: ``x`` (or ``grad`` and ``output``) with a letter on every dim but ``dim``."""

    backward: bool = False

    def candidates(self, call: OpCall) -> list[Candidate]:
        n = 3 if self.backward else 2
        if [p for p, _ in call.arrays] != list(range(n)):
            return []
        x, mask = call.arrays[0][1], call.arrays[n - 1][1]
        if x.dim() == 0:
            return []
        dim = call.arg(n, "dim", None)
        dim = x.dim() - 1 if dim is None else dim % x.dim()
        ls = tuple(None if i == dim else L for i, L in enumerate(letters(x.dim())))
        mask_type = None if self.backward else call.arg(3, "mask_type", None)
        mls = _mask_letters(x, mask, ls, mask_type)
        if mls is None:
            return []
        if mask_type in (0, 1) and x.dim() == 4:
            ls = ls[:2] + (None, None)
        ins = (ls, ls, mls) if self.backward else (ls, mls)
        # the kernels index their operands as contiguous
        fn = _OnMeta(call.func)
        return [attrs.evolve(c, dense=True, local_fn=fn) for c in compile_dims(call, Dims(ins, (ls,)))]

    @staticmethod
    def out_meta(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        """The output's metadata (torch has no meta kernel for these ops): a contiguous tensor
        like the first operand (``x``, ``grad_output``), as the CPU and CUDA kernels make it."""
        x = args[0] if args else kwargs.get("self", kwargs.get("grad_output"))
        return torch.empty(x.shape, dtype=x.dtype, device="meta")


@attrs.frozen
class _OnMeta:
    """The op on one device's shards; on a meta mesh (no meta kernel) its metadata only."""

    op: Any

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        x = args[0] if args else next(iter(kwargs.values()))
        if x.device.type == "meta":
            return torch.empty(x.shape, dtype=x.dtype, device="meta")
        return self.op(*args, **kwargs)


TABLE = {
    aten._masked_softmax: MaskedSoftmax(),
    aten._masked_softmax_backward: MaskedSoftmax(backward=True),
}
