"""The dist backend: one process per mesh device on an initialised torch.distributed world.

A value is this rank's shard, a plain tensor. The mesh maps onto the world row-major
(device ``i`` is rank ``i``). At first use of a mesh every rank creates, in the same
order, one process group per mesh axis and per set of axes an exchange spans (cached per
mesh). Plan steps run through torch's functional collectives and are waited on before
``run_step`` returns, so every value a user sees is ready. Shard sizes of uneven layouts
come from the layout math; collectives that need equal sizes are padded.

Reductions come in three modes (``configure(reductions=...)`` or ``SHARDFN_DIST_REDUCTIONS``):
``"ordered"`` (also on while ``torch.use_deterministic_algorithms(True)``): floating sums
and averages over more than two ranks are done by an all_to_all of the pieces, which each
rank then adds in mesh order (and an all_gather for replicated results): the bytes of a
ring reduce-scatter / all-reduce, results bit-identical to the local backend's.
``"native"``: the library's all_reduce / reduce_scatter (a ring adds in a rank-dependent
order). ``"auto"`` (default): all_reduce native; reduce_scatter ordered on CPU, where it
is also faster than gloo's, native on GPUs. Max/min and integer sums are exact in any mode.

Collectives time out after the default process group's timeout (``init_process_group(timeout=)``),
overridden by ``SHARDFN_DIST_TIMEOUT`` (seconds) or ``configure(timeout=)``; a timed-out or
failed collective raises :class:`CollectiveError` naming the step, the mesh axes and the ranks.

The implementation: ``dist_groups`` (configuration, per-mesh process groups),
``dist_collectives`` (issuing and waiting collectives, their errors), ``dist_steps`` (plan
steps and exchanges); this module is the :class:`DistBackend` protocol on top of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol

from ..plans.planner import Step
from ..values.errors import ShardingError
from ..values.layout import Layout, describe, local_shapes
from ..values.mesh import Mesh
from .device_call import DeviceCall, call_is_complex, empty_outputs, raw_op, skips_empty, substitute, with_locals
from .dist_collectives import CollectiveError as CollectiveError  # documented here (docs/dist.md)
from .dist_collectives import _all_gather_single, dense, pin_in_real_trace, run_collective
from .dist_groups import Group as Group
from .dist_groups import _state, axis_group, rank_of
from .dist_groups import configure as configure  # documented here (docs/dist.md)
from .dist_groups import reductions as reductions  # documented here (docs/dist.md)
from .dist_steps import run_step
from .hooks import SHARD_MAP_RUNNERS


# -- protocol used by ShardedArray -----------------------------------------------------------------


def replicated(whole: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """This rank's copy of a replicated value (every rank passes the same ``whole``)."""
    _state(mesh)
    return whole


