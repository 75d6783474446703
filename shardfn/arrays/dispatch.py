"""Sharding propagation for every aten op on ShardedArrays.

``dispatch`` is called from ``ShardedArray.__torch_dispatch__``. The hot path is one cache
lookup keyed on the op, the input layouts/shapes/dtypes and the static arguments (floats
excluded, so a new scalar each step still hits): a warm call builds ``_fast_key`` from
each array's cached, identity-hashed key fragment; ``_dispatch`` (misses, special cases)
uses the full ``_key`` and files the entry under both. On a miss the rule table proposes
candidate strategies, each costed by the bytes its input redistributions move; the
cheapest is compiled into an :class:`_Entry` that reshards inputs, runs the backend's
local call (``compile_call``), and wraps the outputs.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import attrs
import torch

from ..backends.registry import backend_for
from ..plans.planner import PLAN_CACHES, cost_model, plan_layouts
from ..values.errors import FallbackWarning, ShardingError
from ..values import replica_checks as _replicas
from ..values.layout import Layout, describe
from ..values.schema import op_name as _op_name
from . import array as _array
from . import explicit as _explicit
from . import functorch as _ft
from . import inplace as _inplace
from . import rule_table as _rules
from .array import (ShardedArray, _BatchedArray, _wrap_output, check_partial_dtype, note_derived, raw_full, raw_reshard,
                    wrap)
from .fragments import _fragment, fragment_of
from .reduced import reduced_forms
from .strategies import Candidate, OpCall

aten = torch.ops.aten

_cache: dict[tuple, "_Entry"] = {}
_CACHE_MAX = 4096  # entries; the oldest is dropped first (keys hold int arguments' values)
PLAN_CACHES.append(_cache.clear)  # strategies are chosen by the cost model (``set_cost_model``)
_warned: set[str] = set()


def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` on ShardedArrays: a warm call is one fast key, one dict lookup, the
    entry's run; anything else (a miss, explicit mode, plain tensors, symbolic sizes,
    special and in-place ops) takes ``_dispatch``."""
    fkey = _fast_key(func, args, kwargs)
    if fkey is not None and not _explicit._stack:
        entry = _cache.get(fkey)
        if entry is not None:
            out = entry.warm(args, kwargs)
            if fkey[0] in _VIEWS:
                _inplace.note_views(func, args, kwargs, out)
                if entry.pending_view:
                    _note_derived(func, args, kwargs, out)
            return out
    out = _dispatch(func, args, kwargs, fkey)
    if _inplace.is_view(func):
        _inplace.note_views(func, args, kwargs, out)  # what the output aliases (in-place policy)
        _note_derived(func, args, kwargs, out)
    return out


def _note_derived(func: Any, args: tuple, kwargs: dict, out: Any) -> None:
    """A view of a pending value is reduced through its base (``array.note_derived``)."""
    base = args[0] if args else None
    if isinstance(base, ShardedArray) and base._layout.partial:
        note_derived(func, base, args[1:], kwargs, out if isinstance(out, (tuple, list)) else (out,))


# the ops seen to return an alias of an input (``_inplace.is_view``), by id (fast keys hold
# ids); holding the op keeps its id from being reused
_VIEWS: dict[int, Any] = {}


def _dispatch(func: Any, args: tuple, kwargs: dict, fkey: tuple | None = None) -> Any:
    special = _SPECIAL.get(func)
    if special is not None:
        out = special(func, args, kwargs)
        if out is not NotImplemented:  # a handler may leave a call to the rule table
            return out
    if func._schema.is_mutable:
        return _inplace.run_mutating(func, args, kwargs)
    if func is aten.native_batch_norm.default:
        out = _inplace.unannotated_batch_norm(func, args, kwargs)
        if out is not None:
            return out
    leaves = _leaves(args, kwargs)
    if any(isinstance(v, torch.Tensor) and not isinstance(v, ShardedArray) for _, v in leaves):
        args, kwargs = _lift_plain(func, args, kwargs, leaves)
        leaves = _leaves(args, kwargs)
    key = _key(func, leaves)
    try:
        entry = _cache.get(key)
    except TypeError:  # symbolic sizes (SymInts do not hash): torch.compile with dynamic shapes
        if _any_symbolic(leaves):
            return _dispatch_symbolic(func, args, kwargs, leaves)
        raise
    if entry is None:
        entry = _remember(key, _compile(func, args, kwargs, leaves))
    if (fkey is not None and func not in _SPECIAL and func is not aten.native_batch_norm.default
            and _cache.get(fkey) is not entry):
        if _inplace.is_view(func):
            _VIEWS[id(func)] = func
        _remember(fkey, entry)  # the next such call takes dispatch's fast path
    if _explicit._stack:
        _explicit.check(func, entry, leaves)
    return entry.run(args, kwargs, leaves)


