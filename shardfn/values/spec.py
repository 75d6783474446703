"""Shardings: PartitionSpec ``P``, DTensor-style placements, NamedSharding, and
their conversion to the canonical :class:`~shardfn.values.layout.Layout`."""

from __future__ import annotations

import functools
from typing import Any, Sequence, Union

import attrs

from .torch_compat import ValueMeta
from .errors import ShardingError, ShardingTypeError
from .layout import REDUCE_OPS, Layout
from .mesh import Mesh, current_mesh


def _check_op(op: object, where: str) -> str:
    if op not in REDUCE_OPS:
        raise ShardingError(f"{where}: reduce op {op!r} is unknown; use one of {REDUCE_OPS}")
    return op  # type: ignore[return-value]


def _normalize_partial(partial: object) -> tuple[tuple[str, str], ...]:
    if partial is None:
        return ()
    if isinstance(partial, str):
        return ((partial, "sum"),)
    if isinstance(partial, dict):
        items = list(partial.items())
    elif isinstance(partial, (tuple, list)):
        items = [(a, "sum") for a in partial]
    else:
        raise ShardingError(
            f"P(partial={partial!r}) must be an axis name, a tuple of names, or a dict "
            f"{{axis: op}} with op in {REDUCE_OPS}"
        )
    for a, op in items:
        if not isinstance(a, str):
            raise ShardingError(f"P(partial=...) axis {a!r} is not an axis name (str)")
        _check_op(op, f"P(partial={partial!r})")
    return tuple(items)


def _normalize_entry(entry: object, i: int) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
        return entry
    raise ShardingError(
        f"P entry {i} is {entry!r}; each entry is None, a mesh axis name, or a tuple of names"
    )


class P(tuple, metaclass=ValueMeta):
    """PartitionSpec: one entry per tensor dim (None, an axis name, or a tuple of names,
    first name major); trailing dims may be omitted. ``partial`` names axes over which
    the value is a pending reduction."""

    def __new__(cls, *dims: Any, partial: Any = None) -> P:
        self = super().__new__(cls, dims)
        axes = [a for i, e in enumerate(dims) for a in _normalize_entry(e, i)]
        pairs = _normalize_partial(partial)
        axes += [a for a, _ in pairs]
        dupes = sorted({a for a in axes if axes.count(a) > 1})
        if dupes:
            raise ShardingError(
                f"mesh axis {dupes[0]!r} is used twice in {_p_repr(dims, pairs)}; "
                f"a mesh axis may appear at most once in a spec"
            )
        self._partial = pairs
        self._axes = tuple(axes)
        return self

    @property
    def partial(self) -> dict[str, str]:
        """The pending reductions as ``{axis: op}``."""
        return dict(self._partial)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, P):
            return tuple.__eq__(self, other) and self._partial == other._partial
        return tuple.__eq__(self, other) and not self._partial if isinstance(other, tuple) else NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash((tuple(self), self._partial))

    def __repr__(self) -> str:
        return _p_repr(tuple(self), self._partial)

    def __reduce__(self) -> Any:
        return (_make_p, (tuple(self), dict(self._partial)))


def _make_p(dims: tuple, partial: dict) -> P:
    return P(*dims, partial=partial or None)


def _p_repr(dims: tuple, pairs: tuple[tuple[str, str], ...]) -> str:
    parts = [repr(d) for d in dims]
    if pairs:
        if all(op == "sum" for _, op in pairs):
            names = tuple(a for a, _ in pairs)
            parts.append(f"partial={names[0]!r}" if len(names) == 1 else f"partial={names!r}")
        else:
            parts.append(f"partial={dict(pairs)!r}")
    return "P(" + ", ".join(parts) + ")"


# -- placements ---------------------------------------------------------------------


@attrs.frozen
class Shard(metaclass=ValueMeta):
    """This mesh axis splits tensor dim ``dim`` (negative dims count from the end)."""

    dim: int

    def __attrs_post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise ShardingError(
                f"Shard(dim={self.dim!r}): dim must be an int tensor dim (negative counts "
                f"from the end), e.g. Shard(0) or Shard(-1); got {type(self.dim).__name__}"
            )

    def __str__(self) -> str:
        return f"S({self.dim})"


@attrs.frozen
class Replicate(metaclass=ValueMeta):
    """Every device along this mesh axis holds the same values."""

    def __str__(self) -> str:
        return "R"


