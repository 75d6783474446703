"""Dispatch cache entries: the rule table's candidates for one call signature costed by
the bytes their input moves send, the cheapest compiled into an :class:`_Entry` (input
moves, the backend's local call, output wrapping); the replicate fallback where no rule fits."""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Callable

import attrs
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from ..backends.device_call import with_flag_keys
from ..backends.registry import backend_for
from ..plans.planner import cost_model, plan_layouts
from ..values.errors import FallbackWarning, ShardingError, like_torch
from ..values.layout import Layout, local_shapes
from ..values.schema import op_name as _op_name
from ..values.torch_compat import settle_guards, settling_guards
from . import functorch as _ft
from . import rule_table as _rules
from .array import _BATCHED_NDIM, ShardedArray, _BatchedArray, _make_wrapper, _wrap_output, check_partial_dtype
from .bounds import output_marks
from .cpu_layouts import meta_on_cpu, traced_relayout, typed_as_on_cpu
from .fragments import _odd_stride, fragment_of
from .op_calls import _describe_call, _leaves, _replace, _to_meta, host_slots
from .reduced import reduced_forms
from .redistribute import raw_full, raw_reshard
from .strategies import Candidate, OpCall


_warned: set[str] = set()

aten = torch.ops.aten

# reductions whose meta kernels accept an empty input that torch's kernels reject (only these:
# shardfn's own compositions call amax on empty shards torch's ops never see)
_EMPTY_CHECKED = frozenset({aten.max.default, aten.min.default, aten.argmax.default, aten.argmin.default})
# products whose CPU kernels reject dtypes their meta kernels accept, even for empty inputs
# (dot / vdot of bool or complex32, addr of complex32): on a CPU mesh, empty inputs run the
# kernel too (non-empty shards run it anyway); other devices' kernels take other dtypes
_EMPTY_CHECKED_CPU = frozenset({aten.dot.default, aten.vdot.default, aten.addr.default})
# ops whose eager kernel gives empty inputs another shape than their meta kernel: the kernel's
# (torch's CPU pixel_unshuffle returns an empty input's clone, (6, 0, 0) -> (6, 0, 0); meta: (24, 0, 0))
_EMPTY_BY_KERNEL = frozenset({aten.pixel_unshuffle.default})
_DATA_DEPENDENT = (DynamicOutputShapeException, DataDependentOutputException)


def _meta_run(func: Any, args: tuple, kwargs: dict, device: str | None = None) -> Any:
    """The op on meta tensors of the global shapes: the outputs' global metadata. A
    ``device=`` argument (``.to(device)``, a cast's backward, factories) is read as meta too:
    the shards' device is the mesh's business, the output's shape and dtype are not (on a
    real device it raised here and was read as a data-dependent shape: a silent fallback).
    A rule with an ``out_meta`` computes it instead of the op's meta kernel (one stricter
    than the device kernels: ``_grouped_mm``'s accepts only bfloat16, CPU's any float).
    On a CPU ``device`` the outputs are laid out and typed as torch's CPU kernels make them.
    On symbolic sizes every tensor of the run settles its guards (``settling_guards``): a
    make_fx trace records the run and guards on its tensors' metadata."""
    symbolic = any(isinstance(v, torch.SymInt)
                   or isinstance(v, torch.Tensor) and _ft.is_symbolic((*v.shape, *v.stride()))
                   for _, v in _leaves(args, kwargs))
    with torch.no_grad(), (settling_guards() if symbolic else contextlib.nullcontext()):
        margs, mkwargs = _replace(args, kwargs, _to_meta)
        host = host_slots(func)
        if host:  # host-side arguments stay on the CPU (torch checks they are there)
            margs = tuple(a if i in host else m for i, (a, m) in enumerate(zip(args, margs)))
            mkwargs = {k: kwargs[k] if k in host else v for k, v in mkwargs.items()}
        if isinstance(mkwargs.get("device"), (torch.device, str)):
            mkwargs["device"] = "meta"
        own = getattr(_rules.lookup(func), "out_meta", None)
        if own is not None:
            out = own(func, margs, mkwargs)
        elif device == "cpu":
            out = meta_on_cpu(func, margs, mkwargs)
        else:
            return func(*margs, **mkwargs)
        return typed_as_on_cpu(func, margs, mkwargs, out) if device == "cpu" else out


