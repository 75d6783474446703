"""Redistribution plans: the cheapest sequence of collectives from one layout to another.

``plan_redistribute`` is a pure, cached function of (src, dst, shape, dtype). It searches
(collectives, bytes)-optimal paths over layouts whose edges are per-axis collectives (all_gather,
all_to_all, slice, all_reduce, reduce_scatter, reduce_local of a replicated value or of a
zero-padded shard) plus one direct exchange to
the destination (a permute or an all_to_all over several axes). A plan costs
``alpha * (collectives in sequence) + bytes / beta`` seconds: ``bytes`` is what the
busiest device sends (ring algorithm costs; see ``Step.bytes``), ``alpha`` a collective's
latency. Defaults per backend (:data:`COST_MODELS`, override with
:func:`set_cost_model`):

- ``gloo`` (CPU meshes, also the local backend): alpha 1.2 ms, beta 1.2 GB/s, measured with
  ``benchmarks/measure_gloo_cost.py`` (4 gloo processes over loopback, all_reduce and
  all_gather of 1 B .. 16 MB, minimum of 15 repeats per size, least-squares fit of
  ``t = alpha + bytes_sent / beta`` with ring bytes as the planner counts them) on
  2026-11-23 on this quiet 2-core machine: alpha 1.19 ms, beta 1.22 GB/s (runs under
  heavy load had given alpha ~1.05 ms, beta 0.3-0.7 GB/s). Another host: re-measure and
  call :func:`set_cost_model`.
- ``nccl`` (CUDA meshes): alpha 10 us, beta 100 GB/s (NVLink-class, as given).

For small values the latency term dominates, so the search prefers fewer collectives
(e.g. one padded all_gather over an all_to_all plus an all_gather); for large ones bytes
do. One bound holds whatever the model: a plan never moves more bytes than the best
per-axis plan (at most one collective per mesh axis, as DTensor's planners do), so
e.g. uneven shards over two axes are gathered axis by axis when one exchange over both
would send more (gloo has no all_gather of unequal sizes, and an all_to_all sends a
device's whole shard to every peer).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import operator
from typing import Sequence

import attrs
import numpy as np
import torch

from ..values.errors import ShardingError
from ..values.layout import Box, Layout, all_boxes, describe, max_local_numel
from ..values.mesh import Mesh

@attrs.frozen
class CostModel:
    """A collective costs ``alpha`` seconds plus its bytes over ``beta`` bytes/second."""

    alpha: float
    beta: float

    def seconds(self, collectives: int, nbytes: int) -> float:
        return self.alpha * collectives + nbytes / self.beta

    @property
    def latency_bytes(self) -> int:
        """alpha in bytes' worth (alpha * beta): the search's integer cost per collective."""
        return round(self.alpha * self.beta)


COST_MODELS: dict[str, CostModel] = {
    "gloo": CostModel(1.2e-3, 1.2e9),  # measured, see the module docstring
    "nccl": CostModel(10e-6, 100e9),  # documented guess (NVLink-class), not measured
}


def set_cost_model(backend: str, *, alpha: float | None = None, beta: float | None = None) -> None:
    """Override the latency (seconds) and/or bandwidth (bytes/s) of ``backend``'s model."""
    if backend not in COST_MODELS:
        raise ShardingError(f"set_cost_model: unknown backend {backend!r}; valid: {sorted(COST_MODELS)}")
    old = COST_MODELS[backend]
    COST_MODELS[backend] = CostModel(old.alpha if alpha is None else alpha, old.beta if beta is None else beta)
    plan_layouts.cache_clear()
    for clear in PLAN_CACHES:
        clear()


PLAN_CACHES: list = []
"""``clear`` functions of caches that hold decisions made from plans (``coalesce.py``'s
tree plans); :func:`set_cost_model` empties them with ``plan_layouts``'s."""


def cost_model(mesh: Mesh) -> CostModel:
    """The model for ``mesh``: nccl on CUDA meshes, gloo otherwise."""
    return COST_MODELS["nccl" if getattr(mesh, "device_type", "cpu") == "cuda" else "gloo"]


KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "permute", "slice", "reduce_local")
COMM_KINDS = frozenset(KINDS[:5])


@attrs.frozen
class Route:
    """One piece of an exchange: device ``dst`` copies ``src_box`` of device ``src``'s
    shard into ``dst_box`` of its own (both relative to the local shards)."""

    src: int
    dst: int
    src_slices: tuple[slice, ...]
    dst_slices: tuple[slice, ...]


@attrs.frozen(repr=False, slots=False)
class Step:
    """One transition. ``axis`` is a mesh axis name, or a tuple of names for an exchange
    over several axes. ``dim``/``dim2`` are the tensor dims involved (gather/split dim),
    ``op`` the reduction; ``bytes`` the most bytes any device sends in this step."""

    kind: str
    axis: str | tuple[str, ...]
    src: Layout
    dst: Layout
    bytes: int
    group_size: int
    dim: int | None = None
    dim2: int | None = None
    op: str | None = None
    pieces: tuple | None = attrs.field(default=None, eq=False)

    @functools.cached_property
    def routes(self) -> tuple[Route, ...] | None:
        """For an exchange: every piece a device copies from a peer (or itself)."""
        if self.pieces is None:
            return None
        return tuple(Route(s, t, _rel(box, so), _rel(box, to)) for s, t, box, so, to in self.pieces)

    def __repr__(self) -> str:
        return f"Step({self.kind}, axis={self.axis!r}, {self.src.spec_str()} -> {self.dst.spec_str()})"

    def explain(self) -> str:
        ax = self.axis if isinstance(self.axis, str) else "+".join(self.axis)
        what = {
            "all_gather": f"all_gather dim {self.dim} over '{ax}'",
            "all_to_all": (
                f"all_to_all over '{ax}': split dim {self.dim2}, gather dim {self.dim}"
                if self.dim is not None else f"all_to_all over '{ax}' (direct exchange of pieces)"
            ),
            "slice": f"slice dim {self.dim} by '{ax}' (local, no communication)",
            "all_reduce": f"all_reduce({self.op}) over '{ax}'",
            "reduce_scatter": f"reduce_scatter({self.op}) over '{ax}' onto dim {self.dim}",
            "reduce_local": (f"mark pending {self.op} over '{ax}' (local, no communication)" if self.dim is None else
                             f"mark pending {self.op} over '{ax}', each shard of dim {self.dim} zero-padded to the "
                             f"whole extent (local, no communication)"),
            "permute": f"permute shards over '{ax}' (each device sends its shard to one peer)",
        }[self.kind]
        return f"{what}: {self.src.spec_str()} -> {self.dst.spec_str()}, {self.bytes} B/device"


@attrs.frozen(repr=False)
class Plan:
    """A cached sequence of steps taking ``src`` to ``dst`` for one shape and dtype."""

    src: Layout
    dst: Layout
    shape: tuple[int, ...]
    dtype: torch.dtype
    steps: tuple[Step, ...]

    @property
    def bytes_per_device(self) -> int:
        return sum(s.bytes for s in self.steps)

    @property
    def collectives(self) -> int:
        return sum(1 for s in self.steps if s.kind in COMM_KINDS)

    def cost_terms(self) -> tuple[float, float]:
        """(latency seconds, bandwidth seconds) under the mesh's cost model."""
        m = cost_model(self.src.mesh)
        return m.alpha * self.collectives, self.bytes_per_device / m.beta

    def __str__(self) -> str:
        lat, bw = self.cost_terms()
        head = (
            f"Plan {describe(self.shape, self.dtype, self.src)} -> {self.dst.spec_str()} "
            f"on {self.src.mesh!r}: {len(self.steps)} step(s), {self.bytes_per_device} B/device, "
            f"cost {lat * 1e6:.1f} us latency ({self.collectives} collective(s)) + {bw * 1e6:.1f} us bytes"
        )
        if not self.steps:
            return head + "\n  (no-op: the layouts already agree)"
        return head + "".join(f"\n  {i + 1}. {s.explain()}" for i, s in enumerate(self.steps))

    __repr__ = __str__