@attrs.frozen
class Partial(metaclass=ValueMeta):
    """Devices along this mesh axis hold parts whose reduction by ``op`` is the value.

    ``op`` is "sum", "avg", "max" or "min". "avg" needs a floating or complex dtype (as
    ``torch.mean`` does: an integer average would round differently on different mesh
    shapes); "max"/"min" need a real dtype. Both are checked where the layout meets the
    value (distribute, from_local, reshard, factories) with a ShardingError."""

    op: str = attrs.field(default="sum")

    def __attrs_post_init__(self) -> None:
        _check_op(self.op, "Partial")

    def __str__(self) -> str:
        return f"P({self.op})"


Placement = Union[Shard, Replicate, Partial]


def check_mesh(mesh: object, where: str) -> Mesh:
    """``mesh`` itself if it is a Mesh, else a ShardingError naming ``where``."""
    if not isinstance(mesh, Mesh):
        raise ShardingError(
            f"{where} is {mesh!r} ({type(mesh).__name__}), not a Mesh; build one with "
            f"sf.Mesh(shape, axis_names), e.g. sf.Mesh((2, 4), ('x', 'y'))"
        )
    return mesh


def _as_spec(spec: object) -> P:
    """A NamedSharding's spec: a P, or a tuple/list of P entries."""
    if isinstance(spec, P):
        return spec
    if isinstance(spec, (tuple, list)):
        return P(*spec)
    raise ShardingError(
        f"NamedSharding(spec={spec!r}): spec must be a P(...) (P() for replicated), "
        f"or a tuple of its entries; got {type(spec).__name__}"
    )


@attrs.frozen
class NamedSharding(metaclass=ValueMeta):
    """A spec bound to a mesh."""

    mesh: Mesh = attrs.field(validator=lambda _, __, m: check_mesh(m, "NamedSharding(mesh=...)"))
    spec: P = attrs.field(converter=lambda s: _as_spec(s))

    def placements(self, ndim: int) -> tuple[Placement, ...]:
        """The DTensor-style placements (one per mesh axis) for an ``ndim``-dim value."""
        return layout_placements(self.layout(_rank(ndim, "NamedSharding.placements")))

    def layout(self, ndim: int) -> Layout:
        return spec_to_layout(self.mesh, self.spec, _rank(ndim, "NamedSharding.layout"))

    @staticmethod
    def from_placements(mesh: Mesh, placements: Sequence[Placement], ndim: int) -> NamedSharding:
        ndim = _rank(ndim, "NamedSharding.from_placements")
        return NamedSharding(mesh, layout_to_spec(placements_to_layout(mesh, placements, ndim)))


def _rank(ndim: object, where: str) -> int:
    """``ndim`` checked as a tensor rank: a non-negative int (not a bool)."""
    if isinstance(ndim, bool) or not isinstance(ndim, int):
        raise ShardingTypeError(f"{where}: ndim={ndim!r} must be an int, the tensor's rank (e.g. x.dim())")
    if ndim < 0:
        raise ShardingError(f"{where}: ndim={ndim} must be a tensor's rank, an int >= 0")
    return ndim


Sharding = Union[NamedSharding, P, Sequence[Placement], Layout]


def spec_to_layout(mesh: Mesh, spec: P, ndim: int) -> Layout:
    """The layout of ``spec`` on ``mesh`` for an ``ndim``-dim value (remembered: a training
    step reshards its gradients to their parameters' shardings every step)."""
    try:
        return _spec_layout(mesh, spec, ndim)
    except TypeError:  # an unhashable entry: checked and reported below
        return _spec_to_layout(mesh, spec, ndim)


@functools.lru_cache(maxsize=4096)
def _spec_layout(mesh: Mesh, spec: P, ndim: int) -> Layout:
    return _spec_to_layout(mesh, spec, ndim)


def _spec_to_layout(mesh: Mesh, spec: P, ndim: int) -> Layout:
    if len(spec) > ndim:
        raise ShardingError(
            f"{spec!r} has {len(spec)} entries but the tensor has rank {ndim}; "
            f"give at most {ndim} entries, e.g. {P(*spec[:ndim], partial=spec.partial or None)!r}"
        )
    for a in spec._axes:
        if a not in mesh.axis_names:
            raise ShardingError(
                f"{spec!r} names axis {a!r}, which the mesh lacks; its axes are {mesh.axis_names!r}"
            )
    dims = tuple(_normalize_entry(e, i) for i, e in enumerate(spec)) + ((),) * (ndim - len(spec))
    order = mesh.axis_names
    partial = tuple(sorted(spec._partial, key=lambda p: order.index(p[0])))
    return Layout(mesh, dims, partial)


