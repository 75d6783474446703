"""Partial-manual shard_map (``axis_names=``) on the simulated mesh (every device in this
process).

The body runs once per coordinate of the manual axes, each run in its own thread (as
``_per_device`` runs one per device), on real ShardedArrays over the sub-mesh of the
automatic axes: the shards of that manual coordinate's devices, laid out as the in_specs
say over the automatic axes, with ordinary propagation there. ``sf.lax`` collectives over
the manual axes meet at a barrier and combine the runs' arrays with array ops (a psum is a
sum of arrays, an all_gather a concatenation), so one autograd graph covers every run.
Results are resharded on the sub-mesh to their out_specs' layout there and put together
into the whole-mesh array from the runs' shards. The work is the mesh's work once: no
gathering over the automatic axes, no run re-simulating another's devices.

Gradient conventions as ``_boundary``: an argument replicated over a manual axis gets the
sum of the runs' gradients (Partial), an output replicated over a manual axis takes its
first replica's value and passes its cotangent there only. Communication the sub-mesh
arrays need is counted once (by the first run), as a collective over those devices is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import optree
import torch

from ...arrays.array import ShardedArray, wrap
from ...arrays.redistribute import into_layout
from ...backends import backend_for
from ...backends.hooks import SHARD_MAP, muted
from ...values.errors import ShardingError
from ...values.layout import Layout
from ...values.mesh import Mesh
from .. import lax
from ..specs import _match, _match_columns
from . import per_device as _per_device
from .io import _out_layout, check_output_vma, check_scalar_output
from .sub_layouts import (_block_shape, _full_layout, _manual_out_layout, _order_check, _sub_layout, _varying_manual,
                          _whole_shape)


class _Grid:
    """The devices of ``mesh`` by (manual coordinate index, sub-mesh device)."""

    def __init__(self, mesh: Mesh, sub: Mesh, manual_mesh: Mesh) -> None:
        self.mesh, self.sub, self.manual_mesh = mesh, sub, manual_mesh

    def device(self, c: int, a: int) -> int:
        mc, sc = self.manual_mesh.coords(c), self.sub.coords(a)
        m = self.mesh
        coords = [mc[self.manual_mesh.axis_index(n)] if n in self.manual_mesh.axis_names else sc[self.sub.axis_index(n)]
                  for n in m.axis_names]
        return m.device_at(coords)


class _Pick(torch.autograd.Function):
    """A whole-mesh array -> one sub-mesh array per manual coordinate (its devices' shards)."""

    @staticmethod
    def forward(x: ShardedArray, grid: _Grid, manual: frozenset) -> tuple:
        layout, shape = x._layout, tuple(x.shape)
        backend = backend_for(layout.mesh)
        sl = _sub_layout(layout, grid.sub)
        outs = []
        for c in range(grid.manual_mesh.size):
            devs = [grid.device(c, a) for a in range(grid.sub.size)]
            shards = [backend.shard(x._local, layout.mesh, d) for d in devs]
            block = _block_shape(layout, shape, manual, devs[0])
            outs.append(wrap(backend_for(grid.sub).from_shards(shards, sl, block), sl, block, x.dtype))
        return tuple(outs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        x, grid, manual = inputs
        ctx.meta = (x._layout.without_partial(), tuple(x.shape), x.dtype, grid, manual, [tuple(o.shape) for o in output])

    @staticmethod
    def backward(ctx: Any, *gs: Any) -> Any:
        layout, shape, dtype, grid, manual, blocks = ctx.meta
        sub = grid.sub
        first = next((g for g in gs if isinstance(g, ShardedArray)), None)
        lg = first._layout if first is not None else Layout(sub, ((),) * len(shape), ())
        full = _full_layout(lg, layout, manual, summed=True)
        sb = backend_for(sub)
        shards: list = [None] * layout.mesh.size
        for c, g in enumerate(gs):
            if g is None:
                g = torch.zeros(blocks[c], dtype=dtype)
            g = into_layout(g, lg)
            for a, s in enumerate(sb.shard_list(g._local, sub)):
                shards[grid.device(c, a)] = s
        value = backend_for(layout.mesh).from_shards(shards, full, shape)
        return wrap(value, full, shape, dtype), None, None


class _Join(torch.autograd.Function):
    """One sub-mesh array per manual coordinate (each in its out_spec's layout there) ->
    the whole-mesh array; a manual axis the layout replicates over takes its first replica."""

    @staticmethod
    def forward(layout: Layout, shape: tuple, grid: _Grid, manual: frozenset, *outs: ShardedArray) -> ShardedArray:
        used = set(layout.axis_dim) | set(layout.partial_ops)
        mm = grid.manual_mesh
        sb = backend_for(grid.sub)
        shards: list = [None] * layout.mesh.size
        for c in range(mm.size):
            coords = [0 if n not in used else v for n, v in zip(mm.axis_names, mm.coords(c))]
            src = outs[mm.device_at(coords)]
            for a, s in enumerate(sb.shard_list(src._local, grid.sub)):
                shards[grid.device(c, a)] = s
        return wrap(backend_for(layout.mesh).from_shards(shards, layout, shape), layout, shape, outs[0].dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        layout, shape, grid, manual, *outs = inputs
        ctx.meta = (layout, shape, grid, manual, [(o._layout.without_partial(), tuple(o.shape)) for o in outs])

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        layout, shape, grid, manual, subs = ctx.meta
        want = layout.without_partial()
        g = into_layout(g, want)
        used = set(layout.axis_dim) | set(layout.partial_ops)
        mm = grid.manual_mesh
        backend = backend_for(layout.mesh)
        grads = []
        for c in range(mm.size):
            if any(v != 0 for n, v in zip(mm.axis_names, mm.coords(c)) if n not in used):
                grads.append(None)  # a later replica: its first replica carries the cotangent
                continue
            sl, block = subs[c]
            shards = [backend.shard(g._local, layout.mesh, grid.device(c, a)) for a in range(grid.sub.size)]
            grads.append(wrap(backend_for(grid.sub).from_shards(shards, sl, block), sl, block, g.dtype))
        return (None, None, None, None, *grads)


class _RunBody(_per_device.DeviceBody):
    """One run's lax implementation: collectives over the manual axes combine the runs'
    values (sub-mesh arrays or plain tensors) with torch ops. ``mesh`` is the whole mesh
    (lax checks axis names against it); groups and indices are over the manual axes."""

    array_values = True  # lax hands sub-mesh arrays over as they are

    def __init__(self, mesh: Mesh, manual_mesh: Mesh, sub: Mesh, run: int, rv: Any) -> None:
        super().__init__(manual_mesh, run, rv)  # groups and ``run`` over the manual mesh
        self.mesh = mesh
        self.submesh = sub  # a shard_map nested in the body runs on it (``nested_on_submesh``)


def run(f: Callable, inputs: Any, manual: frozenset, auto: tuple[str, ...], out_specs: Any, check_vma: bool,
        kwargs: dict) -> Any:
    """A partial-manual shard_map call on the simulated mesh (see the module docstring)."""
    _per_device.untraced("shard_map-manual")  # before the setup: symbolic sizes do not hash
    mesh = inputs.mesh
    sub = Mesh(tuple(mesh.axis_size(a) for a in auto), auto, backend=mesh.backend, device_type=mesh.device_type)
    names = tuple(a for a in mesh.axis_names if a in manual)
    mm = Mesh(tuple(mesh.axis_size(a) for a in names), names, backend=mesh.backend, device_type=mesh.device_type)
    grid = _Grid(mesh, sub, mm)
    n = mm.size
    columns = []
    for path, v, layout in zip(inputs.paths, inputs.leaves, inputs.layouts):
        if layout is None or not isinstance(v, torch.Tensor):
            columns.append([v] * n)
            continue
        _order_check(layout, manual, f"shard_map in_specs for {path}")
        arr = into_layout(v, layout)
        vma = _varying_manual(layout, manual)
        columns.append([_per_device.tag(p, vma) for p in _Pick.apply(arr, grid, manual)])
    per_run = [inputs.rebuild([col[c] for col in columns]) for c in range(n)]
    grad = torch.is_grad_enabled()

    def body(c: int, rv: Any) -> Any:
        run_body = _RunBody(mesh, mm, sub, c, rv)
        quiet = muted() if c else contextlib.nullcontext()  # counted once, by the first run
        with torch.set_grad_enabled(grad), quiet, sub, lax._entered(run_body), lax._manual_axes(manual):
            with _per_device._VmaMode():
                out = f(*per_run[c], **kwargs)
            return _laid_out(out, out_specs, mesh, sub)

    results = _per_device.run_threads(n, body, "shard_map-manual")
    treespec, columns = _match_columns(results, out_specs, "shard_map out_specs")
    joined = []
    for p, column, s in columns:
        o = column[0]
        if not isinstance(o, torch.Tensor):
            check_scalar_output(p, o, s)
            joined.append(o)
            continue
        layout = _out_layout(p, s, o.dim(), mesh)
        if check_vma:
            check_output_vma(p, s, layout, set().union(*(_per_device.vma_of(v) for v in column)) & set(manual))
        shape = _whole_shape(layout, column[0].shape, [v.shape for v in column], grid.manual_mesh, manual)
        joined.append(_Join.apply(layout, shape, grid, manual, *column))
    return optree.tree_unflatten(treespec, joined)


def _laid_out(out: Any, out_specs: Any, mesh: Mesh, sub: Mesh) -> Any:
    """A run's results resharded on the sub-mesh to their out_specs' layout there."""
    manual = frozenset(a for a in mesh.axis_names if a not in sub.axis_names)
    paths, leaves, specs, treespec = _match(out_specs, out, "shard_map out_specs", "output")
    laid = []
    for p, v, s in zip(paths, leaves, specs):
        if isinstance(v, torch.Tensor):
            layout = _manual_out_layout(p, s, v.dim(), mesh, manual)
            vma = _per_device.vma_of(v)
            sl = _sub_layout(layout, sub)
            v = _per_device.tag(into_layout(v, sl), vma)
        laid.append(v)
    return optree.tree_unflatten(treespec, laid)


def nested_on_submesh(f: Callable, sub: Mesh, in_specs: Any, out_specs: Any, inner: frozenset, args: tuple,
                      kwargs: dict) -> Any:
    """A shard_map nested in a run over (some of) the automatic axes: a shard_map on the
    run's sub-mesh arrays (collectives inside may name only its axes)."""
    shard_map = SHARD_MAP[0]  # the public one (``api`` registers it; this module is below it)

    if in_specs is None:
        raise ShardingError("a nested shard_map needs in_specs: give one P per argument over the automatic axes")
    names = None if inner == frozenset(sub.axis_names) else inner
    bodies, manual = list(lax._bodies()), list(lax._manual_stack())
    lax._bodies().clear()
    lax._manual_stack().clear()
    try:
        return shard_map(f, mesh=sub, in_specs=in_specs, out_specs=out_specs, axis_names=names)(*args, **kwargs)
    finally:
        lax._bodies().extend(bodies)
        lax._manual_stack().extend(manual)
