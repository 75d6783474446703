"""Indexing ops (DTensor's ``_tensor_ops`` indexing half): the indexed dim must be whole,
every other dim keeps its sharding where the operands agree on its size. An index
tensor's own sharding carries over to the output dims it shapes (``index_select``
with a sharded index gives a sharded output dim, no gather of the source).
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from .base import Candidate, OpCall, bind, letters
from .dims import LINEAR_OPS, Dims, compile_dims

aten = torch.ops.aten


def _paths(call: OpCall) -> list:
    return [p for p, _ in call.arrays]


@attrs.frozen
class IndexSelect:
    """index_select(self, dim, index): output dim ``dim`` follows the 1-D index."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        if len(call.arrays) != 2:
            return []
        b = bind(call.func, call.args, call.kwargs)
        n = len(call.shapes[0])
        d = b["dim"] % max(n, 1)
        ls = letters(n)
        if n == 0:
            return compile_dims(call, Dims(((), (None,) * len(call.shapes[1])), ((),)))
        src = tuple(None if i == d else L for i, L in enumerate(ls))
        out = tuple("I" if i == d else L for i, L in enumerate(ls))
        return compile_dims(call, Dims((src, ("I",)), (out,)))


@attrs.frozen
class GatherScatter:
    """gather / scatter / scatter_add / scatter_reduce: dims other than ``dim`` on which
    every operand has the same size share their sharding; ``dim`` is whole in ``self``.
    gather's index may be sharded along ``dim`` too (its output follows it)."""

    gather: bool = False

    def candidates(self, call: OpCall) -> list[Candidate]:
        shapes = call.shapes
        n = len(shapes[0])
        if any(len(s) != n for s in shapes) or n == 0:
            return []
        b = bind(call.func, call.args, call.kwargs)
        d = b["dim"] % n
        ls = letters(n)
        same = [all(s[i] == shapes[0][i] for s in shapes) for i in range(n)]
        common = tuple(L if same[i] and i != d else None for i, L in enumerate(ls))
        if self.gather:
            idx = tuple("G" if i == d else L for i, L in enumerate(common))
            spec = Dims((common, idx), (idx,))
        else:
            spec = Dims((common,) * len(call.arrays), (common,))
        return compile_dims(call, spec)


@attrs.frozen
class IndexAlong:
    """index_add / index_copy / index_fill (self, dim, index, [source]): ``dim`` whole,
    the other dims of ``self`` and ``source`` shared, the index replicated."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        b = bind(call.func, call.args, call.kwargs)
        n = len(call.shapes[0])
        if n == 0:
            return []
        d = b["dim"] % n
        ls = tuple(None if i == d else L for i, L in enumerate(letters(n)))
        ins = []
        for path, v in call.arrays:
            name = path if isinstance(path, str) else None
            is_index = v.ndim <= 1 and not v.is_floating_point() and (path == 2 or name == "index")
            ins.append((None,) * v.ndim if is_index else ls if v.ndim == n else (None,) * v.ndim)
        cands = compile_dims(call, Dims(tuple(ins), (ls,)))
        if _narrow_prod_fails(call.func, b, call.shapes[0], call.out_metas[0]):
            return cands  # torch raises on the whole value too: so do the shards
        if call.func is torch.ops.aten.index_reduce.default and b.get("reduce") == "prod":
            return [attrs.evolve(c, local_fn=_NarrowProd(call.func)) for c in cands]
        return cands


def _narrow_prod_fails(func: Any, b: dict, shape: tuple, out: Any) -> bool:
    """torch's CPU ``index_reduce(reduce="prod")`` on 16-bit floats asserts internally where
    ``self`` has one element per index along ``dim`` and more than one dim (torch 2.13)."""
    return (func is torch.ops.aten.index_reduce.default and b.get("reduce") == "prod" and len(shape) > 1
            and isinstance(out, torch.Tensor) and out.dtype in (torch.float16, torch.bfloat16)
            and math.prod(shape) == shape[b["dim"] % len(shape)])


@attrs.frozen
class _NarrowProd:
    """``index_reduce(prod)`` on one device's shards: a shard narrowed to one element per index
    (where the whole value is not) runs on 1-d views, the form torch's kernel takes."""

    func: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        b = bind(self.func, args, kwargs)
        x, src = b["self"], b["source"]
        if not _narrow_prod_fails(self.func, b, tuple(x.shape), x):
            return self.func(*args, **kwargs)
        d = b["dim"] % x.dim()
        flat = self.func(x.reshape(-1), 0, b["index"], src.movedim(d, 0).reshape(-1), "prod",
                         include_self=b.get("include_self", True))
        return flat.reshape(x.shape)


