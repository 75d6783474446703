"""Functions torch.compile records as one call: shard_map/local_map make them at run time,
before or after Dynamo is loaded; ``shardfn.compile`` installs the marker once it is.

Dynamo guards a plain function it records by its code object alone, so two functions made
by one ``shard_map`` call site (other bodies, specs or closed-over values) would share a
compiled graph built around the first. Each is therefore a :class:`GraphCall`, an object
Dynamo guards by identity, and equal calls share one object (``graph_call``): a body
rebuilt on every call of a compiled function (a lambda in it) keeps its cached graph."""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .errors import USER_ERRORS
from .torch_compat import ValueMeta

_pending: weakref.WeakSet = weakref.WeakSet()  # made before the marker was installed
_mark: Callable[[Callable], object] | None = None
_interned: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class GraphCall:
    """``fn``, made by ``kind`` from ``body`` and ``params``, as one call in a compiled graph,
    guarded by this object's identity."""

    def __init__(self, fn: Callable, kind: str, body: Any, params: Any) -> None:
        functools.update_wrapper(self, fn)
        self.__wrapped__ = getattr(fn, "__wrapped__", fn)  # the user's function, as fn's own wraps says
        self._fn, self._made = fn, (kind, body, params)

    def _key(self) -> Any:
        """What it computes, from its body and params as they are now (a cell may change)."""
        kind, body, params = self._made
        return (kind, value_key(body), value_key(params))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._fn(*args, **kwargs)
        except USER_ERRORS as e:
            surface_in_compile(e)
            raise

    def __get__(self, obj: Any, objtype: Any = None) -> Any:  # as a class attribute: a method, like a function
        return self if obj is None else types.MethodType(self, obj)

    def __repr__(self) -> str:
        return f"<shardfn graph call {getattr(self, '__qualname__', '?')}>"


def surface_in_compile(e: BaseException) -> None:
    """Where Dynamo runs a call on fake tensors to build its graph, a graph break (Dynamo's
    ``Unsupported``) in place of ``e``, one of shardfn's user errors: the call then runs eagerly
    and raises ``e`` as itself, with its message, as in eager. Dynamo turns every other exception
    of its fake run (IndexError aside) into a TorchRuntimeError, which ``except ShardingError``
    misses. Under ``fullgraph=True`` the graph break is Dynamo's error naming ``e``, as for an
    exception a compiled function raises in Python. Elsewhere (eager, a FakeTensorMode of the
    caller's, AOTAutograd's passes under functional or proxy modes) nothing: ``e`` goes on."""
    if not isinstance(e, USER_ERRORS) or torch._guards.TracingContext.try_get() is None:
        return
    if torch._guards.detect_fake_mode() is None:
        return
    key = torch._C._TorchDispatchModeKey
    if torch._C._get_dispatch_mode(key.FUNCTIONAL) is not None or torch._C._get_dispatch_mode(key.PROXY) is not None:
        return
    from torch._dynamo.exc import Unsupported

    name = type(e).__name__
    raise Unsupported(f"shardfn raised {name}: {e}", gb_type=f"shardfn: {name}") from e


def surfaces_in_compile(fn: Callable) -> Callable:
    """``fn`` (a function torch.compile records as one call) raising its user errors as
    themselves under torch.compile too (:func:`surface_in_compile`)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            surface_in_compile(e)
            raise

    return run


def graph_call(fn: Callable, kind: str, body: Any, params: Any) -> GraphCall:
    """``fn`` (made by ``kind`` from the function ``body`` and the other arguments
    ``params``) as a :class:`GraphCall`: the one made before for an equal body and params
    (:func:`value_key`) while it lives, else a new one. Under torch.compile this runs
    eagerly (a graph break): Dynamo does not trace the keys."""
    return _make(fn, kind, body, params)


def _graph_call(fn: Callable, kind: str, body: Any, params: Any) -> GraphCall:
    call = GraphCall(fn, kind, body, params)
    key = call._key()
    try:
        old = _interned.get(key)
    except TypeError:  # unhashable
        return in_graph(call)
    if old is not None and old._key() == key:
        return old
    _interned[key] = in_graph(call)
    return call


_make: Callable[..., GraphCall] = _graph_call


def in_graph(fn: Any) -> Any:
    """Mark a function made at run time as one graph call."""
    if _mark is not None:
        _mark(fn)
    else:
        _pending.add(fn)
    return fn


def install(mark: Callable[[Callable], object], eager: Callable[[Callable], Callable]) -> None:
    """Use ``mark`` (Dynamo's ``allow_in_graph``) from now on, and on every function made so
    far; ``eager(f)`` (``torch.compiler.disable``): ``f`` run untraced."""
    global _mark, _make
    _mark = mark
    _make = eager(_graph_call)
    for fn in list(_pending):
        mark(fn)
    _pending.clear()


class _Ident:
    """A key part equal only to the very same object (held while the key lives)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Ident) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


_BY_VALUE = (int, bool, str, bytes, type(None), type(Ellipsis), torch.dtype, torch.device, torch.layout,
             torch.memory_format)


def value_key(v: Any, depth: int = 4) -> Any:
    """A hashable key equal for two values only where a function of them computes the same:
    constants and sharding values by value (floats by ``repr``: -0.0 is not 0.0), tuples by
    their items, functions by code, defaults and closure (by the cells' contents now: a body
    rebuilt by each call of a compiled function shares its key), anything else (lists, dicts,
    tensors) by identity."""
    t = type(v)
    if t in _BY_VALUE:
        return (t, v)
    if t in (float, complex):
        return (t, repr(v))
    if isinstance(t, ValueMeta):
        return (t, v)
    if depth <= 0:
        return _Ident(v)
    if t is tuple:
        return (t, tuple(value_key(e, depth - 1) for e in v))
    if t is frozenset:
        return (t, frozenset(value_key(e, depth - 1) for e in v))
    if t is types.FunctionType and not v.__dict__ and not v.__kwdefaults__:
        cells = []
        for c in v.__closure__ or ():
            try:
                cells.append(value_key(c.cell_contents, depth - 1))
            except ValueError:  # an empty cell
                cells.append(_Ident(c))
        return (t, v.__code__, _Ident(v.__globals__), value_key(v.__defaults__, depth - 1), tuple(cells))
    if t is functools.partial and not v.keywords:
        return (t, value_key(v.func, depth - 1), value_key(v.args, depth - 1))
    if t is types.MethodType:
        return (t, _Ident(v.__self__), value_key(v.__func__, depth - 1))
    if t is GraphCall:
        return (t, v._key())
    return _Ident(v)  # mutable containers too: a later change to one must not reach another
