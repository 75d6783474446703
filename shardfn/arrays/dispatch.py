"""Sharding propagation for every aten op on ShardedArrays.

``dispatch`` is called from ``ShardedArray.__torch_dispatch__``. The hot path is one cache
lookup keyed on the op, the input layouts/shapes/dtypes and the static arguments (floats
excluded, so a new scalar each step still hits): a warm call builds ``_fast_key`` from
each array's cached, identity-hashed key fragment; ``_dispatch`` (misses, special cases)
uses the full ``_key`` and files the entry under both. On a miss (``entries.py``) the rule table proposes
candidate strategies, each costed by the bytes its input redistributions move; the
cheapest is compiled into an :class:`_Entry` that reshards inputs, runs the backend's
local call (``compile_call``), and wraps the outputs.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import aliases as _aliases
from . import array as _array
from . import explicit as _explicit
from . import fresh_ops as _fresh_ops
from . import functorch as _ft
from . import inplace as _inplace
from . import rule_table as _rules
from . import special_ops
from ..plans.planner import PLAN_CACHES
from ..values.mesh import check_mesh_device
from .array import ARRAY_TYPES as _ARRAY_TYPES, ShardedArray, _BatchedArray
from .redistribute import note_derived
from .fragments import _fragment, known_finite
from .fresh import _state as _fresh_state, end_fresh, mark_fresh, note_reads
from .reduced import note_recomputed, reduced_forms
from .entries import _BakedSizes, _compile, _Entry
from .op_calls import _leaves, _lift_plain, _replace

aten = torch.ops.aten

_cache: dict[tuple, "_Entry"] = {}
_CACHE_MAX = 4096  # entries; the oldest is dropped first (keys hold int arguments' values)
PLAN_CACHES.append(_cache.clear)  # strategies are chosen by the cost model (``set_cost_model``)


def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` on ShardedArrays: a warm call is one fast key, one dict lookup, the
    entry's run; anything else (a miss, explicit mode, plain tensors, symbolic sizes,
    special and in-place ops) takes ``_dispatch``. The first read of a fresh buffer (``fresh.py``:
    ``ones_like`` seeding a backward, a ``.contiguous()`` copy) ends its freshness, as ``_dispatch``
    would first, and then takes the fast path too."""
    if _inference_mode_enabled() and _aliases.is_view(func) and _normal_base(args) and not _decomposes(func):
        # a view of a normal tensor is a normal tensor, in inference mode too: torch gives it
        # its base's version counter, which a wrapper made in inference mode (an inference
        # tensor) cannot hold ("Cannot set version_counter for inference tensor", pytorch#112024)
        with torch.inference_mode(False), torch.no_grad():
            return dispatch(func, args, kwargs)
    fkey = _fast_key(func, args, kwargs)
    if fkey is None and _fresh_ops.reads_values(func) and note_reads(args, kwargs):
        fkey = _fast_key(func, args, kwargs)
    if fkey is not None and not _explicit._stack:
        entry = _cache.get(fkey)
        if entry is not None:
            out = entry.warm(args, kwargs)
            if fkey[0] in _VIEWS:
                # (type checks and the dispatch keys: no Python-level calls; no local name either, as
                # note_views counts the references to args[0])
                if type(args[0]) not in _ARRAY_TYPES or _dispatch_keys(args[0]).raw_repr() & _FLAG_BITS:
                    keep_math_bits(func, args, out)
                _aliases.note_views(func, args, kwargs, out)
                if entry.pending_view:
                    _note_derived(func, args, kwargs, out)
            elif type(out) in _ARRAY_TYPES:  # a new array, fresh until read (``fresh.mark_fresh``, inlined)
                if out._layout.partial:
                    note_recomputed(func, args, kwargs, out, aten.view.default)
                d = out.__dict__
                if "_fresh" not in d:  # (a nested dispatch may have marked it: ``CopyEntry``)
                    d["_fresh"] = out._kf
                    out._kf = None
            elif type(out) is tuple or type(out) is list:
                mark_fresh(out)
            return out
    out = _dispatch(func, args, kwargs, fkey)
    if _aliases.is_view(func):
        keep_math_bits(func, args, out)
        _aliases.note_views(func, args, kwargs, out)  # what the output aliases (in-place policy)
        _note_derived(func, args, kwargs, out)
    elif not func._schema.is_mutable and _new_arrays(out, args):  # fresh until read (``fresh.py``)
        if isinstance(out, ShardedArray) and out._layout.partial:
            note_recomputed(func, args, kwargs, out, aten.view.default)
        mark_fresh(out)
    return out


_inference_mode_enabled = torch.is_inference_mode_enabled


