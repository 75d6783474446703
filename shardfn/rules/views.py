"""View and shape ops (DTensor's ``_view_ops``): the output keeps the input's sharding
wherever the op maps a dim whole onto another; dims the op cuts into (the dim of a
slice, a cat, a split) must be whole. Views are linear, so pending reductions pass.

``view``/``reshape`` group dims whose sizes multiply to the same number; in a group the
sharding of the major input dim moves to the major output dim when every device's
piece of the flattened group stays the same range (always true for even splits, and
checked index by index for uneven ones); otherwise the group is gathered.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import attrs
import torch

from ..values.layout import Layout, split_range
from ..values.mesh import Mesh
from .base import Candidate, OpCall, _schema_info, bind, letters, norm_dims
from .dims import LINEAR_OPS, Dims, compile_dims
from .reductions import AlongDim

aten = torch.ops.aten


# -- view / reshape ---------------------------------------------------------------------------


def view_groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]] | None:
    """Groups of input dims and output dims with equal size products (size-1 dims left
    out); None for empty tensors."""
    if 0 in a or 0 in b:
        return None
    ins = [i for i, n in enumerate(a) if n != 1]
    outs = [j for j, n in enumerate(b) if n != 1]
    groups, i, j = [], 0, 0
    while i < len(ins) and j < len(outs):
        gi, gj = [ins[i]], [outs[j]]
        pa, pb = a[ins[i]], b[outs[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                gi.append(ins[i])
                pa *= a[ins[i]]
                i += 1
            else:
                gj.append(outs[j])
                pb *= b[outs[j]]
                j += 1
        groups.append((gi, gj))
    return groups


def _ranges(n: int, axes: tuple[str, ...], mesh: Mesh) -> list[tuple[int, int]]:
    """Every device's index range of a dim of size ``n`` split over ``axes``."""
    out = []
    for dev in range(mesh.size):
        c = mesh.coords(dev)
        lo, hi = 0, n
        for ax in axes:
            i = mesh.axis_index(ax)
            lo, hi = split_range(lo, hi, mesh.shape[i], c[i])
        out.append((lo, hi))
    return out


def _moves_whole(axes: tuple[str, ...], mesh: Mesh, n_in: int, r_in: int, n_out: int, r_out: int) -> bool:
    """Whether splitting the major input dim (size n_in, r_in elements per index) and the
    major output dim (n_out, r_out) over ``axes`` gives every device the same elements."""
    a, b = _ranges(n_in, axes, mesh), _ranges(n_out, axes, mesh)
    return all(
        (lo * r_in, hi * r_in) == (lo2 * r_out, hi2 * r_out) or (lo == hi and lo2 == hi2)
        for (lo, hi), (lo2, hi2) in zip(a, b)
    )


def view_layouts(src: Layout, a: Sequence[int], b: Sequence[int]) -> tuple[Layout, Layout]:
    """(input layout needed, output layout) of viewing shape ``a`` as ``b``."""
    mesh = src.mesh
    groups = view_groups(a, b)
    in_dims = [()] * len(a)
    out_dims = [()] * len(b)
    for gi, gj in groups or []:
        axes = src.dims[gi[0]]
        if not axes:
            continue
        r_in = math.prod(a[i] for i in gi[1:])
        r_out = math.prod(b[j] for j in gj[1:])
        if _moves_whole(axes, mesh, a[gi[0]], r_in, b[gj[0]], r_out):
            in_dims[gi[0]] = axes
            out_dims[gj[0]] = axes
    return Layout(mesh, tuple(in_dims), src.partial), Layout(mesh, tuple(out_dims), src.partial)


