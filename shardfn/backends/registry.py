"""Backends: where the shards live and how collectives run.

Each backend is one class implementing :class:`Backend` (``local.LocalBackend``: every
device simulated in this process; ``dist.DistBackend``: one process per device on
torch.distributed). :func:`backend_for` returns a mesh's backend (one instance per
backend); code outside this package asks it what it needs instead of testing which
backend a mesh has. :func:`execute` walks a plan against either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ..plans.planner import COMM_KINDS, PLAN_CACHES, Plan
from .hooks import OBSERVERS, notify
from ..values.mesh import DEFAULT_DEVICE_TYPES


class Backend(Protocol):
    """What shardfn needs from a backend. A *backend value* is what a ShardedArray
    holds in ``_local`` (local: a stacked tensor or a tuple of per-device shards; dist:
    this rank's shard); a *held device* is a mesh device whose shard this process
    stores (local: every device; dist: this rank)."""

    # -- plan steps --------------------------------------------------------------------------
    def run_step(self, step: Any, value: Any, shape: tuple[int, ...], dtype: torch.dtype, *,
                 sym_shape: tuple | None = None) -> Any:
        """One plan step on a backend value. ``sym_shape``: the global shape with
        symbolic (torch.compile dynamic) sizes whose hints are ``shape``; a backend
        that cannot keep them symbolic specialises them."""

    def run_steps(self, steps: Sequence[Any], value: Any, shape: tuple[int, ...], dtype: torch.dtype, *,
                  sym_shape: tuple | None = None) -> Any:
        """A plan's steps in order on a backend value (what :func:`execute` calls); a
        backend whose devices share a process may run several steps as one."""

    # -- which devices this process holds --------------------------------------------------
    def devices(self, mesh: Any) -> Sequence[int]:
        """The held devices of ``mesh`` (row-major device indices), in the order of
        :meth:`shard_list`, :meth:`pack_local` and :meth:`unpack_local`."""

    def shard_list(self, value: Any, mesh: Any) -> tuple[torch.Tensor, ...]:
        """The held devices' shards of a backend value (views where possible)."""

    def shard(self, value: Any, mesh: Any, device: int) -> torch.Tensor:
        """Held device ``device``'s shard of a backend value (a view where possible)."""

    def one_replica(self, value: Any, mesh: Any) -> torch.Tensor:
        """The first held shard, as a fresh alias (for a fully replicated value: the
        whole value)."""

    # -- building backend values --------------------------------------------------------------
    def replicated(self, whole: torch.Tensor, mesh: Any) -> Any:
        """The backend value in which every device holds ``whole`` (on dist every rank
        passes the same ``whole``)."""

    def from_shards(self, shards: Sequence[torch.Tensor], layout: Any, shape: tuple[int, ...]) -> Any:
        """The backend value of ``layout`` from the held devices' shards (in
        :meth:`devices` order), stored in the backend's preferred form."""

    def build(self, layout: Any, shape: tuple[int, ...], make: Callable[[int], torch.Tensor]) -> Any:
        """The backend value whose shard on each held device ``d`` is ``make(d)``.
        ``make`` is called once per distinct shard the backend stores (devices that
        hold equal shards under ``layout`` share one call where the backend keeps one
        copy for them)."""

    def empty(self, layout: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Any:
        """A backend value of ``layout`` with uninitialised shards, in canonical form, in
        which the held devices holding the same part share one tensor (so writing each
        distinct shard once fills every replica: checkpoint loads write into it)."""

    def relabel(self, value: Any, src: Any, dst: Any) -> Any:
        """A backend value on mesh ``src`` as the same per-device shards on ``dst``, a
        mesh over the same row-major devices (``Mesh.flatten`` / ``unflatten``)."""

    # -- the shards users pass in and get out ---------------------------------------------------
    def pack_local(self, shards: Sequence[Any], mesh: Any) -> Any:
        """The held devices' shards as ``to_local`` returns them and ``local_map``
        passes them out (local: a list, one per device; dist: this rank's tensor)."""

    def unpack_local(self, local: Any, mesh: Any) -> list:
        """What ``from_local`` was given as the list of held devices' shards, checked
        for form (ShardingError naming what this backend takes)."""

    # -- global shapes and cross-process checks ----------------------------------------------
    def global_shape(self, shards: Sequence[torch.Tensor], layout: Any, shape: Sequence[int] | None, *,
                     check_ranks: bool = True) -> tuple[int, ...]:
        """The global shape the held shards describe (or ``shape``), checked against
        the layout; with ``check_ranks`` also that every process agrees on it and on
        the dtype (a collective on dist)."""

    def output_shape(self, outs: Sequence[torch.Tensor], layout: Any, exchange: bool) -> tuple[int, ...]:
        """The global shape that the held devices' outputs of a shard_map / local_map
        body describe (replicas taken from the first replica). With ``exchange`` the
        processes swap their output sizes (outputs may be uneven); without, a process
        that does not see every shard takes the layout to be even."""

    def check_same_meta(self, mesh: Any, shape: Sequence[int], dtype: torch.dtype, what: str) -> None:
        """Every process passed one global shape and dtype to ``what``
        (ShardingError otherwise; nothing to check when one process holds every device)."""

    def all_true(self, flags: Sequence[bool], mesh: Any) -> bool:
        """Whether ``flags`` hold on every process."""

    def check_replicas(self, mesh: Any, t: torch.Tensor, over: Sequence[str], what: str) -> None:
        """``t``, which this process passed as a value claimed the same on the devices that
        differ only along mesh axes ``over``, agrees with the other processes' (checked
        replicas, ``values/replica_checks.py``): a ShardingError on every process naming ``what`` and the
        processes that differ. Nothing to check when one process holds every device."""

    # -- autograd and tracing ---------------------------------------------------------------
    def zero_cotangent(self, like: torch.Tensor) -> torch.Tensor | None:
        """The cotangent of a held device's output that receives none: None where
        autograd may skip it, else zeros computed from ``like`` (a traced backward
        must keep the collectives such a value feeds on the backward side)."""

    # -- running ops -----------------------------------------------------------------------
    def compile_call(self, func: Any, call: Any, cand: Any, out_shapes: Sequence[Any], positional: tuple | None) -> Any:
        """An op's local call for one dispatch cache entry, decided once:
        ``(args, kwargs, values, symbolic) -> flat outputs`` (backend values). Its ``lean``
        is None or ``(args, kwargs) -> the lone output`` for a warm call whose arrays sit at
        ``positional``, need no move and are stored canonically (:meth:`is_canonical`);
        ``lean`` returns None while it cannot run such a call yet."""

    def is_canonical(self, value: Any, layout: Any) -> bool:
        """Whether ``value`` is stored in the one form op outputs of ``layout`` have (the
        fast path's ``lean`` calls rely on it; dispatch gives other arrays no fast key)."""

    def keeps_symbolic(self, value: Any) -> bool:
        """Whether an array holding ``value`` may keep symbolic (torch.compile dynamic)
        global sizes through plans and ops; otherwise they are specialised."""

    # -- element-wise updates on the stored data (sf.optim) --------------------------------------
    def storage(self, value: Any, layout: Any, shape: tuple[int, ...]) -> list[torch.Tensor]:
        """The tensors this process stores for an array of ``layout``, each distinct shard
        once (replicas once), in one form per layout: two arrays of one layout and shape
        give tensors of equal shapes, so an element-wise update can run on them directly."""

    def from_storage(self, tensors: Sequence[torch.Tensor], layout: Any, shape: tuple[int, ...]) -> Any:
        """The backend value whose :meth:`storage` is ``tensors`` (the inverse)."""

    def shard_reduce(self, value: Any, layout: Any, shape: tuple[int, ...], fn: Callable, neutral: float) -> Any:
        """A backend value of a 0-d array pending a reduction over every mesh axis: each held
        device's ``fn(t, dims)`` (``t``'s dims ``dims`` reduced away, leading dims batching
        devices) of its shard, where a device holding a replica of a device earlier on an
        axis the layout does not vary over gives ``neutral`` (each distinct shard counted once)."""

    # -- transforms and interop ---------------------------------------------------------------
    def shard_map(self, f: Callable, inputs: Any, out_specs: Any, check_vma: bool, kwargs: dict) -> Any:
        """Run a shard_map body ``f`` on the held devices (``inputs``: the checked
        ``transforms._Inputs``), with this backend's implementation of ``sf.lax``."""

    def axis_group(self, mesh: Any, axes: Sequence[str]) -> Any:
        """This process's torch.distributed group over mesh ``axes`` (``dist.Group``),
        or None when the devices are simulated in this process."""

    def submesh(self, mesh: Any, axes: Sequence[str]) -> Any:
        """The mesh over ``axes`` of the devices sharing this process's coordinates on the
        other axes (a partial-manual shard_map body's mesh, over the backend's existing
        groups), or None where this process holds every device (the caller simulates)."""

    def default_device_type(self) -> str:
        """The device type of a mesh made without ``device_type=``."""


_INSTANCES: dict[str, Backend] = {}


def backend_named(name: str) -> Backend:
    """The backend called ``name`` ("local" or "dist"; one instance each)."""
    backend = _INSTANCES.get(name)
    if backend is None:
        if name == "local":
            from .local import LocalBackend as cls
        elif name == "dist":
            from .dist import DistBackend as cls
        else:
            raise ValueError(f"unknown backend {name!r}")
        backend = _INSTANCES[name] = cls()
    return backend


def backend_for(mesh: Any) -> Backend:
    """The backend that runs ``mesh``."""
    backend = _INSTANCES.get(mesh.backend)
    return backend if backend is not None else backend_named(mesh.backend)


def execute(plan: Plan, value: Any, shape: Any = None) -> Any:
    """Run ``plan`` on a backend value (what a ShardedArray holds) and return the new one.
    ``shape``: the value's global shape when it has symbolic sizes (the plan was made
    from their hints); a backend that can keeps them symbolic. Concrete sizes and no
    observer looking on: the backend's runner of the whole plan, compiled once per plan,
    where it has one (``compile_plan``; the plans a training step repeats, its gradients'
    all-reduces and its batch's split, are the same cached objects every step)."""
    if not plan.steps:
        return value
    sym = shape if shape is not None and _SymInt in set(map(type, shape)) else None
    if sym is None and not OBSERVERS:
        hit = _RUNNERS.get(id(plan))
        if hit is None or hit[0] is not plan:
            hit = _compile(plan)
        if hit[1] is not None:
            out = hit[1](value)
            if out is not None:
                return out
    backend = backend_for(plan.src.mesh)
    observed = bool(OBSERVERS) and not _on_meta(value, plan.src.mesh)
    if observed:
        for step in plan.steps:
            if step.kind in COMM_KINDS:
                notify(step)
    return backend.run_steps(plan.steps, value, plan.shape, plan.dtype, sym_shape=sym)


def execute_many(plan: Plan, values: list) -> list | None:
    """Run ``plan``, a plan of element-wise steps for the concatenation of ``values`` (a
    coalesced bucket's flat buffer), on each of the backend values ``values`` instead, where
    the backend runs such a plan on several values at once (``compile_many``: the local
    backend's all-reduces, one multi-tensor add per level, no concatenation); its collectives
    are reported once, as the bucket's. None where the backend does not (concatenate them
    and :func:`execute` the plan)."""
    if not plan.steps or torch.compiler.is_compiling():
        return None
    hit = _MANY.get(id(plan))
    if hit is None or hit[0] is not plan:
        compile_many = getattr(backend_for(plan.src.mesh), "compile_many", None)
        if len(_MANY) >= _RUNNERS_MAX:
            _MANY.clear()
        hit = _MANY[id(plan)] = (plan, compile_many(plan.steps) if compile_many is not None else None)
    out = hit[1](values) if hit[1] is not None and values else None
    if out is not None and OBSERVERS and not _on_meta(values[0], plan.src.mesh):
        for step in plan.steps:
            if step.kind in COMM_KINDS:
                notify(step)
    return out


_SymInt = torch.SymInt
# A plan's compiled runner (None: its backend has none for the plan), by the plan's id; each
# entry holds its plan (the id stays unique) and is checked by identity.
_RUNNERS: dict[int, tuple[Plan, Callable | None]] = {}
_RUNNERS_MAX = 4096
_MANY: dict[int, tuple[Plan, Callable | None]] = {}  # the same for ``execute_many``'s runners
PLAN_CACHES.append(_RUNNERS.clear)
PLAN_CACHES.append(_MANY.clear)


def _compile(plan: Plan) -> tuple[Plan, Callable | None]:
    compile_plan = getattr(backend_for(plan.src.mesh), "compile_plan", None)
    if len(_RUNNERS) >= _RUNNERS_MAX:
        _RUNNERS.clear()
    hit = _RUNNERS[id(plan)] = (plan, compile_plan(plan.steps, plan.shape) if compile_plan is not None else None)
    return hit


def _on_meta(value: Any, mesh: Any) -> bool:
    """Whether a backend value is a trace (meta/fake tensors, or torch.compile tracing): no data
    moves, so no collective is reported. Meta values of a mesh whose device type is meta are
    its data (the stand-in for an accelerator): their collectives count."""
    t = value[0] if isinstance(value, (tuple, list)) and value else value
    if isinstance(t, torch.Tensor) and type(t).__name__ in ("FakeTensor", "FunctionalTensor"):
        return True
    if isinstance(t, torch.Tensor) and t.is_meta and getattr(mesh, "device_type", None) != "meta":
        return True
    return torch.compiler.is_compiling()


for _name in ("local", "dist"):
    DEFAULT_DEVICE_TYPES[_name] = lambda name=_name: backend_named(name).default_device_type()