def layout_to_spec(layout: Layout) -> P:
    entries = [None if not a else a[0] if len(a) == 1 else a for a in layout.dims]
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries, partial=dict(layout.partial) or None)


def layout_placements(layout: Layout) -> tuple[Placement, ...]:
    order = layout.mesh.axis_names
    for d, axes in enumerate(layout.dims):
        if list(axes) != sorted(axes, key=order.index):
            raise ShardingError(
                f"{layout.spec_str()} shards dim {d} over {axes!r}, not in mesh order "
                f"{order!r}; placements cannot express that order, use the spec instead"
            )
    out: list[Placement] = []
    for a in order:
        if a in layout.partial_ops:
            out.append(Partial(layout.partial_ops[a]))
        elif a in layout.axis_dim:
            out.append(Shard(layout.axis_dim[a]))
        else:
            out.append(Replicate())
    return tuple(out)


def placements_to_layout(mesh: Mesh, placements: Sequence[Placement], ndim: int) -> Layout:
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise ShardingError(
            f"got {len(placements)} placements for a mesh with {mesh.ndim} axes "
            f"{mesh.axis_names!r}; give one placement per mesh axis"
        )
    dims: list[list[str]] = [[] for _ in range(ndim)]
    partial = []
    for a, p in zip(mesh.axis_names, placements):
        if isinstance(p, Shard):
            d = p.dim + ndim if p.dim < 0 else p.dim
            if not 0 <= d < ndim:
                raise ShardingError(
                    f"Shard({p.dim}) on mesh axis {a!r} is out of range for a tensor of "
                    f"rank {ndim}; valid dims are {-ndim}..{ndim - 1}" if ndim else
                    f"Shard({p.dim}) on mesh axis {a!r}: a 0-d tensor has no dim to shard; use Replicate()"
                )
            dims[d].append(a)
        elif isinstance(p, Partial):
            partial.append((a, p.op))
        elif not isinstance(p, Replicate):
            raise ShardingError(
                f"placement {p!r} for mesh axis {a!r} is not Shard, Replicate or Partial"
            )
    return Layout(mesh, tuple(map(tuple, dims)), tuple(partial))


def _is_placements(s: object) -> bool:
    return isinstance(s, (tuple, list)) and not isinstance(s, P) and all(
        isinstance(p, (Shard, Replicate, Partial)) for p in s
    ) and len(s) > 0


def to_layout(sharding: Sharding, ndim: int, mesh: Mesh | None = None, *, arg: str = "sharding") -> Layout:
    """Normalise any accepted sharding spelling for an ``ndim``-dim value.

    A bare P or placements tuple takes its mesh from ``mesh``, else the current mesh.
    """
    if isinstance(sharding, Layout):
        if sharding.ndim != ndim:
            raise ShardingError(f"{arg}: layout {sharding!r} has rank {sharding.ndim}, tensor has rank {ndim}")
        return sharding
    if isinstance(sharding, NamedSharding):
        if mesh is not None and check_mesh(mesh, "mesh=") != sharding.mesh:
            raise ShardingError(f"{arg} is on {sharding.mesh!r} but the value is on {mesh!r}; "
                                f"values on different meshes cannot be combined")
        return spec_to_layout(sharding.mesh, sharding.spec, ndim)
    mesh = check_mesh(mesh, "mesh=") if mesh is not None else current_mesh()
    if mesh is None:
        raise ShardingError(
            f"{arg}={sharding!r} needs a mesh: pass mesh=, use a NamedSharding, or enter `with mesh:`"
        )
    if isinstance(sharding, P):
        return spec_to_layout(mesh, sharding, ndim)
    if _is_placements(sharding):
        return placements_to_layout(mesh, sharding, ndim)
    if isinstance(sharding, tuple) and all(e is None or isinstance(e, (str, tuple)) for e in sharding):
        return spec_to_layout(mesh, P(*sharding), ndim)
    raise ShardingError(
        f"{arg}={sharding!r} is not a sharding; pass a NamedSharding, a P(...) spec, or a "
        f"tuple of placements (Shard(d) / Replicate() / Partial(op)), one per mesh axis"
    )