@attrs.frozen
class View:
    """view / _unsafe_view / reshape: the size argument is localised per device."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        (_, x), = call.arrays
        out_shape = tuple(call.out_metas[0].shape)
        if call.func is aten.view.dtype:
            return [_view_dtype(call, x)]
        src, dst = view_layouts(x._layout, tuple(x.shape), out_shape)
        # the shape argument's name: ``size`` (view), ``shape`` (reshape, which reaches here
        # undecomposed below autograd: a rule's own handler reshaping an array raised ValueError)
        return [_local_shape_candidate(call, (src,), dst, out_shape, _schema_info(call.func)[0][1])]


def _view_dtype(call: OpCall, x: Any) -> Candidate:
    """view(dtype): the bits reinterpreted shard by shard; a change of element size scales
    the last dim, which must then be whole (and of stride 1 locally). A pending sum is
    resolved first (the bits of the parts are not parts of the bits)."""
    dims = x._layout.dims
    if x.dtype.itemsize != call.out_metas[0].dtype.itemsize and dims:
        dims = dims[:-1] + ((),)
    lay = Layout(call.mesh, dims)
    return Candidate((lay,), (lay,), dense="last")


def _local_shape_candidate(call: OpCall, ins: tuple, dst: Layout, out_shape: tuple, arg: str) -> Candidate:
    """A candidate whose ``arg`` (a shape) becomes each device's local output shape."""
    return Candidate(ins, (dst,), local_sizes=((arg, 0),))


@attrs.frozen
class Expand:
    """expand: new leading dims and stretched size-1 dims are replicated."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        (_, x), = call.arrays
        out_shape = tuple(call.out_metas[0].shape)
        lay, shape = x._layout, tuple(x.shape)
        lead = len(out_shape) - len(shape)
        keep = [() if shape[i] == 1 else lay.dims[i] for i in range(len(shape))]
        src = Layout(call.mesh, tuple(keep), lay.partial)
        dst = Layout(call.mesh, ((),) * lead + tuple(keep), lay.partial)
        return [_local_shape_candidate(call, (src,), dst, out_shape, "size")]


# -- dim permutations and insertions -----------------------------------------------------------


@attrs.frozen
class Mapped:
    """Ops whose output dims each come whole from one input dim (or are new):
    ``mapping(bound_args, ndim) -> (dims that must be whole, out dim -> in dim | None)``.
    ``local(whole) -> (local_op, local_args)``: the local call when it is not the op
    itself; ``dense``: the op needs contiguous shards."""

    mapping: Any
    local: Any = None
    dense: bool = False

    def candidates(self, call: OpCall) -> list[Candidate]:
        if len(call.arrays) != 1:
            return []
        (_, x), = call.arrays
        b = bind(call.func, call.args, call.kwargs)
        whole, out_map = self.mapping(b, x.ndim)
        lay = x._layout
        src = Layout(call.mesh, tuple(() if i in whole else d for i, d in enumerate(lay.dims)), lay.partial)
        dst = Layout(call.mesh, tuple(() if i is None else src.dims[i] for i in out_map), lay.partial)
        outs = tuple(dst if isinstance(m, torch.Tensor) else None for m in call.out_metas)
        op, args = self.local(tuple(whole)) if self.local is not None and x.ndim else (None, ())
        return [Candidate((src,), outs, local_op=op, local_args=args, dense=self.dense)]


def _permute_map(b: dict, n: int) -> tuple:
    return (), [d % n for d in b["dims"]]


def _transpose_map(b: dict, n: int) -> tuple:
    out = list(range(n))
    if n:
        d0, d1 = b["dim0"] % n, b["dim1"] % n
        out[d0], out[d1] = d1, d0
    return (), out


def _t_map(b: dict, n: int) -> tuple:
    return (), list(range(n))[::-1]


def _squeeze_dims(b: dict, n: int) -> tuple[int, ...]:
    dim = b.get("dim")
    if n == 0 or isinstance(dim, (list, tuple)) and not dim:
        return ()
    cand = range(n) if dim is None else norm_dims(dim, n)
    shape = b["self"].shape
    return tuple(d for d in cand if shape[d] == 1)


def _squeeze_local(whole: tuple) -> tuple:
    """squeeze exactly the dims that are size 1 globally (a sharded dim may be size 1 locally)."""
    return aten.squeeze.dims, (("dim", whole),)


def _squeeze_map(b: dict, n: int) -> tuple:
    sq = _squeeze_dims(b, n)
    return sq, [i for i in range(n) if i not in sq]


def _unsqueeze_map(b: dict, n: int) -> tuple:
    d = b["dim"] % (n + 1)
    out: list = list(range(n))
    out.insert(d, None)
    return (), out


def _select_map(b: dict, n: int) -> tuple:
    d = b["dim"] % n
    return (d,), [i for i in range(n) if i != d]


def _slice_map(b: dict, n: int) -> tuple:
    d = b["dim"] % n
    size = b["self"].shape[d]
    start, end, step = b.get("start"), b.get("end"), b.get("step", 1)
    full = (start in (None, 0) or start <= -size) and (end is None or end >= size) and step == 1
    return (() if full else (d,)), list(range(n))


def _split_map(b: dict, n: int) -> tuple:
    d = b["dim"] % n
    return (d,), list(range(n))


def _unbind_map(b: dict, n: int) -> tuple:
    d = b["dim"] % n
    return (d,), [i for i in range(n) if i != d]


def _diagonal_map(b: dict, n: int) -> tuple:
    d1, d2 = b["dim1"] % n, b["dim2"] % n
    return (d1, d2), [i for i in range(n) if i not in (d1, d2)] + [None]


def _unfold_map(b: dict, n: int) -> tuple:
    d = b["dimension"] % max(n, 1)
    return (d,), list(range(n)) + [None]


def _repeat_map(b: dict, n: int) -> tuple:
    reps = list(b["repeats"])
    lead = len(reps) - n
    whole = tuple(i for i in range(n) if reps[lead + i] != 1)
    return whole, [None] * lead + list(range(n))


# -- many tensors ---------------------------------------------------------------------------------


@attrs.frozen
class Concat:
    """cat / stack: all inputs laid out alike, the cat dim whole (stack: new dim)."""

    new_dim: bool = False

    def candidates(self, call: OpCall) -> list[Candidate]:
        legacy = [i for i, s in enumerate(call.shapes) if s == (0,)] if not self.new_dim else []
        if legacy and len(legacy) < len(call.arrays) and all(isinstance(p, tuple) for p, _ in call.arrays):
            return self._without_legacy_empty(call, legacy)
        shapes = call.shapes
        ranks = {len(s) for s in shapes}
        if len(ranks) != 1 or any(not isinstance(p, tuple) for p, _ in call.arrays):
            return []
        n = ranks.pop()
        if n == 0 and not self.new_dim:
            return []
        b = bind(call.func, call.args, call.kwargs)
        d = b.get("dim", 0) % (n + 1 if self.new_dim else n)
        ls = letters(n)
        ins = tuple(None if (i == d and not self.new_dim) else L for i, L in enumerate(ls))
        out = ins[:d] + (None,) + ins[d:] if self.new_dim else ins
        spec = Dims((ins,) * len(call.arrays), (out,), (), LINEAR_OPS, joint=True)
        return compile_dims(call, spec)

    def _without_legacy_empty(self, call: OpCall, legacy: list[int]) -> list[Candidate]:
        """cat skips torch's legacy empty 1-D operands (``torch.tensor([])``, how a KV
        cache starts): they keep their layout and drop out of the local call."""
        keep = [i for i in range(len(call.arrays)) if i not in legacy]
        sub = attrs.evolve(call, arrays=[call.arrays[i] for i in keep])
        out = []
        for c in self.candidates(sub):
            ins = list(c.in_layouts)
            for i in legacy:
                ins.insert(i, call.arrays[i][1]._layout)
            out.append(attrs.evolve(c, in_layouts=tuple(ins)))
        return out


@attrs.frozen
class NewFactory:
    """new_zeros/new_ones/new_empty/new_full: a replicated result of the given size."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        (_, x), = call.arrays
        out = call.out_metas[0]
        dst = Layout(call.mesh, ((),) * out.dim())
        return [Candidate((x._layout,), (dst,))]


