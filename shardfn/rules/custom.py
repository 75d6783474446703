"""``sf.register_sharding``: sharding rules for custom ops (or overrides of built-in ones).

A rule is an einsum string (``"mk,kn->mn"``: one letter per dim of each tensor input
and of the output; contracted letters leave the output Partial(sum)), a rule object
with ``candidates(call)``, or, as a decorator, a function of the op's arguments that
returns ``(out_specs, in_specs)`` alternatives; dispatch keeps the one moving the fewest
bytes. Custom ops run once per device on their local shards.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, overload

import attrs
import torch
from torch.utils import _pytree as pytree

from ..values.errors import ShardingError
from ..values.layout import Layout
from ..arrays import rule_table
from .base import Candidate, OpCall, Rule
from .dims import compile_dims, einsum_dims, parse_einsum


@attrs.frozen
class EinsumRule:
    """A user einsum string applied to the op's tensor inputs in argument order."""

    eq: str

    def candidates(self, call: OpCall) -> list[Candidate]:
        ins, out = parse_einsum(self.eq)
        ranks = [len(s) for s in call.shapes]
        outs = [m for m in call.out_metas if isinstance(m, torch.Tensor)]
        if [len(s) for s in ins] != ranks or len(outs) != 1 or outs[0].dim() != len(out):
            raise ShardingError(
                f"{_name(call.func)}: sharding rule {self.eq!r} describes inputs of ranks "
                f"{[len(s) for s in ins]} and an output of rank {len(out)}, but the call has "
                f"tensor inputs of ranks {ranks} and outputs of ranks {[m.dim() for m in outs]}"
            )
        _check_sizes(self.eq, ins, out, call.shapes, tuple(outs[0].shape), call.func)
        _probe_letters(self.eq, ins, out, call)
        return compile_dims(call, einsum_dims(self.eq))


def _check_sizes(eq: str, ins: Sequence[str], out: str, shapes: Sequence[tuple], out_shape: tuple,
                 func: Any) -> None:
    """Each letter names one size across the operands, and the output's dims have the
    sizes its letters name (a misordered rule would otherwise give wrong values)."""
    sizes: dict[str, tuple[int, str]] = {}
    for i, (letters, shape) in enumerate(zip(ins, shapes)):
        for d, (L, n) in enumerate(zip(letters, shape)):
            seen = sizes.setdefault(L, (n, f"input {i} dim {d}"))
            if seen[0] != n:
                raise ShardingError(
                    f"{_name(func)}: sharding rule {eq!r} gives letter {L!r} size {seen[0]} ({seen[1]}) "
                    f"and size {n} (input {i} dim {d}); a letter must name one size"
                )
    for d, (L, n) in enumerate(zip(out, out_shape)):
        if sizes[L][0] != n:
            raise ShardingError(
                f"{_name(func)}: sharding rule {eq!r} says output dim {d} is {L!r} of size {sizes[L][0]} "
                f"({sizes[L][1]}), but the op's output has shape {out_shape}; fix the output letters"
            )


def _probe_letters(eq: str, ins: Sequence[str], out: str, call: OpCall) -> None:
    """Run the op on meta operands whose letters all have distinct sizes: the output's
    sizes then tell which letter each output dim really is, which equal sizes (square
    matrices) cannot. An op that refuses the probe shapes is not probed."""
    sizes = {L: 2 + i for i, L in enumerate(sorted(set("".join(ins))))}
    probes = iter([torch.empty([sizes[L] for L in letters], dtype=v.dtype, device="meta")
                   for letters, (_, v) in zip(ins, call.arrays)])
    from ..arrays.array import ShardedArray

    args, kwargs = pytree.tree_map_only(ShardedArray, lambda _: next(probes), (call.args, call.kwargs))
    try:
        result = call.func(*args, **kwargs)
    except Exception:  # the op's own constraints on sizes: nothing to learn from the probe
        return
    got = tuple(result.shape) if isinstance(result, torch.Tensor) else None
    want = tuple(sizes[L] for L in out)
    if got is not None and got != want:
        raise ShardingError(
            f"{_name(call.func)}: sharding rule {eq!r} says the output's dims are {list(out)}, but with "
            f"letter sizes {sizes} the op returns shape {got}, not {want}; fix the output letters"
        )


@attrs.frozen
class SpecFnRule:
    """Alternatives from ``fn(*args, **kwargs) -> [(out_specs, in_specs), ...]``.

    ``in_specs`` has one entry per tensor input (argument order, lists flattened), or one
    per argument with None for non-tensors; ``out_specs`` one spec, or one per output
    (a Tensor-list output takes a list of specs, or one spec for every element).
    A spec is a ``P``, a placements tuple, a NamedSharding, or None (replicated)."""

    fn: Callable[..., Sequence[tuple[Any, Any]]]

    def candidates(self, call: OpCall) -> list[Candidate]:
        alternatives = self.fn(*call.args, **call.kwargs)
        return [self._candidate(call, out_specs, in_specs) for out_specs, in_specs in alternatives]

    def _candidate(self, call: OpCall, out_specs: Any, in_specs: Any) -> Candidate:
        ins = _input_specs(call, in_specs)
        in_layouts = tuple(_layout(call, s, v.ndim, f"in_specs[{i}]") for i, (s, (_, v)) in enumerate(zip(ins, call.arrays)))
        metas = call.out_metas
        if len(metas) == 1 or not isinstance(out_specs, (list, tuple)) or _is_one_spec(out_specs):
            out_specs = [out_specs] * len(metas)
        if len(out_specs) != len(metas):
            raise ShardingError(
                f"{_name(call.func)}: the sharding rule gave {len(out_specs)} out_specs for "
                f"{len(metas)} outputs; give one spec per output"
            )
        outs = tuple(
            _layout(call, s, m.dim(), f"out_specs[{i}]") if isinstance(m, torch.Tensor) else None
            for i, (s, m) in enumerate(zip(out_specs, metas))
        )
        return Candidate(in_layouts, outs)