def _normal_base(args: tuple) -> bool:
    """Whether a view op's base (its first argument) is a tensor made outside inference mode."""
    return bool(args) and isinstance(args[0], torch.Tensor) and not args[0].is_inference()


def _decomposes(func: Any) -> bool:
    """Whether ``func`` runs as torch's own decomposition: an op with a CompositeImplicitAutograd
    kernel and no rule of its own reaches dispatch only where autograd's keys are skipped
    (``torch.inference_mode``: ``flatten``, ``matmul``, ``layer_norm`` ...), and its parts have
    rules; replicating it whole would gather every input."""
    d = _DECOMPOSES.get(func)
    if d is None:
        d = _DECOMPOSES[func] = (
            func not in _SPECIAL and _rules.lookup(func) is None
            and torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _COMPOSITE))
    return d


_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
_DECOMPOSES: dict[Any, bool] = {}


def _new_arrays(out: Any, args: tuple) -> bool:
    """Whether ``out`` (an op's result) holds arrays, none of them an argument itself."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return any(isinstance(o, ShardedArray) for o in outs) and not any(o is a for o in outs for a in args)


_dispatch_keys = torch._C._dispatch_keys
_FLAG_BITS = (torch._C.DispatchKeySet(torch._C.DispatchKey.Conjugate)
              | torch._C.DispatchKeySet(torch._C.DispatchKey.Negative)).raw_repr()


def keep_math_bits(func: Any, args: tuple, out: Any) -> None:
    """A view keeps its base's lazy conj/neg flags, as torch's views do (``special_ops``: the
    shards hold true values; the flags only decide what torch would reject)."""
    x = args[0] if args else None
    # read off the dispatch keys: ``is_conj()`` of an array with a torch-function hook (3+ dims)
    # is a Python call, and so is hashing the op
    if not isinstance(x, torch.Tensor) or not _dispatch_keys(x).raw_repr() & _FLAG_BITS:
        return
    conj, neg = x.is_conj(), x.is_neg()
    if func not in special_ops.OWN_FLAGS:
        for o in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(o, torch.Tensor):
                torch._C._set_conj(o, conj)
                torch._C._set_neg(o, neg)


def _note_derived(func: Any, args: tuple, kwargs: dict, out: Any) -> None:
    """A view of a pending value is reduced through its base (``redistribute.note_derived``)."""
    base = args[0] if args else None
    if isinstance(base, ShardedArray) and base._layout.partial:
        note_derived(func, base, args[1:], kwargs, out)


# the ops seen to return an alias of an input (``_aliases.is_view``), by id (fast keys hold
# ids); holding the op keeps its id from being reused
_VIEWS: dict[int, Any] = {}


_DEVICE_NOT_MESHS = (aten.to, aten._assert_tensor_metadata)  # a ``device=`` that names no device for the output
_BATCH_NORMS = (aten.native_batch_norm.default, aten.cudnn_batch_norm.default)  # their stats' update: checked per call


def _dispatch(func: Any, args: tuple, kwargs: dict, fkey: tuple | None = None) -> Any:
    if _fresh_ops.reads_values(func):
        note_reads(args, kwargs)  # a fresh array read is fresh no longer (``fresh.py``; only this path sees them)
    # factories (*_like, new_*, random): the mesh owns the device (casts: ``_to_copy``'s rule; ``aten.to``
    # itself reaches here only from torch.func's internals, which decompose it; ``_assert_tensor_metadata``'s
    # device is an expectation it checks, ``special_ops``)
    if kwargs.get("device") is not None and func.overloadpacket not in _DEVICE_NOT_MESHS:
        mesh = next((a.mesh for a in args if isinstance(a, ShardedArray)), None)
        if mesh is not None:
            check_mesh_device(func.__name__.split(".")[0], kwargs["device"], mesh)
    special = _SPECIAL.get(func)
    if special is not None:
        out = special(func, args, kwargs)
        if out is not NotImplemented:  # a handler may leave a call to the rule table
            if fkey is not None and _cache.get(fkey) is None:
                entry = special_ops.alias_entry(func, args, kwargs)
                if entry is not None:
                    _remember_fast(fkey, func, entry)
            return out
    if _decomposes(func):
        return func.decompose(*args, **kwargs)
    if func._schema.is_mutable:
        return _inplace.run_mutating(func, args, kwargs)
    if func in _BATCH_NORMS:
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
    if fkey is not None and func not in _SPECIAL and func not in _BATCH_NORMS:
        if _cache.get(fkey) is not entry:
            _remember_fast(fkey, func, entry)
    if _explicit._stack:
        _explicit.check(func, entry, leaves)
    return entry.run(args, kwargs, leaves)


def _remember_fast(fkey: tuple, func: Any, entry: Any) -> None:
    """Cache ``entry`` under dispatch's fast key: the next such call takes the fast path (a
    view op noted for the in-place policy's alias tracking)."""
    if _aliases.is_view(func):
        _VIEWS[id(func)] = func
    _remember(fkey, entry)


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
        or (isinstance(v, ShardedArray) and _symbolic_strides(v))
        for _, v in leaves
    )