def _remember(key: tuple, entry: Any) -> Any:
    """Cache ``entry``, dropping the oldest entries beyond ``_CACHE_MAX`` (a miss only:
    hits cost nothing extra)."""
    while len(_cache) >= _CACHE_MAX:
        del _cache[next(iter(_cache))]
    _cache[key] = entry
    return entry


# -- symbolic (dynamic) shapes under torch.compile ----------------------------------------------


def _any_symbolic(leaves: list) -> bool:
    return any(
        isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and _ft.is_symbolic(v.shape))
        for _, v in leaves
    )


def _dispatch_symbolic(func: Any, args: tuple, kwargs: dict, leaves: list) -> Any:
    """A call with symbolic sizes: the strategy is chosen (and cached) on the sizes'
    hints, by the same code as concrete calls; the local op then runs on the symbolic
    stacked shards, and output global sizes are read off the local outputs, so nothing is
    specialised. Only the stacked path (every layout even) keeps sizes symbolic."""

    def hinted(path: Any, v: Any) -> Any:
        if isinstance(v, ShardedArray):
            return ShardedArray(v._local, v._layout, _ft.hint_shape(v.shape), v.dtype)
        if isinstance(v, torch.SymInt):
            return _ft.hint_int(v)
        return v

    hargs, hkwargs = _replace(args, kwargs, hinted)
    hleaves = _leaves(hargs, hkwargs)
    key = _key(func, hleaves)
    entry = _cache.get(key)
    if entry is None:
        entry = _remember(key, _compile(func, hargs, hkwargs, hleaves))
    if _explicit._stack:
        _explicit.check(func, entry, hleaves)
    if not isinstance(entry, _Entry) or not entry.stacked:
        # uneven shards or the replicate fallback: sizes cannot stay symbolic, so
        # specialise them (a guard; a dim marked dynamic is then reported by Dynamo)
        return dispatch(func, *_replace(args, kwargs, _specialised))
    try:
        return entry.run(args, kwargs, leaves, symbolic=True)
    except _BakedSizes:
        return dispatch(func, *_replace(args, kwargs, _specialised))


class _BakedSizes(Exception):
    """A rule computed local sizes from the hints where the output's are symbolic."""


def _specialised(path: Any, v: Any) -> Any:
    """``v`` with its symbolic sizes specialised to their values (guarded)."""
    if isinstance(v, torch.SymInt):
        return int(v)
    if isinstance(v, ShardedArray) and _ft.is_symbolic(v.shape):
        from ..values.layout import local_shapes

        shape = tuple(int(n) for n in v.shape)
        local = v._local
        if isinstance(local, torch.Tensor):
            local = local.view(*local.shape[:v.mesh.ndim], *local_shapes(v._layout, shape)[0])
        return ShardedArray(local, v._layout, shape, v.dtype, requires_grad=v.requires_grad)
    if isinstance(v, torch.Tensor) and _ft.is_symbolic(v.shape):
        return v.view(tuple(int(n) for n in v.shape))
    return v


# -- call analysis -----------------------------------------------------------------------------


def _leaves(args: tuple, kwargs: dict) -> list[tuple[Any, Any]]:
    """(path, value) of every argument, lists flattened one level."""
    out = []
    for i, a in enumerate(args):
        if isinstance(a, (list, tuple)):
            out.extend(((i, j), b) for j, b in enumerate(a))
            out.append(((i, "len"), len(a)))
        else:
            out.append((i, a))
    for k, v in kwargs.items():
        out.append((k, v))
    return out


