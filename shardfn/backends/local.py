"""The local backend: every device of the mesh simulated in this process.

A value is stacked (one tensor, the mesh dims in front, each distinct shard stored once)
when every shard has the same shape, else a tuple of per-device shards; ``local_values``
describes both forms and converts between them. ``local_steps`` runs plan steps on them,
``local_calls`` an op's local call; this module is the :class:`LocalBackend` protocol on
top of them.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import torch

from ..values.errors import ShardingError
from ..values.layout import Layout, device_box, is_even, local_shapes
from ..values.mesh import Mesh
from ..values.sharded import Sharded
from .hooks import SHARD_MAP_RUNNERS
from .local_calls import compile_call
from .local_steps import compile_many, compile_plan, run_step, run_steps
from .local_values import set_pending_parts as set_pending_parts  # noqa: F401  (the local backend's one setting)
from .local_values import (Value, compact, device_view, from_parts, is_canonical, parts, replicated,
                           replica_of, settle)


# -- protocol used by ShardedArray ----------------------------------------------------------


def one_replica(value: Value, mesh: Mesh) -> torch.Tensor:
    """The shard of device 0 (for a fully replicated value: the whole value)."""
    return value[0] if isinstance(value, tuple) else value[(0,) * mesh.ndim]


def from_shards(shards: Sequence[torch.Tensor], layout: Layout, shape: tuple[int, ...]) -> Value:
    return from_parts(shards, layout, shape)


def storage(value: Value, layout: Layout, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Even layouts: the canonical stacked tensor; uneven: the distinct shards (row-major)."""
    if is_even(layout, shape):
        if isinstance(value, tuple):
            value = from_parts(value, layout, shape)
        return [settle(compact(value, layout), layout)]
    shards = parts(value, layout.mesh)
    first = replica_of(layout)
    return [shards[d] for d in range(layout.mesh.size) if first[d] == d]


def from_storage(tensors: Sequence[torch.Tensor], layout: Layout, shape: tuple[int, ...]) -> Value:
    if is_even(layout, shape):
        return tensors[0]
    first = replica_of(layout)
    index = {d: i for i, d in enumerate(sorted(set(first)))}
    return tuple(tensors[index[first[d]]] for d in range(layout.mesh.size))


def shard_reduce(value: Value, layout: Layout, shape: tuple[int, ...], fn: Any, neutral: float) -> torch.Tensor:
    """Stacked over the full mesh: distinct shards reduced in one batched call when even."""
    mesh = layout.mesh
    m, nd = mesh.ndim, len(shape)
    if is_even(layout, shape):
        t = storage(value, layout, shape)[0]
        red = fn(t, tuple(range(m, m + nd))) if nd else fn(t.unsqueeze(-1), (m,))
        out = torch.full(mesh.shape, neutral, dtype=red.dtype, device=red.device)
        out[tuple(slice(None) if n != 1 else slice(0, 1) for n in red.shape)] = red
        return out
    shards = parts(value, mesh)
    first = replica_of(layout)
    vals = []
    for d in range(mesh.size):
        if first[d] == d:
            vals.append(fn(shards[d], tuple(range(nd))) if nd else fn(shards[d].reshape(1), (0,)))
        else:
            vals.append(None)
    like = next(v for v in vals if v is not None)
    vals = [v if v is not None else torch.full((), neutral, dtype=like.dtype, device=like.device) for v in vals]
    return torch.stack(vals).view(mesh.shape)


def global_shape(shards: Sequence[torch.Tensor], layout: Layout, shape: Sequence[int] | None, *,
                 check_ranks: bool = True) -> tuple[int, ...]:
    """The global shape the shards describe (or ``shape``), checked against the layout
    (every device's shard is here, so ``check_ranks`` has nothing more to check)."""
    mesh = layout.mesh
    actual = tuple(tuple(s.shape) for s in shards)
    given = shape is not None
    if shape is None:
        dims = []
        for d, axes in enumerate(layout.dims):
            idx = [mesh.axis_index(a) for a in axes]
            total = 0
            for dev in range(mesh.size):
                c = mesh.coords(dev)
                if all(c[i] == 0 for i in range(mesh.ndim) if i not in idx):
                    total += actual[dev][d]
            dims.append(total)
        shape = tuple(dims)
    shape = tuple(int(n) for n in shape)
    if len(shape) != len(actual[0]):
        raise ShardingError(f"from_local: shape={shape} has rank {len(shape)} but the shards have rank {len(actual[0])}")
    expected = local_shapes(layout, shape)
    bad = [dev for dev, (want, got) in enumerate(zip(expected, actual)) if want != got]
    if bad:
        dev = bad[0]
        where = (
            f"the global shape {shape}" if given
            else f"the global shape {shape} (inferred by adding shard sizes along the sharded axes)"
        )
        raise ShardingError(
            f"from_local: shard {dev} (mesh coords {mesh.coords(dev)}) has shape {actual[dev]}, but "
            f"{layout.spec_str()} on {mesh!r} with {where} puts a shard of shape {expected[dev]} "
            f"there; expected shard shapes {list(expected)}; pass shape= to state the global shape"
        )
    return shape


def shard_list(value: Value, mesh: Mesh) -> tuple:
    return parts(value, mesh)


def all_true(flags: Sequence[bool], mesh: Mesh) -> bool:
    return all(flags)


# -- the Backend protocol -------------------------------------------------------------------


