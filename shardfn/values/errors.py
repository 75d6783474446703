"""The error and warning types shardfn raises."""

from __future__ import annotations


class ShardingError(ValueError):
    """A bad mesh, spec, shape, or an incompatible combination of shardings."""


class ShardingTypeError(ShardingError, TypeError):
    """A ShardingError that JAX reports as a TypeError (e.g. shard_map ``in_specs=None`` with a
    plain tensor argument): catchable as either."""


class ShardingRuntimeError(ShardingError, RuntimeError):
    """A ShardingError for arguments torch rejects with a RuntimeError (e.g. shapes that do not
    broadcast): catchable as either, as code written for plain tensors expects."""


class ShardingIndexError(ShardingError, IndexError):
    """A ShardingError for arguments torch rejects with an IndexError (e.g. a dim out of range)."""


def like_torch(error: BaseException) -> type[ShardingError]:
    """The ShardingError type to raise for arguments torch rejected with ``error``: also an
    instance of torch's type where that is an IndexError, TypeError or RuntimeError (a
    ShardingError is already a ValueError)."""
    for base, cls in ((IndexError, ShardingIndexError), (TypeError, ShardingTypeError), (RuntimeError, ShardingRuntimeError)):
        if isinstance(error, base):
            return cls
    return ShardingError


class ImmutableError(TypeError):
    """An in-place operation was applied to an immutable ShardedArray.

    The rule (``shardfn/arrays/inplace/policy.py``): an in-place or ``out=`` op raises when the array it
    writes is observable -- held by Python code (a variable, a container, a module), or a
    view of such an array. An array only C++ holds (a temporary of a torch composite or an
    autograd formula) is updated by running the op's functional form under torch's
    functionalization, views included; gradient accumulation into ``.grad`` too. Routes
    around aten (``x.data = ...``, ``share_memory_``, ``apply_``, ``__dlpack__``) raise.
    """


class FallbackWarning(UserWarning):
    """An op had no sharding rule and ran on replicated inputs."""


class ImplicitReshardError(ShardingError):
    """Under ``sf.explicit(mode="raise")``, an op would have redistributed an input."""


class ImplicitReshardWarning(UserWarning):
    """Under ``sf.explicit(mode="warn")``, an op redistributed an input implicitly."""


class SimulationWarning(UserWarning):
    """``Mesh(backend=None)`` fell back to simulating the whole mesh in this process while the
    process looks like one of several (torchrun's ``RANK``/``WORLD_SIZE`` set without a process
    group, or an initialised world of another size): every process would run the whole job.
    Shown every time (pass ``backend="local"`` to simulate on purpose)."""


# The errors shardfn raises for bad input, which callers catch by type (under torch.compile too:
# ``values/graph_calls.surface_in_compile``).
USER_ERRORS: tuple[type[Exception], ...] = (ShardingError, ImmutableError)