def _lift_plain(func: Any, args: tuple, kwargs: dict, leaves: list) -> tuple[tuple, dict]:
    """Plain tensors next to ShardedArrays take part as replicated values (only in
    Tensor parameters: a 0-d tensor passed as a Scalar stays a number to the op)."""
    mesh = next((v.mesh for _, v in leaves if isinstance(v, ShardedArray)), None)
    if mesh is None:
        return args, kwargs
    slots = _tensor_slots(func)
    from .array import raw_distribute

    checked = _replicas.checking()

    def lift(path: Any, v: Any) -> Any:
        slot = path[0] if isinstance(path, tuple) else path
        if isinstance(v, torch.Tensor) and not isinstance(v, ShardedArray) and slot in slots:
            if checked:
                what = f"{_op_name(func)}: {_arg_name(func, path)}, a plain tensor,"
                backend_for(mesh).check_replicas(mesh, v, mesh.axis_names, what)
            layout = Layout(mesh, ((),) * v.dim())
            return wrap(raw_distribute(v, layout), layout, v.shape, v.dtype)
        return v

    return _replace(args, kwargs, lift)


def _arg_name(func: Any, path: Any) -> str:
    """``argument 'other' (position 1)`` for an op argument at ``path`` (index or keyword, then list index)."""
    slot, rest = (path[0], path[1:]) if isinstance(path, tuple) else (path, ())
    if isinstance(slot, int):
        args = func._schema.arguments
        name = f"argument {args[slot].name!r} (position {slot})" if slot < len(args) else f"argument {slot}"
    else:
        name = f"argument {slot!r}"
    return name + "".join(f"[{i}]" for i in rest)


_SLOTS: dict[Any, frozenset] = {}


def _tensor_slots(func: Any) -> frozenset:
    """Positions and names of the parameters typed Tensor (or Tensor list / optional)."""
    slots = _SLOTS.get(func)
    if slots is None:
        found = set()
        for i, a in enumerate(func._schema.arguments):
            if "Tensor" in str(a.type):
                found.update((i, a.name))
        slots = _SLOTS[func] = frozenset(found)
    return slots


_FAST = object()  # marks a fast key (``_key``s never hold it)
_KW = object()  # separates a fast key's keyword arguments from its positional ones
_TRUE, _FALSE = object(), object()  # bools keyed apart from ints (True == 1 promotes differently)
_MISS = object()
_AS_IS = frozenset({int, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout})


def _fast_key(func: Any, args: tuple, kwargs: dict) -> tuple | None:
    """The warm-path cache key: the op's id (OpOverload hashes in Python; an entry holds
    its op, so the id stays unique while the key is cached), then per argument its array's interned (layout,
    shape, dtype) fragment, or its value (ints, strings, None, dtypes, devices), or just
    its type (floats, complex), or a bool marker; lists and tuples as tuples of those.
    None (take ``_dispatch``) for anything else: plain tensors, SymInts, symbolic shapes."""
    parts = [id(func), _FAST]
    for a in args:
        t = type(a)
        if t is ShardedArray or t is _BatchedArray:
            k = a._kf
            if k is None:
                k = _fragment(a)
                if k is None:
                    return None
            parts.append(k)
        elif t is int or a is None:
            parts.append(a)
        else:
            k = _fast_part(a, t)
            if k is _MISS:
                return None
            parts.append(k)
    if kwargs:
        parts.append(_KW)
        for name, a in kwargs.items():
            k = _fast_part(a, type(a))
            if k is _MISS:
                return None
            parts.append(name)
            parts.append(k)
    return tuple(parts)


def _fast_part(a: Any, t: type) -> Any:
    """One argument's part of a fast key (``_MISS`` if it has none)."""
    if t is ShardedArray or t is _BatchedArray:
        k = a._kf
        return k if k is not None else (_fragment(a) or _MISS)
    if t in _AS_IS:
        return a
    if t is float:
        return float
    if t is bool:
        return _TRUE if a else _FALSE
    if t is list or t is tuple:
        out = tuple(_fast_part(b, type(b)) for b in a)
        return _MISS if _MISS in out else out
    if t is complex:
        return complex
    return _MISS


def _key(func: Any, leaves: list) -> tuple:
    parts: list[Any] = [func]
    for path, v in leaves:
        if isinstance(v, ShardedArray):
            parts.append((path, v._layout, v.shape, v.dtype, reduced_forms(v) if v._layout.partial else None))
        elif isinstance(v, torch.Tensor):
            parts.append((path, "T", v.shape, v.dtype, v.device))
        elif isinstance(v, float):
            parts.append((path, "f"))
        elif isinstance(v, complex):
            parts.append((path, "c"))
        elif v is True or v is False:  # True == 1 as a dict key, but promotes differently
            parts.append((path, "b", v))
        else:
            parts.append((path, v))
    return tuple(parts)