class LocalBackend:
    """Every device of the mesh simulated in this process (see the module docstring);
    implements :class:`shardfn.backends.Backend`. This process holds every device."""

    # the module's functions where they are the method (no wrapper on the hot path)
    run_step = staticmethod(run_step)
    run_steps = staticmethod(run_steps)
    compile_plan = staticmethod(compile_plan)  # ``registry.execute``: a plan's steps as one closure
    compile_many = staticmethod(compile_many)  # ``registry.execute_many``: a bucket's all-reduces, its leaves apart
    shard_list = staticmethod(parts)
    shard = staticmethod(device_view)
    one_replica = staticmethod(one_replica)
    replicated = staticmethod(replicated)
    from_shards = staticmethod(from_shards)
    global_shape = staticmethod(global_shape)
    all_true = staticmethod(all_true)
    compile_call = staticmethod(compile_call)  # dispatch: an op's local call, once per cache entry
    is_canonical = staticmethod(is_canonical)
    storage = staticmethod(storage)
    from_storage = staticmethod(from_storage)
    shard_reduce = staticmethod(shard_reduce)

    def devices(self, mesh: Mesh) -> range:
        return range(mesh.size)

    def build(self, layout: Layout, shape: tuple[int, ...], make) -> Value:
        """Even layouts: one ``make`` call per distinct shard (coordinate 0 on the axes
        the layout does not vary over), stacked compact; uneven: one per device."""
        mesh = layout.mesh
        if not is_even(layout, shape):
            return tuple(make(dev) for dev in range(mesh.size))
        sub = tuple(n if v else 1 for n, v in zip(mesh.shape, layout.varying))
        shards = [make(mesh.device_at(c)) for c in itertools.product(*(range(n) for n in sub))]
        local = local_shapes(layout, shape)[0]
        return shards[0].reshape(*sub, *local) if len(shards) == 1 else torch.stack(shards).view(*sub, *local)

    def empty(self, layout: Layout, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Value:
        """Even layouts: one stacked buffer of the canonical sizes; uneven: one tensor per
        distinct part (box and position on the axes of pending reductions), shared by replicas."""
        if is_even(layout, shape):
            return torch.empty(*layout.varying_sizes, *local_shapes(layout, shape)[0], dtype=dtype, device=device)
        mesh = layout.mesh
        axes = [mesh.axis_index(a) for a, _ in layout.partial]
        made: dict = {}
        out = []
        for dev, local in enumerate(local_shapes(layout, shape)):
            key = (device_box(layout, shape, dev), tuple(mesh.coords(dev)[i] for i in axes))
            if key not in made:
                made[key] = torch.empty(local, dtype=dtype, device=device)
            out.append(made[key])
        return tuple(out)

    def relabel(self, value: Value, src: Mesh, dst: Mesh) -> Value:
        if isinstance(value, tuple):
            return value  # per-device shards in row-major order
        local = value.shape[src.ndim:]
        return value.expand(*src.shape, *local).reshape(*dst.shape, *local)  # mesh dims may be broadcast

    def pack_local(self, shards: Sequence, mesh: Mesh) -> list:
        return list(shards)

    def unpack_local(self, local, mesh: Mesh) -> list:
        if isinstance(local, torch.Tensor) and not isinstance(local, Sharded):
            if local.dim() >= 1 and local.shape[0] == mesh.size:
                return list(local.unbind(0))
            raise ShardingError(
                f"from_local on the local backend takes a list of {mesh.size} tensors (one per "
                f"device of {mesh!r}), got a single tensor of shape {tuple(local.shape)}"
            )
        if not isinstance(local, (list, tuple)):
            raise ShardingError(
                f"from_local on the local backend takes a list of {mesh.size} tensors (one per device "
                f"of {mesh!r}), got {type(local).__name__}"
            )
        if len(local) != mesh.size:
            raise ShardingError(
                f"from_local got {len(local)} local shards but {mesh!r} has {mesh.size} devices; "
                f"pass one tensor per device, row-major"
            )
        return list(local)

    def output_shape(self, outs: Sequence[torch.Tensor], layout: Layout, exchange: bool) -> tuple[int, ...]:
        return global_shape(outs, layout, None)  # every shard is here: nothing to exchange

    def check_same_meta(self, mesh: Mesh, shape: Sequence[int], dtype: torch.dtype, what: str) -> None:
        pass  # one process passed the one value

    def check_replicas(self, mesh: Mesh, t: torch.Tensor, over: Sequence[str], what: str) -> None:
        pass  # one process passed the one value

    def submesh(self, mesh: Mesh, axes: Sequence[str]) -> None:
        return None  # every device is here: the caller simulates the manual axes

    def zero_cotangent(self, like: torch.Tensor) -> None:
        return None  # one autograd graph over every device: no gradient is no work

    def keeps_symbolic(self, value: Value) -> bool:
        return not isinstance(value, tuple)  # stacked values keep symbolic sizes; per-device parts do not

    def shard_map(self, f, inputs, out_specs, check_vma: bool, kwargs: dict):
        """Even inputs: the body once under vmap over the mesh; else once per device in
        threads (``transforms/shard_map/stacked.py``, ``per_device.py``)."""
        return SHARD_MAP_RUNNERS["local"](f, inputs, out_specs, check_vma, kwargs)

    def axis_group(self, mesh: Mesh, axes: Sequence[str]) -> None:
        return None  # devices are simulated in this process: no process groups

    def default_device_type(self) -> str:
        return "cpu"