def plan_redistribute(src, dst, shape: Sequence[int], *, dtype: torch.dtype = torch.float32, mesh: Mesh | None = None) -> Plan:
    """The cheapest plan moving a value of global ``shape`` from sharding ``src`` to ``dst``.

    Both shardings may be NamedShardings, P specs or placement tuples.
    """
    from ..values.spec import to_layout

    shape = check_shape(shape)
    if not isinstance(dtype, torch.dtype):
        raise ShardingError(f"plan_redistribute: dtype={dtype!r} is not a torch.dtype, e.g. torch.float32")
    src_l = to_layout(src, len(shape), mesh, arg="src")
    dst_l = to_layout(dst, len(shape), src_l.mesh, arg="dst")
    return plan_layouts(src_l, dst_l, shape, dtype)


def check_shape(shape: object, where: str = "plan_redistribute") -> tuple[int, ...]:
    """A global shape as a tuple of non-negative ints (a string is not a shape)."""
    ok = isinstance(shape, Sequence) and not isinstance(shape, (str, bytes)) and all(
        hasattr(n, "__index__") and not isinstance(n, bool) and operator.index(n) >= 0 for n in shape
    )
    if not ok:
        raise ShardingError(
            f"{where}: shape={shape!r} is not a shape; pass a tuple of non-negative "
            f"ints, e.g. (8, 16) (a torch.Size works too)"
        )
    return tuple(operator.index(n) for n in shape)


@functools.lru_cache(maxsize=8192)
def plan_layouts(src: Layout, dst: Layout, shape: tuple[int, ...], dtype: torch.dtype) -> Plan:
    """``plan_redistribute`` on canonical layouts; the cache key holds mesh, shape and dtype."""
    if src.mesh != dst.mesh:
        raise ShardingError(
            f"cannot redistribute between meshes {src.mesh!r} and {dst.mesh!r}; "
            f"values on different meshes cannot be combined"
        )
    itemsize = torch.empty((), dtype=dtype).element_size()
    a, b = _drop_trivial(src), _drop_trivial(dst)
    model = cost_model(src.mesh)
    steps = () if a == b else _bounded_search(a, b, shape, itemsize, model)
    plan = Plan(src, dst, shape, dtype, steps)
    full = Layout(a.mesh, ((),) * len(shape))
    if steps and full not in (a, b) and plan.collectives > 1:
        # never worse than gathering everything and cutting locally (the search's byte bound
        # is per axis, which uneven splits of tiny dims can make loose)
        via = Plan(src, dst, shape, dtype, _bounded_search(a, full, shape, itemsize, model)
                   + _bounded_search(full, b, shape, itemsize, model))
        if (sum(via.cost_terms()), via.bytes_per_device) < (sum(plan.cost_terms()), plan.bytes_per_device):
            return via
    return plan


def _drop_trivial(layout: Layout) -> Layout:
    """Forget mesh axes of size 1: sharding or reducing over them changes nothing."""
    mesh = layout.mesh
    if all(n > 1 for n in mesh.shape):
        return layout
    keep = {a for a, n in zip(mesh.axis_names, mesh.shape) if n > 1}
    dims = tuple(tuple(a for a in axes if a in keep) for axes in layout.dims)
    return Layout(mesh, dims, tuple(p for p in layout.partial if p[0] in keep))


# -- the search ---------------------------------------------------------------------------


