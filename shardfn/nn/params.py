"""Sharding a model's parameters by regex rules (:func:`shard_params`): each name's first
matching rule gives its spec (and initialiser); tensors on the meta device are materialised
shard by shard, with torch's default initialisation where the owner's is known."""

from __future__ import annotations

import hashlib
import math
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from ..arrays.array import ShardedArray
from ..arrays.redistribute import distribute
from ..random import keys as _random
from ..values.errors import ShardingError
from ..values.layout import Layout, describe
from ..values.mesh import Mesh
from ..values.spec import P, Sharding, to_layout
from . import init
from .init import Initializer

RuleLike = Sequence[Any]  # (regex, spec) or (regex, spec, init)


class UnmatchedParamsWarning(UserWarning):
    """Some parameters matched no rule of :func:`shard_params` and were replicated."""


@attrs.frozen
class _Rule:
    index: int
    pattern: re.Pattern
    spec: Sharding
    init: Initializer | None


@attrs.frozen
class _Entry:
    """One tensor to shard: its name, value, and (for modules) owner and attribute."""

    name: str
    tensor: torch.Tensor
    owner: nn.Module | None
    attr: str


# -- shard_params --------------------------------------------------------------------------------


def shard_params(module_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
                 rules: Sequence[RuleLike] | Mapping[Any, Any], *,
                 mesh: Mesh | None = None, key: _random.KeyLike | None = None, dtype: torch.dtype | None = None,
                 unmatched: str = "warn") -> dict[str, ShardedArray]:
    """Shard every parameter and buffer by the first rule whose regex matches its name.

    Args:
        module_or_state_dict: a module (its parameters and buffers) or a state dict.
        rules: ``(regex, spec)`` or ``(regex, spec, init)``; ``re.search`` on the dotted
            name, first match wins. ``spec`` is a P, placements or NamedSharding. A dict
            ``{regex: spec}`` is the list of its items, in order.
        mesh: the mesh for bare specs (else the current mesh).
        key: the key for initialisers (default: drawn from torch's default generator,
            or the ``sf.random.set_seed`` key). Each tensor uses ``fold_in(key, hash(name))``,
            so its values do not depend on the rules' order or on the other tensors.
        dtype: cast every tensor to this dtype (default: keep each one's dtype).
        unmatched: what to do with tensors no rule matches (they are replicated):
            ``"warn"`` (an :class:`UnmatchedParamsWarning` naming them), ``"ignore"``,
            or ``"error"`` (a ShardingError).

    Returns:
        A dict name -> ShardedArray, ready for ``torch.func.functional_call``.

    Tensors on the meta device are materialised shard by shard with their rule's
    initialiser, or torch's default initialisation for Linear, Embedding, convolution
    and normalisation layers; real tensors keep their values. A spec that does not fit
    a tensor is a ShardingError naming the tensor, its shape and the spec.
    """
    if unmatched not in ("warn", "ignore", "error"):
        raise ShardingError(f"unmatched={unmatched!r} must be 'warn', 'ignore' or 'error'")
    compiled = _compile_rules(rules)
    entries = _entries(module_or_state_dict)
    base_key = _random._key_or_draw(key) if any(e.tensor.is_meta for e in entries) else None
    out, missed = {}, []
    for e in entries:
        rule = next((r for r in compiled if r.pattern.search(e.name)), None)
        if rule is None:
            missed.append(e.name)
        layout = _fit(e, rule, mesh)
        out[e.name] = _materialise(e, rule, layout, base_key, dtype or e.tensor.dtype)
    if missed:
        _report_unmatched(missed, unmatched, rules)
    return out


def _compile_rules(rules: Sequence[RuleLike] | Mapping[Any, Any]) -> list[_Rule]:
    if isinstance(rules, Mapping):  # {regex: spec}, first match wins in its order (torchtitan's plans are dicts)
        rules = list(rules.items())
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise ShardingError(f"rules must be a list of (regex, spec) pairs or a dict {{regex: spec}}, "
                            f"got {type(rules).__name__}")
    out = []
    for i, r in enumerate(rules):
        if not isinstance(r, (tuple, list)) or len(r) not in (2, 3):
            raise ShardingError(f"rules[{i}]={r!r} must be (regex, spec) or (regex, spec, init)")
        pattern, spec, fn = r[0], r[1], (r[2] if len(r) == 3 else None)
        try:
            compiled = pattern if isinstance(pattern, re.Pattern) else re.compile(pattern)
        except (re.error, TypeError) as exc:
            raise ShardingError(f"rules[{i}]: {pattern!r} is not a valid regex: {exc}") from None
        if fn is not None and not callable(fn):
            raise ShardingError(f"rules[{i}]: init {fn!r} is not callable; use e.g. sf.nn.init.normal(std=0.02)")
        out.append(_Rule(i, compiled, spec, fn))
    return out


