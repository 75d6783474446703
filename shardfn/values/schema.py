"""Aten schemas: arguments by name (rules and backends both bind calls)."""

from __future__ import annotations

from typing import Any


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
