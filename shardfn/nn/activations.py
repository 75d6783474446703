"""Activation layouts by regex over submodule names (:func:`shard_activations`): the
sequence- and vocabulary-parallel halves of a recipe that :func:`shard_params` starts.

Each matching submodule's tensor inputs and outputs pass through
``with_sharding_constraint`` in forward hooks, so the gradients flowing back through them
are laid out the same way. Works with ``torch.func.functional_call`` (the hooks live on the
modules, not on the parameters)."""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..arrays.array import ShardedArray
from ..arrays.redistribute import distribute
from ..values.errors import ShardingError
from ..values.layout import Layout
from ..values.mesh import Mesh
from ..values.spec import NamedSharding, P, _is_placements
from ..transforms.constraints import with_sharding_constraint

__all__ = ["ActivationHandle", "UnmatchedRulesWarning", "shard_activations"]


class UnmatchedRulesWarning(UserWarning):
    """A rule of :func:`shard_activations` matched no submodule."""


@attrs.frozen
class _ActRule:
    index: int
    pattern: re.Pattern
    inputs: Any  # None, a sharding, or {arg name or position: sharding}
    outputs: Any  # None, a sharding, or {output position or key: sharding}

    @property
    def label(self) -> str:
        return f"shard_activations rules[{self.index}] ({self.pattern.pattern!r})"


