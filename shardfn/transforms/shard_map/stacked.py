"""shard_map bodies on the local backend when every shard has one shape.

The body runs once for the whole mesh under one vmap level per mesh axis (size-1 axes
get none), so it sees tensors of the local shape and each op runs once on the stacked
shards. A value's *canonical* form is its physical tensor of shape
``(d_0, ..., d_{m-1}, *local_shape)`` with ``d_k`` the size of mesh axis ``k`` when the
value varies over it (is batched at its level) and 1 when it is invariant there. This
is JAX's varying-manual-axes typing: psum / all_gather results are unbatched, i.e.
replicated, and autograd through the physical ops gives JAX's transposes (psum <->
pbroadcast, all_gather <-> take this device's slice).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
import torch._C._functorch as _ft
from torch._functorch.vmap import vmap_increment_nesting

from ...arrays.array import ShardedArray
from ...arrays.functorch import base_array
from ...arrays.redistribute import gather, reshard
from ...backends.local_values import sum_of_copies
from ...values.errors import ShardingError
from ...values.layout import Layout
from ...values.mesh import Mesh, to_mesh_device
from .. import boundary as B
from ..inner import at_level
from ..lax import _entered
from ..specs import _match
from . import recompute as _recompute
from .io import _Inputs, _out_layout, check_output_vma, check_scalar_output

# Random ops draw the same numbers on every device, as torch.manual_seed'ed ranks do.
_RANDOMNESS = "same"


class StackedBody:
    """The vmap levels of one shard_map call; also the lax implementation inside it."""

    one_shape = True  # every device's body tensor has the same shape (transforms/inner.py)

    def __init__(self, mesh: Mesh, *, leader: bool = True) -> None:
        self.mesh = mesh
        self.leader = leader  # False for traces that must not count communication
        self.m = mesh.ndim
        self.levels: list[int | None] = [None] * self.m

    @contextlib.contextmanager
    def levels_entered(self) -> Iterator[StackedBody]:
        with contextlib.ExitStack() as stack:
            for k, n in enumerate(self.mesh.shape):
                if n > 1:
                    self.levels[k] = stack.enter_context(vmap_increment_nesting(n, _RANDOMNESS))
            try:
                yield self
            finally:
                self.levels = [None] * self.m

    # -- canonical <-> body tensors ----------------------------------------------------------
    def wrap(self, c: torch.Tensor) -> torch.Tensor:
        """The body tensor (local shape) for canonical ``c``."""
        t = c
        for k, lvl in enumerate(self.levels):
            if lvl is not None and t.shape[0] == self.mesh.shape[k]:
                t = _ft._add_batch_dim(t, 0, lvl)
            else:
                t = t.squeeze(0)
        return t

    def unwrap(self, t: torch.Tensor) -> torch.Tensor:
        """The canonical form of body tensor ``t``."""
        top = max((lvl for lvl in self.levels if lvl is not None), default=None)
        if top is not None and _ft.maybe_get_level(t) > top:
            raise ShardingError(
                "sf.lax collectives cannot be applied to a tensor traced by a torch.func "
                "transform (grad, vmap, ...) opened inside the shard_map body; apply the "
                "collective outside that transform"
            )
        for lvl in reversed(self.levels):
            bdim = None
            if lvl is not None:
                t, bdim = _ft._unwrap_batched(t, lvl)
            t = t.unsqueeze(0) if bdim is None else t.movedim(bdim, 0)
        return t

    def vma(self, t: torch.Tensor) -> set[str]:
        """Mesh axes over which body tensor ``t`` varies, under any torch.func transform
        opened inside the body too (its wrappers are looked through)."""
        top = max((lvl for lvl in self.levels if lvl is not None), default=None)
        if top is None:
            return set()
        while _ft.maybe_get_level(t) > top:
            t = _ft.get_unwrapped(t)
        out = set()
        for k in reversed(range(self.m)):
            lvl = self.levels[k]
            if lvl is not None and _ft.maybe_get_level(t) == lvl:
                t, bdim = _ft._unwrap_batched(t, lvl)
                if bdim is not None:
                    out.add(self.mesh.axis_names[k])
        return out

    def varying(self, c: torch.Tensor) -> set[str]:
        """Mesh axes over which canonical ``c`` varies."""
        return {a for k, a in enumerate(self.mesh.axis_names) if c.shape[k] > 1}

    # -- groups ----------------------------------------------------------------------------
    def _ais(self, axes: tuple[str, ...]) -> list[int]:
        return [self.mesh.axis_index(a) for a in axes]

    def _to_group(self, c: torch.Tensor, ais: list[int]) -> torch.Tensor:
        """``(*D, *local)`` -> ``(*D with ais at 1, G, *local)``, G ranked row-major over ais."""
        m = self.m
        sizes = list(c.shape)
        for k in ais:
            sizes[k] = self.mesh.shape[k]
        c = c.expand(sizes)
        rest = [k for k in range(m) if k not in ais]
        c = c.permute(rest + ais + list(range(m, c.dim())))
        c = c.flatten(len(rest), m - 1)
        for k in sorted(ais):
            c = c.unsqueeze(k)
        return c

    def _from_group(self, c: torch.Tensor, ais: list[int]) -> torch.Tensor:
        """Inverse of :meth:`_to_group`: dim ``m`` (G) goes back to the mesh dims ``ais``."""
        m = self.m
        for k in sorted(ais, reverse=True):
            c = c.squeeze(k)
        rest = [k for k in range(m) if k not in ais]
        c = c.unflatten(len(rest), [self.mesh.shape[k] for k in ais])
        order = rest + ais
        return c.permute([order.index(k) for k in range(m)] + list(range(m, c.dim())))

    # -- the lax protocol --------------------------------------------------------------------
    def reduce(self, x: torch.Tensor, axes: tuple[str, ...], op: str) -> torch.Tensor:
        c = self.unwrap(x)
        for k in self._ais(axes):
            if c.shape[k] == 1:
                c = sum_of_copies(c, self.mesh.shape[k]) if op == "sum" else c
            elif op == "sum":
                c = c.sum(k, keepdim=True, dtype=c.dtype)
            elif op == "max":
                c = c.amax(k, keepdim=True)
            else:
                c = c.amin(k, keepdim=True)
        return self.wrap(c)

    def all_gather(self, x: torch.Tensor, axes: tuple[str, ...], axis: int) -> torch.Tensor:
        m = self.m
        g = self._to_group(self.unwrap(x), self._ais(axes))
        return self.wrap(g.movedim(m, m + axis).flatten(m + axis, m + axis + 1))

    def psum_scatter(self, x: torch.Tensor, axes: tuple[str, ...], dim: int) -> torch.Tensor:
        m, ais = self.m, self._ais(axes)
        s = self.unwrap(self.reduce(x, axes, "sum"))
        g = math.prod(self.mesh.shape[k] for k in ais)
        s = s.unflatten(m + dim, (g, s.shape[m + dim] // g)).movedim(m + dim, m)
        return self.wrap(self._from_group(s, ais))

    def all_to_all(self, x: torch.Tensor, axes: tuple[str, ...], split_axis: int, concat_axis: int) -> torch.Tensor:
        m, ais = self.m, self._ais(axes)
        t = self._to_group(self.unwrap(x), ais)  # (*D1, G_src, *local)
        g = t.shape[m]
        sa, ca = m + 1 + split_axis, m + 1 + concat_axis
        t = t.unflatten(sa, (g, t.shape[sa] // g)).movedim(sa, m)  # (*D1, G_dst, G_src, *local')
        t = t.movedim(m + 1, ca).flatten(ca, ca + 1)
        return self.wrap(self._from_group(t, ais))

    def ppermute(self, x: torch.Tensor, axes: tuple[str, ...], perm: tuple[tuple[int, int], ...]) -> torch.Tensor:
        m, ais = self.m, self._ais(axes)
        t = self._to_group(self.unwrap(x), ais)
        g = t.shape[m]
        src = [-1] * g
        for s, d in perm:
            src[d] = s
        idx = torch.tensor([max(s, 0) for s in src], device=t.device)
        out = t.index_select(m, idx)
        if min(src) < 0:
            keep = torch.tensor([s >= 0 for s in src], device=t.device)
            keep = keep.view([g] + [1] * (t.dim() - m - 1))
            out = torch.where(keep, out, torch.zeros((), dtype=t.dtype, device=t.device))
        return self.wrap(self._from_group(out, ais))

    def axis_index(self, axes: tuple[str, ...]) -> torch.Tensor:
        ais = self._ais(axes)
        g = math.prod(self.mesh.shape[k] for k in ais)
        top = max((lvl for lvl in self.levels if lvl is not None), default=None)
        with at_level(-1 if top is None else top):  # a plain tensor under a transform opened in the body
            idx = torch.arange(g, device=self.mesh.device_type).view([1] * self.m + [g])
            return self.wrap(self._from_group(idx, ais))


def run(mesh: Mesh, f: Any, args: list, is_mapped: list[bool], rebuild: Any, kwargs: dict,
        *, leader: bool = True) -> tuple[list, Any]:
    """Call ``f`` once for the whole mesh.

    ``args`` are the flat argument leaves (canonical tensors where ``is_mapped``),
    ``rebuild`` turns them back into the positional args. Returns the canonical output
    leaves and the output treespec.
    """
    import optree

    body = StackedBody(mesh, leader=leader)
    with body.levels_entered(), _entered(body), _recompute.body_context(
            functools.partial(_reopened, body, list(body.levels)) if leader else contextlib.nullcontext):
        leaves = [body.wrap(a) if mapped else a for a, mapped in zip(args, is_mapped)]
        out = f(*rebuild(leaves), **kwargs)
        flat, spec = optree.tree_flatten(out, none_is_leaf=True)
        flat = [body.unwrap(o) if isinstance(o, torch.Tensor) else o for o in flat]
    return flat, spec


@contextlib.contextmanager
def _reopened(body: StackedBody, levels: list[int | None]) -> Iterator[None]:
    """The body's vmap levels and collectives again, for a checkpoint recomputation."""
    with body.levels_entered():
        if body.levels != levels:
            raise ShardingError(
                "torch.utils.checkpoint inside a shard_map body is recomputed at a different "
                "torch.func nesting depth than it ran at; run the backward at the depth of the "
                "forward"
            )
        with _entered(body):
            yield


