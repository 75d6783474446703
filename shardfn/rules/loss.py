"""The loss kept sharded, as Megatron does by hand.

- ``nll_loss`` with ``reduction="mean"`` on batch-sharded rows: the rows' loss sum and
  total weight stay pending sums, stacked into one 2-element all_reduce, then divided
  (the total weight is global, as the backward needs it).
- vocabulary-parallel loss on class-sharded logits: ``log_softmax`` over a sharded
  class dim runs Megatron's vocab_parallel_cross_entropy reductions (a max all_reduce
  and a sum-of-exp all_reduce of batch-sized tensors), its backward one sum all_reduce;
  ``nll_loss`` picks each target's log-probability on the device holding that class
  (other targets are ignored there), so loss and total weight are pending sums over the
  class axes.

- margin losses of an empty batch: torch's ``multi_margin_loss`` and
  ``multilabel_margin_loss`` kernels return before writing the loss of a ``(0, C)`` input
  (uninitialised memory, another value each call); shardfn gives the value torch's own
  reference (``torch._decomp``) defines: the mean nan (0 / 0, as every other mean loss of an
  empty batch), the sum 0.
- margin losses of batch-sharded rows (``RowsOfLoss``): each device runs the kernel on its
  rows with ``reduction="sum"``, a reduced loss is a pending sum over the batch axes; "mean"
  divides each device's sum (and gradient) by the global row count.

- elementwise losses (``mse_loss``, ``huber_loss``, ``binary_cross_entropy``...): their terms
  are pointwise (the table's rule), a "mean" or "sum" is the terms' ``mean()`` / ``sum()``.

``SPECIAL`` handlers compose these from ops on ShardedArrays (each dispatched by its own
rule) and return ``NotImplemented`` where the plain rule applies.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from ..values.layout import Layout
from .base import Candidate, OpCall, ShardFact, bind, out_of_range

aten = torch.ops.aten

_MEAN, _SUM = 1, 2


def _sharded(x: Any) -> bool:
    from ..arrays.array import ShardedArray

    return isinstance(x, ShardedArray)


def _nll_mean(func: Any, args: tuple, kwargs: dict) -> Any:
    """Mean nll over sharded rows or classes: pending sums of loss and weight, one
    all_reduce of both, one division."""
    b = bind(func, args, kwargs)
    x, t = b["self"], b["target"]
    if b["reduction"] != _MEAN or x.dim() < 2 or not _sharded(x) or not x._layout.dims[0] and not x._layout.dims[1]:
        return NotImplemented
    with torch.no_grad():
        total, weight = func(x, t, b["weight"], _SUM, b["ignore_index"])
        both = torch.stack([total, weight])
        from ..arrays.array import wrap
        from ..arrays.redistribute import raw_reshard

        rep = Layout(both.mesh, ((),))
        both = wrap(raw_reshard(both, rep), rep, both.shape, both.dtype)
        return both[0] / both[1], both[1]


def _log_softmax_classes(func: Any, args: tuple, kwargs: dict) -> Any:
    """log_softmax over a sharded dim: max and sum-of-exp all_reduces of the other dims."""
    b = bind(func, args, kwargs)
    x, dim = b["self"], b["dim"]
    if not _sharded(x) or x.dim() == 0 or not x._layout.dims[dim % x.dim()] or x.numel() == 0:
        return NotImplemented
    with torch.no_grad():
        if b["half_to_float"]:
            x = aten._to_copy(x, dtype=torch.float32)
        m = x.amax(dim, keepdim=True)
        shifted = x - m
        return shifted - shifted.exp().sum(dim, keepdim=True).log()


def _log_softmax_backward_classes(func: Any, args: tuple, kwargs: dict) -> Any:
    """grad - exp(out) * sum(grad): one sum all_reduce over the sharded dim."""
    b = bind(func, args, kwargs)
    g, out, dim = b["grad_output"], b["output"], b["dim"]
    if not _sharded(out) or out.dim() == 0 or not out._layout.dims[dim % out.dim()]:
        return NotImplemented
    with torch.no_grad():
        res = g - out.exp() * g.sum(dim, keepdim=True)
        return res if res.dtype == b["input_dtype"] else aten._to_copy(res, dtype=b["input_dtype"])


def _margin_of_empty(func: Any, args: tuple, kwargs: dict) -> Any:
    """A margin loss of an empty ``(0, C)`` batch: torch's kernels leave a reduced one unwritten
    (under ``vmap`` too: its fallback runs the kernel per example), so the result was whatever
    memory the allocator handed out. The loss is the mean or sum of no terms, as torch's
    reference decomposition computes it: ``x.mean()`` (nan) or ``x.sum()`` (0) of the empty
    input (unreduced: the rows' empty sums, no fallback); the backwards' empty gradient is
    computed too. Any argument the kernel would check otherwise goes to it (its own error)."""
    b = bind(func, args, kwargs)
    x, t, red = b["self"], b["target"], b["reduction"]
    if (not _sharded(x) or not x.dtype.is_floating_point or x.dim() != 2 or x.shape[0] != 0 or x.shape[1] == 0
            or red not in (0, _MEAN, _SUM) or not isinstance(t, torch.Tensor) or t.dtype != torch.int64):
        return NotImplemented  # a loss the kernel writes (or its own error)
    if func in (aten.multi_margin_loss.default, aten.multi_margin_loss_backward.default):
        w = b["weight"]
        if b["p"] not in (1, 2) or t.dim() > 1 or t.numel() != 0 or w is not None and (w.dim() > 1 or w.numel() != x.shape[1]):
            return NotImplemented
    elif tuple(t.shape) != tuple(x.shape):
        return NotImplemented
    if func in (aten.multi_margin_loss_backward.default, aten.multilabel_margin_loss_backward.default):
        return aten.zeros_like.default(x)
    with torch.no_grad():
        loss = aten.mean.default(x) if red == _MEAN else aten.sum.default(x) if red == _SUM else aten.sum.dim_IntList(x, [1])
        return loss if func is aten.multi_margin_loss.default else (loss, aten.zeros_like.default(x))


def _elementwise_then_reduced(func: Any, args: tuple, kwargs: dict) -> Any:
    """A loss that is an elementwise term, then reduced (``mse_loss``, ``huber_loss``,
    ``binary_cross_entropy``...: ``ELEMENTWISE_LOSSES``), "mean" or "sum" of a sharded input: the
    unreduced terms (the pointwise rule: they keep the input's sharding), then ``mean()`` /
    ``sum()`` (pending over the split dims), as torch's kernels reduce them. The backwards: the
    unreduced gradient of the broadcast ``grad_output``, divided by the element count for "mean"
    (the kernels' ``norm``)."""
    b = bind(func, args, kwargs)
    x, red = b["self"], b["reduction"]
    if red not in (_MEAN, _SUM) or not any(_sharded(v) for v in b.values()):
        return NotImplemented
    b["reduction"] = 0
    with torch.no_grad():
        terms = func(*(b[a.name] for a in func._schema.arguments))
        if "grad_output" in b:
            return terms / x.numel() if red == _MEAN else terms
        return terms.mean() if red == _MEAN else terms.sum()


# losses whose kernels compute elementwise terms, then reduce them (forward and backward)
ELEMENTWISE_LOSSES = ("mse_loss", "mse_loss_backward", "smooth_l1_loss", "smooth_l1_loss_backward", "huber_loss",
                      "huber_loss_backward", "soft_margin_loss", "soft_margin_loss_backward", "binary_cross_entropy",
                      "binary_cross_entropy_backward", "binary_cross_entropy_with_logits")

SPECIAL = {
    **{getattr(aten, n).default: _elementwise_then_reduced for n in ELEMENTWISE_LOSSES},
    aten.multi_margin_loss.default: _margin_of_empty,
    aten.multilabel_margin_loss_forward.default: _margin_of_empty,
    aten.multi_margin_loss_backward.default: _margin_of_empty,
    aten.multilabel_margin_loss_backward.default: _margin_of_empty,
    aten.nll_loss_forward.default: _nll_mean,
    aten._log_softmax.default: _log_softmax_classes,
    aten._log_softmax_backward_data.default: _log_softmax_backward_classes,
}


@attrs.frozen
class ClassSharded:
    """nll_loss (and its backward) on logits whose class dim (1) is sharded: each device
    looks up the targets in its class range, the others are ignored there; loss and total
    weight are pending sums over the class axes (the input gradient stays class-sharded)."""

    backward: bool

    def candidates(self, call: OpCall) -> list[Candidate]:
        b = bind(call.func, call.args, call.kwargs)
        x = b["self"]
        names = [_arg_name(call.func, p) for p, _ in call.arrays]
        if x.dim() != 2 or b["ignore_index"] >= 0 or "self" not in names:
            return []
        xl = call.arrays[names.index("self")][1]._layout
        cls = xl.dims[1]
        if not cls:
            return []
        mesh = call.mesh
        rows = xl.dims[0]
        part_cls = tuple((a, "sum") for a in cls)
        ins = []
        for n, (_, v) in zip(names, call.arrays):
            if n == "self":
                ins.append(Layout(mesh, (rows, cls)))
            elif n == "target":
                ins.append(Layout(mesh, (rows,)))
            elif n == "weight":
                ins.append(Layout(mesh, (cls,)))
            elif n == "grad_output":
                ins.append(Layout(mesh, (rows,) if v.dim() == 1 else ((),) * v.dim()))
            else:  # total_weight: the global one for "mean"
                ins.append(v._layout if b["reduction"] != _MEAN else Layout(mesh, ()))
        if self.backward:
            outs = (Layout(mesh, (rows, cls)),)
        else:
            red = b["reduction"]
            loss = Layout(mesh, (rows,), _order(mesh, part_cls)) if red == 0 else Layout(
                mesh, (), _order(mesh, part_cls + tuple((a, "sum") for a in rows)))
            if red == _MEAN:
                return []  # handled by _nll_mean, which asks for "sum"
            outs = (loss, Layout(mesh, (), _order(mesh, part_cls + tuple((a, "sum") for a in rows))))
        i = names.index("self")
        facts = (ShardFact("lo", "offset", i, 1), ShardFact("classes", "size", i, 1))
        return [Candidate(tuple(ins), outs, local_fn=_ClassRange(call.func, x.shape[1]), facts=facts)]


def _order(mesh: Any, partial: tuple) -> tuple:
    names = mesh.axis_names
    return tuple(sorted(partial, key=lambda p: names.index(p[0])))


def _arg_name(func: Any, path: Any) -> str:
    from .base import _schema_info

    names = _schema_info(func)[0]
    return names[path] if isinstance(path, int) else path


@attrs.frozen
class _ClassRange:
    """The op on one device's shards, whose classes are ``[lo, lo + classes)``: targets
    outside that range become ``ignore_index``, the others are shifted into it. A target
    outside all ``n_classes`` raises IndexError, as torch's kernel does."""

    func: Any
    n_classes: int

    def __call__(self, *args: Any, lo: Any, classes: Any, **kwargs: Any) -> Any:
        b = bind(self.func, args, kwargs)
        t, ii = b["target"], b["ignore_index"]
        bad = out_of_range(t, self.n_classes, ii)
        if bad is not None:
            raise IndexError(f"Target {bad} is out of bounds.")
        inside = (t >= lo) & (t < lo + classes)
        b["target"] = torch.where(inside, t - lo, torch.full_like(t, ii))
        names = [a.name for a in self.func._schema.arguments]
        return self.func(*(b[n] for n in names))


@attrs.frozen
class RowsOfLoss:
    """A row-wise loss (``multi_margin_loss``, ``multilabel_margin_loss`` and their backwards)
    whose rows (dim 0 of a 2-D ``self``) ``rule`` may shard: where a candidate shards them, each
    device calls :class:`_RowsSummed` (a "mean" divides by the global row count, which no
    device sees; a device holding no rows gives the zero loss torch's kernel leaves unwritten).
    Classes stay whole (a class-sharded input is gathered along them first)."""

    rule: Any

    def candidates(self, call: OpCall) -> list[Candidate]:
        b = bind(call.func, call.args, call.kwargs)
        x = b["self"]
        cands = self.rule.candidates(call)
        names = [_arg_name(call.func, p) for p, _ in call.arrays]
        if x.dim() != 2 or b["reduction"] not in (_MEAN, _SUM) or "self" not in names:
            return cands
        i = names.index("self")
        fn = _RowsSummed(call.func, x.shape[0])
        return [attrs.evolve(c, local_fn=fn) if c.in_layouts[i].dims[0] else c for c in cands]

    @staticmethod
    def out_meta(func: Any, args: tuple, kwargs: dict) -> Any:
        """The backwards have no meta kernel: the forward's meta checks the shapes as the kernel
        does, and the gradient is laid out like ``self`` (contiguous, as the kernel allocates it)."""
        fwd = _FORWARD.get(func)
        if fwd is None:
            return func(*args, **kwargs)
        b = bind(func, args, kwargs)
        fwd(*(b[a.name] for a in fwd._schema.arguments))
        return torch.empty(b["self"].shape, dtype=b["self"].dtype, device=b["self"].device)


_FORWARD = {aten.multi_margin_loss_backward.default: aten.multi_margin_loss.default,
            aten.multilabel_margin_loss_backward.default: aten.multilabel_margin_loss_forward.default}


@attrs.frozen
class _RowsSummed:
    """The op on one device's rows of a reduced row-wise loss: run with ``reduction="sum"``,
    divided by the global row count ``rows`` for "mean" (the loss and the gradient alike); the
    loss of no rows is 0 (torch's kernels return it unwritten)."""

    func: Any
    rows: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        b = bind(self.func, args, kwargs)
        mean = b["reduction"] == _MEAN
        b["reduction"] = _SUM
        x = b["self"]
        if "grad_output" not in b and x.shape[0] == 0:
            zero = x.new_zeros(())
            out: Any = zero if self.func is aten.multi_margin_loss.default else (zero, x.new_zeros(x.shape))
        else:
            out = self.func(*(b[a.name] for a in self.func._schema.arguments))
        if not mean:
            return out
        return out / self.rows if isinstance(out, torch.Tensor) else (out[0] / self.rows, *out[1:])