def _replace(args: tuple, kwargs: dict, fn: Callable[[Any, Any], Any]) -> tuple[tuple, dict]:
    """Rebuild args/kwargs with ``fn(path, value)`` applied to every leaf."""
    new_args = []
    for i, a in enumerate(args):
        if isinstance(a, (list, tuple)):
            new_args.append(type(a)(fn((i, j), b) for j, b in enumerate(a)))
        else:
            new_args.append(fn(i, a))
    return tuple(new_args), {k: fn(k, v) for k, v in kwargs.items()}


def _to_meta(path: Any, v: Any) -> Any:
    if isinstance(v, ShardedArray):
        return torch.empty(v.shape, dtype=v.dtype, device="meta")
    if isinstance(v, torch.Tensor):
        return v.to("meta")
    return v


def _meta_run(func: Any, args: tuple, kwargs: dict) -> Any:
    """The op on meta tensors of the global shapes: the outputs' global metadata. A
    ``device=`` argument (``.to(device)``, a cast's backward) is read as meta too: the
    shards' device is the backend's business, the output's shape and dtype are not."""
    with torch.no_grad():
        margs, mkwargs = _replace(args, kwargs, _to_meta)
        if isinstance(mkwargs.get("device"), (torch.device, str)):
            mkwargs["device"] = "meta"
        return func(*margs, **mkwargs)


def _describe_call(func: Any, leaves: list) -> str:
    arrays = [v for _, v in leaves if isinstance(v, ShardedArray)]
    return f"{_op_name(func)}: " + " x ".join(describe(tuple(a.shape), a.dtype, a._layout) for a in arrays)


# -- compilation -----------------------------------------------------------------------------------


def _compile(func: Any, args: tuple, kwargs: dict, leaves: list) -> "_Entry":
    arrays = [(p, v) for p, v in leaves if isinstance(v, ShardedArray)]
    meshes = {v.mesh for _, v in arrays}
    if len(meshes) > 1:
        raise ShardingError(
            f"{_describe_call(func, leaves)}: inputs live on different meshes "
            f"{sorted(map(repr, meshes))}; reshard them onto one mesh first"
        )
    mesh = next(iter(meshes))
    try:
        out_meta = _meta_run(func, args, kwargs)
    except NotImplementedError:
        out_meta = None  # data-dependent output shape: only the fallback can run it
    except (RuntimeError, IndexError, ValueError, TypeError) as e:
        raise ShardingError(
            f"{_describe_call(func, leaves)}: shape mismatch or invalid arguments (the op rejects "
            f"these global shapes, whatever the sharding): {e}"
        ) from None
    call = OpCall(func, args, kwargs, arrays, out_meta, mesh)
    rule = _rules.lookup(func)
    cands = rule.candidates(call) if rule is not None and out_meta is not None else []
    if not cands:
        why = "has no sharding rule" if rule is None else (
            "has a sharding rule that does not cover this call" if out_meta is not None
            else "has an output shape that depends on the data")
        return _fallback_entry(func, call, why)
    best = min(cands, key=lambda c: _cost(c, call))
    _check_ranks(func, call, best)
    return _Entry(func, call, best)


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
    return model.alpha * plan.collectives + plan.bytes_per_device / model.beta