def _bounded_search(src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int, model: CostModel) -> tuple:
    """The cheapest plan by ``model`` among those moving no more bytes than the best
    per-axis plan (see :func:`_per_axis_bytes`): a collective saved never costs more bytes
    than moving each mesh axis on its own would.

    A label-setting search over (layout, collectives, bytes) in order of cost, then bytes,
    exchanges (standard collectives first) and steps. A label is dropped when one popped
    earlier at its layout had no more collectives and no more bytes, or when it moves more
    bytes than the bound (known once a plan exceeding it was found). The first plan found
    within the bound is the cheapest. The direct exchange out of a layout is routed only
    when the search reaches it (queued at a lower bound of its cost: one more collective)."""
    lat = model.latency_bytes
    axis_edges = _edge_cache(dst, shape, itemsize)
    counter = itertools.count()
    settled: dict[Layout, list[tuple[int, int]]] = {}  # (collectives, bytes) popped per layout
    heap = [((0, 0, 0, 0), 0, next(counter), src, (), None)]
    bound = math.inf

    def push(key: tuple, c: int, state: Layout, path: tuple, step: Step) -> None:
        c2 = c + (1 if step.kind in COMM_KINDS else 0)
        n2 = key[1] + step.bytes
        if n2 <= bound and not _dominated(settled.get(step.dst, ()), c2, n2):
            new = (lat * c2 + n2, n2, key[2] + (step.pieces is not None), key[3] + 1)
            heapq.heappush(heap, (new, c2, next(counter), step.dst, path + (step,), None))

    while heap:
        key, c, _, state, path, origin = heapq.heappop(heap)
        nbytes = key[1]
        if origin is not None:  # route the exchange out of ``state`` now that its lower bound is reached
            push(origin, c - 1, state, path, _exchange(state, dst, shape, itemsize))
            continue
        if nbytes > bound or _dominated(settled.get(state, ()), c, nbytes):
            continue
        if state == dst:
            if lat == 0 or bound < math.inf:
                return path  # bytes only, the first plan moves fewest bytes; or within the bound
            bound = _per_axis_bytes(src, dst, shape, itemsize, nbytes)
            if nbytes <= bound:
                return path
            continue
        settled.setdefault(state, []).append((c, nbytes))
        for step in axis_edges(state):
            push(key, c, state, path, step)
        if state.partial == dst.partial:
            low = (key[0] + lat, nbytes, key[2] + 1, key[3] + 1)
            heapq.heappush(heap, (low, c + 1, next(counter), state, path, key))
    raise ShardingError(f"no redistribution from {src.spec_str()} to {dst.spec_str()}")  # unreachable


def _dominated(labels: list[tuple[int, int]], collectives: int, nbytes: int) -> bool:
    """Whether a label with no more collectives and no more bytes is among ``labels``."""
    return any(c <= collectives and b <= nbytes for c, b in labels)


def _edge_cache(dst: Layout, shape: tuple[int, ...], itemsize: int):
    """The per-axis steps (``_edges`` without the exchange) towards ``dst``, memoised per
    layout: a search may expand a layout once per label."""
    return functools.cache(lambda s: tuple(_edges(s, dst, shape, itemsize, exchange=False)))


def _per_axis_bytes(src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int, limit: int) -> int:
    """Fewest bytes of a plan of per-axis steps (no exchange) with at most one collective
    per mesh axis: the plans DTensor's planners make (one transformation per mesh dim),
    costed like ours; ``limit`` if there is none moving fewer than ``limit`` bytes."""
    edges = _edge_cache(dst, shape, itemsize)
    start = (src, frozenset())
    best = {start: 0}
    heap = [(0, 0, next(counter := itertools.count()), start)]
    while heap:
        nbytes, steps, _, (state, used) = heapq.heappop(heap)
        if nbytes >= limit:
            break
        if state == dst:
            return nbytes
        if best.get((state, used), math.inf) < nbytes:
            continue
        for step in edges(state):
            comm = step.kind in COMM_KINDS
            if (comm and step.axis in used) or (step.kind == "reduce_local" and step.dim is not None):  # not DTensor's
                continue
            nxt = (step.dst, used | {step.axis} if comm else used)
            n = nbytes + step.bytes
            if n < best.get(nxt, math.inf):
                best[nxt] = n
                heapq.heappush(heap, (n, steps + 1, next(counter), nxt))
    return limit


