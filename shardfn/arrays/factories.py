"""Factories: sharded arrays built shard by shard, each device allocating only its own.

Everything here (and the random numbers of :mod:`shardfn.random`) is built on one
primitive, :func:`_from_boxes`: evaluate a function on the global index box of every
shard this process holds, through the backend's ``build`` (on the local backend replicas
share one computed shard, stored once; on the dist backend a rank computes only its own
box).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch

from .array import ShardedArray, wrap
from ..backends.registry import backend_for
from ..values.errors import ShardingError, like_torch
from ..values.layout import Box, Layout, device_box
from ..values.mesh import Mesh, mesh_device, to_mesh_device
from ..values.spec import Sharding, to_layout

ShapeLike = int | Sequence[int]
MakeShard = Callable[[int, Box], torch.Tensor]

__all__ = ["arange", "empty", "full", "make_array_from_callback", "ones", "zeros"]


# -- shapes, layouts, devices ----------------------------------------------------------


def _shape(shape: ShapeLike, arg: str = "shape") -> tuple[int, ...]:
    """A shape as a tuple of non-negative ints (an int means a 1-d shape)."""
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    try:  # operator.index, as torch's factories: 4.0 is not a size
        out = tuple(operator.index(n) for n in shape)
        ok = not isinstance(shape, (str, bytes)) and all(not isinstance(n, bool) for n in shape) and min(out, default=0) >= 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ShardingError(f"{arg}={shape!r} is not a shape; pass a tuple of non-negative ints, e.g. (8, 16)")
    return out


def _layout(shape: tuple[int, ...], sharding: Sharding, mesh: Mesh | None) -> Layout:
    return to_layout(sharding, len(shape), mesh)


def _mesh_device(mesh: Mesh) -> torch.device:
    """The device this process puts its shards on."""
    return mesh_device(mesh)


def _local_devices(mesh: Mesh) -> list[int]:
    """The devices whose shards this process holds (all of them on the local backend)."""
    return list(backend_for(mesh).devices(mesh))


def _local_boxes(layout: Layout, shape: tuple[int, ...]) -> list[Box]:
    """The global index boxes of the shards this process holds, in local-shard order."""
    return [device_box(layout, shape, d) for d in _local_devices(layout.mesh)]


def _box_shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def _shard_of(value: object, mesh: Mesh, device: int) -> torch.Tensor:
    """Device ``device``'s shard of a backend value held by this process."""
    return backend_for(mesh).shard(value, mesh, device)


# -- the primitive -----------------------------------------------------------------------


def _zeroed(layout: Layout, device: int) -> bool:
    """Whether ``device`` holds zeros because it is not the first of a pending sum."""
    coords = layout.mesh.coords(device)
    return any(op == "sum" and coords[layout.mesh.axis_index(a)] for a, op in layout.partial)


def _from_boxes(layout: Layout, shape: tuple[int, ...], make: MakeShard, dtype: torch.dtype,
                device: torch.device) -> object:
    """The backend value whose shard on each device is ``make(device, box)``.

    A pending sum keeps the value on the first device of each group (zeros elsewhere);
    other pending reductions hold it on every device, as ``distribute`` does. Devices
    with one box (and both zeroed or not) share one computed shard.
    """
    cache: dict[tuple, torch.Tensor] = {}

    def shard(dev: int) -> torch.Tensor:
        box = device_box(layout, shape, dev)
        zero = _zeroed(layout, dev)
        if (box, zero) not in cache:
            cache[box, zero] = torch.zeros(_box_shape(box), dtype=dtype, device=device) if zero else make(dev, box)
        return cache[box, zero]

    return backend_for(layout.mesh).build(layout, shape, shard)


def _build(shape: tuple[int, ...], layout: Layout, make: Callable[[Box], torch.Tensor], dtype: torch.dtype,
           *, requires_grad: bool = False, stride: tuple[int, ...] | None = None) -> ShardedArray:
    """A ShardedArray whose shard on each device is ``make(box)`` (reporting ``stride``: None, contiguous)."""
    value = _from_boxes(layout, shape, lambda dev, box: make(box), dtype, _mesh_device(layout.mesh))
    return wrap(value, layout, shape, dtype, requires_grad=requires_grad, stride=stride)


# -- public factories -----------------------------------------------------------------------