def _compile(func: Any, args: tuple, kwargs: dict, leaves: list) -> "_Entry":
    arrays = [(p, v) for p, v in leaves if isinstance(v, ShardedArray)]
    _check_host_slots(func, arrays)
    meshes = {v.mesh for _, v in arrays}
    if len(meshes) > 1:
        raise ShardingError(
            f"{_describe_call(func, leaves)}: inputs live on different meshes "
            f"{sorted(f'{m!r} on {m.device_type!r}' for m in meshes)}; reshard them onto one mesh first"
        )
    mesh = next(iter(meshes))
    checked = func in _EMPTY_CHECKED or (func in _EMPTY_CHECKED_CPU and mesh.device_type == "cpu")
    if checked and all(v.numel() == 0 for _, v in arrays):
        _check_empty(func, args, kwargs)
    try:
        if func in _EMPTY_BY_KERNEL and arrays and all(v.numel() == 0 for _, v in arrays):
            out_meta = _empty_meta(func, args, kwargs)
        else:
            out_meta = _meta_run(func, args, kwargs, mesh.device_type)
        if out_meta is None and not func._schema.returns:
            out_meta = ()  # no outputs (``_linalg_check_errors``): not a shape the data decides
    except ZeroDivisionError:  # a Python meta kernel dividing by numel() of empty inputs
        out_meta = _empty_meta(func, args, kwargs)
    except NotImplementedError:
        out_meta = None  # data-dependent output shape: only the fallback can run it
    except _DATA_DEPENDENT:
        raise  # torch.compile's fake run: Dynamo breaks the graph there, as it does for plain tensors
    except (RuntimeError, IndexError, ValueError, TypeError) as e:
        if not (arrays and all(v.numel() == 0 for _, v in arrays)):
            raise _rejected(func, leaves, e) from None
        # empty inputs: torch's own kernel decides (a meta kernel may raise another type than
        # torch's, or reject what torch accepts: vector_norm(inf) of [0, 7, 5] over dim -2)
        try:
            out_meta = _empty_meta(func, args, kwargs)
        except (RuntimeError, IndexError, ValueError, TypeError) as torch_error:
            raise _rejected(func, leaves, torch_error) from None
    call = OpCall(func, args, kwargs, arrays, out_meta, mesh)
    rule = _rules.lookup(func)
    cands = rule.candidates(call) if rule is not None and out_meta is not None else []
    if not cands:
        if out_meta is None and getattr(rule, "local_when_replicated", False) and all(
                v._layout.is_replicated() for _, v in arrays):
            return _fallback_entry(func, call, None)  # each device runs it on its replica: the rule's strategy
        why = "has no sharding rule" if rule is None else (
            "has a sharding rule that does not cover this call" if out_meta is not None
            else "has an output shape that depends on the data")
        return _fallback_entry(func, call, why)
    best = min(cands, key=lambda c: _cost(c, call))
    _check_ranks(func, call, best)
    return _Entry(func, call, best)


def _check_host_slots(func: Any, arrays: list) -> None:
    """A host-side argument (``scalars`` of the foreach ops: values the kernel reads on the
    CPU) must be a plain CPU tensor, as torch requires; a ShardedArray there raised torch's
    shape complaint about the meta run."""
    host = host_slots(func)
    for path, v in arrays:
        slot = path[0] if isinstance(path, tuple) else path
        if slot in host:
            name = slot if isinstance(slot, str) else func._schema.arguments[slot].name
            raise ShardingError(f"{_op_name(func)}: argument {name!r} is read on the host and must be a plain CPU "
                                f"tensor, got a ShardedArray {tuple(v.shape)} {v.spec}; pass {name}.full_tensor()")