def _edges(s: Layout, goal: Layout, shape: tuple[int, ...], itemsize: int, exchange: bool = True):
    """Steps out of ``s`` towards ``goal``: per-axis collectives and slices, and (with
    ``exchange``) the direct exchange to ``goal``."""
    mesh = s.mesh
    ndim = len(shape)
    goal_ops = goal.partial_ops
    n_src = max_local_numel(s, shape) * itemsize
    for a, g in zip(mesh.axis_names, mesh.shape):
        if g == 1:
            continue
        if a in s.partial_ops:
            op = s.partial_ops[a]
            if not _reducible(s, a):
                continue
            rest = {k: v for k, v in s.partial if k != a}
            freed = s.with_partial(rest)
            yield Step("all_reduce", a, s, freed, 2 * (g - 1) * n_src // g, g, op=op)
            # any op scatters (max/min too; on gloo an all_to_all plus a local reduction)
            for d in range(ndim):
                t = freed.with_dims(d, s.dims[d] + (a,))
                n_pad = g * max_local_numel(t, shape) * itemsize
                yield Step("reduce_scatter", a, s, t, (g - 1) * n_pad // g, g, dim=d, op=op)
        elif a in s.axis_dim:
            d = s.axis_dim[a]
            if s.dims[d][-1] != a:
                continue
            base = s.with_dims(d, s.dims[d][:-1])
            yield Step("all_gather", a, s, base, (g - 1) * n_src, g, dim=d)
            if goal_ops.get(a) == "sum":
                # each device's piece in place in the whole dim, zeros elsewhere: a pending
                # sum with no communication (a split residual added to a pending block output)
                yield Step("reduce_local", a, s, base.with_partial({**s.partial_ops, a: "sum"}), 0, g, dim=d, op="sum")
            for e in range(ndim):
                if e != d:
                    t = base.with_dims(e, base.dims[e] + (a,))
                    yield Step("all_to_all", a, s, t, (g - 1) * n_src // g, g, dim=d, dim2=e)
        else:
            # slicing is free, so only slice towards the goal: otherwise the search would
            # wander through every free layout before paying for anything
            d = goal.axis_dim.get(a)
            if d is not None:
                yield Step("slice", a, s, s.with_dims(d, s.dims[d] + (a,)), 0, g, dim=d)
            if a in goal_ops:
                t = s.with_partial({**s.partial_ops, a: goal_ops[a]})
                yield Step("reduce_local", a, s, t, 0, g, op=goal_ops[a])
    if exchange and s.partial == goal.partial and s != goal:
        yield _exchange(s, goal, shape, itemsize)


_COMMUTE = {"sum": "linear", "avg": "linear", "max": "max", "min": "min"}


def _reducible(s: Layout, axis: str) -> bool:
    """Pending reductions apply in mesh-axis order; ``axis`` may go first only if every
    earlier pending reduction commutes with it (sum and avg commute; max/min only with
    themselves)."""
    op = _COMMUTE[s.partial_ops[axis]]
    for a, other in s.partial:
        if a == axis:
            return True
        if _COMMUTE[other] != op:
            return False
    return True


def _exchange(src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int) -> Step:
    """Move every piece straight to the device that needs it, within groups of devices
    that differ only on the mesh axes whose role changes."""
    mesh = src.mesh
    axes = _exchange_axes(src, dst, shape)
    table = _PieceTable(src, dst, shape, range(mesh.size))
    moved = table.s != table.t
    sent = np.zeros(mesh.size, dtype=np.int64)
    np.add.at(sent, table.s[moved], table.numel[moved] * itemsize)
    sb, db = _box_array(src, shape), _box_array(dst, shape)
    whole = bool((table.box[moved] == sb[table.s[moved]]).all() and (table.box[moved] == db[table.t[moved]]).all())
    senders = table.s[moved]
    kind = "permute" if whole and len(np.unique(senders)) == len(senders) else "all_to_all"
    group = math.prod(mesh.axis_size(a) for a in axes)
    return Step(kind, axes if len(axes) > 1 else axes[0], src, dst, int(sent.max(initial=0)), group, pieces=table)


def routes_to(src: Layout, dst: Layout, shape: tuple[int, ...], targets: Sequence[int]) -> tuple[Route, ...]:
    """The routes of :func:`_exchange`'s step into the devices ``targets`` only (a backend
    that stores each distinct shard once builds the shards of one device per replica group)."""
    return tuple(Route(s, t, _rel(box, so), _rel(box, to)) for s, t, box, so, to in _PieceTable(src, dst, shape, targets))


def _exchange_axes(src: Layout, dst: Layout, shape: tuple[int, ...]) -> tuple[str, ...]:
    changed = {a for d in range(len(shape)) if src.dims[d] != dst.dims[d] for a in src.dims[d] + dst.dims[d]}
    return tuple(a for a in src.mesh.axis_names if a in changed)


@functools.lru_cache(maxsize=1024)
def _box_array(layout: Layout, shape: tuple[int, ...]) -> np.ndarray:
    """``all_boxes`` as an int64 array (devices, dims, 2)."""
    return np.asarray(all_boxes(layout, shape), dtype=np.int64).reshape(layout.mesh.size, len(shape), 2)


@functools.lru_cache(maxsize=64)
def _coords_array(mesh) -> np.ndarray:
    return np.asarray([mesh.coords(d) for d in range(mesh.size)], dtype=np.int64).reshape(mesh.size, len(mesh.shape))


class _PieceTable:
    """Every non-empty piece a device of ``targets`` needs, taken from the devices that
    differ from it only on the exchanged axes, as arrays (sources ``s``, targets ``t``,
    boxes, element counts), target-major, sources ascending. Iterating yields
    ``(src device, dst device, box, src box, dst box)`` tuples, built once on first use
    (the planner costs an exchange from the arrays alone; only the chosen one is routed)."""

    def __init__(self, src: Layout, dst: Layout, shape: tuple[int, ...], targets: Sequence[int]) -> None:
        mesh = src.mesh
        self._src, self._dst, self._shape = src, dst, shape
        vary = [mesh.axis_index(a) for a in _exchange_axes(src, dst, shape) if a in src.axis_dim]
        tgt = np.asarray(list(targets), dtype=np.int64)
        combos = np.asarray(list(itertools.product(*(range(mesh.shape[i]) for i in vary))), dtype=np.int64)
        coords = np.repeat(_coords_array(mesh)[tgt][:, None, :], len(combos), axis=1)  # (targets, combos, axes)
        if vary:
            coords[:, :, vary] = combos[None, :, :]
        strides = np.asarray([math.prod(mesh.shape[i + 1:]) for i in range(len(mesh.shape))], dtype=np.int64)
        srcs = coords @ strides  # (targets, combos)
        sb, db = _box_array(src, shape), _box_array(dst, shape)
        lo = np.maximum(sb[srcs][..., 0], db[tgt][:, None, :, 0])
        hi = np.minimum(sb[srcs][..., 1], db[tgt][:, None, :, 1])
        numel = np.clip(hi - lo, 0, None).prod(axis=-1)
        keep = numel > 0
        self.s = srcs[keep]
        self.t = np.broadcast_to(tgt[:, None], srcs.shape)[keep]
        self.box = np.stack([lo[keep], hi[keep]], axis=-1)  # (pieces, dims, 2)
        self.numel = numel[keep]
        self._tuples: tuple | None = None

    def __iter__(self):
        if self._tuples is None:
            sb, db = all_boxes(self._src, self._shape), all_boxes(self._dst, self._shape)
            boxes = [tuple(map(tuple, b)) for b in self.box.tolist()]
            self._tuples = tuple((s, t, b, sb[s], db[t]) for s, t, b in zip(self.s.tolist(), self.t.tolist(), boxes))
        return iter(self._tuples)

    def __len__(self) -> int:
        return len(self.s)


def _rel(inner: Box, outer: Box) -> tuple[slice, ...]:
    return tuple(slice(lo - olo, hi - olo) for (lo, hi), (olo, _) in zip(inner, outer))
