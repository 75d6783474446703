"""Backends: where the shards live and how collectives run.

Both backends implement the same small protocol (one function per plan step kind plus
``run`` for local computation); :func:`execute` walks a plan against either.
"""

from __future__ import annotations

from typing import Any

from ..plan import Plan


def backend_for(mesh) -> Any:
    if mesh.backend == "local":
        from . import local

        return local
    from . import dist

    return dist


def execute(plan: Plan, value: Any) -> Any:
    """Run ``plan`` on a backend value (what a ShardedArray holds) and return the new one."""
    if not plan.steps:
        return value
    from ..debug import _record

    backend = backend_for(plan.src.mesh)
    for step in plan.steps:
        _record(step)
        value = backend.run_step(step, value, plan.shape, plan.dtype)
    return value
