"""The error and warning types shardfn raises."""

from __future__ import annotations


class ShardingError(ValueError):
    """A bad mesh, spec, shape, or an incompatible combination of shardings."""


class ImmutableError(TypeError):
    """An in-place operation was applied to an immutable ShardedArray."""


class FallbackWarning(UserWarning):
    """An op had no sharding rule and ran on replicated inputs."""


class ImplicitReshardError(ShardingError):
    """Under ``sf.explicit(mode="raise")``, an op would have redistributed an input."""


class ImplicitReshardWarning(UserWarning):
    """Under ``sf.explicit(mode="warn")``, an op redistributed an input implicitly."""
