"""Aten schemas: arguments by name (rules and backends both bind calls); an in-place op's
out-of-place overload (the in-place policy's casting check and forward-AD route)."""

from __future__ import annotations

import functools
from typing import Any

import torch


def _schema_info(func: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    info = _SCHEMAS.get(func)
    if info is None:
        args = func._schema.arguments
        names = tuple(a.name for a in args)
        defaults = {a.name: a.default_value for a in args if a.has_default_value()}
        info = _SCHEMAS[func] = (names, defaults)
    return info


_SCHEMAS: dict[Any, tuple] = {}


def op_name(func: Any) -> str:
    """How messages name an op: ``aten.mm`` for an aten overload, else its full name."""
    return f"aten.{func.overloadpacket.__name__}" if func.namespace == "aten" else str(func)


def bind(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Arguments by schema name, defaults filled in."""
    names, defaults = _schema_info(func)
    b = dict(defaults)
    b.update(zip(names, args))
    b.update(kwargs)
    return b


def replace_arg(func: Any, args: tuple, kwargs: dict, name: str, value: Any) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with the argument called ``name`` set to ``value``."""
    names, _ = _schema_info(func)
    i = names.index(name)
    if i < len(args):
        return args[:i] + (value,) + args[i + 1:], kwargs
    return args, {**kwargs, name: value}


def written(func: Any, args: tuple, kwargs: dict, skip: tuple[str, ...] = ()) -> list:
    """The arguments ``func`` writes (``(a!)`` in its schema), lists flattened, None left out;
    the arguments named in ``skip`` too."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write or a.name in skip:
            continue
        v = kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
        if isinstance(v, (list, tuple)):
            out.extend(v)
        elif v is not None:
            out.append(v)
    return out


def is_inplace(func: Any) -> bool:
    """Whether ``func`` is an in-place op by torch's naming (``add_``; not a dunder such as ``__iand__``)."""
    name = func._schema.name.split("::")[-1]
    return name.endswith("_") and not name.endswith("__")


@functools.lru_cache(maxsize=None)
def functional_overload(func: Any) -> Any:
    """The out-of-place overload of an in-place op (``pow_.Scalar`` -> ``pow.Tensor_Scalar``):
    the one taking the same arguments (names, types, keyword-only) and returning one tensor;
    overload names do not always agree (``pow.Scalar`` takes a Scalar base), nor does the
    order (``polygamma_(self, n)`` -> ``polygamma(n, self)``: call it with
    ``functional_args``). None if none."""
    if not is_inplace(func):
        return None
    packet = getattr(torch.ops.aten, func._schema.name.split("::")[-1][:-1], None)
    if packet is None:
        return None
    want = _signature(func)
    ops = [getattr(packet, o) for o in packet.overloads()]
    ops = [op for op in ops if len(op._schema.returns) == 1 and not op._schema.is_mutable]
    return next((op for op in ops if _signature(op) == want), None) or next(
        (op for op in ops if sorted(_signature(op)) == sorted(want)), None)


def functional_args(func: Any, op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``func``'s arguments as its out-of-place overload ``op`` takes them, matched by name."""
    if _signature(op) == _signature(func):
        return args, kwargs
    b = bind(func, args, kwargs)
    return (tuple(b[a.name] for a in op._schema.arguments if not a.kwarg_only),
            {a.name: b[a.name] for a in op._schema.arguments if a.kwarg_only and a.name in b})


def _signature(op: Any) -> tuple:
    """An overload's arguments as (name, type, keyword-only) triples."""
    return tuple((a.name, str(a.type), a.kwarg_only) for a in op._schema.arguments)
