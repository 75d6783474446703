"""shard_map bodies on the local backend when shards differ in shape (uneven layouts).

The body runs once per device, each in its own thread, on that device's plain local
tensor, so Python sees each device's true shape. Collectives meet at a barrier: every
device deposits its input, one thread computes every device's result as a
differentiable function of all inputs, and each device picks up its own. Autograd
therefore sees one graph over all devices and differentiates the whole SPMD program.

Which mesh axes a value varies over (for ``check_vma``) is tracked by a
TorchFunctionMode that tags each op's outputs with the union of its inputs' tags.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch.overrides import TorchFunctionMode

from ...arrays.array import ShardedArray
from ...arrays.redistribute import reshard
from ...values.errors import ShardingError
from ...values.layout import Layout, device_box
from ...values.mesh import Mesh
from .. import boundary as B
from . import recompute as _recompute
from ..lax import _entered
from ..specs import _match_columns
from .io import _Inputs, assemble_parts

_VMA = "_sf_vma"


def vma_of(t: Any) -> frozenset[str]:
    """Mesh axes the body value ``t`` varies over (empty for untracked tensors)."""
    return getattr(t, _VMA, frozenset())


def tag(t: torch.Tensor, vma: frozenset[str]) -> torch.Tensor:
    setattr(t, _VMA, vma)
    return t


class _VmaMode(TorchFunctionMode):
    """Tags every op's tensor outputs with the union of its inputs' varying axes. With
    ``traced_closures`` (the run inside ``boundary.Opaque`` under torch.func or forward
    AD, whose arguments arrive as plain tensors) a tensor an enclosing transform tracks
    can only be a closure, which the device threads cannot differentiate: it raises."""

    def __init__(self, traced_closures: bool = False) -> None:
        super().__init__()
        self.traced_closures = traced_closures

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves = [t for t in optree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if self.traced_closures:
            _check_untraced(leaves)
        out = func(*args, **kwargs)
        vma = frozenset().union(*(vma_of(t) for t in leaves))
        if vma:
            for o in optree.tree_leaves(out):
                if isinstance(o, torch.Tensor):
                    tag(o, vma_of(o) | vma)
        return out


def _check_untraced(tensors: list) -> None:
    from torch._C._functorch import is_functorch_wrapped_tensor
    from torch.autograd import forward_ad

    inner = torch._C._functorch.maybe_current_level() or 0  # transforms opened inside the body, in this thread
    for t in tensors:
        wrapped = is_functorch_wrapped_tensor(t) and torch._C._functorch.maybe_get_level(t) > inner
        if wrapped or (forward_ad._current_level >= 0 and forward_ad.unpack_dual(t).tangent is not None):
            raise ShardingError(
                "a shard_map body with uneven shards uses a tensor that an enclosing torch.func transform "
                "(or forward-AD dual) tracks without receiving it as an argument (a closure); the body runs "
                "once per device in threads that cannot see the transform, so its derivative would be lost. "
                "Pass it as an argument of the shard_mapped function (in_specs P() replicates it)"
            )


class _Rendezvous:
    """A reusable meeting point of all devices' threads."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.slots: list[Any] = [None] * n
        self.result: list | None = None
        self.error: BaseException | None = None
        self.barrier = threading.Barrier(n, action=self._run)

    def exchange(self, dev: int, key: tuple, payload: Any, fn: Callable[[list], list]) -> Any:
        """Deposit ``payload``; once all devices have, ``fn(payloads)`` gives each its result."""
        self.slots[dev] = (key, payload, fn)
        self.barrier.wait()
        result, error = self.result, self.error
        self.barrier.wait()
        if error is not None:
            raise error
        return result[dev]  # type: ignore[index]

    def _run(self) -> None:
        keys = [s[0] for s in self.slots]
        self.result, self.error = None, None
        if any(k != keys[0] for k in keys):
            calls = ", ".join(f"device {d}: {_describe(k)}" for d, k in enumerate(keys))
            self.error = ShardingError(
                f"shard_map devices diverged: they must make the same collective calls in the "
                f"same order, but reached {calls}"
            )
            return
        try:
            with torch.enable_grad() if torch.is_grad_enabled() else torch.no_grad():
                self.result = self.slots[0][2]([s[1] for s in self.slots])
        except BaseException as e:  # noqa: BLE001  re-raised in every device's thread
            self.error = e


def _describe(key: tuple) -> str:
    return "the end of the body" if key[0] == "end" else f"sf.lax.{key[0]} over {key[1]!r}"