def _rejected(func: Any, leaves: list, e: Exception) -> Exception:
    """The op's own error on these global shapes, as torch's type (``like_torch``)."""
    return like_torch(e)(
        f"{_describe_call(func, leaves)}: shape mismatch or invalid arguments (the op rejects "
        f"these global shapes, whatever the sharding): {e}"
    )


def _check_empty(func: Any, args: tuple, kwargs: dict) -> None:
    """Run ``func`` on real empty tensors of the global shapes, for torch's own errors
    (``max()`` of an empty tensor raises; its meta kernel does not check). Empty tensors
    hold no data, so this costs no copy; a call that raises is never cached. Real tensors even
    while torch.compile traces (under its fake mode the check passed, and the entry it cached
    then answered real calls: ``max()`` of an empty array gave -inf)."""
    from torch.utils._python_dispatch import _disable_current_modes

    def empty(path: Any, v: Any) -> Any:
        return torch.empty(_ft.hint_shape(v.shape), dtype=v.dtype) if isinstance(v, ShardedArray) else v

    with torch.no_grad(), _disable_current_modes():
        eargs, ekwargs = _replace(args, kwargs, empty)
        func(*eargs, **ekwargs)


def _empty_meta(func: Any, args: tuple, kwargs: dict) -> Any:
    """The op's output metadata from a run on real tensors holding no data: empty ones, and
    an expanded zero for the others (real even while torch.compile traces: its fake tensors
    would run the same meta kernels)."""
    def empty(path: Any, v: Any) -> Any:
        if not isinstance(v, ShardedArray):
            return v
        shape = _ft.hint_shape(v.shape)
        if v.numel():
            return torch.zeros((), dtype=v.dtype).expand(shape)
        return torch.empty_strided(shape, _ft.hint_shape(v.stride()), dtype=v.dtype)

    from torch.utils._python_dispatch import _disable_current_modes

    with torch.no_grad(), _disable_current_modes():
        eargs, ekwargs = _replace(args, kwargs, empty)
        out = func(*eargs, **ekwargs)
    outs, rebuild = _flat_outputs(out)
    return rebuild([torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device="meta")
                    if isinstance(o, torch.Tensor) else o for o in outs])


def _check_ranks(func: Any, call: OpCall, cand: Candidate) -> None:
    """A rule's layouts must fit the values they describe (a bug in the rule otherwise)."""
    for l, m in zip(cand.out_layouts, call.out_metas):
        if l is not None and (not isinstance(m, torch.Tensor) or l.ndim != m.dim()):
            raise RuntimeError(f"{_op_name(func)}: sharding rule gave output layout {l!r} for {m!r}")


# how much of a pending output's eventual reduction a strategy is charged: a pending sum
# may merge with others or pass through linear ops before it is reduced once
_PENDING_WEIGHT = 0.5


def _cost(c: Candidate, call: OpCall) -> float:
    """Seconds by the mesh's cost model (latency and bytes): the input moves (a reduction
    already at hand is free), plus part of what resolving each pending output will cost,
    so ties go to the strategy a person would pick (reduce the activation once rather than
    gather a weight and leave a pending sum downstream)."""
    model = cost_model(call.mesh)
    total = 0.0
    for (_, v), want in zip(call.arrays, c.in_layouts):
        if want == v._layout:
            continue
        shape, dtype = tuple(v.shape), v.dtype
        forms = reduced_forms(v) if v._layout.partial else ()
        if want in forms:
            continue
        total += min(_seconds(model, plan_layouts(f, want, shape, dtype)) for f in (v._layout, *forms))
    for l, m in zip(c.out_layouts, call.out_metas):
        if l is not None and l.partial:
            total += _PENDING_WEIGHT * _seconds(model, plan_layouts(l, l.without_partial(), tuple(m.shape), m.dtype))
    return total


