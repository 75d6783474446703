"""JAX-style random keys and the sampling functions built on them (the package docstring explains the guarantees)."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, Sequence

import attrs
import torch

from . import counter_rng as _rng
from ..arrays.array import ShardedArray
from ..arrays.redistribute import raw_full, raw_reshard
from ..values.context import ThreadStack
from ..values.errors import ShardingError
from ..arrays.factories import ShapeLike, _allocating, _build, _from_boxes, _layout, _mesh_device, _shape, _shard_of
from ..values.layout import Box, Layout
from ..values.mesh import Mesh
from ..values.spec import Sharding

__all__ = [
    "Key", "bernoulli", "dropout", "fold_in", "key", "normal", "randint", "seeded", "set_seed",
    "split", "uniform",
]


@attrs.frozen(repr=False)
class Key:
    """A PRNG key: the two uint32 words of a Philox key. Immutable and hashable."""

    lo: int
    hi: int

    def __iter__(self) -> Iterator[int]:
        return iter((self.lo, self.hi))

    def __repr__(self) -> str:
        return f"Key(0x{self.lo:08x}, 0x{self.hi:08x})"


KeyLike = Key | Sequence[int]


def _eager(fn):
    """Inside ``torch.compile`` a call breaks the graph and runs eagerly (as torch's own
    ``nonzero`` does): Dynamo cannot trace the keys (attrs values) or the Philox rounds on
    Python ints. The draw is the eager one; ``fullgraph=True`` raises at the call."""
    return torch._dynamo.disable(fn, reason=f"sf.random.{fn.__name__} runs eagerly")


def _check_key(k: object) -> Key:
    if isinstance(k, Key):
        return k
    try:
        lo, hi = _rng._check_key(k)
    except (TypeError, ValueError):
        raise TypeError(f"expected a key from sf.random.key(seed), got {k!r}") from None
    return Key(lo, hi)


# -- keys --------------------------------------------------------------------------------


@_eager
def key(seed: int) -> Key:
    """A key from an integer seed in [-2**63, 2**64-1] (negative seeds wrap to 64 bits).

    Example:
        >>> k = sf.random.key(42)
    """
    try:
        s = operator.index(seed)
    except TypeError:
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}") from None
    if isinstance(seed, bool) or not -(2**63) <= s <= 2**64 - 1:
        raise ValueError(f"seed={seed!r} out of range: must be an int in [-2**63, 2**64-1]")
    return Key(*_rng.key_from_seed(s % 2**64))


@_eager
def split(key: KeyLike, num: int = 2) -> tuple[Key, ...]:
    """``num`` new, independent keys derived from ``key`` (like ``jax.random.split``)."""
    return tuple(Key(lo, hi) for lo, hi in _rng.split(_check_key(key), num))


@_eager
def fold_in(key: KeyLike, data: int) -> Key:
    """A new key from ``key`` and an integer ``data`` in [0, 2**64-1] (e.g. a step or rank)."""
    return Key(*_rng.fold_in(_check_key(key), data))


# -- samplers ------------------------------------------------------------------------------


def _sample(shape: ShapeLike, sharding: Sharding | None, mesh: Mesh | None, dtype: torch.dtype,
            draw) -> torch.Tensor:
    """``draw(global_shape, box, device)`` over the whole shape (no sharding: a plain
    tensor) or over each local shard's box."""
    shape = _shape(shape)
    if sharding is None:
        return _allocating(shape, dtype, lambda: draw(shape, None, None))
    layout = _layout(shape, sharding, mesh)
    device = _mesh_device(layout.mesh)
    return _allocating(shape, dtype, lambda: _build(shape, layout, lambda box: draw(shape, box, device), dtype))


@_eager
def uniform(key: KeyLike, shape: ShapeLike = (), sharding: Sharding | None = None, *,
            dtype: torch.dtype | None = None, minval: float = 0.0, maxval: float = 1.0,
            mesh: Mesh | None = None) -> torch.Tensor:
    """Uniform floats in [minval, maxval).

    Args:
        key: from :func:`key` / :func:`split` / :func:`fold_in`.
        shape: the global shape.
        sharding: a NamedSharding, P or placements; None returns a plain tensor.
        dtype: a floating dtype (default: torch's default dtype).
        mesh: the mesh for a bare P / placements (else the current mesh).

    Returns:
        A ShardedArray (or plain tensor) whose gathered value is the same for every
        sharding and mesh.

    Example:
        >>> u = sf.random.uniform(k, (8, 8), P("x", "y"), mesh=mesh)
    """
    k, dtype = _check_key(key), dtype or torch.get_default_dtype()
    return _sample(shape, sharding, mesh, dtype, lambda s, box, dev: _rng.uniform(
        k, s, box, dtype=dtype, low=minval, high=maxval, device=dev))


