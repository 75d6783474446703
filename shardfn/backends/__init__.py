"""Backends: where the shards live and how collectives run.

Both backends implement the same small protocol (one function per plan step kind plus
``run`` for local computation); :func:`execute` walks a plan against either.
"""

from __future__ import annotations

from typing import Any

import torch

from ..plan import Plan


def backend_for(mesh) -> Any:
    if mesh.backend == "local":
        from . import local

        return local
    from . import dist

    return dist


def execute(plan: Plan, value: Any, shape: Any = None) -> Any:
    """Run ``plan`` on a backend value (what a ShardedArray holds) and return the new one.
    ``shape``: the value's global shape when it has symbolic sizes (the plan was made
    from their hints); the local backend keeps them symbolic."""
    if not plan.steps:
        return value
    from ..debug import _record

    backend = backend_for(plan.src.mesh)
    for step in plan.steps:
        _record(step)
        if shape is not None and plan.src.mesh.backend == "local" and any(isinstance(n, torch.SymInt) for n in shape):
            value = backend.run_step(step, value, plan.shape, plan.dtype, sym_shape=shape)
        else:
            value = backend.run_step(step, value, plan.shape, plan.dtype)
    return value