def _seconds(model: Any, plan: Any) -> float:
    return model.alpha * plan.collectives + (plan.bytes_per_device + _marked_bytes(plan)) / model.beta


def _marked_bytes(plan: Any) -> int:
    """Bytes a plan writes locally to mark a value pending (``reduce_local``: the value on one
    device of the group, zeros on the others, then summed in by the op). No communication, but
    every device holds and reads a whole-size part where the value alone was enough: charged
    like the bytes of a collective, so that a pending sum meeting a whole-size replicated
    operand is reduced first where that is cheaper (a residual added to a Megatron block's
    output: the all-reduce the next norm would run anyway, run at the add)."""
    total = 0
    for step in plan.steps:
        if step.kind == "reduce_local" and step.dim is None:
            total += math.prod(local_shapes(step.src, plan.shape)[0]) * plan.dtype.itemsize
    return total


def _flat_outputs(out: Any) -> tuple[list, Callable[[list], Any]]:
    if isinstance(out, (tuple, list)):
        kind = type(out)
        return list(out), (lambda xs: kind(xs))
    return [out], (lambda xs: xs[0])


def _nothing(outs: list) -> None:
    """The result of an op with no outputs."""
    return None


@attrs.define
class _Entry:
    """A compiled strategy for one cache key: which inputs to reshard, the backend's
    local call (``compile_call``: everything about running it is decided here, once),
    and the output metadata."""

    func: Any
    call: OpCall
    cand: Candidate
    out_shapes: list = attrs.field(init=False)
    out_dtypes: list = attrs.field(init=False)
    out_strides: list = attrs.field(init=False)  # None: contiguous
    rebuild: Callable = attrs.field(init=False)
    stacked: bool = attrs.field(init=False)  # the local call keeps symbolic sizes symbolic
    # hot-path precomputations: where the sharded args sit, which inputs need
    # resharding, the backend's local call
    positional: tuple | None = attrs.field(init=False)
    paths: tuple = attrs.field(init=False)  # where the sharded arguments sit (fixed by the key)
    any_move: bool = attrs.field(init=False)
    out_fragments: list = attrs.field(init=False)  # the outputs' fast-key fragments
    single: tuple | None = attrs.field(init=False)  # a lone tensor output's (layout, shape, dtype, fragment)
    wrap_args: tuple | None = attrs.field(init=False, default=None)  # its wrapper's constructor arguments
    moves: list = attrs.field(init=False)
    local: Any = attrs.field(init=False)
    lean: Callable | None = attrs.field(init=False)  # the local call's fast form (``warm``)
    pending_view: bool = attrs.field(init=False)  # outputs pending a reduction (``dispatch._note_derived``)
    # traced outputs laid out as the run will lay them out (``cpu_layouts.traced_relayout``), or None
    relayout: Callable | None = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        metas, self.rebuild = _flat_outputs(self.call.out_meta)
        if not self.func._schema.returns:
            self.rebuild = _nothing  # a check (``_linalg_check_errors``): torch's op returns None
        self.out_shapes = [tuple(m.shape) if isinstance(m, torch.Tensor) else None for m in metas]
        self.out_dtypes = [m.dtype if isinstance(m, torch.Tensor) else None for m in metas]
        self.out_strides = [None if not isinstance(m, torch.Tensor) or _ft.is_symbolic(m.shape)
                            else _odd_stride(tuple(m.shape), m.stride(), m.storage_offset()) for m in metas]
        # the key holds the input layouts and shapes, so which inputs need resharding is fixed
        self.moves = [
            v._layout != want and bool(plan_layouts(v._layout, want, _ft.hint_shape(v.shape), v.dtype).steps)
            for (_, v), want in zip(self.call.arrays, self.cand.in_layouts)
        ]
        paths = tuple(p for p, _ in self.call.arrays)
        self.positional = paths if all(isinstance(p, int) for p in paths) else None
        self._precompute_warm_path(paths)
        self.local = backend_for(self.call.mesh).compile_call(
            self.func, self.call, self.cand, self.out_shapes, self.positional)
        self.stacked = self.local.keeps_symbolic
        self.pending_view = any(l is not None and l.partial for l in self.cand.out_layouts)
        lone = self.positional is not None and not self.any_move and self.single is not None
        self.lean = self.local.lean if lone else None
        self.relayout = traced_relayout(self.func, self.call.args) if self.call.mesh.device_type == "cpu" else None
        if self.relayout is not None and self.lean is not None:
            self.lean = _relaid_lean(self.lean, self.relayout)
        # the cache must not keep the first call's arrays alive (nor count as holding them)
        self.call = attrs.evolve(self.call, args=(), kwargs={}, arrays=[])

    def _precompute_warm_path(self, paths: tuple) -> None:
        """What ``run`` needs per call, fixed by the cache key: where the arrays sit, whether
        any moves, the outputs' key fragments (and a lone output's wrap arguments)."""
        self.paths, self.any_move = paths, any(self.moves)
        for l, d in zip(self.cand.out_layouts, self.out_dtypes):
            if l is not None and l.partial:
                check_partial_dtype(l, d)  # what ShardedArray() checks; outputs skip it
        finite = output_marks(self.func, self.call, self.cand.out_layouts, self.out_dtypes)
        self.out_fragments = [
            None if s is None or l is None or _ft.is_symbolic(s) else fragment_of(l, s, d, st, u)
            for l, s, d, st, u in zip(self.cand.out_layouts, self.out_shapes, self.out_dtypes, self.out_strides, finite)
        ]
        single = not isinstance(self.call.out_meta, (tuple, list)) and self.cand.out_layouts[0] is not None
        self.single = (self.cand.out_layouts[0], self.out_shapes[0], self.out_dtypes[0],
                       self.out_fragments[0], self.out_strides[0]) if single else None
        if single:  # ``_wrap_output``'s arguments to the wrapper constructor, for ``warm``
            layout, shape, dtype, frag, stride = self.single
            self.wrap_args = (ShardedArray if len(shape) < _BATCHED_NDIM else _BatchedArray, shape,
                              *(stride if stride is not None else (None, None)), dtype, layout, frag)

    def warm(self, args: tuple, kwargs: dict) -> Any:
        """``run`` for dispatch's fast path, whose arrays are stored canonically (``_fragment``):
        one local call and one wrap when the backend has a lean form for it."""
        lean = self.lean
        if lean is not None:
            out = lean(args, kwargs)
            if out is not None:  # ``_wrap_output`` inlined (two Python calls less on every warm op)
                cls, shape, strides, offset, dtype, layout, frag = self.wrap_args
                r = _make_wrapper(cls, shape, strides, offset, None, dtype, torch.strided,
                                  (out[0] if type(out) is tuple else out).device)
                r._local = out
                r._layout = layout
                r._kf = frag
                return r
        return self.run(args, kwargs)

    def run(self, args: tuple, kwargs: dict, leaves: Any = None, symbolic: bool = False) -> Any:
        """Reshard the inputs that need it, run the backend's local call, wrap the outputs
        (the sharded arguments sit where ``paths`` says: the cache key fixes it, ``leaves``
        is unused)."""
        if self.positional is not None and not self.any_move:
            values = {p: args[p]._local for p in self.positional}
        else:
            values = {p: raw_reshard(v, want) if move else v._local
                      for p, want, move in zip(self.paths, self.cand.in_layouts, self.moves)
                      for v in (_at(args, kwargs, p),)}
        locals_ = self.local(args, kwargs, values, symbolic)
        if self.relayout is not None:
            locals_ = self.relayout(locals_)
        if symbolic:
            return self.rebuild(self._wrap_symbolic(args, kwargs, locals_))
        if self.single is not None:  # one tensor output (most ops): no lists, no rebuild
            return _wrap_output(locals_[0], *self.single)
        return self.rebuild([
            local if layout is None or local is None else _wrap_output(local, layout, shape, dtype, frag, stride)
            for local, layout, shape, dtype, frag, stride in zip(
                locals_, self.cand.out_layouts, self.out_shapes, self.out_dtypes, self.out_fragments, self.out_strides)
        ])

    def _wrap_symbolic(self, args: tuple, kwargs: dict, locals_: list) -> list:
        """Outputs of a symbolic call: global sizes read off the stacked local outputs; strides
        and storage offset those torch gives the op on tensors of the symbolic global shapes
        (a meta run: ``x.t().is_contiguous()`` is False under ``dynamic=True`` as in eager)."""
        try:
            metas, _ = _flat_outputs(_meta_run(self.func, args, kwargs))
        except Exception:  # noqa: BLE001 - no meta run on these sizes: contiguous, static sizes specialised
            metas = [None] * len(locals_)
        results = []
        for local, layout, dtype, meta in zip(locals_, self.cand.out_layouts, self.out_dtypes, metas):
            if layout is None or local is None:
                results.append(local)
                continue
            settle_guards(local)
            shape = _global_of_stacked(local, layout)
            if not _ft.is_symbolic(shape):
                shape = _check_static_output(meta, shape)
            # as they are (comparing symbolic strides with the contiguous ones would guard on them)
            stride = None if meta is None else (tuple(meta.stride()), meta.storage_offset())
            results.append(_wrap_output(local, layout, shape, dtype, None, stride))
        return results


