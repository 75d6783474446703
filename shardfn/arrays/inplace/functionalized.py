"""An in-place write into private or fresh arrays run under torch's functionalization: the
targets' roots updated functionally and rebound, their live views regenerated."""

from __future__ import annotations

from typing import Any

import torch

from ..aliases import rebind, regenerate_views, replay, root
from ..fresh import writing
from ...values.schema import functional_args, functional_overload

aten = torch.ops.aten


def run_functionalized(func: Any, args: tuple, kwargs: dict, targets: list) -> Any:
    """Run ``func`` under functionalization on the targets' roots; rebind what changed."""
    result = None
    if not _functionalizes(func):
        op = functional_overload(func)
        if op is not None and len(targets) == 1 and args and args[0] is targets[0]:
            # ``x.op_(...)`` as ``x.copy_(op(...))``: torch's functionalization has no kernel for
            # it (``polygamma_``, whose out-of-place form takes ``n`` first, raised "custom
            # (non-ATen) operator" on every fresh or private array)
            fargs, fkwargs = functional_args(func, op, args, kwargs)
            with writing():  # its own value is part of the write, not a read
                new = op(*fargs, **fkwargs)
            result = _result(func, args, kwargs, None)
            func, args, kwargs = aten.copy_.default, (targets[0], new), {}
    roots: dict[int, Any] = {}
    for t in targets:
        r = root(t)
        roots[id(r)] = r
    functional: dict[int, Any] = {i: torch._to_functional_tensor(r) for i, r in roots.items()}
    # inside __torch_dispatch__ the Functionalize key is excluded: let it run again
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.Functionalize)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), writing():
        torch._enable_functionalization(reapply_views=True)
        try:
            fargs = tuple(_swap(a, targets, functional) for a in args)
            fkwargs = {k: _swap(v, targets, functional) for k, v in kwargs.items()}
            if len(targets) > 1 and func._schema.name.startswith("aten::_foreach_") and not func._schema.returns:
                _foreach_in_order(func, fargs, fkwargs, len(fargs[0]))
                out = None
            else:
                out = func(*fargs, **fkwargs)
            out = _unwrapped_all(out)
            for f in functional.values():
                torch._sync(f)
            new = {i: torch._from_functional_tensor(functional[i]) for i in roots}
        finally:
            torch._disable_functionalization()
    with writing():
        for i, r in roots.items():
            rebind(r, new[i], write=True)
            regenerate_views(r)
    return _result(func, args, kwargs, out) if result is None else result


def _functionalizes(func: Any) -> bool:
    """Whether torch's functionalization has a kernel for ``func`` (composites decompose first)."""
    name = func.name()
    return (torch._C._dispatch_has_kernel_for_dispatch_key(name, "Functionalize")
            or torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd"))


def _foreach_in_order(func: Any, fargs: tuple, fkwargs: dict, n: int) -> None:
    """An in-place foreach op one list entry after another, as torch's kernel updates them: an
    entry reading an earlier one's target sees its new value. (``_foreach_add_([a, b], [b, a])``
    gives ``b + (a + b)``; run once, functionalization read every entry's old value, a silent
    wrong value under torch.func.)"""
    def entry(v: Any, i: int) -> Any:
        return type(v)([v[i]]) if isinstance(v, (list, tuple)) and len(v) == n else v

    for i in range(n):
        func(*(entry(a, i) for a in fargs), **{k: entry(v, i) for k, v in fkwargs.items()})


# (module functions, not closures: a recursive closure is a reference cycle that would keep
# the arrays alive, and counted as observable, until the next garbage collection)
def _swap(v: Any, targets: list, functional: dict) -> Any:
    """``v`` with each write target replaced by its functional counterpart."""
    if isinstance(v, (list, tuple)):
        return type(v)(_swap(b, targets, functional) for b in v)
    return _as_functional(v, functional) if any(v is t for t in targets) else v


def _as_functional(x: Any, functional: dict) -> Any:
    """The functional tensor standing for ``x``: its root's wrapper, views replayed on it."""
    f = functional.get(id(x))
    if f is None:
        link = x._view_of
        f = functional[id(x)] = replay(link, _as_functional(link[0], functional))
    return f


def _result(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """What the in-place / out= op returns: its written arguments where the schema says
    so, the functional run's other outputs (e.g. batch norm's saved statistics)."""
    rets = func._schema.returns
    written = [a for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    outs = []
    for r in rets:
        src = next((a for a in written if r.alias_info is not None and a.alias_info.before_set == r.alias_info.before_set), None)
        if src is None:
            outs.append(None)
            continue
        idx = [a.name for a in func._schema.arguments].index(src.name)
        outs.append(kwargs.get(src.name) if src.kwarg_only or idx >= len(args) else args[idx])
    if not rets:
        return None
    computed = out if isinstance(out, (tuple, list)) else (out,)
    outs = [o if o is not None else c for o, c in zip(outs, computed)]
    return outs[0] if len(rets) == 1 else tuple(outs)


def _unwrapped_all(out: Any) -> Any:
    """The functional run's outputs as plain arrays (``_unwrapped`` of each)."""
    if isinstance(out, (tuple, list)):
        return type(out)(_unwrapped(o) for o in out)
    return _unwrapped(out)


def _unwrapped(x: Any) -> Any:
    """``x`` synced and taken out of its functional wrapper, if it is in one."""
    if isinstance(x, torch.Tensor) and torch._is_functional_tensor(x):
        torch._sync(x)
        return torch._from_functional_tensor(x)
    return x
