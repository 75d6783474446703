"""``shard_map`` (JAX's): map a function over the shards of its arguments.

On the local backend the body runs once for the whole mesh under vmap when every shard
has one shape and vmap can batch it (``stacked.py``), else once per device in threads
(``per_device.py``); on
the dist backend each rank runs it on plain tensors (``dist.py``). Inside a body, or with
``axis_names=``, it is manual over some axes only (``manual.py``). Arguments and outputs
are matched and checked in ``io.py``; the crossings between ShardedArrays and local
tensors, with their gradient conventions, are in ``transforms/boundary.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, overload

import optree
import torch

from ...backends.hooks import SHARD_MAP, SHARD_MAP_RUNNERS
from ...values.errors import ShardingTypeError
from ...values.graph_calls import graph_call
from ...values.mesh import Mesh
from ..lax import _in_shard_map
from . import dist, per_device, stacked
from .io import _Inputs, _shard_map
from .manual import shard_map_manual

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["shard_map"]


@overload
def shard_map(f: F, *, mesh: Mesh | None = None, in_specs: Any = None, out_specs: Any, check_vma: bool = True,
              axis_names: Any = None) -> F: ...


@overload
def shard_map(f: None = None, *, mesh: Mesh | None = None, in_specs: Any = None, out_specs: Any,
              check_vma: bool = True, axis_names: Any = None) -> Callable[[F], F]: ...


def shard_map(f: Any = None, *, mesh: Mesh | None = None, in_specs: Any = None, out_specs: Any,
              check_vma: bool = True, axis_names: Any = None) -> Any:
    """Map ``f`` over the shards of its arguments (JAX's ``shard_map``).

    Args:
        f: the body; it sees each device's local tensors and may call ``sf.lax``
            collectives over the mesh axes.
        mesh: the mesh (default: that of the ShardedArray arguments, else the current one).
        in_specs: a P per positional argument, or a tree prefix of the arguments; a single
            P applies to all of them. ShardedArrays are resharded to their spec, plain
            tensors distributed. Non-tensor leaves are passed through unchanged.
            ``None``: each ShardedArray argument keeps its own spec (a plain tensor is
            then an error). Keyword arguments reach every device's body unchanged and
            may hold no tensors (ShardingTypeError: nothing would split them).
        out_specs: a tree prefix of the outputs; each output becomes a ShardedArray whose
            shards are the devices' local outputs. ``P(..., partial=axis)`` declares the
            local outputs pending sums over ``axis``.
        check_vma: raise a ShardingError when an output varies over a mesh axis its
            out_spec leaves out (psum / all_gather results count as replicated), or
            when ``partial=`` names an axis the output does not vary over.
        axis_names: the mesh axes the body is manual over (default: all). Collectives
            may name only these. The body runs once per coordinate of the manual axes
            (once per rank on dist) on ShardedArrays over the sub-mesh of the other axes
            (that coordinate's devices; on dist a view using the mesh's process groups),
            laid out there as the in_specs say, with ordinary propagation; nothing is
            gathered on entry, and results are resharded there to their out_specs (the
            communication the specs need). Under torch.func transforms the body sees
            whole values over the automatic axes instead.

    Returns:
        The mapped function. Results and gradients equal those of the unsharded
        computation the body describes.

    Example::

        @functools.partial(sf.shard_map, mesh=mesh, in_specs=(P('x', None), P()), out_specs=P())
        def loss(x, w):
            return sf.lax.psum(((x @ w) ** 2).sum(), 'x')
    """
    if f is None:
        return functools.partial(shard_map, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma,
                                 axis_names=axis_names)
    if not callable(f):  # JAX raises a TypeError here too, not at the first call
        raise ShardingTypeError(f"shard_map: f={f!r} ({type(f).__name__}) is not callable; pass the function "
                                f"to map, e.g. sf.shard_map(fn, mesh=mesh, in_specs=..., out_specs=...)")

    if not isinstance(check_vma, bool):  # "no" or 0.0 would read as a choice it is not
        raise ShardingTypeError(f"shard_map: check_vma={check_vma!r} ({type(check_vma).__name__}) must be True or False")

    @functools.wraps(f)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        _check_kwargs(f, kwargs)
        if axis_names is not None or _in_shard_map():
            return shard_map_manual(f, mesh, in_specs, out_specs, check_vma, axis_names, args, kwargs)
        return _shard_map(f, mesh, in_specs, out_specs, check_vma, args, kwargs)

    return graph_call(mapped, "shard_map", f, (mesh, in_specs, out_specs, check_vma, axis_names))


# What torch's vmap raises for a body it cannot batch but that runs on each device's own
# tensors: Python control flow on a varying value, .item(), ops of data-dependent output
# shape, an autograd.Function without vmap support, an op with no batching rule (JAX's eager
# shard_map runs such bodies).
_NOT_BATCHABLE = (
    "vmap: It looks like you're",
    "vmap: We do not support batching operators that can output dynamic shape",
    "it must override the setup_context",
    "but it does not have vmap support",
    "Batching rule not implemented for",  # and no fallback (view and out= ops)
)


def _run_local(f: Callable, inputs: _Inputs, out_specs: Any, check_vma: bool, kwargs: dict) -> Any:
    """The local backend's run: stacked under vmap when every shard has one shape, else (or
    when the body cannot be batched, see ``_NOT_BATCHABLE``) once per device."""
    if inputs.even():
        try:
            return stacked._run_stacked(f, inputs, out_specs, check_vma, kwargs)
        except RuntimeError as e:
            if not any(m in str(e) for m in _NOT_BATCHABLE):
                raise
    return _per_device(f, inputs, out_specs, check_vma, kwargs)


def _per_device(f: Callable, inputs: _Inputs, out_specs: Any, check_vma: bool, kwargs: dict) -> Any:
    """The body once per device, a thread each (under torch.compile: a graph break, see
    ``per_device.run_threads``)."""
    return per_device._run_per_device(f, inputs, out_specs, check_vma, kwargs)


SHARD_MAP_RUNNERS["local"] = _run_local
SHARD_MAP_RUNNERS["dist"] = dist.shard_map_call
SHARD_MAP.append(shard_map)  # a shard_map nested in a simulated partial-manual run calls it


def _check_kwargs(f: Callable, kwargs: dict) -> None:
    """Keyword arguments reach every device's body whole (no in_spec splits them): a tensor
    among them would silently act as a closure, so it is refused (JAX refuses keywords)."""
    for k, v in kwargs.items():
        if any(isinstance(t, torch.Tensor) for t in optree.tree_leaves(v, none_is_leaf=True)):
            raise ShardingTypeError(
                f"shard_map of {getattr(f, '__name__', f)!r}: keyword argument {k}= holds a tensor; keyword "
                f"arguments are not split by in_specs, so pass tensors positionally (with their in_specs) or "
                f"close over them; keywords may carry non-tensor options only")