def one_replica(value: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """This rank's copy (a fresh alias, so autograd Functions can return it)."""
    return value.view(value.shape)


def from_shards(shards: Sequence[torch.Tensor], layout: Layout, shape: tuple[int, ...]) -> torch.Tensor:
    _state(layout.mesh)
    return shards[0]


def global_shape(shards: Sequence[torch.Tensor], layout: Layout, shape: Sequence[int] | None, *,
                 check_ranks: bool = True) -> tuple[int, ...]:
    """The global shape: ``shape`` if given, else the even one (local size times the sizes of
    the axes sharding each dim); this rank's shard is checked against it, and every rank's
    global shape and dtype against the others' (one small all_gather), so a mismatch is a
    ShardingError on every rank rather than a hang or abort in a later collective."""
    mesh, x = layout.mesh, shards[0]
    rank = _state(mesh).rank
    if shape is None:
        shape = tuple(
            n * math.prod(mesh.axis_size(a) for a in axes) for n, axes in zip(x.shape, layout.dims)
        )
    shape = tuple(int(n) for n in shape)
    error = None
    if len(shape) != x.dim():
        error = f"from_local: shape={shape} has rank {len(shape)} but the local tensor has rank {x.dim()}"
    elif local_shapes(layout, shape)[rank] != tuple(x.shape):
        error = (
            f"from_local: rank {rank} (mesh coords {mesh.coords(rank)}) has a local tensor of shape "
            f"{tuple(x.shape)}, but {describe(shape, x.dtype, layout)} on {mesh!r} puts a shard of shape "
            f"{local_shapes(layout, shape)[rank]} there; pass shape= with the global shape for uneven layouts"
        )
    if check_ranks:
        check_same_meta(mesh, shape, x.dtype, "from_local", error)
    elif error is not None:
        raise ShardingError(error)
    return shape


_DTYPE_CODE = {d: i for i, d in enumerate(sorted(
    {v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))}
_META_DIMS = 8  # shape entries sent as is; longer shapes also send a checksum


def check_same_meta(mesh: Mesh, shape: Sequence[int], dtype: torch.dtype, what: str, error: str | None = None) -> None:
    """Every rank of ``mesh`` passed one global shape and dtype to ``what`` and none hit a
    local ``error``; otherwise a ShardingError on every rank naming the ranks that differ."""
    if _tracing():
        if error is not None:
            raise ShardingError(error)
        return  # traced code: the eager run checked these inputs
    st = _state(mesh)
    shape = tuple(shape)
    meta = [int(error is not None), _DTYPE_CODE.get(dtype, -1), len(shape)]
    meta += list(shape[:_META_DIMS]) + [0] * (_META_DIMS - min(len(shape), _META_DIMS))
    meta.append(sum((i + 1) * 1_000_003 * n for i, n in enumerate(shape)) % (1 << 62))
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else "cpu"
    mine = torch.tensor(meta, dtype=torch.int64, device=device)
    rows = run_collective(
        f"{what} metadata check", st.groups[mesh.axis_names], _all_gather_single, mine, 0
    ).view(mesh.size, -1).tolist()
    if error is not None:
        raise ShardingError(error)
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        raise ShardingError(
            f"{what}: rank(s) {failed} rejected their input (see their error); every rank must pass a valid input")
    differ = [r for r, row in enumerate(rows) if row[1:] != rows[0][1:]]
    if differ:
        raise ShardingError(
            f"{what}: ranks disagree on the global shape/dtype: rank 0 has {_meta_str(rows[0])}, "
            + ", ".join(f"rank {r} has {_meta_str(rows[r])}" for r in differ[:4])
            + ". Every rank must pass tensors of one global shape and dtype"
        )


def _fingerprint(t: torch.Tensor) -> list[int]:
    """Dtype, shape and three position-weighted sums of the bytes of ``t``: equal tensors
    (bit for bit) give equal fingerprints, different ones almost surely not."""
    b = dense(t.detach()).reshape(-1).view(torch.uint8).to(torch.int64)
    i = torch.arange(b.numel(), dtype=torch.int64, device=b.device)
    sums = [b.sum(), (b * (i % 65521 + 1)).sum(), (b * ((i * 40503) % 1000003 + 7)).sum()]
    shape = list(t.shape[:_META_DIMS]) + [0] * (_META_DIMS - min(t.dim(), _META_DIMS))
    return [_DTYPE_CODE.get(t.dtype, -1), t.dim(), *shape, *(int(s.item()) for s in sums)]


def check_replicas(mesh: Mesh, t: torch.Tensor, over: Sequence[str], what: str) -> None:
    """``t`` is claimed the same on the ranks that differ only along mesh axes ``over``:
    compare fingerprints (one all_gather over the mesh); a ShardingError on every rank
    naming ``what`` and the ranks that hold other values than the first of their group."""
    if _tracing() or not over:
        return
    st = _state(mesh)
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else "cpu"
    mine = torch.tensor(_fingerprint(t), dtype=torch.int64, device=device)
    rows = run_collective(
        f"{what} replica check", st.groups[mesh.axis_names], _all_gather_single, mine, 0
    ).view(mesh.size, -1).tolist()
    pos = [mesh.axis_index(a) for a in over]
    first: dict[tuple, int] = {}
    differ: list[tuple[int, int]] = []
    for r in range(mesh.size):
        key = tuple(c for i, c in enumerate(mesh.coords(r)) if i not in pos)
        ref = first.setdefault(key, r)
        if rows[r] != rows[ref]:
            differ.append((ref, r))
    if differ:
        pairs = ", ".join(f"rank {r} differs from rank {ref}" for ref, r in differ[:8])
        raise ShardingError(
            f"{what} is claimed replicated over mesh axes {tuple(over)!r} of {mesh!r}, but the ranks hold "
            f"different values: {pairs} (checked because sf.debug.check_replicas() / {_replica_env()}=1 is on). "
            f"Every rank must pass the same value there (seed random generators alike, or build the value "
            f"with sf.random / the factories), or shard it / declare it Partial"
        )


def _replica_env() -> str:
    from ..values.replica_checks import ENV

    return ENV


def _tracing() -> bool:
    """Whether torch.compile is tracing (no data-dependent collectives there)."""
    return torch.compiler.is_compiling() or torch._guards.detect_fake_mode() is not None


def _meta_str(row: list[int]) -> str:
    names = {i: d for d, i in _DTYPE_CODE.items()}
    ndim = row[2]
    shape = tuple(row[3:3 + min(ndim, _META_DIMS)]) + (("...",) if ndim > _META_DIMS else ())
    return f"{names.get(row[1], 'an unknown dtype')}{list(shape)}"


def all_local_shapes(t: torch.Tensor, mesh: Mesh) -> list[tuple[int, ...]]:
    """Every rank's shape of its tensor ``t`` (one small all_gather over the mesh)."""
    mine = torch.tensor([list(t.shape)], dtype=torch.int64)
    group = _state(mesh).groups[mesh.axis_names]
    every = pin_in_real_trace(funcol.wait_tensor(_all_gather_single(mine, 0, group.pg)))
    return [tuple(int(n) for n in row) for row in every]


def shard_list(value: torch.Tensor, mesh: Mesh) -> tuple[torch.Tensor, ...]:
    return (value,)


def all_true(flags: Sequence[bool], mesh: Mesh) -> bool:
    """Whether ``flags`` hold on every rank (a min all_reduce over the mesh)."""
    st = _state(mesh)
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else "cpu"
    ok = torch.tensor([int(all(flags))], dtype=torch.int32, device=device)
    return bool(run_collective("all_reduce", st.groups[mesh.axis_names], funcol.all_reduce, ok, "min").item())


# -- running an op's local call -------------------------------------------------------------


def compile_call(func: Any, call: Any, cand: Any, out_shapes: Sequence[Any], positional: tuple | None) -> Any:
    """The local computation of one strategy: the local call once, on this rank's shards
    (localised sizes and shard facts are this rank's). ``(args, kwargs, values,
    symbolic) -> flat outputs``."""
    return RankCall(func, cand, call, out_shapes, positional)


class RankCall:
    """The local call on this rank's shards."""

    keeps_symbolic = False

    def __init__(self, func: Any, cand: Any, call: Any, out_shapes: Sequence[Any], positional: tuple | None) -> None:
        self.rank = rank_of(call.mesh)
        self.device_call = DeviceCall(func, cand, [tuple(v.shape) for _, v in call.arrays], out_shapes, (self.rank,),
                                      call_is_complex(call))
        self.positional = positional
        self.direct = raw_op(self.device_call.direct)  # the op itself when nothing needs adapting
        # this rank's local output shapes where every output is empty here while the global
        # outputs are not (as the local backend: nothing to compute, and a kernel may reject
        # the empty piece), with their dtypes
        metas = getattr(call, "out_metas", None) or ()
        typed = len(metas) == len(cand.out_layouts or ()) and all(m is None or isinstance(m, torch.Tensor) for m in metas)
        empty = empty_outputs(cand, out_shapes, metas) if typed else {}
        self.empty = [None if sh is None else (sh, m.dtype) for sh, m in zip(empty[self.rank], metas)] \
            if self.rank in empty else None
        self.skip_empty = self.empty is not None and skips_empty(func)  # not called: see ``empty_outputs``
        # the same decision on every rank: whether any rank's outputs are all empty
        raises = _raises_on_values(func, call) or _empty_on_some(cand, call) or bool(empty)
        self.mesh = call.mesh if call.mesh.size > 1 and raises else None

    def lean(self, args: tuple, kwargs: dict) -> Any:
        """The lone output for arrays at ``positional`` needing no move (dispatch's fast path)."""
        a = with_locals(args, self.positional)
        if self.mesh is not None:
            return self._together(lambda: self._run(tuple(a), kwargs)[0], lone=True)
        if self.direct is not None:
            return self.direct(*a, **kwargs)
        return self.device_call(tuple(a), kwargs, self.rank)[0]

    def __call__(self, args: tuple, kwargs: dict, values: dict, symbolic: bool = False) -> list:
        a, k = substitute(args, kwargs, values, self.positional)
        if self.mesh is not None:
            return self._together(lambda: self._run(a, k))
        return self._run(a, k)

    def _run(self, a: tuple, k: dict) -> list:
        # (traced, every rank records the call: a rank whose graph lacks it may have its collectives
        # placed otherwise by the partitioner, a backward one moved into the forward, and the ranks'
        # collectives then disagree; the real kernel later runs on the empty piece, as before)
        if self.skip_empty and not (_tracing() or _proxy_tracing()):
            return self._empties()
        if self.direct is not None:
            out = self.direct(*a, **k)
            return list(out) if isinstance(out, (tuple, list)) else [out]
        return self.device_call(a, k, self.rank)

    def _empties(self) -> list:
        """This rank's outputs where they are all empty (``self.empty``; None where undefined)."""
        return [None if e is None else torch.empty(e[0], dtype=e[1], device=self.mesh.device_type) for e in self.empty]

    def _together(self, run: Callable[[], Any], lone: bool = False) -> Any:
        """``run()`` for an op whose kernel raises on some values (an index out of range, an
        integer division by zero; or any error, when some ranks' shards are empty and others'
        not), which this rank's shard may hold and another's not: one
        all_reduce tells every rank whether any raised, and then all raise (the type the
        lowest such rank raised) rather than leave their peers waiting in a later collective."""
        if _tracing() or _proxy_tracing():
            return run()
        try:
            out, err = run(), None
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            out, err = None, e
            if self.empty is not None and isinstance(e, (RuntimeError, IndexError, ValueError)) \
                    and not isinstance(e, ShardingError):
                out, err = self._empties(), None
                out = out[0] if lone else out
        n = len(_ERRORS) + 1
        mine = self.rank * n + _error_kind(err) if err is not None else self.mesh.size * n
        group = _state(self.mesh).groups[self.mesh.axis_names]
        first = int(run_collective("all_reduce", group, funcol.all_reduce, torch.tensor([mine], dtype=torch.int64),
                                   "min").item())
        if first == self.mesh.size * n:
            return out
        rank, kind = divmod(first, n)
        if err is not None and (rank == self.rank or _error_kind(err) == kind):
            raise err
        cls = _ERRORS[kind] if kind < len(_ERRORS) else RuntimeError
        raise cls(f"{self.device_call.func}: rank {rank} raised {cls.__name__} on its shard (an index out of range or a "
                  f"division by zero there, as torch's kernel would raise on the whole value); every rank raises")


# ops whose kernels raise on the values they are given, not only on shapes
_INDEXING = frozenset({
    "index_select", "gather", "scatter", "scatter_add", "scatter_reduce", "index", "index_put", "_index_put_impl_",
    "index_add", "index_copy", "index_fill", "index_reduce", "embedding", "take", "take_along_dim", "put",
    "nll_loss_forward", "nll_loss2d_forward", "nll_loss", "nll_loss_nd", "one_hot", "_embedding_bag",
    "embedding_bag", "masked_scatter", "repeat_interleave", "multinomial", "bincount",
})
_INTEGER_DIVISION = frozenset({"div", "floor_divide", "remainder", "fmod", "div_", "floor_divide_", "remainder_",
                               "fmod_"})
_ERRORS = (IndexError, NotImplementedError, RuntimeError, ValueError, TypeError, ZeroDivisionError)


def _raises_on_values(func: Any, call: Any) -> bool:
    name = getattr(getattr(func, "overloadpacket", None), "__name__", "")
    if name in _INDEXING:
        return True
    if name not in _INTEGER_DIVISION or (name.startswith("div") and call.kwargs.get("rounding_mode") is None):
        return False  # true division never raises
    return all(not (v.is_floating_point() or v.is_complex()) for _, v in call.arrays if isinstance(v, torch.Tensor))


def _empty_on_some(cand: Any, call: Any) -> bool:
    """Whether an input's shard is empty on some ranks and not on others (an uneven layout):
    kernels check dtypes and arguments only on non-empty inputs, so only some ranks may raise."""
    for layout, (_, v) in zip(cand.in_layouts, call.arrays):
        if layout is None or not isinstance(v, torch.Tensor):
            continue
        empty = {math.prod(s) == 0 for s in local_shapes(layout, tuple(v.shape))}
        if len(empty) > 1:
            return True
    return False


def _error_kind(err: BaseException) -> int:
    return next((i for i, cls in enumerate(_ERRORS) if isinstance(err, cls)), len(_ERRORS))


def _proxy_tracing() -> bool:
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is not None

# -- the Backend protocol ----------------------------------------------------------------------


class DistBackend:
    """One process per mesh device (see the module docstring); implements
    :class:`shardfn.backends.Backend`. This process holds one device, its rank."""

    def run_step(self, step: Step, value: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, *,
                 sym_shape: tuple | None = None) -> torch.Tensor:
        return run_step(step, value, shape, dtype)  # symbolic shard sizes are specialised there

    def run_steps(self, steps: Any, value: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, *,
                  sym_shape: tuple | None = None) -> torch.Tensor:
        for step in steps:  # every collective runs: the other ranks take the same steps
            value = run_step(step, value, shape, dtype)
        return value

    # the module's functions where they are the method (no wrapper on the hot path)
    rank_of = staticmethod(rank_of)  # not in the protocol: this process's device index
    shard_list = staticmethod(shard_list)
    one_replica = staticmethod(one_replica)
    replicated = staticmethod(replicated)
    from_shards = staticmethod(from_shards)
    global_shape = staticmethod(global_shape)
    all_true = staticmethod(all_true)
    axis_group = staticmethod(axis_group)
    check_replicas = staticmethod(check_replicas)
    compile_call = staticmethod(compile_call)  # dispatch: an op's local call, once per cache entry

    def is_canonical(self, value: torch.Tensor, layout: Layout) -> bool:
        return True  # a rank's shard has one form

    def devices(self, mesh: Mesh) -> tuple[int]:
        return (rank_of(mesh),)

    def storage(self, value: torch.Tensor, layout: Layout, shape: tuple[int, ...]) -> list[torch.Tensor]:
        return [value]

    def from_storage(self, tensors: Sequence[torch.Tensor], layout: Layout, shape: tuple[int, ...]) -> torch.Tensor:
        return tensors[0]

    def shard_reduce(self, value: torch.Tensor, layout: Layout, shape: tuple[int, ...], fn: Callable,
                     neutral: float) -> torch.Tensor:
        mesh = layout.mesh
        axes = set(layout.axis_dim) | set(layout.partial_ops)
        red = fn(value, tuple(range(value.dim()))) if value.dim() else fn(value.reshape(1), (0,))
        replica = any(c != 0 for a, c in zip(mesh.axis_names, mesh.coords(rank_of(mesh))) if a not in axes)
        return torch.full((), neutral, dtype=red.dtype, device=red.device) if replica else red

    def shard(self, value: torch.Tensor, mesh: Mesh, device: int) -> torch.Tensor:
        return value

    def build(self, layout: Layout, shape: tuple[int, ...], make: Callable[[int], torch.Tensor]) -> torch.Tensor:
        return from_shards([make(rank_of(layout.mesh))], layout, shape)

    def empty(self, layout: Layout, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(local_shapes(layout, shape)[rank_of(layout.mesh)], dtype=dtype, device=device)

    def relabel(self, value: torch.Tensor, src: Mesh, dst: Mesh) -> torch.Tensor:
        return value  # device i is rank i on both meshes

    def pack_local(self, shards: Sequence[Any], mesh: Mesh) -> Any:
        return shards[0]

    def unpack_local(self, local: Any, mesh: Mesh) -> list:
        if not isinstance(local, torch.Tensor):
            raise ShardingError(f"from_local on the dist backend takes this rank's tensor, got {type(local).__name__}")
        return [local]

    def output_shape(self, outs: Sequence[torch.Tensor], layout: Layout, exchange: bool) -> tuple[int, ...]:
        if not exchange:
            return global_shape(outs, layout, None)
        from . import local

        metas = [torch.empty(s, device="meta") for s in all_local_shapes(outs[0], layout.mesh)]
        return local.global_shape(metas, layout, None)

    def check_same_meta(self, mesh: Mesh, shape: Sequence[int], dtype: torch.dtype, what: str) -> None:
        check_same_meta(mesh, shape, dtype, what)

    def zero_cotangent(self, like: torch.Tensor) -> torch.Tensor:
        # built from the cotangent and still on its graph (a masked fill: exact zeros,
        # NaN included): a constant zero would let AOTAutograd's partitioner move the
        # collectives it feeds into the forward graph of some ranks only, and a cut edge
        # would make a second derivative skip collectives on some ranks (a gloo crash)
        return like.masked_fill(torch.ones((), dtype=torch.bool, device=like.device), 0)

    def keeps_symbolic(self, value: torch.Tensor) -> bool:
        return False  # plans run on concrete shard sizes

    def shard_map(self, f: Callable, inputs: Any, out_specs: Any, check_vma: bool, kwargs: dict) -> Any:
        """This rank's part of the body, collectives through ``transforms/shard_map/dist.py``."""
        return SHARD_MAP_RUNNERS["dist"](f, inputs, out_specs, check_vma, kwargs)

    def submesh(self, mesh: Mesh, axes: Sequence[str]) -> Mesh:
        from ..values.mesh import submesh

        coords = _state(mesh).coords
        fixed = tuple((a, coords[i]) for i, a in enumerate(mesh.axis_names) if a not in axes)
        return submesh(mesh, axes, fixed)

    def default_device_type(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"