def _entries(obj: nn.Module | Mapping[str, torch.Tensor]) -> list[_Entry]:
    if isinstance(obj, nn.Module):
        out = []
        for prefix, mod in obj.named_modules():
            for attr, t in list(mod._parameters.items()) + list(mod._buffers.items()):
                if t is not None:
                    name = f"{prefix}.{attr}" if prefix else attr
                    out.append(_Entry(name, t, mod, attr))
        seen: set[int] = set()
        return [e for e in out if not (id(e.tensor) in seen or seen.add(id(e.tensor)))]
    if isinstance(obj, Mapping):
        for name, t in obj.items():
            if not isinstance(t, torch.Tensor):
                raise ShardingError(f"state dict entry {name!r} is {type(t).__name__}, not a tensor")
        return [_Entry(n, t, None, n) for n, t in obj.items()]
    raise ShardingError(f"shard_params takes an nn.Module or a state dict, got {type(obj).__name__}")


def _fit(e: _Entry, rule: _Rule | None, mesh: Mesh | None) -> Layout:
    """The layout ``rule`` gives ``e`` (replicated when unmatched), with a clear error."""
    spec = P() if rule is None else rule.spec
    try:
        return to_layout(spec, e.tensor.dim(), mesh)
    except ShardingError as exc:
        where = f"rule {rule.index} ({rule.pattern.pattern!r})" if rule else "the default"
        raise ShardingError(
            f"parameter {e.name!r} of shape {tuple(e.tensor.shape)}: {where} gives spec {spec!r}, "
            f"which does not fit it: {exc}"
        ) from None


def _name_key(base: _random.Key, name: str) -> _random.Key:
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return _random.fold_in(base, int.from_bytes(digest, "little"))


def _materialise(e: _Entry, rule: _Rule | None, layout: Layout, base_key: _random.Key | None,
                 dtype: torch.dtype) -> ShardedArray:
    t = e.tensor
    if t.is_meta:
        fn = rule.init if rule is not None and rule.init is not None else _default_init(e)
        if fn is None:
            raise ShardingError(
                f"parameter {e.name!r} ({describe(tuple(t.shape), dtype, layout)}) is on the meta device "
                f"and no rule gives it an init; add one, e.g. "
                f"({e.name.replace('.', chr(92) + '.')!r}, {layout.spec_str()}, sf.nn.init.normal(std=0.02))"
            )
        out = fn(_name_key(base_key, e.name), tuple(t.shape), layout, dtype=dtype)
    else:
        out = distribute(t.detach().to(dtype), layout)
    if t.requires_grad and (out.is_floating_point() or out.is_complex()):
        out.requires_grad_(True)
    return out


def _report_unmatched(names: list[str], mode: str, rules: Sequence[RuleLike]) -> None:
    if mode == "ignore":
        return
    listed = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
    msg = (f"{len(names)} parameter(s) matched none of the {len(rules)} rules and are replicated: {listed}; "
           f"add a rule (e.g. ('.*', P())) to say so explicitly")
    if mode == "error":
        raise ShardingError(msg)
    warnings.warn(msg, UnmatchedParamsWarning, stacklevel=3)


# -- torch's default initialisation, for tensors on the meta device --------------------------------

_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.RMSNorm)


def _default_init(e: _Entry) -> Initializer | None:
    """What the owner's ``reset_parameters`` would do, when that is known."""
    mod, attr = e.owner, e.attr
    if isinstance(mod, (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd)):
        if attr == "weight":
            return init.kaiming_uniform(a=math.sqrt(5))
        if attr == "bias":
            fan_in, _ = nn.init._calculate_fan_in_and_fan_out(mod.weight)
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
            return init.uniform(-bound, bound)
    if isinstance(mod, nn.Embedding) and attr == "weight" and mod.padding_idx is None:
        return init.normal()
    if isinstance(mod, _NORMS):
        return {"weight": init.ones(), "bias": init.zeros(), "running_mean": init.zeros(),
                "running_var": init.ones(), "num_batches_tracked": init.zeros()}.get(attr)
    return None