@_eager
def normal(key: KeyLike, shape: ShapeLike = (), sharding: Sharding | None = None, *,
           dtype: torch.dtype | None = None, mean: float = 0.0, std: float = 1.0,
           mesh: Mesh | None = None) -> torch.Tensor:
    """Normal samples ``mean + std * z`` (see :func:`uniform` for the arguments)."""
    k, dtype = _check_key(key), dtype or torch.get_default_dtype()
    return _sample(shape, sharding, mesh, dtype, lambda s, box, dev: _rng.normal(
        k, s, box, dtype=dtype, mean=mean, std=std, device=dev))


@_eager
def randint(key: KeyLike, shape: ShapeLike, minval: int, maxval: int, sharding: Sharding | None = None, *,
            dtype: torch.dtype = torch.int64, mesh: Mesh | None = None) -> torch.Tensor:
    """Integers in [minval, maxval) of an integer ``dtype`` (see :func:`uniform`)."""
    k = _check_key(key)
    return _sample(shape, sharding, mesh, dtype, lambda s, box, dev: _rng.randint(
        k, s, box, low=minval, high=maxval, dtype=dtype, device=dev))


@_eager
def bernoulli(key: KeyLike, p: float | torch.Tensor = 0.5, shape: ShapeLike | None = None,
              sharding: Sharding | None = None, *, dtype: torch.dtype = torch.bool,
              mesh: Mesh | None = None) -> torch.Tensor:
    """True with probability ``p`` (a float, or a tensor broadcastable to ``shape``).

    A ShardedArray ``p`` supplies the default shape and sharding, and each device reads
    only its own shard of it.

    Example:
        >>> keep = sf.random.bernoulli(k, 0.9, (8, 128), P("dp"), mesh=mesh)
    """
    k = _check_key(key)
    if isinstance(p, ShardedArray):
        shape = tuple(p.shape) if shape is None else _shape(shape)
        if sharding is None:
            sharding = p._layout.without_partial()
        if tuple(p.shape) == shape:
            return _bernoulli_sharded(k, p, shape, _layout(shape, sharding, p.mesh), dtype)
        p = raw_full(p)
    if shape is None:
        shape = tuple(p.shape) if isinstance(p, torch.Tensor) else ()
    shape = _shape(shape)
    if isinstance(p, torch.Tensor):
        try:
            p = p.expand(shape)
        except RuntimeError:
            raise ShardingError(f"bernoulli: p of shape {tuple(p.shape)} does not broadcast to shape {shape}") from None
    # unsharded, the draws are made where a tensor p lives (as torch.bernoulli(p) does: a meta p
    # has no values to move to the CPU); sharded, on the mesh's device
    home = p.device if isinstance(p, torch.Tensor) else None
    return _sample(shape, sharding, mesh, dtype, lambda s, box, dev: _rng.bernoulli(
        k, s, box, p=_p_box(p, box, dev), dtype=dtype, device=home if dev is None else dev))


def _p_box(p: float | torch.Tensor, box: Box | None, device: torch.device | None) -> float | torch.Tensor:
    """Device ``device``'s box of a plain tensor ``p``, moved there (the mesh owns the device)."""
    if not isinstance(p, torch.Tensor) or box is None:
        return p
    if p.is_meta and device.type != "meta":
        raise ShardingError(
            f"bernoulli: p is a meta tensor of shape {tuple(p.shape)}, which holds no values, but the shards go "
            f"to the mesh's device type {device.type!r}; give p with values (any device), or a mesh with "
            f"device_type='meta'")
    return p[tuple(slice(lo, hi) for lo, hi in box)].to(device)


def _bernoulli_sharded(k: Key, p: ShardedArray, shape: tuple[int, ...], layout: Layout,
                       dtype: torch.dtype) -> ShardedArray:
    """Bernoulli draws whose probabilities are the local shards of ``p`` (resharded)."""
    from ..arrays.array import wrap

    mesh = layout.mesh
    value = raw_reshard(p, layout.without_partial())

    def make(dev: int, box: Box) -> torch.Tensor:
        return _rng.bernoulli(k, shape, box, p=_shard_of(value, mesh, dev), dtype=dtype, device=_mesh_device(mesh))

    return wrap(_from_boxes(layout, shape, make, dtype, _mesh_device(mesh)), layout, shape, dtype)