class DeviceBody:
    """The lax implementation seen by one device's thread."""

    def __init__(self, mesh: Mesh, dev: int, rv: _Rendezvous) -> None:
        self.mesh, self.dev, self.rv = mesh, dev, rv
        self.group_mesh = mesh  # the mesh whose axes the collectives group over and ``dev`` indexes
        self.leader = dev == 0

    def _groups(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Device groups over ``axes``, each ranked row-major over ``axes``."""
        mesh = self.group_mesh
        ais = [mesh.axis_index(a) for a in axes]
        groups: dict[tuple, dict[int, int]] = {}
        for d in range(mesh.size):
            c = mesh.coords(d)
            rank = 0
            for k in ais:
                rank = rank * mesh.shape[k] + c[k]
            groups.setdefault(tuple(v for k, v in enumerate(c) if k not in ais), {})[rank] = d
        return [[g[r] for r in sorted(g)] for g in groups.values()]

    def _collective(self, name: str, axes: tuple[str, ...], x: torch.Tensor, vma: frozenset[str],
                    per_group: Callable[[list[torch.Tensor]], list[torch.Tensor]], key: tuple = ()) -> torch.Tensor:
        groups = self._groups(axes)

        def fn(xs: list) -> list:
            out: list = [None] * len(xs)
            for grp in groups:
                try:
                    res = per_group([xs[d] for d in grp])
                except RuntimeError as e:
                    shapes = [tuple(xs[d].shape) for d in grp]
                    raise ShardingError(
                        f"sf.lax.{name} over {axes!r}: the devices' local tensors have shapes {shapes}, "
                        f"which this collective cannot combine ({e})"
                    ) from None
                for d, r in zip(grp, res):
                    out[d] = r
            return out

        return tag(self.rv.exchange(self.dev, (name, axes) + key, x, fn), vma)

    def reduce(self, x: torch.Tensor, axes: tuple[str, ...], op: str) -> torch.Tensor:
        def per_group(xs: list) -> list:
            s = torch.stack(xs)
            r = s.sum(0, dtype=s.dtype) if op == "sum" else s.amax(0) if op == "max" else s.amin(0)
            return [r] * len(xs)

        name = {"sum": "psum", "max": "pmax", "min": "pmin"}[op]
        return self._collective(name, axes, x, vma_of(x) - set(axes), per_group)

    def all_gather(self, x: torch.Tensor, axes: tuple[str, ...], axis: int) -> torch.Tensor:
        def per_group(xs: list) -> list:
            return [torch.cat(xs, axis)] * len(xs)

        return self._collective("all_gather", axes, x, vma_of(x) - set(axes), per_group, (axis,))

    def psum_scatter(self, x: torch.Tensor, axes: tuple[str, ...], dim: int) -> torch.Tensor:
        def per_group(xs: list) -> list:
            s = torch.stack(xs).sum(0, dtype=xs[0].dtype)
            return list(s.split(s.shape[dim] // len(xs), dim))

        return self._collective("psum_scatter", axes, x, vma_of(x) | set(axes), per_group, (dim,))

    def all_to_all(self, x: torch.Tensor, axes: tuple[str, ...], split_axis: int, concat_axis: int) -> torch.Tensor:
        def per_group(xs: list) -> list:
            g = len(xs)
            pieces = [t.split(t.shape[split_axis] // g, split_axis) for t in xs]
            return [torch.cat([p[i] for p in pieces], concat_axis) for i in range(g)]

        return self._collective("all_to_all", axes, x, vma_of(x) | set(axes), per_group, (split_axis, concat_axis))

    def ppermute(self, x: torch.Tensor, axes: tuple[str, ...], perm: tuple[tuple[int, int], ...]) -> torch.Tensor:
        def per_group(xs: list) -> list:
            out = [torch.zeros_like(t) for t in xs]
            for s, d in perm:
                out[d] = xs[s]
            return out

        return self._collective("ppermute", axes, x, vma_of(x) | set(axes), per_group, (perm,))

    def axis_index(self, axes: tuple[str, ...]) -> torch.Tensor:
        mesh = self.group_mesh
        c = mesh.coords(self.dev)
        rank = 0
        for a in axes:
            k = mesh.axis_index(a)
            rank = rank * mesh.shape[k] + c[k]
        return tag(torch.tensor(rank, device=mesh.device_type), frozenset(axes))


def untraced(name: str) -> None:
    """Break torch.compile's graph where a body runs a thread per device: threads cannot be
    traced (the fake and functional modes are per-thread), so while Dynamo traces, the call
    leaves the graph and runs eagerly."""
    if torch._guards.detect_fake_mode() is not None:
        from torch._dynamo.exc import Unsupported

        raise Unsupported(f"shard_map run a thread per device ({name}): not traced, run eagerly",
                          gb_type="shardfn: shard_map per device")


def run_threads(n: int, body: Callable[[int, _Rendezvous], Any], name: str) -> list[Any]:
    """``body(i, rv)`` for every ``i < n`` concurrently, each in its own thread, meeting
    the others at ``rv`` (its collectives, and once more at the end); the results in order.
    A failure in one thread aborts the others' barrier and is raised here."""
    untraced(name)
    rv = _Rendezvous(n)
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def work(i: int) -> None:
        try:
            results[i] = body(i, rv)
            rv.exchange(i, ("end",), None, lambda xs: [None] * n)
        except BaseException as e:  # noqa: BLE001  re-raised by the caller's thread
            errors[i] = e
            rv.barrier.abort()

    threads = [threading.Thread(target=work, args=(i,), name=f"{name}-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real:
        raise real[0]
    if any(errors):
        raise next(e for e in errors if e is not None)
    return results


class _Recomputing(DeviceBody):
    """A checkpointed region of a per-device body recomputed during backward: each device's
    recomputation runs alone, so there is no other device to meet; axis_index still works."""

    def __init__(self, mesh: Mesh, dev: int) -> None:
        super().__init__(mesh, dev, None)  # type: ignore[arg-type]
        self.leader = False

    def _collective(self, name: str, axes: tuple[str, ...], *args: Any, **kwargs: Any) -> torch.Tensor:
        raise ShardingError(
            f"sf.lax.{name} over {axes!r} in a checkpointed region recomputed during backward: this "
            f"shard_map body runs once per device (uneven shards, or a body torch.vmap cannot batch: "
            f"data-dependent Python control flow, .item(), an autograd.Function without vmap support), "
            f"and the devices' recomputations cannot meet; keep the collective outside the checkpointed "
            f"region, or make the body batchable (torch.where instead of if, setup_context and "
            f"generate_vmap_rule=True on the Function)"
        )


def run(mesh: Mesh, f: Any, per_device_args: list[tuple], kwargs: dict, traced_closures: bool = False) -> list[Any]:
    """Call ``f(*per_device_args[d], **kwargs)`` for every device ``d`` concurrently and
    return the outputs, one per device (``traced_closures``: see :class:`_VmaMode`)."""
    grad = torch.is_grad_enabled()

    def body(dev: int, rv: _Rendezvous) -> Any:
        with torch.set_grad_enabled(grad), mesh, _entered(DeviceBody(mesh, dev, rv)):
            with _VmaMode(traced_closures), _recompute.body_context(lambda: _entered(_Recomputing(mesh, dev))):
                return f(*per_device_args[dev], **kwargs)

    return run_threads(mesh.size, body, "shard_map-device")


# -- the local backend's runner for uneven shards -------------------------------------------


def _device_pieces(v: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """Each device's local tensor of argument ``v`` (differentiable)."""
    if isinstance(v, ShardedArray):
        v = reshard(v, layout)
        return list(B.EnterParts.apply(v, B.summed_grad_layout(layout), True))
    shape = tuple(v.shape)
    return [v[tuple(slice(lo, hi) for lo, hi in device_box(layout, shape, d))] for d in range(layout.mesh.size)]


def _run_per_device(f: Callable, inputs: _Inputs, out_specs: Any, check_vma: bool, kwargs: dict) -> Any:
    from torch.autograd.forward_ad import _current_level
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    if get_proxy_mode() is not None:
        raise ShardingError(
            "shard_map with uneven shards cannot be traced by make_fx (torch.func.linearize, "
            "torch.compile's tracing): its body runs once per device in threads the tracer does not "
            "see; use torch.func.jvp instead of linearize, or make every sharded dim divisible by its "
            "mesh axes"
        )
    if torch._C._are_functorch_transforms_active() or _current_level >= 0:
        return _run_per_device_opaque(f, inputs, out_specs, check_vma, kwargs)
    flat, treespec = _per_device_flat(f, inputs, inputs.leaves, out_specs, check_vma, kwargs)
    return optree.tree_unflatten(treespec, flat)


def _run_per_device_opaque(f: Callable, inputs: _Inputs, out_specs: Any, check_vma: bool, kwargs: dict) -> Any:
    """The per-device run as one autograd Function (``boundary.Opaque``): its threads
    cannot see torch.func's thread-local transform state (nor forward-AD duals), so they
    work on plain tensors inside it; its derivatives and batching rule re-run it."""
    where = [i for i, v in enumerate(inputs.leaves) if isinstance(v, torch.Tensor)]
    result: dict = {}

    def run(*tensors: torch.Tensor) -> list[torch.Tensor]:
        leaves = list(inputs.leaves)
        for i, t in zip(where, tensors):
            leaves[i] = t
        result["flat"], result["spec"] = _per_device_flat(f, inputs, leaves, out_specs, check_vma, kwargs,
                                                          traced_closures=True)
        return [o for o in result["flat"] if isinstance(o, torch.Tensor)]

    outs = iter(B.Opaque.apply(run, *[inputs.leaves[i] for i in where]))
    flat = [next(outs) if isinstance(o, torch.Tensor) else o for o in result["flat"]]
    return optree.tree_unflatten(result["spec"], flat)


def _per_device_flat(f: Callable, inputs: _Inputs, leaves: list, out_specs: Any, check_vma: bool,
                     kwargs: dict, traced_closures: bool = False) -> tuple[list, Any]:
    mesh = inputs.mesh
    columns = []
    for v, l in zip(leaves, inputs.layouts):
        if l is None:
            columns.append([v] * mesh.size)
            continue
        vma = frozenset(l.axis_dim) | frozenset(l.partial_ops)  # a pending value's parts vary too
        columns.append([tag(p, vma) for p in _device_pieces(v, l)])
    per_device = [inputs.rebuild([col[d] for col in columns]) for d in range(mesh.size)]
    outs = run(mesh, f, per_device, kwargs, traced_closures)
    treespec, columns = _match_columns(outs, out_specs, "shard_map out_specs")
    return [assemble_parts(p, column, s, mesh, check_vma, vma_of) for p, column, s in columns], treespec