@attrs.frozen
class SizedBackward:
    """slice_backward / select_backward(grad, input_sizes, dim, ...): the grad's layout
    with ``dim`` whole (select: a new whole dim); ``input_sizes`` become local."""

    insert: bool = False

    def candidates(self, call: OpCall) -> list[Candidate]:
        (_, g), = call.arrays
        out_shape = tuple(call.out_metas[0].shape)
        n = len(out_shape)
        d = bind(call.func, call.args, call.kwargs)["dim"] % n
        dims = list(g._layout.dims)
        if self.insert:
            out_dims = dims[:d] + [()] + dims[d:]
        else:
            dims[d] = ()
            out_dims = dims
        src = Layout(call.mesh, tuple(dims), g._layout.partial)
        dst = Layout(call.mesh, tuple(out_dims), g._layout.partial)
        return [Candidate((src,), (dst,), local_sizes=(("input_sizes", 0),))]


@attrs.frozen
class UnfoldBackward:
    """unfold_backward(grad, input_sizes, dim, size, step): the windows (grad's ``dim``, one per
    step) summed back into the input's ``dim``, each window's elements the grad's last dim: those
    two whole, the grad's other dims sharded as the output's. Linear in the grad: a pending
    reduction stays pending. (It fell back, replicating the grad, and on a symbolic size under
    torch.compile(dynamic=True) specialised it in the joint pass only: fuzzer seed 5845067868.)"""

    def candidates(self, call: OpCall) -> list[Candidate]:
        (_, g), = call.arrays
        n = len(call.out_metas[0].shape)
        d = bind(call.func, call.args, call.kwargs)["dim"] % max(n, 1)
        out_dims = tuple(() if i == d else g._layout.dims[i] for i in range(n))
        src = Layout(call.mesh, (*out_dims, ()) if n else ((),) * g.dim(), g._layout.partial)
        dst = Layout(call.mesh, out_dims, g._layout.partial)
        return [Candidate((src,), (dst,), local_sizes=(("input_sizes", 0),))]