def make_array_from_callback(shape: ShapeLike, sharding: Sharding,
                             data_callback: Callable[[tuple[slice, ...]], torch.Tensor], *,
                             mesh: Mesh | None = None) -> ShardedArray:
    """A ShardedArray whose every shard is ``data_callback(index)`` (as in JAX).

    Args:
        shape: the global shape.
        sharding: a NamedSharding, P or placements tuple.
        data_callback: maps a tuple of slices (the shard's global index ranges) to the
            shard's values, a tensor of that shard's shape. Called once per distinct shard
            this process holds.
        mesh: the mesh for a bare P / placements (else the current mesh).

    Example:
        >>> x = sf.make_array_from_callback((8, 4), P("x"), lambda idx: full[idx], mesh=mesh)
    """
    shape = _shape(shape)
    layout = _layout(shape, sharding, mesh)
    boxes = _local_boxes(layout, shape)
    probe = data_callback(tuple(slice(lo, hi) for lo, hi in boxes[0]))
    first = boxes[0]
    if not isinstance(probe, torch.Tensor) or tuple(probe.shape) != _box_shape(first):
        got = tuple(probe.shape) if isinstance(probe, torch.Tensor) else type(probe).__name__
        raise ShardingError(
            f"make_array_from_callback: data_callback returned {got} for the shard at "
            f"{[f'{lo}:{hi}' for lo, hi in first]}; it must return a tensor of shape {_box_shape(first)}"
        )

    def make(box: Box) -> torch.Tensor:
        t = probe if box == first else data_callback(tuple(slice(lo, hi) for lo, hi in box))
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != _box_shape(box):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ShardingError(
                f"make_array_from_callback: data_callback returned {got} for the shard at "
                f"{[f'{lo}:{hi}' for lo, hi in box]}; it must return a tensor of shape {_box_shape(box)}"
            )
        return to_mesh_device(t.to(dtype=probe.dtype), layout.mesh)

    probe = to_mesh_device(probe, layout.mesh)  # the mesh owns the device: shards made elsewhere move there
    value = _from_boxes(layout, shape, lambda dev, box: make(box), probe.dtype, probe.device)
    return wrap(value, layout, shape, probe.dtype)


def arange(start: float, end: float | None = None, step: float = 1, sharding: Sharding | None = None, *,
           mesh: Mesh | None = None, dtype: torch.dtype | None = None, requires_grad: bool = False) -> torch.Tensor:
    """``torch.arange(start, end, step)`` laid out as ``sharding``; without a sharding, a plain
    tensor. An integer range is computed shard by shard; a floating one is torch's own range
    sliced (its kernel rounds each value by where it falls in a vector chunk: only the whole
    range gives its bits)."""
    if end is None:
        start, end = 0, start
    try:
        meta = torch.arange(start, end, step, dtype=dtype, device="meta")
    except (RuntimeError, TypeError) as e:
        raise like_torch(e)(f"arange(start={start!r}, end={end!r}, step={step!r}): {e}") from None
    shape, dtype = tuple(meta.shape), meta.dtype
    if sharding is None:
        return torch.arange(start, end, step, dtype=dtype, requires_grad=requires_grad)
    layout = _layout(shape, sharding, mesh)
    device = _mesh_device(layout.mesh)
    exact = not (dtype.is_floating_point or dtype.is_complex)

    def make(box: Box) -> torch.Tensor:
        (lo, hi), = box
        if exact:
            return (torch.arange(lo, hi, dtype=torch.int64, device=device) * step + start).to(dtype)
        return torch.arange(start, end, step, dtype=dtype, device=device)[lo:hi].clone()

    return _allocating(shape, dtype, lambda: _build(shape, layout, make, dtype, requires_grad=requires_grad))


def full(shape: ShapeLike, fill_value: bool | complex, sharding: Sharding | None = None, *,
         mesh: Mesh | None = None, dtype: torch.dtype | None = None,
         requires_grad: bool = False) -> torch.Tensor:
    """An array of ``shape`` filled with ``fill_value``, laid out as ``sharding``.

    Each device allocates only its own shard (replicas share one buffer on the local
    backend). The dtype follows ``torch.full`` when not given. Without a sharding the
    result is a plain tensor. A pending sum holds the value on the first device of each
    group and zeros elsewhere (so the gathered value is ``fill_value``).

    Example:
        >>> b = sf.full((1024,), 0.5, P("tp"), mesh=mesh)
    """
    shape = _shape(shape)
    dtype = _check_fill(fill_value, dtype)
    if sharding is None:
        return _allocating(shape, dtype, lambda: torch.full(shape, fill_value, dtype=dtype, requires_grad=requires_grad))
    layout = _layout(shape, sharding, mesh)
    device = _mesh_device(layout.mesh)
    return _allocating(shape, dtype, lambda: _build(
        shape, layout, lambda box: torch.full(_box_shape(box), fill_value, dtype=dtype, device=device),
        dtype, requires_grad=requires_grad))