@attrs.frozen
class AdvancedIndex:
    """x[i0, i1, ...] (aten.index): indexed dims whole; dims not indexed keep their
    sharding at their place in the output; index tensors of one shape may be sharded, the
    output dims they shape following them."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        b = bind(call.func, call.args, call.kwargs)
        indices = list(b["indices"])
        x_shape = call.shapes[0]
        n = len(x_shape)
        out = call.out_metas[0]
        if not isinstance(out, torch.Tensor) or any(
            isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices
        ):
            return []
        ls = letters(n)
        indices += [None] * (n - len(indices))
        used = [i for i, t in enumerate(indices) if t is not None]
        k = out.dim() - (n - len(used))
        contiguous = used == list(range(used[0], used[-1] + 1)) if used else True
        rest = [ls[i] for i in range(n) if i not in used]
        if contiguous and used:
            before = [ls[i] for i in range(used[0])]
            out_letters = before + [None] * k + rest[len(before):]
        else:
            out_letters = [None] * k + rest
        src = tuple(None if i in used else L for i, L in enumerate(ls))
        # index tensors of one shape (no broadcasting between them) may be sharded: the
        # output dims they shape follow them (a lookup of batch-split ids stays split)
        shapes = {tuple(t.shape) for t in indices if isinstance(t, torch.Tensor)}
        idx = tuple(f"I{j}" for j in range(k)) if len(shapes) == 1 and len(next(iter(shapes))) == k else (None,) * k
        at = (len(before) if contiguous and used else 0)
        out_letters[at:at + k] = idx
        index_ids = {id(t) for t in indices if isinstance(t, torch.Tensor)}
        ins = (src,) + tuple(idx if id(v) in index_ids and v.ndim == k else (None,) * v.ndim for _, v in call.arrays[1:])
        return compile_dims(call, Dims(ins, (tuple(out_letters),)))


@attrs.frozen
class IndexPut:
    """index_put(self, indices, values, accumulate): the dims ``self`` does not index keep
    their sharding, ``values`` taking the layout of ``self[indices]`` (``values`` of exactly
    that shape). With ``accumulate`` the op adds ``values`` into ``self``: linear in both,
    so a pending sum of ``values`` passes through (``self`` taking it on), and index tensors
    split like ``values``' rows leave the output pending over their axes (the backward of
    ``x[:, :, [i]]``, of a table lookup, of ``w[batch_ids]``)."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        b = bind(call.func, call.args, call.kwargs)
        indices = list(b["indices"])
        x_shape = call.shapes[0]
        n = len(x_shape)
        values = b["values"]
        if n == 0 or any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices):
            return Replicated().candidates(call)
        indices += [None] * (n - len(indices))
        used = [i for i, t in enumerate(indices) if t is not None]
        if not used:
            return Replicated().candidates(call)
        shapes = [tuple(t.shape) for t in indices if t is not None]
        try:
            k = len(torch.broadcast_shapes(*shapes))
        except RuntimeError:
            return Replicated().candidates(call)
        ls = letters(n)
        rest = [ls[i] for i in range(n) if i not in used]
        if used == list(range(used[0], used[-1] + 1)):
            before = [ls[i] for i in range(used[0])]
            val_letters = before + [None] * k + rest[len(before):]
        else:
            before = []
            val_letters = [None] * k + rest
        accumulate = bool(b.get("accumulate", False))
        # with accumulate, index tensors of one shape may be split (values alike): each
        # device scatters its own rows, the output a pending sum (self added once)
        ishapes = {tuple(t.shape) for t in indices if isinstance(t, torch.Tensor)}
        idx = (tuple(f"I{j}" for j in range(k)) if accumulate and len(ishapes) == 1 and len(next(iter(ishapes))) == k
               else (None,) * k)
        at = len(before) if used == list(range(used[0], used[-1] + 1)) else 0
        val_letters[at:at + k] = idx
        if not isinstance(values, torch.Tensor) or values.dim() != len(val_letters):
            return Replicated().candidates(call)
        # a dim of ``values`` that broadcasts (size 1 against more: vmap's batching rule hands a
        # 0-d value over as (B, 1, 1)) is whole: split alike, its one element lands on one device
        sizes = [x_shape[i] for i in range(n) if i not in used]
        lead = len(before)
        want = [x_shape[i] for i in range(lead)] + list(torch.broadcast_shapes(*shapes)) + sizes[lead:]
        val_letters = [L if values.shape[j] == want[j] else None for j, L in enumerate(val_letters)]
        src = tuple(None if i in used else L for i, L in enumerate(ls))
        index_ids = {id(t) for t in indices if isinstance(t, torch.Tensor)}
        ins, partial_ins = [], []
        for i, (_, v) in enumerate(call.arrays):
            if v is b["self"] and i == 0:
                ins.append(src)
            elif v is values:
                ins.append(tuple(val_letters))
                partial_ins.append(i)
            elif id(v) in index_ids and v.ndim == k:
                ins.append(idx)
            else:
                ins.append((None,) * v.ndim)
        if not accumulate:
            return compile_dims(call, Dims(tuple(ins), (src,)))
        reduce = tuple((L, "sum") for L in idx if L is not None)
        return compile_dims(call, Dims(tuple(ins), (src,), reduce, LINEAR_OPS, joint=True, addends=(0,),
                                       partial_ins=tuple(partial_ins)))