@attrs.frozen
class DiagonalBackward:
    """diagonal_backward(grad, input_sizes, offset, dim1, dim2): zeros of ``input_sizes`` with
    ``grad`` (the diagonal, its last dim) written on the diagonal of dims ``dim1``/``dim2``:
    the diagonal dim and those two whole, the grad's other dims sharded as the output's
    others. Linear in the grad (zeros elsewhere): a pending reduction stays pending."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        (_, g), = call.arrays
        n = len(call.out_metas[0].shape)
        b = bind(call.func, call.args, call.kwargs)
        d1, d2 = b["dim1"] % n, b["dim2"] % n
        batch = iter(g._layout.dims[:-1])
        out_dims = tuple(() if i in (d1, d2) else next(batch) for i in range(n))
        src = Layout(call.mesh, (*g._layout.dims[:-1], ()), g._layout.partial)
        dst = Layout(call.mesh, out_dims, g._layout.partial)
        return [Candidate((src,), (dst,), local_sizes=(("input_sizes", 0),))]


@attrs.frozen
class DiagEmbed:
    """diag_embed(input, offset, dim1, dim2): the input's last dim written on the diagonal of
    the output's new dims ``dim1``/``dim2`` (jacfwd of ``cholesky``, ``eigh``...): the diagonal
    dim and those two whole, the other dims sharded as the input's. Linear, zeros elsewhere: a
    pending reduction stays pending."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        (_, x), = call.arrays
        if x.dim() == 0:
            return []
        n = x.dim() + 1
        b = bind(call.func, call.args, call.kwargs)
        d1, d2 = b["dim1"] % n, b["dim2"] % n
        batch = iter(x._layout.dims[:-1])
        out_dims = tuple(() if i in (d1, d2) else next(batch) for i in range(n))
        src = Layout(call.mesh, (*x._layout.dims[:-1], ()), x._layout.partial)
        return [Candidate((src,), (Layout(call.mesh, out_dims, x._layout.partial),))]


@attrs.frozen
class ViewScatter:
    """select_scatter / slice_scatter / diagonal_scatter(input, src, ...): ``src`` written
    into the view of ``input`` that ``mapping`` describes (torch's view inverses, which an
    in-place write through a view becomes): the dims the view cuts into whole, every other
    dim sharded alike in ``input``, ``src`` (where the view puts it) and the output. Linear
    in both together: a reduction pending on both alike stays pending. torch's kernels clone
    ``input`` keeping its strides (``clone_preserve_strides``): a shard whose elements share
    memory (the ``unfold`` view a ``clone`` of an array keeps) is made distinct first
    (``dense="distinct"``), else the write lands on several elements."""

    mapping: Any

    def candidates(self, call: OpCall) -> list[Candidate]:
        if len(call.arrays) != 2:
            return []
        (_, x), (_, v) = call.arrays
        whole, out_map = self.mapping(bind(call.func, call.args, call.kwargs), x.ndim)
        partial = x._layout.partial if v._layout.partial == x._layout.partial else ()
        dims = tuple(() if i in whole else d for i, d in enumerate(x._layout.dims))
        inp = Layout(call.mesh, dims, partial)
        src = Layout(call.mesh, tuple(() if i is None else dims[i] for i in out_map), partial)
        cands = [Candidate((inp, src), (inp,), dense="distinct")]
        # or sharded as ``src`` is (a replicated ``input`` is cut locally: DeepSeek's key
        # states, written head-split into a fresh replicated ``new_empty``)
        vdims = [()] * x.ndim
        for j, i in enumerate(out_map):
            if i is not None and i not in whole:
                vdims[i] = v._layout.dims[j]
        if tuple(vdims) != dims:
            by_src = Layout(call.mesh, tuple(vdims), partial)
            src2 = Layout(call.mesh, tuple(() if i is None else vdims[i] for i in out_map), partial)
            cands.append(Candidate((by_src, src2), (by_src,), dense="distinct"))
        return cands


