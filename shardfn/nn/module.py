"""DTensor-style :func:`distribute_module`: a module's parameters and buffers turned into
ShardedArrays in place by a partition function (the rest replicated), with input and
output hooks."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from ..arrays.array import ShardedArray
from ..arrays.redistribute import distribute
from ..values.mesh import Mesh
from ..values.spec import P


def distribute_module(module: nn.Module, mesh: Mesh,
                      partition_fn: Callable[[str, nn.Module, Mesh], None] | None = None,
                      input_fn: Callable[[nn.Module, Any, Mesh], Any] | None = None,
                      output_fn: Callable[[nn.Module, Any, Mesh], Any] | None = None) -> nn.Module:
    """Turn ``module``'s parameters and buffers into ShardedArrays, in place (DTensor's API).

    Args:
        module: the module to distribute.
        mesh: the device mesh.
        partition_fn: ``partition_fn(name, submodule, mesh)`` for every submodule; it may
            replace parameters with ShardedArrays (e.g. ``nn.Parameter(sf.distribute(...))``).
            Whatever is still a plain tensor afterwards is replicated.
        input_fn: ``input_fn(module, inputs, mesh)`` runs before ``forward`` (a forward
            pre-hook) and may return new inputs, e.g. distributed according to attributes
            of the module.
        output_fn: ``output_fn(module, outputs, mesh)`` runs after ``forward`` and may
            return new outputs.

    Returns:
        ``module`` itself.
    """
    if partition_fn is not None:
        for name, sub in list(module.named_modules()):
            partition_fn(name, sub, mesh)
    _replicate_rest(module, mesh)
    if input_fn is not None:
        _check_arity(input_fn, "input_fn", "(module, inputs, mesh)")
        module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, mesh))
    if output_fn is not None:
        _check_arity(output_fn, "output_fn", "(module, outputs, mesh)")
        module.register_forward_hook(lambda mod, inputs, outputs: output_fn(mod, outputs, mesh))
    return module


def _replicate_rest(module: nn.Module, mesh: Mesh) -> None:
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None and not isinstance(p, ShardedArray):
                sub._parameters[name] = nn.Parameter(distribute(p.detach(), P(), mesh=mesh),
                                                     requires_grad=p.requires_grad)
        for name, b in list(sub._buffers.items()):
            if b is not None and not isinstance(b, ShardedArray):
                sub._buffers[name] = distribute(b, P(), mesh=mesh)


def _check_arity(fn: Callable, what: str, sig: str) -> None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return
    if sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) != 3:
        raise TypeError(f"{what} takes {sig} (the module first, as torch's distribute_module now does); "
                        f"got {getattr(fn, '__name__', fn)}{inspect.signature(fn)}")