class ActivationHandle:
    """What :func:`shard_activations` returns: ``remove()`` takes the hooks off again (also on
    leaving a ``with`` block); ``matched`` maps each hooked submodule name to its rule index."""

    def __init__(self, handles: list[Any], matched: dict[str, int]) -> None:
        self._handles = handles
        self.matched = matched

    def remove(self) -> None:
        """Take every hook off (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> ActivationHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"ActivationHandle({len(self.matched)} modules: {sorted(self.matched)})"


def shard_activations(module: nn.Module, rules: Sequence[Sequence[Any]], *, mesh: Mesh | None = None) -> ActivationHandle:
    """Constrain the layouts of submodules' inputs and outputs by regex over their names.

    Args:
        module: the model; submodule names are those of ``module.named_modules()``
            (``""`` is ``module`` itself).
        rules: ``(regex, in_spec, out_spec)`` triples; ``re.search`` on the dotted name, the
            first matching rule wins. A spec is a sharding (P, placements or NamedSharding)
            for every tensor input (``in_spec``: positional and keyword arguments) or output
            (``out_spec``: every tensor in the returned pytree), ``None`` to leave that side
            alone, a tuple of shardings (or None) by position, or a dict choosing tensors:
            ``{argument name or position: sharding}`` for inputs, ``{output position or key:
            sharding}`` for outputs.
        mesh: the mesh for bare P specs (else the arrays' own mesh / the current mesh).

    Returns:
        an :class:`ActivationHandle`; ``handle.remove()`` undoes the hooks.

    Example (sequence parallel on a Hugging Face Llama, with ``shard_params`` for the weights)::

        handle = sf.nn.shard_activations(model, [
            (r"layers\\.\\d+$", P("dp", "tp"), None),  # residual stream split over sequence
            (r"(input_layernorm|post_attention_layernorm|norm)$", P("dp", "tp"), P("dp", "tp")),
        ], mesh=mesh)
    """
    if not isinstance(module, nn.Module):
        raise ShardingError(f"shard_activations takes an nn.Module, got {type(module).__name__}")
    compiled = _compile(rules, mesh)
    handles: list[Any] = []
    matched: dict[str, int] = {}
    used: set[int] = set()
    for name, sub in module.named_modules():
        rule = next((r for r in compiled if r.pattern.search(name)), None)
        if rule is None:
            continue
        used.add(rule.index)
        matched[name] = rule.index
        where = f"{rule.label} on module {name!r}"
        if rule.inputs is not None:
            handles.append(sub.register_forward_pre_hook(_pre_hook(rule.inputs, where, _arg_names(sub), mesh),
                                                         with_kwargs=True))
        if rule.outputs is not None:
            handles.append(sub.register_forward_hook(_post_hook(rule.outputs, where, mesh)))
    unused = [r.label for r in compiled if r.index not in used]
    if unused:
        warnings.warn(f"{', '.join(unused)} matched no submodule of {type(module).__name__}", UnmatchedRulesWarning,
                      stacklevel=2)
    return ActivationHandle(handles, matched)


def _is_sharding(s: Any) -> bool:
    return isinstance(s, (P, NamedSharding, Layout)) or _is_placements(s)


def _compile(rules: Sequence[Sequence[Any]], mesh: Mesh | None) -> list[_ActRule]:
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise ShardingError(f"shard_activations: rules must be a list of (regex, in_spec, out_spec), "
                            f"got {type(rules).__name__}")
    out = []
    for i, r in enumerate(rules):
        if not isinstance(r, Sequence) or isinstance(r, (str, bytes)) or len(r) != 3:
            raise ShardingError(f"shard_activations rules[{i}]={r!r} must be a (regex, in_spec, out_spec) triple")
        pattern, ins, outs = r
        try:
            compiled = pattern if isinstance(pattern, re.Pattern) else re.compile(pattern)
        except (re.error, TypeError) as exc:
            raise ShardingError(f"shard_activations rules[{i}]: {pattern!r} is not a valid regex: {exc}") from None
        rule = _ActRule(i, compiled, None, None)
        out.append(attrs.evolve(rule, inputs=_spec(ins, rule, "in_spec", mesh), outputs=_spec(outs, rule, "out_spec", mesh)))
    return out


def _spec(spec: Any, rule: _ActRule, side: str, mesh: Mesh | None) -> Any:
    if spec is None:
        return None
    if isinstance(spec, Mapping):
        for k, v in spec.items():
            if not isinstance(k, (int, str)):
                raise ShardingError(f"{rule.label}: {side} keys are argument names or positions, got {k!r}")
            if v is not None and not _is_sharding(v):
                raise ShardingError(f"{rule.label}: {side}[{k!r}]={v!r} is not a sharding (P, placements, NamedSharding)")
        return {k: _bind(v, mesh) for k, v in spec.items() if v is not None}
    if isinstance(spec, (tuple, list)) and not _is_sharding(spec) and all(s is None or _is_sharding(s) for s in spec):
        return {i: _bind(s, mesh) for i, s in enumerate(spec) if s is not None}  # one per position
    if not _is_sharding(spec):
        raise ShardingError(f"{rule.label}: {side}={spec!r} is not a sharding (P, placements or NamedSharding), "
                            f"a tuple or dict of them, or None")
    return _bind(spec, mesh)


def _bind(spec: Any, mesh: Mesh | None) -> Any:
    return NamedSharding(mesh, spec) if mesh is not None and isinstance(spec, P) else spec


def _arg_names(sub: nn.Module) -> list[str]:
    try:
        params = inspect.signature(sub.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _constrain(x: Any, sharding: Any, where: str, mesh: Mesh | None) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    try:
        if not isinstance(x, ShardedArray) and not torch._C._functorch.is_functorch_wrapped_tensor(x) and mesh is not None:
            return distribute(x, sharding, mesh=mesh)
        return with_sharding_constraint(x, sharding)
    except ShardingError as exc:
        raise ShardingError(f"{where}: {exc}") from None


def _constrain_all(tree: Any, sharding: Any, where: str, mesh: Mesh | None) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: _constrain(t, sharding, where, mesh), tree)


def _pre_hook(spec: Any, where: str, names: list[str], mesh: Mesh | None) -> Any:
    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not isinstance(spec, dict):
            return (_constrain_all(args, spec, f"{where}, inputs", mesh),
                    _constrain_all(kwargs, spec, f"{where}, inputs", mesh))
        args, kwargs = list(args), dict(kwargs)
        for key, s in spec.items():
            pos = key if isinstance(key, int) else (names.index(key) if key in names else None)
            if pos is not None and pos < len(args):
                args[pos] = _constrain_all(args[pos], s, f"{where}, input {key!r}", mesh)
            elif isinstance(key, str) and key in kwargs:
                kwargs[key] = _constrain_all(kwargs[key], s, f"{where}, input {key!r}", mesh)
        return tuple(args), kwargs

    return hook


def _post_hook(spec: Any, where: str, mesh: Mesh | None) -> Any:
    def hook(mod: nn.Module, args: tuple, out: Any) -> Any:
        if not isinstance(spec, dict):
            return _constrain_all(out, spec, f"{where}, outputs", mesh)
        if isinstance(out, tuple) and all(isinstance(k, int) for k in spec):
            items = list(out)
            for k, s in spec.items():
                if k < len(items):
                    items[k] = _constrain_all(items[k], s, f"{where}, output {k}", mesh)
            return type(out)(items) if not hasattr(out, "_fields") else type(out)(*items)
        if isinstance(out, Mapping):
            for k, s in spec.items():
                if k in out:
                    out[k] = _constrain_all(out[k], s, f"{where}, output {k!r}", mesh)
            return out
        if isinstance(out, torch.Tensor) and set(spec) <= {0}:
            return _constrain(out, spec[0], f"{where}, output 0", mesh) if spec else out
        raise ShardingError(f"{where}: out_spec keys {sorted(map(repr, spec))} do not fit an output of type "
                            f"{type(out).__name__}")

    return hook