def _symbolic_strides(v: ShardedArray) -> bool:
    """A view with concrete sizes may still report symbolic strides or offset (a slice of a
    dynamic dim: ``x[:3].mT``)."""
    return _ft.is_symbolic(v.stride()) or isinstance(v.storage_offset(), torch.SymInt)


def _dispatch_symbolic(func: Any, args: tuple, kwargs: dict, leaves: list) -> Any:
    """A call with symbolic sizes: the strategy is chosen (and cached) on the sizes'
    hints, by the same code as concrete calls; the local op then runs on the symbolic
    stacked shards, and output global sizes are read off the local outputs, so nothing is
    specialised. Only the stacked path (every layout even) keeps sizes symbolic."""

    def hinted(path: Any, v: Any) -> Any:
        if isinstance(v, ShardedArray):  # with the strides it reports (a view's rules see torch's)
            return _array._wrap_output(v._local, v._layout, _ft.hint_shape(v.shape), v.dtype, None,
                                       (_ft.hint_shape(v.stride()), _ft.hint_int(v.storage_offset())))
        if isinstance(v, torch.SymInt):
            return _ft.hint_int(v)
        return v

    if func is aten.slice.Tensor and any(_past_the_end(v) for _, v in leaves):
        return dispatch(func, *_replace(args, kwargs, _to_the_end))
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


_END = 2**62  # a slice bound at least this large is torch's "to the end" (INT64_MAX: ``x[1:]``)


def _past_the_end(v: Any) -> bool:
    return isinstance(v, torch.SymInt) and _ft.hint_int(v) >= _END


def _to_the_end(path: Any, v: Any) -> Any:
    """A slice bound of "to the end" made a symbol: Dynamo replays a view input's slice on
    its fake base with every int a fresh symbol of no source (``view_from_base``), and the
    slice's clamping guards on it then fail to build ('sources must not be empty'). Every
    bound past the dim gives the same slice, so the sentinel's value is used, unguarded."""
    return _ft.hint_int(v) if _past_the_end(v) else v


def _specialised(path: Any, v: Any) -> Any:
    """``v`` with its symbolic sizes specialised to their values (guarded)."""
    if isinstance(v, torch.SymInt):
        return _ft.static_int(v)
    if isinstance(v, ShardedArray) and _ft.is_symbolic(v.shape):
        from ..values.layout import local_shapes

        shape = tuple(_ft.static_int(n) for n in v.shape)
        local = v._local
        if isinstance(local, torch.Tensor):
            local = local.view(*local.shape[:v.mesh.ndim], *local_shapes(v._layout, shape)[0])
        return ShardedArray(local, v._layout, shape, v.dtype, requires_grad=v.requires_grad)
    if isinstance(v, ShardedArray) and _symbolic_strides(v):  # concrete sizes: keep the view's strides, guarded
        return _array._wrap_output(v._local, v._layout, tuple(v.shape), v.dtype, None,
                                   (tuple(_ft.static_int(n) for n in v.stride()), _ft.static_int(v.storage_offset())))
    if isinstance(v, torch.Tensor) and _ft.is_symbolic(v.shape):
        return v.view(tuple(_ft.static_int(n) for n in v.shape))
    return v


_FAST = object()  # marks a fast key (``_key``s never hold it)
_KW = object()  # separates a fast key's keyword arguments from its positional ones
_TRUE, _FALSE = object(), object()  # bools keyed apart from ints (True == 1 promotes differently)
_MISS = object()
_AS_IS = frozenset({int, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout})
_INTS = {int}


def _fast_key(func: Any, args: tuple, kwargs: dict) -> tuple | None:
    """The warm-path cache key: the op's id (OpOverload hashes in Python; an entry holds
    its op, so the id stays unique while the key is cached), then per argument its array's interned (layout,
    shape, dtype) fragment, or its value (ints, strings, None, dtypes, devices), or just
    its type (floats, complex), or a bool marker; lists and tuples as tuples of those.
    None (take ``_dispatch``) for anything else: plain tensors, SymInts, symbolic shapes."""
    fid = id(func)
    parts = [fid, _FAST]
    for a in args:
        t = type(a)
        if t is ShardedArray or t is _BatchedArray:
            k = a._kf
            if k is None:
                d = a.__dict__  # a fresh root holding its fragment back (``_held_back``, its usual case inline)
                k = d["_fresh"] if "_fresh" in d else None
                if k is None or fid not in _READS or "_reduced" in d:
                    k = _held_back(a, fid, func)
                    if k is None:
                        return None
                elif _READS[fid][1] and not _fresh_state.writing:  # its first read
                    del d["_fresh"]
                    a._kf = k
            parts.append(k)
        elif t is int or a is None:
            parts.append(a)
        elif t is float:
            parts.append(float if a - a == 0.0 and a != 0.0 else _number_class(a))
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


