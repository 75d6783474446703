"""``F.embedding_bag`` / ``nn.EmbeddingBag``'s kernels: ``_embedding_bag``,
``_embedding_bag_forward_only`` and their backwards (``_embedding_bag_dense_backward``,
``_embedding_bag_per_sample_weights_backward``; ``_embedding_bag_backward`` is composite).

The weight's embedding dim (columns) splits with no communication: each device sums, averages
or maxes its own columns of every bag, and its gradient columns come from the output
gradient's. The vocabulary dim (rows) splits for ``sum`` and ``mean`` (``_VocabBag``): each
device adds up the rows it holds, so the output is a pending sum, as ``rules/nn.py`` does for
``embedding``. ``max`` over a row split is a max of per-device maxima *with an argmax*, and a
device holding none of a bag's rows has no candidate: those calls keep the weight's rows whole.

The bags themselves reach the kernel as one flat ``indices`` vector cut by ``offsets`` (a 2-d
input is flattened by ``F.embedding_bag``): which indices belong to a device's bags depends on
the offsets' values, so the indices and offsets stay whole (a gather of integers).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from .base import Candidate, OpCall, ShardFact, _schema_info, bind, out_of_range, replicated
from .dims import Dims, compile_dims

aten = torch.ops.aten

_MAX = 2  # the kernels' ``mode``: 0 sum, 1 mean, 2 max


def _names(call: OpCall) -> list[str]:
    names = _schema_info(call.func)[0]
    return [names[p] if isinstance(p, int) else p for p, _ in call.arrays]


@attrs.frozen
class EmbeddingBag:
    """The forward: ``weight`` (V, D) -> (output (bags, D), offset2bag, bag_size, max_indices).
    ``max_indices`` is (bags, D) in ``max`` mode (each column's argmax row) and follows the
    columns then; the other auxiliary outputs depend on the indices and offsets only and are
    replicated."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        names = _names(call)
        if "weight" not in names or call.arrays[names.index("weight")][1].ndim != 2:
            return []
        mode = call.arg(4, "mode", 0)
        ins = tuple(("V", "D") if n == "weight" else (None,) * v.ndim for n, (_, v) in zip(names, call.arrays))
        metas = call.out_metas
        # the auxiliary outputs lack the weight's dims: left out of the spec (which would
        # forbid splitting a dim an output lacks) and replicated below, as every device
        # computes them whole from the whole indices and offsets
        by_col = mode == _MAX and metas[3].dim() == 2
        outs = ((None, "D"), None, None, (None, "D") if by_col else None)
        spec = Dims(ins, outs, (("V", "sum"),))
        wi = names.index("weight")
        vocab = call.arrays[wi][1].shape[0]
        out = []
        for c in compile_dims(call, spec):
            lays = tuple(replicated(call.mesh, m.dim()) if o is None else o for o, m in zip(c.out_layouts, metas))
            c = attrs.evolve(c, out_layouts=lays)
            if not c.in_layouts[wi].dims[0]:
                # columns split (or none): a device may hold none of them where they do not divide
                out.append(attrs.evolve(c, local_fn=_ColumnBag(call.func)) if c.in_layouts[wi].dims[1]
                           and call.arrays[wi][1].shape[1] else c)
            elif mode != _MAX and metas[0].dtype != torch.float16:
                # (not float16: a device's part of a bag may overflow where the bag does not)
                # rows split: the output is a pending sum over the row axes
                out.append(attrs.evolve(c, local_fn=_VocabBag(call.func, vocab),
                                        facts=(ShardFact("lo", "offset", wi, 0), ShardFact("rows", "size", wi, 0))))
        filled = metas[1].shape[0]
        if not isinstance(filled, int):  # (symbolic sizes: the meta kernel's offset2bag, always filled)
            return out
        return [attrs.evolve(c, local_fn=_Offset2bagAs(call.func, c.local_fn or call.func, bool(filled))) for c in out]


@attrs.frozen
class _Offset2bagAs:
    """One device's call with ``offset2bag`` filled or empty as the logical call's is. The CPU
    kernel leaves it empty on its sum fast path, which it takes from the weight's layout (a
    float32 / float16 / bfloat16 weight with unit-strided columns, unit-strided per-sample
    weights, no padding_idx): a device's shard, or the zero column ``_ColumnBag`` and
    ``_VocabBag`` look up, may take it where the logical weight does not (a transposed weight,
    or the strided slice torch.func.vmap's fallback passes of a weight batched on its last dim:
    fuzzer seed 5829542315) or the other way round, and the devices' outputs then disagreed
    with their shapes (a reshape of the stacked outputs raised)."""

    op: Any
    fn: Any  # the device's call: the op, ``_ColumnBag`` or ``_VocabBag``
    filled: bool

    def __call__(self, *args: Any, **kwargs: Any) -> tuple:
        out, offset2bag, bag_size, max_indices = self.fn(*args, **kwargs)
        if bool(offset2bag.shape[0]) != self.filled:
            offset2bag = _offset2bag(bind(self.op, args, kwargs), offset2bag) if self.filled else offset2bag[:0]
        return out, offset2bag, bag_size, max_indices


def _offset2bag(b: dict, like: torch.Tensor) -> torch.Tensor:
    """Each index's bag, as the CPU kernel's slow path makes ``offset2bag`` (make_offset2bag: a
    count of the offsets at or before each position, less one; with include_last_offset the
    last offset starts no bag)."""
    indices, offsets = b["indices"], b["offsets"]
    if b.get("include_last_offset", False) and offsets.shape[0]:
        offsets = offsets[:-1]
    n = indices.shape[0]
    starts = like.new_zeros(n + 1).index_add_(0, offsets.to(like.dtype), torch.ones_like(offsets, dtype=like.dtype))
    starts[0] -= 1
    return starts.cumsum(0)[:n]


@attrs.frozen
class _ColumnBag:
    """One device's bags over its columns of the weight. The CPU kernel rejects a weight of no
    columns (``Expected i < index_size``), which a column split that does not divide gives a
    device (2 columns over 3); such a device's outputs have no columns, its auxiliary outputs
    come from the kernel on one column of zeros (the same bags and sizes, torch's IndexError for
    an index outside the vocabulary), as in ``_VocabBag`` (fuzzer seed 5826296477 --gen 5)."""

    op: Any

    def __call__(self, *args: Any, **kwargs: Any) -> tuple:
        b = bind(self.op, args, kwargs)
        weight = b["weight"]
        if weight.shape[1] != 0:
            return self.op(*args, **kwargs)
        one = torch.zeros(weight.shape[0], 1, dtype=weight.dtype, device=weight.device)
        out, offset2bag, bag_size, max_indices = self.op(one, *args[1:], **kwargs) if args else self.op(
            **{**kwargs, "weight": one})
        return out[:, :0], offset2bag, bag_size, max_indices[:, :0] if max_indices.dim() == 2 else max_indices


@attrs.frozen
class _VocabBag:
    """One device's ``sum`` / ``mean`` bags over its vocabulary rows ``[lo, lo + rows)``: the
    rows it holds, weighted, added into their bags; other indices and ``padding_idx`` add zero
    (``where``, not a product with a 0/1 mask: a row of inf times 0 is nan). The auxiliary
    outputs come from the kernel itself on a weight of one column of zeros (the same indices,
    offsets and padding, so the same bags and bag sizes, and torch's own IndexError for an
    index outside the vocabulary); ``mean`` divides by those bag sizes."""

    op: Any
    vocab: int

    def __call__(self, *args: Any, lo: Any, rows: Any, **kwargs: Any) -> tuple:
        b = bind(self.op, args, kwargs)
        weight, indices, offsets = b["weight"], b["indices"], b["offsets"]
        psw, pad, mode = b.get("per_sample_weights"), b.get("padding_idx", -1), b.get("mode", 0)
        if out_of_range(indices, self.vocab) is not None:
            raise IndexError("index out of range in self")
        # one column (the CPU kernel rejects none): V zeros, against the shard's V / n x D
        ones = torch.zeros(self.vocab, 1, dtype=weight.dtype, device=weight.device)
        _, offset2bag, bag_size, max_indices = self.op(ones, indices, offsets, False, mode, False,
                                                       psw, b.get("include_last_offset", False), pad)
        # (not bag_size's length: _embedding_bag_forward_only's CPU kernel keeps one per offset
        # with include_last_offset, one more than the bags)
        last = bool(b.get("include_last_offset", False))
        nbags = max(offsets.shape[0] - 1, 0) if last else offsets.shape[0]
        inside = (indices >= lo) & (indices < lo + rows)
        if pad is not None and pad >= 0:
            inside &= indices != pad
        local = torch.where(inside, indices - lo, torch.zeros_like(indices))
        if weight.shape[0] == 0:
            looked = torch.zeros(indices.shape[0], weight.shape[1], dtype=weight.dtype, device=weight.device)
        else:
            looked = torch.nn.functional.embedding(local, weight)
        if psw is not None:
            looked = looked * psw.unsqueeze(-1)
        looked = torch.where(inside.unsqueeze(-1), looked, torch.zeros((), dtype=weight.dtype, device=weight.device))
        # each index's bag from the offsets (the kernel's offset2bag may be left empty: CPU's
        # sum fast path); with include_last_offset the last offset ends the last bag and the
        # indices after it add to no bag, as in the kernel
        pos = torch.arange(indices.shape[0], device=indices.device)
        bag = torch.searchsorted(offsets[:nbags].contiguous(), pos, right=True) - 1
        keep = bag >= 0
        if last and offsets.shape[0]:
            keep &= pos < offsets[-1]
        out = torch.zeros(nbags, weight.shape[1], dtype=weight.dtype, device=weight.device)
        out = out.index_add(0, torch.where(keep, bag, torch.zeros_like(bag)),
                            torch.where(keep.unsqueeze(-1), looked, torch.zeros((), dtype=looked.dtype, device=looked.device)))
        if mode == 1:
            out = out / bag_size[:nbags].clamp(min=1).unsqueeze(-1).to(out.dtype)
        return out, offset2bag, bag_size, max_indices


@attrs.frozen
class EmbeddingBagDenseBackward:
    """``_embedding_bag_dense_backward`` (and ``_embedding_bag_backward``, which autograd
    calls and which runs it for a dense gradient): the weight's gradient (V, D) is the output
    gradient's rows added into the bags' rows, column by column: its columns follow the
    gradient's (``max`` mode's ``maximum_indices`` too), with no communication."""

    mode_at: int = 7  # ``_embedding_bag_backward`` takes ``sparse`` too: its mode is at 8

    def candidates(self, call: OpCall) -> list[Candidate]:
        if self.mode_at == 8 and call.arg(9, "sparse", False):
            return []  # a sparse gradient: no rule
        names = _names(call)
        mode = call.arg(self.mode_at, "mode", 0)
        ins = tuple((None, "D") if n == "grad" or (n == "maximum_indices" and mode == _MAX and v.ndim == 2)
                    else (None,) * v.ndim for n, (_, v) in zip(names, call.arrays))
        # the CPU kernel reads the gradient's rows as contiguous (a column shard is a strided view)
        return [attrs.evolve(c, dense=True) for c in compile_dims(call, Dims(ins, ((None, "D"),)))]


@attrs.frozen
class PerSampleWeightsBackward:
    """``_embedding_bag_per_sample_weights_backward``: each index's weight gradient is the dot
    product of its bag's output gradient with its weight row, over the columns: with the
    columns split it is a pending sum over their axes."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        names = _names(call)
        ins = tuple((None, "D") if n in ("grad", "weight") else (None,) * v.ndim
                    for n, (_, v) in zip(names, call.arrays))
        return compile_dims(call, Dims(ins, ((None,),), (("D", "sum"),)))


_FORWARD = EmbeddingBag()
TABLE = {
    aten._embedding_bag: _FORWARD,
    aten._embedding_bag_forward_only: _FORWARD,
    aten._embedding_bag_dense_backward: EmbeddingBagDenseBackward(),
    aten._embedding_bag_backward: EmbeddingBagDenseBackward(mode_at=8),
    aten._embedding_bag_per_sample_weights_backward: PerSampleWeightsBackward(),
}