def _check_fill(fill_value: object, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of ``full(shape, fill_value, dtype=dtype)``; a ShardingError when the
    dtype cannot hold the value exactly (1.5 as an integer, 300 as uint8, 2 as bool)."""
    if isinstance(fill_value, torch.Tensor) and fill_value.numel() == 1 and not isinstance(fill_value, ShardedArray):
        fill_value = fill_value.item()
    if not isinstance(fill_value, (bool, int, float, complex)):
        raise ShardingError(
            f"full: fill_value={fill_value!r} ({type(fill_value).__name__}) is not a number; "
            f"pass a bool, int, float or complex"
        )
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ShardingError(f"full: dtype={dtype!r} is not a torch.dtype, e.g. torch.float32")
    try:
        held = torch.full((2,), fill_value, dtype=dtype)[0]  # (1,) skips the overflow check
    except RuntimeError as e:
        name = dtype if dtype is not None else "the dtype torch.full infers"
        raise like_torch(e)(f"full: fill_value={fill_value!r} does not fit {name}: {e}") from None
    if not _holds(held.item(), fill_value):
        raise ShardingError(
            f"full: fill_value={fill_value!r} cannot be held by dtype {held.dtype} (it would become "
            f"{held.item()!r}); pass a value of that dtype or a dtype that holds it"
        )
    return held.dtype


def _holds(held: object, value: object) -> bool:
    """Whether storing ``value`` kept it (NaN and rounding to a float dtype count as kept)."""
    if isinstance(value, bool) or isinstance(held, bool):
        return bool(held) == bool(value) and (isinstance(held, bool) or held in (0, 1)) and value in (0, 1)
    if isinstance(held, float) and not isinstance(value, complex):
        return True  # a float dtype rounds (as torch.full does); overflow raised above
    if isinstance(held, complex):
        return True
    if isinstance(value, complex):
        return value.imag == 0 and held == value.real
    return held == value


def _allocating(shape: tuple[int, ...], dtype: torch.dtype, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``build()``, with an allocation failure reported with the size that failed."""
    try:
        return build()
    except (RuntimeError, OverflowError, MemoryError) as e:
        if isinstance(e, RuntimeError) and "alloc" not in str(e).lower() and "overflow" not in str(e).lower():
            raise
        raise ShardingError(
            f"cannot allocate an array of shape {shape} and dtype {dtype} "
            f"({_nbytes(shape, dtype)} bytes in total, before sharding): {str(e).splitlines()[0][:200]}"
        ) from None


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def zeros(shape: ShapeLike, sharding: Sharding | None = None, *, mesh: Mesh | None = None,
          dtype: torch.dtype | None = None, requires_grad: bool = False) -> torch.Tensor:
    """Zeros of ``shape`` laid out as ``sharding`` (each device allocates its shard only)."""
    return full(shape, 0, sharding, mesh=mesh, dtype=dtype or torch.get_default_dtype(),
                requires_grad=requires_grad)


def ones(shape: ShapeLike, sharding: Sharding | None = None, *, mesh: Mesh | None = None,
         dtype: torch.dtype | None = None, requires_grad: bool = False) -> torch.Tensor:
    """Ones of ``shape`` laid out as ``sharding`` (each device allocates its shard only)."""
    return full(shape, 1, sharding, mesh=mesh, dtype=dtype or torch.get_default_dtype(),
                requires_grad=requires_grad)


def empty(shape: ShapeLike, sharding: Sharding | None = None, *, mesh: Mesh | None = None,
          dtype: torch.dtype | None = None, requires_grad: bool = False) -> torch.Tensor:
    """An uninitialised array of ``shape`` laid out as ``sharding``."""
    shape = _shape(shape)
    dtype = dtype or torch.get_default_dtype()
    if sharding is None:
        return _allocating(shape, dtype, lambda: torch.empty(shape, dtype=dtype, requires_grad=requires_grad))
    layout = _layout(shape, sharding, mesh)
    device = _mesh_device(layout.mesh)
    return _allocating(shape, dtype, lambda: _build(
        shape, layout, lambda box: torch.empty(_box_shape(box), dtype=dtype, device=device),
        dtype, requires_grad=requires_grad))