def _relaid_lean(lean: Callable, relayout: Callable) -> Callable:
    """``lean`` with its output laid out by ``relayout`` (``_Entry.relayout``)."""
    def run(args: tuple, kwargs: dict) -> Any:
        out = lean(args, kwargs)
        return out if out is None or type(out) is torch.Tensor else relayout([out])[0]  # (eager: as it is)
    return run


def _at(args: tuple, kwargs: dict, path: Any) -> Any:
    """The argument at ``path`` (a position, a (position, index) pair, or a keyword)."""
    if isinstance(path, int):
        return args[path]
    if isinstance(path, tuple):
        return args[path[0]][path[1]]
    return kwargs[path]


def _check_static_output(meta: torch.Tensor | None, shape: tuple) -> tuple:
    """A call with symbolic inputs gave an output of concrete sizes: fine when the op's
    output (``meta``, its run on the symbolic global shapes) really has those sizes; a rule
    that baked hint sizes in would silently bake them into the graph, so the call is redone
    with its sizes specialised (guarded)."""
    want = None if meta is None else tuple(meta.shape)
    if want is None or _ft.is_symbolic(want):
        raise _BakedSizes(f"{want}")
    return shape


def _global_of_stacked(local: torch.Tensor, layout: Layout) -> tuple:
    """The global shape of a stacked value of an even layout (symbolic sizes kept)."""
    mesh = layout.mesh
    return tuple(
        n * math.prod(mesh.axis_size(a) for a in axes)
        for n, axes in zip(local.shape[mesh.ndim:], layout.dims)
    )