@attrs.frozen
class PadLast:
    """constant_pad_nd(x, pad): the last ``len(pad) // 2`` dims whole."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        n = len(call.shapes[0])
        k = len(bind(call.func, call.args, call.kwargs)["pad"]) // 2
        ls = tuple(None if i >= n - k else L for i, L in enumerate(letters(n)))
        return compile_dims(call, Dims((ls,), (ls,)))


def _as_complex_map(b: dict, n: int) -> tuple:
    return (n - 1,), list(range(n - 1))


def _as_real_map(b: dict, n: int) -> tuple:
    return (), list(range(n)) + [None]


def _whole(*dims: int) -> AlongDim:
    return AlongDim(fixed=dims)


TABLE = {
    aten.view: View(),
    aten._unsafe_view: View(),
    aten.reshape: View(),
    aten.expand: Expand(),
    aten.permute: Mapped(_permute_map),
    aten.transpose.int: Mapped(_transpose_map),
    aten.t: Mapped(_t_map),
    aten.squeeze: Mapped(_squeeze_map, _squeeze_local),
    aten.unsqueeze: Mapped(_unsqueeze_map),
    aten.select.int: Mapped(_select_map),
    aten.slice.Tensor: Mapped(_slice_map),
    aten.split.Tensor: Mapped(_split_map),
    aten.split_with_sizes: Mapped(_split_map),
    aten.unbind.int: Mapped(_unbind_map),
    aten.diagonal: Mapped(_diagonal_map),
    aten.unfold: Mapped(_unfold_map),
    aten.repeat: Mapped(_repeat_map),
    aten.cat: Concat(),
    aten.stack: Concat(new_dim=True),
    aten.flip: AlongDim(arg="dims"),
    aten.roll: AlongDim(arg="dims", default_all=True),
    aten.tril: _whole(-2, -1),
    aten.triu: _whole(-2, -1),
    aten.slice_backward: SizedBackward(),
    aten.select_backward: SizedBackward(insert=True),
    aten.diagonal_backward: DiagonalBackward(),
    aten.unfold_backward: UnfoldBackward(),
    aten.diag_embed: DiagEmbed(),
    aten.constant_pad_nd: PadLast(),
    aten.select_scatter: ViewScatter(_select_map),
    aten.slice_scatter: ViewScatter(_slice_map),
    aten.diagonal_scatter: ViewScatter(_diagonal_map),
    aten.view_as_complex: Mapped(_as_complex_map, dense=True),
    aten.view_as_real: Mapped(_as_real_map, dense=True),
    aten.new_zeros: NewFactory(),
    aten.new_ones: NewFactory(),
    aten.new_empty: NewFactory(),
    aten.new_full: NewFactory(),
}

# The *_copy variants behave like the views they copy.
for _name in ("view", "expand", "permute", "t", "transpose", "unsqueeze", "squeeze", "unbind",
              "split_with_sizes", "unfold", "diagonal", "select", "slice", "split"):
    _packet = getattr(aten, _name + "_copy", None)
    _rule = TABLE.get(getattr(aten, _name)) or TABLE.get(getattr(getattr(aten, _name), "int", None)) \
        or TABLE.get(getattr(getattr(aten, _name), "Tensor", None))
    if _packet is not None and _rule is not None:
        TABLE[_packet] = _rule
TABLE[aten.unsafe_split] = TABLE[aten.split.Tensor]
TABLE[aten.unsafe_split_with_sizes] = TABLE[aten.split_with_sizes]
