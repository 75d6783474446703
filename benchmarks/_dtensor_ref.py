"""Reference measurements for PyTorch DTensor under simulated ``LocalTensorMode``.

Everything runs in one process: a ``"fake"`` process group supplies the world
size / rank 0 that ``DeviceMesh`` needs, and
``torch.distributed._local_tensor.LocalTensorMode`` makes every DTensor hold a
``LocalTensor`` (one real shard per simulated rank) and executes collectives
locally.  No real communication happens.

Recipe (torch 2.13)::

    import torch
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard

    dist.init_process_group("fake", rank=0, world_size=8)  # FakeStore implied
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("x", "y"))
    with LocalTensorMode(8):
        d = distribute_tensor(torch.randn(7, 5, 3), mesh, [Shard(0), Shard(1)])
        e = d.redistribute(mesh, [Shard(1), Shard(0)])
        full = e.full_tensor().reconcile()   # LocalTensor -> plain tensor

All timings are taken *inside* an already-entered ``LocalTensorMode`` (the
cost of entering/leaving the mode is excluded) and report the median of
``repeat`` ``time.perf_counter`` samples after a warm-up.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode, local_tensor_mode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)

__all__ = [
    "setup_fake_world",
    "make_mesh",
    "dtensor_redistribute_full",
    "time_dtensor_redistribute",
    "time_dtensor_op",
    "time_torch_op",
    "OP_NAMES",
    "median_time",
]

OP_NAMES: tuple[str, ...] = ("add", "mul_scalar", "addmm", "sum")

_MESHES: dict[tuple[tuple[int, ...], tuple[str, ...]], DeviceMesh] = {}
_WARMUP = 5


def setup_fake_world(world_size: int) -> None:
    """Initialise a single-process ``"fake"`` default process group of ``world_size``.

    ``init_device_mesh`` needs an initialised default group even under
    ``LocalTensorMode`` (otherwise it tries env:// rendezvous).  Idempotent: a
    no-op if a group of that size already exists; a group of another size is
    destroyed and replaced (cached meshes are dropped with it); a non-fake
    group raises ``RuntimeError``.
    """
    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise RuntimeError(f"a real {dist.get_backend()!r} process group is already initialised")
        if dist.get_world_size() == world_size:
            return
        dist.destroy_process_group()
        _MESHES.clear()
    dist.init_process_group("fake", rank=0, world_size=world_size)


def make_mesh(mesh_shape: tuple[int, ...], axis_names: tuple[str, ...]) -> DeviceMesh:
    """Return a cached CPU ``DeviceMesh`` of ``mesh_shape`` over a fake world of prod(mesh_shape) ranks."""
    key = (tuple(mesh_shape), tuple(axis_names))
    setup_fake_world(math.prod(mesh_shape))
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = init_device_mesh("cpu", key[0], mesh_dim_names=key[1])
        _MESHES[key] = mesh
    return mesh


def _to_plain(t: torch.Tensor) -> torch.Tensor:
    """Collapse a LocalTensor whose shards are all identical into a plain tensor."""
    return t.reconcile() if isinstance(t, LocalTensor) else t


def _place(global_t: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """``distribute_tensor`` that also accepts ``Partial`` placements.

    DTensor refuses ``redistribute`` to Partial, so for each Partial axis the
    Replicate shard is kept on mesh coordinate 0 and zeroed elsewhere (for
    ``sum``; other reduce ops keep identical copies), then wrapped with
    ``DTensor.from_local``.  Must be called inside LocalTensorMode.
    """
    placements = tuple(placements)
    base = tuple(Replicate() if p.is_partial() else p for p in placements)
    d = distribute_tensor(global_t, mesh, base)
    if base == placements:
        return d
    zero_axes = [i for i, p in enumerate(placements) if p.is_partial() and p.reduce_op == "sum"]
    lm = local_tensor_mode()
    assert lm is not None, "_place must run inside LocalTensorMode"
    with lm.disable():
        ranks = mesh.mesh.flatten().tolist()
    coords = dict(zip(ranks, itertools.product(*map(range, mesh.shape))))

    def keep(rank: int, t: torch.Tensor) -> torch.Tensor:
        return t if all(coords[rank][i] == 0 for i in zero_axes) else torch.zeros_like(t)

    local = lm.tensor_map(d.to_local(), keep)
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=d.shape, stride=d.stride()
    )


def median_time(fn: Callable[[], Any], repeat: int, warmup: int = _WARMUP) -> float:
    """Median ``time.perf_counter`` seconds of ``repeat`` calls to ``fn`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def dtensor_redistribute_full(
    mesh_shape: tuple[int, ...],
    axis_names: tuple[str, ...],
    global_tensor: torch.Tensor,
    src_placements: Sequence[Placement],
    dst_placements: Sequence[Placement],
) -> torch.Tensor:
    """Place ``global_tensor`` with ``src_placements``, redistribute to ``dst_placements``
    under LocalTensorMode, and return the reassembled global value as a plain tensor
    (for correctness checks; should equal ``global_tensor``).
    """
    mesh = make_mesh(mesh_shape, axis_names)
    with LocalTensorMode(mesh.size()):
        d = _place(global_tensor, mesh, src_placements)
        out = d.redistribute(mesh, tuple(dst_placements))
        assert tuple(out.placements) == tuple(dst_placements), out.placements
        return _to_plain(out.full_tensor())


def time_dtensor_redistribute(
    mesh_shape: tuple[int, ...],
    axis_names: tuple[str, ...],
    shape: tuple[int, ...],
    src_placements: Sequence[Placement],
    dst_placements: Sequence[Placement],
    *,
    repeat: int = 50,
) -> float:
    """Median seconds per ``DTensor.redistribute`` of a float32 tensor of global
    ``shape`` from ``src_placements`` to ``dst_placements`` under LocalTensorMode.

    The source DTensor is built once (untimed); only ``redistribute`` is timed.
    Uneven shapes are supported by DTensor (torch.chunk-style sharding).
    """
    mesh = make_mesh(mesh_shape, axis_names)
    dst = tuple(dst_placements)
    g = torch.randn(shape, dtype=torch.float32)
    with LocalTensorMode(mesh.size()):
        d = _place(g, mesh, src_placements)
        return median_time(lambda: d.redistribute(mesh, dst), repeat)


def _op_inputs(
    mesh_ndim: int, op_name: str
) -> tuple[Callable[..., torch.Tensor], list[torch.Tensor], list[tuple[Placement, ...]]]:
    """Global inputs and per-input placements for ``op_name``.

    Shardings (mesh axis 0 / mesh axis 1 / remaining axes Replicate):
      * add:        a, b (8, 8)           both [Shard(0), Shard(1)]
      * mul_scalar: x (8, 8) * 2.0        x [Shard(0), Shard(1)]
      * addmm:      bias (8,), m1 (8, 8), m2 (8, 8):
                    m1 [Shard(0), Replicate], m2 [Replicate, Shard(1)],
                    bias [Replicate, Shard(0)]  -> out [Shard(0), Shard(1)]
                    (on a 1-D mesh: m1 Shard(0), m2/bias Replicate)
      * sum:        x (8, 8).sum()       x [Shard(0), Shard(1)] -> out Partial
    All choices need no communication; the cost is sharding propagation + dispatch.
    """
    n = mesh_ndim

    def pl(*per_axis: Placement) -> tuple[Placement, ...]:
        return tuple(per_axis[i] if i < len(per_axis) else Replicate() for i in range(n))

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 8, generator=gen)
    y = torch.randn(8, 8, generator=gen)
    xy = pl(Shard(0), Shard(1))
    if op_name == "add":
        return torch.add, [x, y], [xy, xy]
    if op_name == "mul_scalar":
        return (lambda t: torch.mul(t, 2.0)), [x], [xy]
    if op_name == "addmm":
        bias = torch.randn(8, generator=gen)
        return (
            torch.addmm,
            [bias, x, y],
            [pl(Replicate(), Shard(0)), pl(Shard(0), Replicate()), pl(Replicate(), Shard(1))],
        )
    if op_name == "sum":
        return torch.sum, [x], [xy]
    raise ValueError(f"unknown op {op_name!r}; expected one of {OP_NAMES}")


def time_dtensor_op(
    mesh_shape: tuple[int, ...],
    axis_names: tuple[str, ...],
    op_name: str,
    *,
    repeat: int = 200,
) -> float:
    """Median seconds per DTensor ``op_name`` call (see ``_op_inputs`` for shapes and
    shardings) under LocalTensorMode, with the sharding-propagation cache warm.
    """
    mesh = make_mesh(mesh_shape, axis_names)
    fn, globals_, placements = _op_inputs(mesh.ndim, op_name)
    with LocalTensorMode(mesh.size()):
        args = [_place(g, mesh, p) for g, p in zip(globals_, placements)]
        return median_time(lambda: fn(*args), repeat)


def time_torch_op(op_name: str, *, repeat: int = 200) -> float:
    """Median seconds per plain-torch ``op_name`` call on the same global inputs."""
    fn, args, _ = _op_inputs(1, op_name)
    return median_time(lambda: fn(*args), repeat)