def _fallback_entry(func: Any, call: OpCall, why: str | None) -> Any:
    """Replicate-run-replicate; ``why`` is warned about once per op (no path replicates
    silently)."""
    name = _op_name(func)
    if why is not None and name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"{_describe_call(func, call.arrays)} {why}: its inputs are replicated and it runs on the full "
            f"tensors; add a rule with sf.register_sharding({name.replace('aten.', 'torch.ops.aten.')}, ...)",
            FallbackWarning,
            stacklevel=4,
        )
    return _Fallback(func, call.mesh)


def _as_reported(v: ShardedArray) -> torch.Tensor:
    """``v``'s full value in memory laid out with its reported strides and storage offset
    (contiguous where those overlap)."""
    full = raw_full(v)
    shape, stride, off = tuple(v.shape), v.stride(), v.storage_offset()
    if full.numel() == 0 or _odd_stride(shape, stride, off) is None or 0 in stride:
        return full.contiguous()
    extent = 1 + sum((n - 1) * st for n, st in zip(shape, stride))
    out = torch.empty(off + extent, dtype=full.dtype, device=full.device).as_strided(shape, stride, off)
    try:
        out.copy_(full)
    except RuntimeError:  # overlapping strides
        return full.contiguous()
    return out


# ops that read the storage around a view, not only its elements (as torch keeps them)
_READS_STORAGE = frozenset({aten.as_strided.default, aten.as_strided_copy.default})


