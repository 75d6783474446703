"""In-place writes under forward-mode AD: a root array's op as its out-of-place overload and
a rebind (functionalization breaks there)."""

from __future__ import annotations

from typing import Any

import torch

from ..aliases import rebind, regenerate_views
from ..array import ShardedArray
from ..fresh import writing
from ...values.schema import functional_args, functional_overload


def forward_ad_live() -> bool:
    """Whether forward-mode AD (``torch.func.jvp``/``jacfwd``, ``forward_ad``) is on."""
    if torch.autograd.forward_ad._current_level >= 0:
        return True
    if not torch._C._are_functorch_transforms_active():
        return False
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters())


def out_of_place(func: Any, args: tuple, kwargs: dict, targets: list) -> Any:
    """An in-place op on one root array (``x.op_(...)``) as its out-of-place overload and a
    rebind, where functionalizing it breaks under forward-mode AD: torch's Python meta of an
    in-place op (``lerp_``) prints a functional tensor there, whose ``unpack_dual`` asserts
    and leaves torch's state broken (the next op segfaulted). None where it does not apply
    (views, several targets, no such overload, another dtype or shape)."""
    x = targets[0] if len(targets) == 1 else None
    if x is None or not args or args[0] is not x or "_view_of" in x.__dict__:
        return None
    op = functional_overload(func)
    if op is None:
        return None
    fargs, fkwargs = functional_args(func, op, args, kwargs)
    new = op(*fargs, **fkwargs)
    if not isinstance(new, ShardedArray) or new.dtype != x.dtype or tuple(new.shape) != tuple(x.shape):
        return None
    with writing():
        rebind(x, new, write=True)
        regenerate_views(x)
    return x