# -- the local backend's runner for even shards ---------------------------------------------


def _to_canonical(v: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Canonical form (see ``stacked``) of argument ``v`` laid out as ``layout``."""
    if isinstance(v, ShardedArray) or base_array(v) is not None:
        # (torch.func-wrapped arrays too: their shards, not ops on the wrapper, e.g. the
        # summands under a partial in_spec)
        v = reshard(v, layout)
        used = B.used_axes(layout)
        dims = tuple(n if a in used else 1 for a, n in zip(layout.mesh.axis_names, layout.mesh.shape))
        return B.EnterStacked.apply(v, B.stacked_modes(layout, dims))
    return _split_full(v, layout)


def _split_full(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Canonical form of a full tensor, by reshape and permute (plain autograd)."""
    mesh = layout.mesh
    sizes: list[int] = []
    pos: dict[str, int] = {}
    local: list[int] = []
    for n, axes in zip(x.shape, layout.dims):
        for a in axes:
            pos[a] = len(sizes)
            sizes.append(mesh.axis_size(a))
        local.append(len(sizes))
        sizes.append(n // max(1, math.prod(mesh.axis_size(a) for a in axes)))
    for a in mesh.axis_names:
        if a not in pos:
            pos[a] = len(sizes)
            sizes.append(1)
    return x.reshape(sizes).permute([pos[a] for a in mesh.axis_names] + local)


def _run_stacked(f: Callable, inputs: _Inputs, out_specs: Any, check_vma: bool, kwargs: dict) -> Any:
    mesh = inputs.mesh
    mapped = [l is not None for l in inputs.layouts]
    leaves = [_to_canonical(v, l) if l is not None else v for v, l in zip(inputs.leaves, inputs.layouts)]
    flat, treespec = run(mesh, f, leaves, mapped, inputs.rebuild, kwargs)
    out_tree = optree.tree_unflatten(treespec, flat)
    paths, outs, specs, _ = _match(out_specs, out_tree, "shard_map out_specs", "output")
    results = [_assemble_stacked(p, c, s, mesh, check_vma) for p, c, s in zip(paths, outs, specs)]
    return optree.tree_unflatten(treespec, results)


class _Unchecked(torch.autograd.Function):
    """Device 0's value along mesh dim ``k`` of an output that varies over an axis its
    out_spec leaves out (check_vma=False); the cotangent goes to every device divided by
    their number: JAX's transpose of such an output."""

    generate_vmap_rule = True

    @staticmethod
    def forward(c: torch.Tensor, k: int) -> torch.Tensor:
        return c.narrow(k, 0, 1).clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        c, k = inputs
        ctx.k, ctx.n = k, c.shape[k]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        sizes = list(g.shape)
        sizes[ctx.k] = ctx.n
        return g.expand(sizes) / ctx.n, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, _: Any) -> torch.Tensor:
        return t.narrow(ctx.k, 0, 1).clone()


def _assemble_stacked(path: str, c: Any, spec: Any, mesh: Mesh, check_vma: bool) -> Any:
    if not isinstance(c, torch.Tensor):
        check_scalar_output(path, c, spec)
        return c
    if isinstance(c, ShardedArray) or base_array(c) is not None:
        c = gather(c)  # computed from a ShardedArray the body closed over: its whole (per-device) value
    c = to_mesh_device(c, mesh)  # the mesh owns the device: a body's new tensors move there
    m = mesh.ndim
    layout = _out_layout(path, spec, c.dim() - m, mesh)
    varying = {a for k, a in enumerate(mesh.axis_names) if c.shape[k] > 1}
    if check_vma:
        check_output_vma(path, spec, layout, varying)
    used = B.used_axes(layout)
    for k, a in enumerate(mesh.axis_names):
        if a in varying and a not in used:
            c = c.narrow(k, 0, 1) if check_vma else _Unchecked.apply(c, k)
    shape = tuple(
        n * math.prod(mesh.axis_size(a) for a in axes) for n, axes in zip(c.shape[m:], layout.dims)
    )
    return B.ExitStacked.apply(c, layout, shape)