def _flat_outputs(out: Any) -> tuple[list, Callable[[list], Any]]:
    if isinstance(out, (tuple, list)):
        kind = type(out)
        return list(out), (lambda xs: kind(xs))
    return [out], (lambda xs: xs[0])


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
    rebuild: Callable = attrs.field(init=False)
    stacked: bool = attrs.field(init=False)  # the local call keeps symbolic sizes symbolic
    # hot-path precomputations: where the sharded args sit, which inputs need
    # resharding, the backend's local call
    positional: tuple | None = attrs.field(init=False)
    paths: tuple = attrs.field(init=False)  # where the sharded arguments sit (fixed by the key)
    any_move: bool = attrs.field(init=False)
    out_fragments: list = attrs.field(init=False)  # the outputs' fast-key fragments
    single: tuple | None = attrs.field(init=False)  # a lone tensor output's (layout, shape, dtype, fragment)
    moves: list = attrs.field(init=False)
    local: Any = attrs.field(init=False)
    lean: Callable | None = attrs.field(init=False)  # the local call's fast form (``warm``)
    pending_view: bool = attrs.field(init=False)  # outputs pending a reduction (``_note_derived``)

    def __attrs_post_init__(self) -> None:
        metas, self.rebuild = _flat_outputs(self.call.out_meta)
        self.out_shapes = [tuple(m.shape) if isinstance(m, torch.Tensor) else None for m in metas]
        self.out_dtypes = [m.dtype if isinstance(m, torch.Tensor) else None for m in metas]
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
        # the cache must not keep the first call's arrays alive (nor count as holding them)
        self.call = attrs.evolve(self.call, args=(), kwargs={}, arrays=[])

    def _precompute_warm_path(self, paths: tuple) -> None:
        """What ``run`` needs per call, fixed by the cache key: where the arrays sit, whether
        any moves, the outputs' key fragments (and a lone output's wrap arguments)."""
        self.paths, self.any_move = paths, any(self.moves)
        for l, d in zip(self.cand.out_layouts, self.out_dtypes):
            if l is not None and l.partial:
                check_partial_dtype(l, d)  # what ShardedArray() checks; outputs skip it
        self.out_fragments = [
            None if s is None or l is None or _ft.is_symbolic(s) else fragment_of(l, s, d)
            for l, s, d in zip(self.cand.out_layouts, self.out_shapes, self.out_dtypes)
        ]
        single = not isinstance(self.call.out_meta, (tuple, list)) and self.cand.out_layouts[0] is not None
        self.single = (self.cand.out_layouts[0], self.out_shapes[0], self.out_dtypes[0],
                       self.out_fragments[0]) if single else None

    def warm(self, args: tuple, kwargs: dict) -> Any:
        """``run`` for dispatch's fast path, whose arrays are stored canonically (``_fragment``):
        one local call and one wrap when the backend has a lean form for it."""
        lean = self.lean
        if lean is not None:
            out = lean(args, kwargs)
            if out is not None:
                return _wrap_output(out, *self.single)
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
        if symbolic:
            return self.rebuild(self._wrap_symbolic(args, kwargs, locals_))
        if self.single is not None:  # one tensor output (most ops): no lists, no rebuild
            return _wrap_output(locals_[0], *self.single)
        return self.rebuild([
            local if layout is None else _wrap_output(local, layout, shape, dtype, frag)
            for local, layout, shape, dtype, frag in zip(
                locals_, self.cand.out_layouts, self.out_shapes, self.out_dtypes, self.out_fragments)
        ])

    def _wrap_symbolic(self, args: tuple, kwargs: dict, locals_: list) -> list:
        """Outputs of a symbolic call: global sizes read off the stacked local outputs."""
        results = []
        for local, layout, dtype in zip(locals_, self.cand.out_layouts, self.out_dtypes):
            if layout is None:
                results.append(local)
                continue
            shape = _global_of_stacked(local, layout)
            if not _ft.is_symbolic(shape):
                shape = _check_static_output(self.func, args, kwargs, len(results), shape)
            results.append(ShardedArray(local, layout, shape, dtype))
        return results


def _at(args: tuple, kwargs: dict, path: Any) -> Any:
    """The argument at ``path`` (a position, a (position, index) pair, or a keyword)."""
    if isinstance(path, int):
        return args[path]
    if isinstance(path, tuple):
        return args[path[0]][path[1]]
    return kwargs[path]


def _check_static_output(func: Any, args: tuple, kwargs: dict, i: int, shape: tuple) -> tuple:
    """A call with symbolic inputs gave an output of concrete sizes: fine when the op's
    output really has those sizes; a rule that baked hint sizes in would silently bake
    them into the graph, so the call is redone with its sizes specialised (guarded)."""
    outs, _ = _flat_outputs(_meta_run(func, args, kwargs))
    want = tuple(outs[i].shape)
    if _ft.is_symbolic(want):
        raise _BakedSizes(f"{_op_name(func)}: {want}")
    return shape