def _in_storage(v: ShardedArray) -> torch.Tensor:
    """``v`` as a plain view into a buffer holding its root base's values where torch keeps
    them, so an op that reads the storage around a view (``as_strided``) reads the base's
    values and torch's storage-bounds check sees the base's storage."""
    root = v._base if v._is_view() and isinstance(v._base, ShardedArray) else v
    n = root.untyped_storage().nbytes() // root.element_size()
    buf = torch.zeros(n, dtype=root.dtype, device=root.device)
    full = _flipped(raw_full(root), root)  # the storage holds what torch stores: lazy conj/neg flags undone
    at = buf.as_strided(tuple(root.shape), root.stride(), root.storage_offset())
    for d in reversed(range(root.dim())):  # an expanded dim holds one value where it is stored
        if root.stride(d) == 0 and root.shape[d] > 1:
            at, full = at.narrow(d, 0, 1), full.narrow(d, 0, 1)
    try:
        at.copy_(full)
    except RuntimeError:  # overlapping strides: read v's own elements only
        return _as_reported(v)
    if v.dtype != root.dtype:
        buf = buf.view(v.dtype)
    # v's true values where torch stores the flagged ones: the whole buffer flipped, so the
    # op still sees one storage (as_strided's storage offset is the buffer's)
    return _flipped(buf, v).as_strided(tuple(v.shape), v.stride(), v.storage_offset())


def _flipped(t: torch.Tensor, like: ShardedArray) -> torch.Tensor:
    """``t`` conjugated / negated where ``like`` carries torch's lazy conj / neg flag: an array's
    values are true values, its storage (as torch keeps it) the flagged ones; both ways alike."""
    if like.is_conj():
        t = t.conj_physical()
    return t.neg() if like.is_neg() else t


@attrs.define
class _Fallback:
    func: Any
    mesh: Any
    pending_view: bool = False  # outputs are replicated

    def run(self, args: tuple, kwargs: dict, leaves: Any = None, symbolic: bool = False) -> Any:
        # laid out as the wrapper says (kernels such as native_group_norm_backward trust the
        # strides; as_strided reads the storage; a replicated value is an expanded view)
        lay_out = _in_storage if self.func in _READS_STORAGE else _as_reported
        a, k = _replace(args, kwargs, lambda p, v: lay_out(v) if isinstance(v, ShardedArray) else v)
        complex_call = any(isinstance(v, torch.Tensor) and v.is_complex() for v in (*a, *k.values()))
        out = (with_flag_keys(self.func) if complex_call else self.func)(*a, **k)
        backend = backend_for(self.mesh)
        outs, rebuild = _flat_outputs(out)

        def wrapped(o: Any) -> Any:
            if isinstance(o, (list, tuple)):  # a list output among several (``_fused_adam``'s): each tensor too
                return type(o)(wrapped(x) for x in o)
            if not isinstance(o, torch.Tensor):
                return o
            layout = Layout(self.mesh, ((),) * o.dim())
            # reported as torch lays the output out (a view's strides and storage offset:
            # forward AD checks that a view's tangent is laid out like its primal)
            return _wrap_output(backend.replicated(o, self.mesh), layout, tuple(o.shape), o.dtype, None,
                                (tuple(o.stride()), o.storage_offset()))

        return rebuild([wrapped(o) for o in outs])

    def warm(self, args: tuple, kwargs: dict) -> Any:
        return self.run(args, kwargs)


class _BakedSizes(Exception):
    """A rule computed local sizes from the hints where the output's are symbolic."""