def _is_one_spec(s: Any) -> bool:
    from ..values.spec import P, _is_placements

    return isinstance(s, P) or _is_placements(s)


def _input_specs(call: OpCall, in_specs: Any) -> list:
    """One spec per sharded input (argument order)."""
    if _is_one_spec(in_specs) or in_specs is None:
        in_specs = [in_specs]
    in_specs = list(in_specs)
    if len(in_specs) == len(call.arrays):
        return in_specs
    by_arg: dict[Any, Any] = dict(enumerate(in_specs[: len(call.args)]))
    by_arg.update(zip(call.kwargs, in_specs[len(call.args):]))
    out = []
    for path, _ in call.arrays:
        key, j = (path[0], path[1]) if isinstance(path, tuple) else (path, None)
        if key not in by_arg:
            raise ShardingError(
                f"{_name(call.func)}: the sharding rule gave {len(in_specs)} in_specs; give one "
                f"per tensor input ({len(call.arrays)}) or one per argument "
                f"({len(call.args) + len(call.kwargs)}, None for non-tensors)"
            )
        s = by_arg[key]
        out.append(s[j] if j is not None and isinstance(s, list) else s)
    return out


def _layout(call: OpCall, spec: Any, ndim: int, where: str) -> Layout:
    from ..values.spec import P, to_layout

    try:
        return to_layout(P() if spec is None else spec, ndim, call.mesh, arg=where)
    except ShardingError as e:
        raise ShardingError(f"{_name(call.func)}: sharding rule {where}: {e}") from None


def _name(func: Any) -> str:
    return str(func)


def _overloads(op: Any) -> list:
    """Every overload an op handle stands for (custom ops, packets, overloads)."""
    if hasattr(op, "_opoverload"):  # torch.library.custom_op
        op = op._opoverload
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    if isinstance(op, torch._ops.OpOverload):
        return [op]
    raise ShardingError(
        f"register_sharding takes an op such as torch.ops.mylib.op or torch.ops.aten.mm.default, "
        f"got {op!r}"
    )


def _as_rule(rule: Any, ops: list) -> Rule:
    if isinstance(rule, str):
        _check_einsum(rule, ops)
        return EinsumRule(rule)
    if hasattr(rule, "candidates"):
        return rule
    raise ShardingError(
        f"register_sharding: rule must be an einsum string such as 'mk,kn->mn' or an object "
        f"with candidates(call); got {rule!r} (use the decorator form for a function)"
    )


def _check_einsum(eq: str, ops: list) -> None:
    """Syntax, letters and arity of an einsum rule, checked when it is registered."""
    def bad(why: str) -> ShardingError:
        return ShardingError(
            f"register_sharding: einsum rule {eq!r} {why}; write one comma-separated group of "
            f"letters per tensor input, '->', and the output's letters, e.g. 'mk,kn->mn' for mm"
        )

    if eq.replace(" ", "").count("->") != 1:
        raise bad("needs exactly one '->'")
    ins, out = parse_einsum(eq)
    for part in (*ins, out):
        if not all(c.isascii() and c.isalpha() for c in part):
            raise bad(f"has {part!r}, which is not letters only")
        if len(set(part)) != len(part):
            raise bad(f"repeats a letter within {part!r}")
    missing = sorted(set(out) - set("".join(ins)))
    if missing:
        raise bad(f"has output letter(s) {missing} that no input names")
    for op in ops:
        _check_arity(eq, len(ins), op)


def _check_arity(eq: str, n: int, op: Any) -> None:
    """The rule has one operand per Tensor parameter and the op returns one Tensor."""
    types = [str(a.type) for a in op._schema.arguments]
    if any("Tensor" in t and "[]" in t for t in types):
        return  # a tensor list: its length is known at the call only
    required = sum(t == "Tensor" for t in types)
    optional = sum(t in ("Tensor?", "Optional[Tensor]") for t in types)
    returns = [str(r.type) for r in op._schema.returns]
    if not required <= n <= required + optional:
        raise ShardingError(
            f"register_sharding: einsum rule {eq!r} has {n} input(s) but {op} takes "
            f"{required}{f' to {required + optional}' if optional else ''} tensor(s): {op._schema}"
        )
    if returns != ["Tensor"]:
        raise ShardingError(
            f"register_sharding: an einsum rule describes one tensor output, but {op} returns "
            f"{returns}: {op._schema}; use the decorator form for several outputs"
        )


@overload
def register_sharding(op: Any, rule: str | Rule) -> None: ...
@overload
def register_sharding(op: Any, rule: None = None) -> Callable[[Callable], Callable]: ...


def register_sharding(op: Any, rule: Any = None) -> Any:
    """Give ``op`` a sharding rule (replacing any built-in one).

    Args:
        op: the op (``torch.ops.ns.name``, one overload, or a ``torch.library.custom_op``).
        rule: an einsum string (``"bk,kn->bn"``) or a rule object. Omitted: returns a
            decorator for a function of the op's arguments returning a list of
            ``(out_specs, in_specs)`` alternatives.

    Example::

        @sf.register_sharding(torch.ops.mylib.scale)
        def _(x, factor):
            return [(P("x"), (P("x"), None)), (P(), (P(), None))]
    """
    ops = _overloads(op)
    if rule is None:
        def decorate(fn: Callable) -> Callable:
            _install(ops, SpecFnRule(fn))
            return fn

        return decorate
    _install(ops, _as_rule(rule, ops))
    return None


def _install(ops: list, rule: Rule) -> None:
    for o in ops:
        rule_table.register(o, rule)
