"""torch.compile integration.

Dynamo never traces shardfn's Python: ops on ShardedArrays reach ``__torch_dispatch__``
(traced later by AOTAutograd, which flattens the arrays into their shard tensors), and
the public functions that move data between layouts are *allowed in graph*: Dynamo
records one call to them and AOTAutograd traces through them. Sharding values (P,
NamedSharding, placements, Mesh, Layout) are registered as opaque *value* types, so they
can be built inside a compiled function, read off intermediate arrays, and passed to
those functions as graph constants (guarded by equality).

Registration needs ``torch._dynamo``, which costs over a second to import; it is done
when torch imports it (``torch.compile`` does), not when shardfn is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any, Callable

import torch

from ..arrays import array, redistribute
from ..transforms import constraints
from ..values import graph_calls, torch_compat
from ..values.layout import Layout
from ..values.mesh import Mesh
from ..values.spec import NamedSharding, P, Partial, Replicate, Shard, _make_p

_registered = False


def _value_types() -> tuple[type, ...]:
    return (P, NamedSharding, Shard, Replicate, Partial, Mesh, Layout)


def _graph_functions() -> list[Callable]:
    """Functions Dynamo records as one call (their arguments: tensors, pytrees of them,
    and sharding values)."""
    return [
        redistribute.reshard, redistribute.distribute, redistribute.gather,
        array.ShardedArray.full_tensor, array.ShardedArray.redistribute,
        array.ShardedArray.to_local, array.ShardedArray.from_local,
        constraints.with_sharding_constraint,
    ]


def _fx_repr(obj: Any) -> tuple[str, dict[str, type]]:
    """An expression that rebuilds ``obj`` in generated graph code."""
    if isinstance(obj, P):
        return repr(obj), {"P": P}
    if isinstance(obj, Mesh):
        return (f"Mesh({obj.shape!r}, {obj.axis_names!r}, backend={obj.backend!r}, "
                f"device_type={obj.device_type!r})"), {"Mesh": Mesh}
    if isinstance(obj, NamedSharding):
        m, g = _fx_repr(obj.mesh)
        return f"NamedSharding({m}, {obj.spec!r})", {**g, "NamedSharding": NamedSharding, "P": P}
    if isinstance(obj, Layout):
        m, g = _fx_repr(obj.mesh)
        return f"Layout({m}, {obj.dims!r}, {obj.partial!r})", {**g, "Layout": Layout}
    names = {Shard: "Shard", Replicate: "Replicate", Partial: "Partial"}
    return repr(obj), {names[type(obj)]: type(obj)}


def _p_node(p: Any, tracer: Any) -> Any:
    """A graph node that rebuilds ``p``: fx maps every tuple argument to a plain tuple,
    which would drop ``P.partial``."""
    return tracer.create_node("call_function", _make_p, (tuple(p), dict(p._partial)), {})


def register() -> None:
    """Make shardfn's values and functions known to Dynamo (idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True
    from torch._library.opaque_object import register_opaque_type

    for cls in _value_types():
        cls.__fx_repr__ = _fx_repr
        if issubclass(cls, tuple):
            cls.__fx_create_arg__ = _p_node
        members = torch_compat.opaque_value_members(cls)
        register_opaque_type(cls, typ="value", **({} if members is None else {"members": members}))
    allow_in_graph = sys.modules["torch._dynamo"].allow_in_graph
    for fn in _graph_functions():
        allow_in_graph(fn)
    # shard_map / local_map functions (GraphCalls), never traced as frames either: an uneven
    # shard_map breaks the graph, then runs eagerly
    _never_trace(graph_calls.GraphCall.__call__)
    graph_calls.install(lambda call: (allow_in_graph(call), _never_trace(call._fn)), torch.compiler.disable)
    _never_trace(array.ShardedArray.__torch_dispatch__)
    # the graph functions' wrapper (``graph_calls.surfaces_in_compile``: one code object for all):
    # run eagerly after the graph break a user error makes, it raises the error, untraced
    _never_trace(redistribute.reshard)
    if not hasattr(torch.Tensor, "__coerce_same_metadata_as_tangent__"):
        torch.Tensor.__coerce_same_metadata_as_tangent__ = _plain_tangent_as_array
    _values_as_bytecode_constants()
    _opaque_values_with_class_source()