@_eager
def dropout(key: KeyLike, x: torch.Tensor, rate: float) -> torch.Tensor:
    """``x`` with each element zeroed with probability ``rate`` and the rest scaled by
    ``1 / (1 - rate)``; differentiable in ``x``. The mask is laid out like ``x``.

    Example:
        >>> h = sf.random.dropout(sf.random.fold_in(k, step), h, 0.1)
    """
    rate = float(rate)
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"dropout rate={rate} must be in [0, 1]")
    if rate == 0.0:
        return x
    if rate == 1.0:
        return x * 0.0
    sharding = x._layout.without_partial() if isinstance(x, ShardedArray) else None
    keep = bernoulli(key, 1.0 - rate, tuple(x.shape), sharding, dtype=x.dtype)
    if not isinstance(x, ShardedArray):
        keep = keep.to(x.device)
    return x * (keep / (1.0 - rate))


# -- the key that torch's random ops on ShardedArrays use --------------------------------


@attrs.define
class _SeedState:
    key: Key | None = None
    count: int = 0


_state = _SeedState()  # set_seed: every thread's (as torch.manual_seed is)
_scoped = ThreadStack()  # seeded(): this thread's block only (innermost last)


def _current() -> _SeedState:
    items = _scoped.items
    return items[-1] if items else _state


def set_seed(seed: KeyLike | int | None) -> None:
    """Make a key drive torch's random ops on ShardedArrays (and ``sf.rand``/``sf.randn``
    and ``sf.nn.shard_params`` called without a key) instead of torch's default generator.

    The n-th such op after ``set_seed(k)`` uses ``fold_in(k, n)``, so e.g. each pipeline
    stage can use its own stream with ``set_seed(fold_in(k, stage))``. An int is a seed
    for :func:`key`; None returns to torch's default generator. An explicit
    ``generator=`` passed to an op still wins.

    Example:
        >>> sf.random.set_seed(sf.random.fold_in(sf.random.key(0), stage))
    """
    if seed is None:
        _state.key, _state.count = None, 0
        return
    _state.key = key(seed) if isinstance(seed, int) and not isinstance(seed, bool) else _check_key(seed)
    _state.count = 0


@contextlib.contextmanager
def seeded(seed: KeyLike | int | None) -> Iterator[None]:
    """:func:`set_seed` for the duration of a ``with`` block, in this thread only (the
    previous state returns; other threads keep theirs)."""
    st = _SeedState()
    if seed is not None:
        st.key = key(seed) if isinstance(seed, int) and not isinstance(seed, bool) else _check_key(seed)
    _scoped.items.append(st)  # this thread only: another thread's random ops keep their state
    try:
        yield
    finally:
        _scoped.items.pop()


def _next_key(generator: torch.Generator | None = None, device: torch.device | str | None = None) -> Key:
    """A fresh key for one random op: from the :func:`set_seed` key if set (and no
    ``generator``), else two 32-bit words drawn from ``generator`` / torch's default
    generator of ``device`` (a fixed amount of state, whatever the shape or sharding)."""
    st = _current()
    if generator is None and st.key is not None:
        k = fold_in(st.key, st.count)
        st.count += 1
        return k
    dev = torch.device(generator.device if generator is not None else device or "cpu")
    if dev.type == "meta":
        dev = torch.device("cpu")
    words = torch.empty(2, dtype=torch.int64, device=dev).random_(0, 2**32, generator=generator)
    lo, hi = words.tolist()
    return Key(lo, hi)


def _key_or_draw(k: KeyLike | None) -> Key:
    return _next_key() if k is None else _check_key(k)


# -- torch-style factories (sf.rand / sf.randn) ----------------------------------------------


def rand(shape: ShapeLike, sharding: Sharding | None = None, *, key: object = None, mesh: Mesh | None = None,
         dtype: torch.dtype | None = None, requires_grad: bool = False) -> torch.Tensor:
    """Uniform values in [0, 1): ``sf.random.uniform(key, shape, sharding)``.

    ``key`` is a :func:`shardfn.random.key`; None draws one from torch's default
    generator (so ``torch.manual_seed`` makes the call reproducible).
    """
    out = uniform(_key_or_draw(key), shape, sharding, mesh=mesh, dtype=dtype)
    return out.requires_grad_() if requires_grad else out


def randn(shape: ShapeLike, sharding: Sharding | None = None, *, key: object = None, mesh: Mesh | None = None,
          dtype: torch.dtype | None = None, requires_grad: bool = False) -> torch.Tensor:
    """Standard normal values: ``sf.random.normal(key, shape, sharding)`` (see :func:`rand`)."""
    out = normal(_key_or_draw(key), shape, sharding, mesh=mesh, dtype=dtype)
    return out.requires_grad_() if requires_grad else out