def _global_of_stacked(local: torch.Tensor, layout: Layout) -> tuple:
    """The global shape of a stacked value of an even layout (symbolic sizes kept)."""
    mesh = layout.mesh
    return tuple(
        n * math.prod(mesh.axis_size(a) for a in axes)
        for n, axes in zip(local.shape[mesh.ndim:], layout.dims)
    )


# -- fallback: replicate, run once, replicate the result ------------------------------------------


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


@attrs.define
class _Fallback:
    func: Any
    mesh: Any
    pending_view: bool = False  # outputs are replicated

    def run(self, args: tuple, kwargs: dict, leaves: Any = None, symbolic: bool = False) -> Any:
        # contiguous like the wrapper claims to be (kernels such as native_group_norm_backward
        # trust a contiguous-looking argument; a replicated value is an expanded view)
        a, k = _replace(args, kwargs, lambda p, v: raw_full(v).contiguous() if isinstance(v, ShardedArray) else v)
        out = self.func(*a, **k)
        backend = backend_for(self.mesh)
        outs, rebuild = _flat_outputs(out)
        res = []
        for o in outs:
            if isinstance(o, torch.Tensor):
                layout = Layout(self.mesh, ((),) * o.dim())
                res.append(wrap(backend.replicated(o, self.mesh), layout, o.shape, o.dtype))
            else:
                res.append(o)
        return rebuild(res)

    def warm(self, args: tuple, kwargs: dict) -> Any:
        return self.run(args, kwargs)


# -- in-place ops and special cases -------------------------------------------------------------------


def _alias(func: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    return wrap(x._local, x._layout, x.shape, x.dtype)


def _is_same_size(func: Any, args: tuple, kwargs: dict) -> bool:
    return tuple(args[0].shape) == tuple(args[1].shape)


def _same_storage_numel(func: Any, args: tuple, kwargs: dict) -> bool:
    # forward AD (jvp) asks before reusing a tangent; a ShardedArray's "storage" is its
    # global extent (wrappers are always contiguous)
    return args[0].numel() == args[1].numel()


def _allclose(func: Any, args: tuple, kwargs: dict) -> bool:
    """Like ``equal``: shard by shard in one layout (broadcasting operands: on full values)."""
    a, b, *rest = args
    if tuple(a.shape) != tuple(b.shape):
        full = [raw_full(t) if isinstance(t, ShardedArray) else t for t in (a, b)]
        return bool(func(*full, *rest, **kwargs))
    return _equal(func, (a, b), {}, compare=lambda x, y: func(x, y, *rest, **kwargs))


def _equal(func: Any, args: tuple, kwargs: dict, compare: Callable = torch.equal) -> bool:
    a, b = args
    if tuple(a.shape) != tuple(b.shape):
        return False
    if not isinstance(a, ShardedArray):
        a, b = b, a
    layout = a._layout.without_partial()
    if isinstance(b, ShardedArray) and b.mesh != a.mesh:
        raise ShardingError(f"aten.equal: operands live on different meshes {a.mesh!r} and {b.mesh!r}")
    from .array import raw_distribute

    va = raw_reshard(a, layout)
    vb = raw_reshard(b, layout) if isinstance(b, ShardedArray) else raw_distribute(b, layout)
    return backend_for(a.mesh).all_true(
        [compare(x, y) for x, y in zip(_shards(va, a.mesh), _shards(vb, a.mesh))], a.mesh
    )


def _shards(value: Any, mesh: Any) -> tuple:
    return backend_for(mesh).shard_list(value, mesh)


def _scalar(func: Any, args: tuple, kwargs: dict) -> Any:
    return func(raw_full(args[0]))


_SPECIAL: dict[Any, Callable] = _rules.SPECIAL  # the rule families add theirs (losses, random ops)
_SPECIAL.update({
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.clone.default: _alias,
    aten._lazy_clone.default: _alias,
    aten.lift_fresh.default: _alias,
    aten.is_same_size.default: _is_same_size,
    aten._has_same_storage_numel.default: _same_storage_numel,
    aten.equal.default: _equal,
    aten.allclose.default: _allclose,
    aten._local_scalar_dense.default: _scalar,
})
_rules.on_change(_cache.clear)  # a registered rule replaces what cached entries chose
_array._dispatch_fn = dispatch  # ShardedArray.__torch_dispatch__ calls it (array.py cannot import this module)