def _values_as_bytecode_constants() -> None:
    """A sharding value built inside a compiled function and live at a graph break
    (``p = P("dp"); ...; graph_break(); reshard(y, p)``) is handed to the resumed frame as
    a bytecode constant, as Dynamo does for Enums (opaque values too). Otherwise Dynamo
    returns it from the graph, and AOTAutograd wraps an opaque graph output in a
    FakeScriptObject (torch 2.13; 2.11 fails storing it in a weak-keyed dict, which a tuple
    subclass cannot enter): the resumed frame received the fake. The values are immutable,
    so one object in the code's constants is safe."""
    from torch._dynamo import bytecode_transformation, codegen, utils

    base = utils.is_safe_constant
    if getattr(base, "_sf_values", False):
        return

    def is_safe_constant(v: Any) -> bool:
        return isinstance(v, _value_types()) or base(v)

    is_safe_constant._sf_values = True  # type: ignore[attr-defined]
    for mod in (utils, codegen, bytecode_transformation):  # each imported the name
        if getattr(mod, "is_safe_constant", None) is base:
            mod.is_safe_constant = is_safe_constant  # type: ignore[attr-defined]


def _opaque_values_with_class_source() -> None:
    """A sharding value read off a compiled function's input (``x.spec``, ``x.mesh``) is an
    opaque object with a source; torch 2.13's variable for it sets that source after its base
    class derived the class's source from none, so reading a property of it (``x.mesh.size``,
    ``len(x.spec)``, ``x.spec.partial``) failed in Dynamo ("cls_source must not be None for MRO
    walk"). The class's source is derived as the base class does when given the source."""
    try:
        from torch._dynamo.source import TypeSource
        from torch._dynamo.variables.script_object import TorchScriptObjectVariable
    except ImportError:  # pragma: no cover - a torch without it has no such variable
        return
    init = TorchScriptObjectVariable.__init__
    if getattr(init, "_sf_class_source", False):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if getattr(self, "cls_source", None) is None and getattr(self, "source", None) is not None:
            self.cls_source = TypeSource(self.source)

    __init__._sf_class_source = True  # type: ignore[attr-defined]
    TorchScriptObjectVariable.__init__ = __init__  # type: ignore[method-assign]


def _plain_tangent_as_array(self: torch.Tensor, flatten_spec: Any, expected_type: Any = None) -> Any:
    """A plain tangent where a compiled backward expects an array's: laid out as expected.
    Some of torch's backward formulas make their zeros from sizes and options, not from a
    tensor (``sgn`` of a real input: a ZeroTensor), so the gradient of an array can come back
    plain; the next compiled graph's backward guessed an array (fuzzer seed 5728942245). Any
    other expected type: None (AOTAutograd's error, as without this hook)."""
    if not (isinstance(expected_type, type) and issubclass(expected_type, array.ShardedArray)):
        return None
    if type(self) is not torch.Tensor or not isinstance(flatten_spec, tuple) or not isinstance(flatten_spec[0], Layout):
        return None
    dense = torch.zeros(self.shape, dtype=self.dtype, device=self.device) if self._is_zerotensor() else self
    return redistribute.distribute(dense, flatten_spec[0])


def _never_trace(fn: Callable) -> None:
    """Dynamo runs ``fn`` and everything it calls without tracing, when it meets the frame
    itself: an op on arrays run eagerly after a graph break (e.g. ``torch.cov``'s data-dependent
    ``aten.equal``) calls ``__torch_dispatch__`` under Dynamo's frame hook, and shardfn's
    dispatch is not code to compile (ops inside a traced region reach it through fake tensors
    and AOTAutograd, never as frames). Costs nothing per call (a mark on the code object)."""
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:  # pragma: no cover - every supported torch has them
        return
    code = getattr(fn, "__func__", fn).__code__
    set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


class _OnDynamoImport(importlib.abc.MetaPathFinder):
    """Runs :func:`register` right after ``torch._dynamo`` is imported."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            register()

        spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


def install() -> None:
    if "torch._dynamo" in sys.modules:
        register()
    elif not any(isinstance(f, _OnDynamoImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _OnDynamoImport())