_READS: dict[int, tuple] = {}  # id(op) -> (op, whether it reads its arrays' values: ``fresh_ops.reads_values``)


def _held_back(a: Any, fid: int, func: Any) -> Any:
    """The fast-key fragment of an array that has none set: a fresh array (or a view of one)
    holds its fragment back (``fresh.mark_fresh``, ``aliases.note_views``) so that its first read
    comes here and ends the freshness, as ``_dispatch`` would (a view op or a write reads nothing);
    otherwise ``_fragment`` (None: take ``_dispatch``)."""
    d = a.__dict__
    root = "_view_of" not in d
    key = "_fresh" if root else "_kfh"
    if key not in d:
        return _fragment(a)
    k = d[key]
    kept = k is not None and "_derived" not in d and "_reduced" not in d
    if not kept:  # (a pending view's fragment names what its base has reduced: computed each time)
        k = _fragment(a, held=True)
        if k is None:
            return None
    r = _READS[fid] if fid in _READS else None
    if r is None:
        r = _READS[fid] = (func, _fresh_ops.reads_values(func))
    if r[1] and not _fresh_state.writing:  # a read: fresh no longer
        if root:
            del d["_fresh"]
        else:
            del d["_kfh"]
            end_fresh(a)
        if kept:
            a._kf = k
    return k


def _fast_part(a: Any, t: type) -> Any:
    """One argument's part of a fast key (``_MISS`` if it has none)."""
    if t is ShardedArray or t is _BatchedArray:
        k = a._kf
        return k if k is not None else (_fragment(a) or _MISS)
    if t in _AS_IS:
        return a
    if t is float:
        return float if a - a == 0.0 and a != 0.0 else _number_class(a)
    if t is bool:
        return _TRUE if a else _FALSE
    if t is list or t is tuple:
        if set(map(type, a)) == _INTS:  # sizes and dims: keyed as they are (C-level calls only)
            return tuple(a)
        out = tuple(_fast_part(b, type(b)) for b in a)
        return _MISS if _MISS in out else out
    if t is complex:
        return complex if a - a == 0.0 and a != 0.0 else _number_class(a)
    return _MISS


_ZERO, _NONFINITE = object(), object()


def _number_class(a: float | complex) -> Any:
    """A float's or complex's part of a cache key: only its type where it is finite and
    nonzero (a new scalar each step still hits); zero and non-finite numbers apart, as
    rules decide on them (a pending sum passes ``* c`` and ``/ c`` only for a finite
    nonzero ``c``)."""
    if a == 0:
        return (type(a), _ZERO)
    if a - a != 0:  # inf or nan (in either component)
        return (type(a), _NONFINITE)
    return type(a)


def _key(func: Any, leaves: list) -> tuple:
    parts: list[Any] = [func]
    for path, v in leaves:
        if isinstance(v, ShardedArray):
            # (the device: a lifted plain 0-d CPU tensor is an array on the CPU whatever the mesh's
            # device, and an entry compiled for a 0-d array on the mesh's device stacked it there)
            parts.append((path, v._layout, v.shape, v.dtype, v.stride(), v.storage_offset(),
                          reduced_forms(v) if v._layout.partial else None, known_finite(v), v.device.type))
        elif isinstance(v, torch.Tensor):
            parts.append((path, "T", v.shape, v.dtype, v.device))
        elif isinstance(v, (float, complex)):
            parts.append((path, _number_class(v)))
        elif v is True or v is False:  # True == 1 as a dict key, but promotes differently
            parts.append((path, "b", v))
        else:
            parts.append((path, v))
    return tuple(parts)


_SPECIAL: dict[Any, Callable] = _rules.SPECIAL  # the rule families add theirs (losses, random ops)
_SPECIAL.update(special_ops.HANDLERS)
_rules.on_change(_cache.clear)  # a registered rule replaces what cached entries chose
_rules.on_change(_DECOMPOSES.clear)  # (and a composite op given a rule runs by it)
_array._dispatch_fn = dispatch  # ShardedArray.__torch_dispatch__ calls it (array.py cannot import this module)
