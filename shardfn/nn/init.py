"""Initialisers that materialise a parameter shard by shard (``sf.nn.init``).

Each factory returns an :class:`Initializer`: ``init(key, shape, sharding, *, dtype,
mesh=None)`` draws the whole parameter with :mod:`shardfn.random`, so every device
computes only its own shard and the values are the same for every sharding. Fan-based
initialisers take their fans from the global shape, as ``torch.nn.init`` does::

    rules = [(r"attn\\.qkv\\.weight", P("tp", None), sf.nn.init.normal(std=0.02))]
"""

from __future__ import annotations

import math
from typing import Protocol

import attrs
import torch

from ..random import keys as _random
from ..arrays.factories import full
from ..values.mesh import Mesh
from ..values.spec import Sharding

__all__ = [
    "Initializer", "constant", "kaiming_normal", "kaiming_uniform", "normal", "ones", "uniform",
    "xavier_normal", "xavier_uniform", "zeros",
]


class Initializer(Protocol):
    """Makes a parameter's value: ``init(key, shape, sharding, dtype=..., mesh=...)``."""

    def __call__(self, key: _random.KeyLike, shape: tuple[int, ...], sharding: Sharding | None, *,
                 dtype: torch.dtype, mesh: Mesh | None = None) -> torch.Tensor: ...


@attrs.frozen
class _Normal:
    mean: float
    std: float

    def __call__(self, key, shape, sharding, *, dtype, mesh=None):  # type: ignore[no-untyped-def]
        if self.std == 0.0:
            return full(shape, self.mean, sharding, mesh=mesh, dtype=dtype)
        return _random.normal(key, shape, sharding, dtype=dtype, mean=self.mean, std=self.std, mesh=mesh)


@attrs.frozen
class _Uniform:
    low: float
    high: float

    def __call__(self, key, shape, sharding, *, dtype, mesh=None):  # type: ignore[no-untyped-def]
        if self.low == self.high:
            return full(shape, self.low, sharding, mesh=mesh, dtype=dtype)
        return _random.uniform(key, shape, sharding, dtype=dtype, minval=self.low, maxval=self.high, mesh=mesh)


@attrs.frozen
class _Constant:
    value: float

    def __call__(self, key, shape, sharding, *, dtype, mesh=None):  # type: ignore[no-untyped-def]
        return full(shape, self.value, sharding, mesh=mesh, dtype=dtype)


@attrs.frozen
class _Fan:
    """Scaled by the fans of the global shape: ``std = gain * sqrt(scale / fan)``."""

    dist: str  # "uniform" | "normal"
    mode: str  # "fan_in" | "fan_out" | "fan_avg"
    gain: float
    scale: float

    def __call__(self, key, shape, sharding, *, dtype, mesh=None):  # type: ignore[no-untyped-def]
        fan_in, fan_out = torch.nn.init._calculate_fan_in_and_fan_out(torch.empty(shape, device="meta"))
        fan = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[self.mode]
        std = self.gain * math.sqrt(self.scale / fan) if fan else 0.0
        if self.dist == "normal":
            return _Normal(0.0, std)(key, shape, sharding, dtype=dtype, mesh=mesh)
        bound = math.sqrt(3.0) * std
        return _Uniform(-bound, bound)(key, shape, sharding, dtype=dtype, mesh=mesh)


def normal(mean: float = 0.0, std: float = 1.0) -> Initializer:
    """Normal values ``mean + std * z`` (like ``torch.nn.init.normal_``)."""
    return _Normal(float(mean), float(std))


def uniform(a: float = 0.0, b: float = 1.0) -> Initializer:
    """Uniform values in [a, b) (like ``torch.nn.init.uniform_``)."""
    if not a <= b:
        raise ValueError(f"uniform init needs a <= b, got a={a}, b={b}")
    return _Uniform(float(a), float(b))


def constant(value: float) -> Initializer:
    """Every element ``value``."""
    return _Constant(value)


def zeros() -> Initializer:
    """Zeros."""
    return _Constant(0)


def ones() -> Initializer:
    """Ones."""
    return _Constant(1)


def xavier_uniform(gain: float = 1.0) -> Initializer:
    """Glorot uniform: bound ``gain * sqrt(6 / (fan_in + fan_out))``."""
    return _Fan("uniform", "fan_avg", float(gain), 1.0)


def xavier_normal(gain: float = 1.0) -> Initializer:
    """Glorot normal: std ``gain * sqrt(2 / (fan_in + fan_out))``."""
    return _Fan("normal", "fan_avg", float(gain), 1.0)


def _check_mode(mode: str) -> str:
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"mode={mode!r} must be 'fan_in' or 'fan_out'")
    return mode


def kaiming_uniform(a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu") -> Initializer:
    """He uniform, as ``torch.nn.init.kaiming_uniform_`` (torch's Linear uses ``a=sqrt(5)``)."""
    return _Fan("uniform", _check_mode(mode), torch.nn.init.calculate_gain(nonlinearity, a), 1.0)


def kaiming_normal(a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu") -> Initializer:
    """He normal, as ``torch.nn.init.kaiming_normal_``."""
    return _Fan("normal", _check_mode(mode), torch.nn.init.calculate_gain(nonlinearity, a), 1.0)