@attrs.frozen
class Replicated:
    """Ops with no better strategy: every input whole, the output replicated (no
    warning: the op is known to need the full tensors). ``dense``: the kernel needs its
    inputs contiguous (a replica held as a view of a stacked or batched tensor is not)."""

    dense: bool = False

    def candidates(self, call: OpCall) -> list[Candidate]:
        ins = tuple((None,) * len(s) for s in call.shapes)
        outs = tuple((None,) * m.dim() if isinstance(m, torch.Tensor) else None for m in call.out_metas)
        cands = compile_dims(call, Dims(ins, outs))
        return [attrs.evolve(c, dense=True) for c in cands] if self.dense else cands


_REPLICATED = Replicated()

@attrs.frozen
class DataDependentShape:
    """Ops whose output shape depends on the values (``nonzero``, ``masked_select``,
    ``unique``...): no meta run gives it, so there are no candidates. On replicated inputs
    each device computes the whole result from its own replica, which is this rule's only
    strategy: dispatch runs it replicated, without communication and without a warning
    (``local_when_replicated``); sharded inputs are gathered first, with a FallbackWarning."""

    local_when_replicated = True

    def candidates(self, call: OpCall) -> list[Candidate]:
        return []


_DATA_DEPENDENT = DataDependentShape()

TABLE = {
    aten.index_select: IndexSelect(),
    **{getattr(aten, n): _DATA_DEPENDENT for n in (
        "nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive", "bincount")},
    aten.gather: GatherScatter(gather=True),
    aten.scatter: GatherScatter(),
    aten.scatter_add: GatherScatter(),
    aten.scatter_reduce: GatherScatter(),
    aten.index_add: IndexAlong(),
    aten.index_copy: IndexAlong(),
    aten.index_fill: IndexAlong(),
    aten.index_reduce: IndexAlong(),
    aten.index.Tensor: AdvancedIndex(),
    aten._unsafe_index.Tensor: AdvancedIndex(),
    aten.index_put: IndexPut(),
    aten._unsafe_index_put: IndexPut(),
    aten.masked_scatter: _REPLICATED,
    aten.take: _REPLICATED,
    aten.put: _REPLICATED,
    aten.searchsorted: _REPLICATED,
    aten.bucketize: _REPLICATED,
    # (dense: torch asserts infos.is_contiguous(), and a batch's info under vmap(in_dims=-1) is
    # held as a strided view: seed 5805294189, solve under vmap of the last dim)
    aten._linalg_check_errors: Replicated(dense=True),  # a batch's info gathered (4 bytes a matrix): torch's message and index
    aten._assert_async: _REPLICATED,  # a one-element condition
}
