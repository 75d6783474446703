"""The dist backend's per-mesh state: its configuration (collective timeout, reduction mode)
and, at first use of a mesh, one process group per mesh axis and per set of axes an exchange
spans, created by every rank in the same order and cached per mesh (a sub-mesh view reuses
its parent's groups)."""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from ..plans.planner import Step
from ..values.errors import ShardingError
from ..values.mesh import Mesh


# -- configuration ---------------------------------------------------------------------------


def _env_timeout() -> datetime.timedelta | None:
    raw = os.environ.get("SHARDFN_DIST_TIMEOUT")
    return datetime.timedelta(seconds=float(raw)) if raw else None


_MODES = ("auto", "ordered", "native")


def _env_mode() -> str:
    mode = os.environ.get("SHARDFN_DIST_REDUCTIONS", "auto")
    if mode not in _MODES:
        raise ValueError(f"SHARDFN_DIST_REDUCTIONS={mode!r}; use one of {_MODES}")
    return mode


_config: dict[str, Any] = {"timeout": _env_timeout(), "reductions": _env_mode()}


def configure(*, timeout: datetime.timedelta | float | None = None, reductions: str | None = None) -> None:
    """Set the collective timeout (a timedelta or seconds; applies to meshes first used
    afterwards) and the reduction mode: ``"auto"``, ``"ordered"`` (bit-identical to the
    local backend) or ``"native"`` (see the module docstring)."""
    if timeout is not None:
        _config["timeout"] = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
    if reductions is not None:
        if reductions not in _MODES:
            raise ValueError(f"reductions={reductions!r}; use one of {_MODES}")
        _config["reductions"] = reductions


@contextlib.contextmanager
def reductions(mode: str) -> Iterator[None]:
    """Use reduction ``mode`` inside the block, e.g. ``with reductions("ordered"):`` for
    results bit-identical to the local backend."""
    old = _config["reductions"]
    configure(reductions=mode)
    try:
        yield
    finally:
        _config["reductions"] = old


def _mode() -> str:
    if torch.are_deterministic_algorithms_enabled():
        return "ordered"
    return _config["reductions"]


def _default_timeout() -> datetime.timedelta | None:
    if _config["timeout"] is not None:
        return _config["timeout"]
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        return backend.options._timeout
    except (AttributeError, RuntimeError):
        return None


# -- per-mesh state ------------------------------------------------------------------------------


@attrs.frozen
class Group:
    """The devices that differ from this rank only on ``axes``: ``pg`` is their process
    group and ``ranks`` their global ranks in process-group order (ascending, which is
    row-major over ``axes`` taken in mesh order)."""

    axes: tuple[str, ...]
    ranks: tuple[int, ...]  # global ranks, in group order (row-major over ``axes``)
    pg: Any
    timeout: datetime.timedelta | None

    @property
    def size(self) -> int:
        return len(self.ranks)


@attrs.frozen
class _State:
    mesh: Mesh
    rank: int
    coords: tuple[int, ...]
    groups: dict  # axes tuple (mesh order) -> Group


_states: dict[Mesh, _State] = {}
_pgs: dict[tuple, Any] = {}


def _state(mesh: Mesh) -> _State:
    st = _states.get(mesh)
    if st is None:
        st = _states[mesh] = _make_state(mesh)
    return st


def _check_world(mesh: Mesh) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        raise ShardingError(
            f"{mesh!r} uses backend='dist' but torch.distributed is not initialised; launch with "
            f"torchrun and call torch.distributed.init_process_group() first, or use backend='local'"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != mesh.size:
        raise ShardingError(
            f"{mesh!r} has {mesh.size} devices but the torch.distributed world has {world} ranks "
            f"(this is rank {rank}); on the dist backend the mesh size must equal the world size "
            f"(launch torchrun with --nproc-per-node={mesh.size}, or reshape the mesh)"
        )
    return rank


def _make_state(mesh: Mesh) -> _State:
    """Create the groups of every non-empty set of mesh axes; collective over all ranks."""
    if mesh.within is not None:
        return _view_state(mesh)
    rank = _check_world(mesh)
    timeout = _default_timeout()
    groups = {}
    for k in range(1, mesh.ndim + 1):
        for axes in itertools.combinations(mesh.axis_names, k):
            groups[axes] = _make_group(mesh, axes, rank, timeout)
    return _State(mesh, rank, mesh.coords(rank), groups)


def _view_state(mesh: Mesh) -> _State:
    """A sub-mesh view (``mesh.submesh``): this rank's place in it, and the parent's groups
    over its axes with members renumbered as the view's devices (no new process group)."""
    parent, fixed = mesh.within
    pst = _state(parent)
    for a, c in fixed:
        if pst.coords[parent.axis_index(a)] != c:
            raise ShardingError(
                f"{mesh!r} is a view at {a}={c}, but this rank (coords {pst.coords} on {parent!r}) is not in it"
            )
    pos = [parent.axis_index(a) for a in mesh.axis_names]

    def device(r: int) -> int:
        c = parent.coords(r)
        return mesh.device_at(tuple(c[i] for i in pos))

    groups = {
        axes: Group(axes, tuple(device(r) for r in g.ranks), g.pg, g.timeout)
        for axes, g in pst.groups.items() if all(a in mesh.axis_names for a in axes)
    }
    return _State(mesh, device(pst.rank), tuple(pst.coords[i] for i in pos), groups)


def _make_group(mesh: Mesh, axes: tuple[str, ...], rank: int, timeout: datetime.timedelta | None) -> Group:
    idx = [mesh.axis_index(a) for a in axes]
    partitions: dict[tuple, list[int]] = {}
    for dev in range(mesh.size):
        c = mesh.coords(dev)
        partitions.setdefault(tuple(c[i] for i in range(mesh.ndim) if i not in idx), []).append(dev)
    mine = None
    for ranks in partitions.values():
        key = (tuple(ranks), timeout)
        if key not in _pgs:  # every rank creates every group, in the same order
            kwargs = {"timeout": timeout} if timeout is not None else {}
            _pgs[key] = dist.new_group(ranks, **kwargs)
        if rank in ranks:
            mine = Group(axes, tuple(ranks), _pgs[key], timeout)
    return mine


def _group(step: Step, mesh: Mesh) -> Group:
    st = _state(mesh)
    axes = (step.axis,) if isinstance(step.axis, str) else tuple(step.axis)
    return st.groups[tuple(a for a in mesh.axis_names if a in axes)]


def axis_group(mesh: Mesh, axes: Sequence[str]) -> Group:
    """This rank's :class:`Group` over mesh ``axes`` (a non-empty collection of axis names)."""
    st = _state(mesh)
    key = tuple(a for a in mesh.axis_names if a in axes)
    if len(key) != len(set(axes)) or not key:
        raise ShardingError(f"axes {tuple(axes)!r} are not distinct axes of {mesh!r}")
    return st.groups[key]


def rank_of(mesh: Mesh) -> int:
    """This process's device index on ``mesh`` (its global rank)."""
    return _state(mesh).rank
