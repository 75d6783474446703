"""The small compiler from dim-letter rule data to candidate strategies.

A :class:`Dims` names every dim of every sharded input and of every output with a
letter (``None``: the dim must be whole). Letters shared between inputs must be sharded
alike; a letter missing from an output is *reduced*: sharding it leaves that output
Partial with the letter's reduce op, or, without one, it may not be sharded at all.
``"mk,kn->mn"`` is the einsum spelling of one such rule (``k`` reduced with ``sum``).

For each mesh axis the compiler considers: replicate, shard one of the letters some
input already shards over that axis, or keep an input's pending reduction (for ops
linear in that input). Each combination is one :class:`Candidate`; dispatch keeps the
one that moves the fewest bytes.

A pending sum passes through a product (``linear`` without ``joint``: a contraction, a
scaling) only where its factors are known to hold no ±inf (``base.finite_factor``):
``sum(parts) @ B`` is not ``sum(parts @ B)`` where ``B`` holds inf (a part of 0 gives
``0 * inf = nan``, parts of both signs ``inf - inf``), so with a factor that may hold inf
the pending input is reduced first.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import attrs

from ..values.layout import Layout
from .base import Candidate, OpCall, finite_factor, sum_passes

Letters = tuple[str | None, ...]

LINEAR_OPS = ("sum", "avg")


@attrs.frozen
class Dims:
    """Rule data for one call.

    ``ins``/``outs``: a letter per dim (``outs`` entries are None for non-tensor outputs).
    ``reduce``: letter -> reduce op making outputs that lack it Partial.
    ``linear``: pending-reduction ops an input may keep, the output taking them over
    (``"multi"`` semantics: only one input may be Partial over an axis, the others are
    replicated on it); ``joint``: all inputs may be Partial together (add-like).
    ``addends``: inputs added to the result, which must carry the output's Partial too.
    ``factors``: without ``joint``, the inputs a pending input is multiplied by (None: every
    other input but the addends); it stays pending only where they are known finite.
    """

    ins: tuple[Letters, ...]
    outs: tuple[Letters | None, ...]
    reduce: tuple[tuple[str, str], ...] = ()
    linear: tuple[str, ...] = ()
    joint: bool = False
    addends: tuple[int, ...] = ()
    partial_ins: tuple[int, ...] | None = None
    factors: tuple[int, ...] | None = None


_REPLICATE = ("rep",)


def compile_dims(call: OpCall, spec: Dims, **fns: Any) -> list[Candidate]:
    """Candidates for ``call`` under ``spec``; ``fns`` (local-call facts such as
    ``local_sizes``) are passed on to every Candidate."""
    mesh = call.mesh
    layouts = call.layouts
    options = [_axis_options(a, layouts, spec, call) for a in mesh.axis_names]
    seen: set = set()
    out: list[Candidate] = []
    for combo in itertools.product(*options):
        built = _build(call, spec, dict(zip(mesh.axis_names, combo)))
        if built is None or built in seen:
            continue
        seen.add(built)
        out.append(Candidate(built[0], built[1], **fns))
    return out


def _axis_options(axis: str, layouts: Sequence[Layout], spec: Dims, call: OpCall) -> list[tuple]:
    opts: list[tuple] = []
    for i, (lay, letters) in enumerate(zip(layouts, spec.ins)):
        d = lay.axis_dim.get(axis)
        if d is not None and letters[d] is not None and ("shard", letters[d]) not in opts:
            opts.append(("shard", letters[d]))
        op = lay.partial_ops.get(axis)
        if (op in spec.linear and _may_be_partial(spec, i) and ("partial", i, op) not in opts
                and sum_passes(call, call.arrays[i][1].dtype) and _finite_factors(call, spec, i)):
            opts.append(("partial", i, op))
    opts.append(_REPLICATE)
    return opts


def _finite_factors(call: OpCall, spec: Dims, i: int) -> bool:
    """Whether pending input ``i`` may pass through the product: its factors (the inputs it is
    multiplied by) are known to hold no ±inf. Ops linear in their inputs jointly add them:
    no factors."""
    if spec.joint:
        return True
    factors = spec.factors
    if factors is None:
        factors = tuple(j for j in range(len(call.arrays)) if j not in spec.addends)
    return all(finite_factor(call.arrays[j][1]) for j in factors if j != i)


def _may_be_partial(spec: Dims, i: int) -> bool:
    return (spec.partial_ins is None or i in spec.partial_ins) and i not in spec.addends


def _build(call: OpCall, spec: Dims, choice: dict[str, tuple]) -> tuple | None:
    mesh = call.mesh
    layouts = call.layouts
    letter_axes: dict[str, list[str]] = {}
    partial: dict[str, str] = {}
    partial_src: dict[str, int] = {}
    for a in mesh.axis_names:
        c = choice[a]
        if c[0] == "shard":
            letter_axes.setdefault(c[1], []).append(a)
        elif c[0] == "partial":
            partial[a], partial_src[a] = c[2], c[1]
    order = {L: _ordered(L, axes, layouts, spec) for L, axes in letter_axes.items()}
    reduce = dict(spec.reduce)
    out_partial = dict(partial)
    outs = []
    for letters in spec.outs:
        if letters is None:
            outs.append(None)
            continue
        p = dict(out_partial)
        for L, axes in order.items():
            if L not in letters:
                if L not in reduce:
                    return None
                for a in axes:
                    p[a] = reduce[L]
        outs.append(_layout(mesh, letters, order, p))
    reduced = {a for o in outs if o is not None for a, _ in o.partial} - set(partial)
    red_ops = {a: op for o in outs if o is not None for a, op in o.partial}
    ins = []
    for i, letters in enumerate(spec.ins):
        p = {}
        for a, op in partial.items():
            if (spec.joint and _may_be_partial(spec, i)) or partial_src[a] == i or i in spec.addends:
                p[a] = op
        if i in spec.addends:
            p.update({a: red_ops[a] for a in reduced})
        ins.append(_layout(mesh, letters, order, p))
    return tuple(ins), tuple(outs)


def _ordered(letter: str, axes: list[str], layouts: Sequence[Layout], spec: Dims) -> tuple[str, ...]:
    """Axes sharding one letter, in the major-first order an input already uses."""
    if len(axes) == 1:
        return tuple(axes)
    for lay, letters in zip(layouts, spec.ins):
        for d, L in enumerate(letters):
            if L == letter:
                have = [a for a in lay.dims[d] if a in axes]
                if have:
                    return tuple(have) + tuple(a for a in axes if a not in have)
    return tuple(axes)


def _layout(mesh: Any, letters: Letters, order: dict, partial: dict[str, str]) -> Layout:
    dims = tuple(order.get(L, ()) if L is not None else () for L in letters)
    names = mesh.axis_names
    return Layout(mesh, dims, tuple(sorted(partial.items(), key=lambda p: names.index(p[0]))))


# -- einsum strings -------------------------------------------------------------------------


def parse_einsum(eq: str) -> tuple[tuple[str, ...], str]:
    """``"mk,kn->mn"`` -> (("mk", "kn"), "mn")."""
    lhs, _, rhs = eq.replace(" ", "").partition("->")
    return tuple(lhs.split(",")), rhs


def einsum_dims(eq: str, ranks: Sequence[int] | None = None) -> Dims:
    """Dims for an einsum string: contracted letters reduce with ``sum``; the op is
    linear in each operand. Inputs beyond the equation's operands are addends broadcast
    against the output (their ``ranks`` right-aligned; size-1 dims get None)."""
    ins, out = parse_einsum(eq)
    reduce = tuple((L, "sum") for L in sorted(set("".join(ins)) - set(out)))
    return Dims(tuple(tuple(s) for s in ins), (tuple(out),), reduce, LINEAR_OPS)


def with_addend(spec: Dims, letters: Letters) -> Dims:
    """``spec`` with an extra leading input added to the result (addmm's ``self``)."""
    return attrs.evolve(
        spec, ins=(letters,) + spec.ins, addends=(0,),
        partial_ins=tuple(range(1, len(spec.ins) + 1)),
    )


def broadcast_letters(out: Letters, shape: Sequence[int], out_shape: Sequence[int]) -> Letters:
    """Letters of an operand broadcast into an output (right-aligned; stretched dims None)."""
    off = len(out_shape) - len(shape)
    return tuple(out[k + off] if shape[k] == out_shape[k + off] else None for k in range(len(shape)))

