"""Moving a ShardedArray between layouts: ``distribute`` (a full tensor onto the mesh), ``reshard``
(another layout, or a view of the mesh: ``Mesh.flatten`` / ``unflatten``), ``gather`` (the full
value), each a differentiable autograd Function over the autograd-free ``raw_*`` moves of backend
values that dispatch shares (a pending reduction runs once per target layout, kept on the array)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.autograd import forward_ad as _forward_ad

from ..backends.registry import backend_for, execute
from ..plans.planner import PLAN_CACHES, plan_layouts
from ..values import replica_checks as _replicas
from ..values.errors import ShardingError
from ..values.graph_calls import surfaces_in_compile
from ..values.layout import Layout, all_boxes
from ..values.mesh import Mesh, current_mesh, to_mesh_device
from ..values.mesh_views import not_a_view, refinement, to_fine
from . import functorch as _ft
from .fresh import end_fresh
from .reduced import base_reduced, keep_reduction, link_of
from ..values.spec import NamedSharding, P, Sharding, check_mesh, to_layout
from . import array as _array  # ``_array._dispatch_fn``: read at call time (dispatch installs it)
from .array import ARRAY_TYPES as _ARRAY_TYPES, ShardedArray, copy_strides, kept_strides, wrap


def _shares_memory(a: Any, sources: Any) -> bool:
    """Whether tensor(s) ``a`` may share storage with tensor(s) ``sources`` (True when unsure:
    tensors without real storage, e.g. under tracing)."""
    try:
        mine = {t.untyped_storage().data_ptr() for t in _tensors(a)}
        theirs = {t.untyped_storage().data_ptr() for t in _tensors(sources)}
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return True
    return bool(mine & theirs)


def _dense(value: torch.Tensor) -> bool:
    """Whether ``value``'s elements are distinct and fill a block (size-1 dims aside): no
    replica shares another's memory (a stride-0 mesh dim of size > 1)."""
    dims = sorted((st, n) for n, st in zip(value.shape, value.stride()) if n != 1)
    want = 1
    for st, n in dims:
        if st != want:
            return value.numel() == 0
        want *= n
    return True


def _copy_strided(value: torch.Tensor) -> torch.Tensor:
    """A dense copy of ``value`` (not a view: a compiled function guards a view's base), in its
    memory order, whose size-1 dims are strided as an elementwise op's output would be (the
    largest extent of the dims inside them), not 0 (a replica's cut of an expanded copy). A
    compiled function guards on its inputs' strides: a parameter distributed with a 0 there and
    updated by ``p - lr * g`` afterwards recompiled on its second step."""
    shape, strides = value.shape, value.stride()
    new = [s if n != 1 or s != 0 else
           max((strides[j] * shape[j] for j in range(k + 1, len(shape)) if shape[j] > 1), default=1)
           for k, (n, s) in enumerate(zip(shape, strides))]
    if new == list(strides):
        return value.clone()  # (a dense value's clone keeps its strides)
    return torch.empty_strided(shape, new, dtype=value.dtype, device=value.device).copy_(value)


def _tensors(v: Any) -> list:
    if isinstance(v, torch.Tensor):
        return [v]
    return [t for x in v for t in _tensors(x)]


# filled by the transforms layer when imported (arrays never import it)
_reshard_tree: Callable | None = None  # ``shardfn.transforms.coalesce.reshard_tree``: pytree reshard


def _mesh_of(x: Any, mesh: Mesh | None) -> Mesh | None:
    if mesh is not None:
        check_mesh(mesh, "mesh=")
    if isinstance(x, ShardedArray):
        if mesh is not None and mesh != x.mesh:
            raise ShardingError(f"mesh={mesh!r} differs from the array's mesh {x.mesh!r}")
        return x.mesh
    return mesh if mesh is not None else current_mesh()


# -- public functions -------------------------------------------------------------------


@surfaces_in_compile
def distribute(tensor: torch.Tensor, sharding: Sharding, *, mesh: Mesh | None = None) -> ShardedArray:
    """Lay out a full tensor over the mesh (each device keeps only its shard).

    A Partial sharding puts the value on the first device of each reduction group (sum)
    or on all of them (avg/max/min). On dist every rank must pass the same tensor.
    """
    if isinstance(tensor, ShardedArray) or _ft.base_array(tensor) is not None:
        if mesh is not None and getattr(sharding, "mesh", None) is None:
            # a bare spec takes ``mesh=`` first (the array's own mesh only without one)
            sharding = to_layout(sharding, tensor.dim(), mesh)
        return reshard(tensor, sharding)
    if not isinstance(tensor, torch.Tensor):
        raise ShardingError(f"distribute takes a torch.Tensor, got {type(tensor).__name__}")
    layout = to_layout(sharding, tensor.dim(), _mesh_of(tensor, mesh))
    tensor = to_mesh_device(tensor, layout.mesh)  # the mesh owns the device
    backend = backend_for(layout.mesh)
    backend.check_same_meta(layout.mesh, tuple(tensor.shape), tensor.dtype, "distribute")
    if _replicas.checking():
        backend.check_replicas(layout.mesh, tensor, layout.mesh.axis_names, "sf.distribute: the tensor argument")
    return _Distribute.forward(tensor, layout) if _untracked(tensor) else _Distribute.apply(tensor, layout)


device_put = distribute


@surfaces_in_compile
def reshard(x: ShardedArray, sharding: Sharding) -> ShardedArray:
    """The same global value in a new layout, moved with the cheapest plan; the gradient
    is resharded back. ``x`` may be a pytree of arrays (``sharding`` a matching tree or a
    prefix): leaves sharing plan steps then move together (``coalesce.py``)."""
    if not isinstance(x, torch.Tensor):
        if _reshard_tree is None:
            raise ShardingError(f"reshard takes a ShardedArray, got {type(x).__name__}")
        return _reshard_tree(x, sharding)
    base = x if isinstance(x, ShardedArray) else _ft.base_array(x)
    if base is not None:
        end_fresh(base)  # its value is read (``fresh.py``): the result may be the array itself
    if base is None:
        if isinstance(x, torch.Tensor):
            return distribute(x, sharding)
        raise ShardingError(f"reshard takes a ShardedArray, got {type(x).__name__}")
    mesh = base._layout.mesh
    target = getattr(sharding, "mesh", None)
    if target is not None and target is not mesh and target != mesh and isinstance(x, ShardedArray):
        return reshard_across(x, to_layout(sharding, x.ndim, target))
    dst = _to_layout(sharding, x.ndim, mesh)
    if dst == (x._layout if base is x else _ft.layout_of(x)):
        return x
    return _Reshard.forward(x, dst) if base is x and _untracked(x) else _Reshard.apply(x, dst)


@surfaces_in_compile
def gather(x: ShardedArray) -> torch.Tensor:
    """The global value as a plain tensor (= ``x.full_tensor()``)."""
    if not isinstance(x, ShardedArray) and _ft.base_array(x) is None:
        raise ShardingError(f"gather takes a ShardedArray, got {type(x).__name__}")
    return _FullTensor.forward(x) if isinstance(x, ShardedArray) and _untracked(x) else _FullTensor.apply(x)


def _untracked(x: torch.Tensor) -> bool:
    """Whether a move of ``x`` has nothing to record: no gradient (``x`` needs none, or grad
    mode is off), no torch.func transform or forward-AD level, no dispatch mode (fake tensors,
    tracing) looking on. Such a move runs its Function's ``forward`` alone: the Function's
    ``apply`` (context, output bookkeeping) costs several times the move of a small array,
    every step (``sf.reshard(grad, sharding)`` before an optimizer update, a batch's
    ``distribute``)."""
    return (not (x.requires_grad and torch.is_grad_enabled()) and not torch._C._are_functorch_transforms_active()
            and _forward_ad._current_level < 0 and not torch._C._len_torch_dispatch_stack())


# -- raw (autograd-free) helpers shared with dispatch --------------------------------------


def raw_reshard(x: ShardedArray, dst: Layout) -> Any:
    """The backend value of ``x`` laid out as ``dst`` (no autograd). A pending reduction
    is run once per target layout however many ops read ``x`` or views of it: the array
    is immutable, so the result is kept on it (checked against the shards it was made
    from, which the autograd engine's ``.grad`` accumulation may rebind), and a view of a
    pending value (``note_derived``) is reduced by reducing its base once and viewing the
    result."""
    if dst is x._layout or dst == x._layout:
        return x._local
    if not x._layout.partial:
        return _execute_reshard(x, dst)
    cache = x.__dict__.setdefault("_reduced", {})
    hit = cache.get(dst)
    if hit is not None and hit[0] is x._local and hit[1] == x._layout:
        return hit[2]
    value = _via_base(x, dst)
    if value is None:
        value = _from_reduced(x, dst, cache)
    if value is None:
        value = _execute_reshard(x, dst)
    cache[dst] = (x._local, x._layout, value)
    x._kf = None  # its dispatch key fragment names the reduced forms it has (dispatch._fragment)
    if "_same" in x.__dict__:
        keep_reduction(x, dst, value)
    return value


def _from_reduced(x: ShardedArray, dst: Layout, cache: dict) -> Any:
    """``x`` as ``dst`` moved from a reduction of ``x`` already at hand, where that moves less
    than reducing ``x`` again (None otherwise): a pending value reduced to a replicated layout
    by one op and read split by another (a forward's ``softplus`` of a row-parallel output
    reads it whole, its backward split like the heads' gradient) is sliced locally, as
    dispatch's costs assume (``entries._cost``: a reduction at hand is a free source), rather
    than reduce-scattered again."""
    at_hand = [(form, value) for form, (local, layout, value) in list(cache.items())
               if local is x._local and layout == x._layout and not form.partial]
    if not at_hand:  # (no reduction at hand: the usual case, nothing to plan)
        return None
    shape = tuple(x.shape)
    try:
        hash(shape)
    except TypeError:  # symbolic sizes: the direct move
        return None
    direct = _plan(x._layout, dst, shape, x.dtype)
    best, best_cost = None, (direct.collectives, direct.bytes_per_device)
    for form, value in at_hand:
        plan = _plan(form, dst, shape, x.dtype)
        if (plan.collectives, plan.bytes_per_device) < best_cost:
            best, best_cost = (plan, value), (plan.collectives, plan.bytes_per_device)
    return None if best is None else execute(best[0], best[1], shape)


def note_derived(func: Any, base: ShardedArray, rest: tuple, kwargs: dict, out: Any) -> None:
    """Link each pending output of a view op to its pending base, so one reduction serves
    both (``raw_reshard``): only where the view has at least the base's elements (reducing
    the base then costs no more than reducing the view). ``out``: the op's output, an array
    or a sequence of them (``chunk``/``split``, even of one)."""
    many = isinstance(out, (tuple, list))
    for i, o in enumerate(out if many else (out,)):
        if (isinstance(o, ShardedArray) and o is not base and o._layout.partial == base._layout.partial
                and o.numel() >= base.numel()):
            o._derived = (base, func, rest, kwargs, i if many else None, o._local)
            o._kf = None  # the fragment depends on whether the base has been reduced


def _via_base(x: ShardedArray, dst: Layout) -> Any:
    """``x`` as ``dst`` by reducing the base ``x`` is a view of and viewing the result,
    when ``dst`` only resolves ``x``'s pending reductions (or the base's reduction is
    already at hand); None otherwise."""
    link = link_of(x)
    if link is None or (dst.dims != x._layout.dims and not base_reduced(x)) or dst.partial:
        return None
    base, func, rest, kwargs, i, _ = link
    plain = base._layout.without_partial()
    reduced = wrap(raw_reshard(base, plain), plain, base.shape, base.dtype)
    out = _array._dispatch_fn(func, (reduced, *rest), kwargs)
    if i is not None:
        out = out[i]
    if out._layout == dst:
        return out._local
    return raw_reshard(out, dst)


def _execute_reshard(x: ShardedArray, dst: Layout) -> Any:
    shape = tuple(x.shape)
    try:
        plan = _plan(x._layout, dst, shape, x.dtype)
    except TypeError:  # symbolic sizes (SymInts do not hash): planned on their hints
        plan = plan_layouts(x._layout, dst, _ft.hint_shape(shape), x.dtype)
    return execute(plan, x._local, shape)


# Identity-keyed fronts of ``to_layout`` and ``plan_layouts`` for the moves a training step
# repeats (its gradients resharded to their parameters' shardings: the same sharding, layout
# and shape objects every step): a dict lookup by ids instead of hashing and comparing layouts
# and specs (Python-level ``__hash__``/``__eq__`` calls). Each entry keeps its key objects
# alive (their ids stay unique) and is checked by identity.
_DST: dict[tuple, tuple] = {}  # (id(sharding), ndim, id(mesh)) -> (sharding, mesh, layout)
_PLANS: dict[tuple, tuple] = {}  # (id(src), id(dst), shape, dtype) -> (src, dst, plan)
_FRONT_MAX = 4096
PLAN_CACHES.append(_PLANS.clear)  # plans follow the cost model (``set_cost_model``)


def _to_layout(sharding: Sharding, ndim: int, mesh: Mesh) -> Layout:
    """``to_layout(sharding, ndim, mesh)``, remembered for immutable shardings."""
    key = (id(sharding), ndim, id(mesh))
    hit = _DST.get(key)
    if hit is not None and hit[0] is sharding and hit[1] is mesh:
        return hit[2]
    dst = to_layout(sharding, ndim, mesh)
    if type(sharding) in (NamedSharding, P, Layout):
        if len(_DST) >= _FRONT_MAX:
            _DST.clear()
        _DST[key] = (sharding, mesh, dst)
    return dst


def _plan(src: Layout, dst: Layout, shape: tuple, dtype: torch.dtype) -> Any:
    """``plan_layouts(src, dst, shape, dtype)`` through the identity-keyed front."""
    key = (id(src), id(dst), shape, dtype)
    hit = _PLANS.get(key)
    if hit is not None and hit[0] is src and hit[1] is dst:
        return hit[2]
    plan = plan_layouts(src, dst, shape, dtype)
    if len(_PLANS) >= _FRONT_MAX:
        _PLANS.clear()
    _PLANS[key] = (src, dst, plan)
    return plan


def raw_full(x: ShardedArray) -> torch.Tensor:
    end_fresh(x)  # its value is read (``fresh.py``)
    value = raw_reshard(x, Layout(x.mesh, ((),) * x.ndim))
    return backend_for(x.mesh).one_replica(value, x.mesh)


def raw_distribute(t: torch.Tensor, layout: Layout) -> Any:
    backend = backend_for(layout.mesh)
    rep = backend.replicated(t, layout.mesh)
    full = Layout(layout.mesh, ((),) * t.dim())
    return execute(plan_layouts(full, layout, _ft.hint_shape(t.shape), t.dtype), rep, tuple(t.shape))


# -- autograd functions -------------------------------------------------------------------


class _Function(torch.autograd.Function):
    """An autograd Function whose ``apply`` skips torch's per-call ``inspect.signature``
    binding of default arguments (tens of microseconds; these forwards have no defaults
    and are always called with every argument), except under torch.func transforms,
    which take torch's own path."""

    @classmethod
    def apply(cls, *args: Any) -> Any:
        if torch._C._are_functorch_transforms_active():
            return super().apply(*args)
        return super(torch.autograd.Function, cls).apply(*_unwrap_dead(args))


_unwrap_dead = torch._functorch.utils.unwrap_dead_wrappers


def _vmap_into_layout(fn: type, in_dims: tuple, x: Any, layout: Layout) -> tuple:
    """The vmap rule of ``fn(x, layout)`` (a move into ``layout``): the batch dim of ``x``
    becomes an unsharded dim of the layout."""
    b = in_dims[0]
    return fn.apply(x, layout if b is None else _ft.insert_dim(layout, b)), b


def moved(x: ShardedArray, dst: Layout) -> ShardedArray:
    """``x``'s value laid out as ``dst``, keeping what a move does not change: its strides and
    its lazy conj/neg flags (shards hold true values; the flags decide what torch rejects:
    ``view_as_real`` of a resharded ``x.conj()`` raises as torch's does)."""
    out = wrap(raw_reshard(x, dst), dst, x.shape, x.dtype, stride=kept_strides(x))
    if x.is_conj():
        torch._C._set_conj(out, True)
    if x.is_neg():
        torch._C._set_neg(out, True)
    return out


class _Reshard(_Function):
    @staticmethod
    def forward(x: ShardedArray, dst: Layout) -> ShardedArray:
        return moved(x, dst)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        x = inputs[0]
        ctx.src, ctx.dst = x._layout if type(x) in _ARRAY_TYPES else _ft.layout_of(x), inputs[1]

    @staticmethod
    def jvp(ctx: Any, t: Any, _: Any) -> Any:
        return reshard(_as_sharded(t, ctx.dst), ctx.dst)

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        return reshard(_as_sharded(g, ctx.src), ctx.src.without_partial()), None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: Any, dst: Layout) -> tuple:
        return _vmap_into_layout(_Reshard, in_dims, x, dst)


class _Distribute(_Function):
    @staticmethod
    def forward(t: torch.Tensor, layout: Layout) -> ShardedArray:
        # like jax.device_put, a copy: where the plan only sliced or expanded ``t``, the
        # shards are redone from one copy of ``t`` (replicas share that copy); a stacked value
        # that is one contiguous block of ``t`` (a batch split over 'dp') is copied as it is:
        # the same elements and strides, without running the plan twice
        value = raw_distribute(t.detach(), layout)
        if _shares_memory(value, t):
            if isinstance(value, torch.Tensor) and "_squeezed" not in value.__dict__ and _dense(value):
                value = _copy_strided(value)  # (a replicated value keeps its squeezed view: ``local_values.replicated``)
            else:
                value = raw_distribute(t.detach().clone(), layout)
        return wrap(value, layout, t.shape, t.dtype, stride=copy_strides(t))  # (torch's strides for a copy of t)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.layout = inputs[1]

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        return (_FullTensor.apply(g) if _ft.base_array(g) is not None else g), None

    @staticmethod
    def jvp(ctx: Any, t: Any, _: Any) -> Any:
        return distribute(t, ctx.layout)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, t: Any, layout: Layout) -> tuple:
        return _vmap_into_layout(_Distribute, in_dims, t, layout)


class _FullTensor(_Function):
    @staticmethod
    def forward(x: ShardedArray) -> torch.Tensor:
        # a gather allocates; a replicated array's replica, and a pending value's reduction
        # (kept on the array for later reads), are copied: the result is the caller's to write
        full = raw_full(x)
        if x._layout.partial or _shares_memory(full, x._local):
            return full.clone(memory_format=torch.contiguous_format)
        return full.contiguous()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.layout = _ft.layout_of(inputs[0])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        rep = Layout(ctx.layout.mesh, ((),) * g.dim())
        return reshard(_Distribute.apply(g, rep), ctx.layout.without_partial())

    @staticmethod
    def jvp(ctx: Any, t: Any) -> Any:
        return _FullTensor.apply(t) if _ft.base_array(t) is not None else t

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: Any) -> tuple:
        return _FullTensor.apply(x), in_dims[0]


def into_layout(x: torch.Tensor, layout: Layout) -> ShardedArray:
    """``x`` laid out as ``layout`` (differentiable): a ShardedArray resharded, a plain tensor distributed."""
    return reshard(x, layout) if isinstance(x, ShardedArray) else distribute(x, layout)

def _as_sharded(g: Any, layout: Layout) -> ShardedArray:
    if isinstance(g, ShardedArray) or _ft.base_array(g) is not None:
        return g
    return distribute(g, Layout(layout.mesh, ((),) * g.dim()))


def _sharding_mesh(sharding: Any) -> Mesh | None:
    return getattr(sharding, "mesh", None)


# -- across mesh views (``Mesh.flatten`` / ``unflatten``) ------------------------------------------


def relabel(value: Any, src: Mesh, dst: Mesh) -> Any:
    """The backend value of a layout on ``src`` as the same shards on ``dst``."""
    return backend_for(src).relabel(value, src, dst)


def reshard_across(x: Any, dst: Layout) -> Any:
    """``x`` laid out as ``dst`` on a view of its mesh (differentiable)."""
    return _Across.apply(x, dst)


def _move(x: Any, dst: Layout) -> Any:
    src_mesh = x._layout.mesh
    if backend_for(src_mesh) is not backend_for(dst.mesh):
        raise not_a_view(src_mesh, dst.mesh)
    if src_mesh.device_type == "meta" != dst.mesh.device_type:
        raise ShardingError(
            f"an array of shape {tuple(x.shape)} on a meta mesh holds no values, so it cannot move onto "
            f"{dst.mesh!r} (device_type {dst.mesh.device_type!r}); distribute a tensor with values there")
    fine, own_src, own_dst = refinement(src_mesh, dst.mesh)
    shape = tuple(x.shape)
    src, src_f = _said_alike(x._layout, fine, own_src, shape)
    local = raw_reshard(x, src)  # (x's own value unless a dim's split is one the fine mesh cannot say)
    dst_c, dst_f = _said_alike(dst, fine, own_dst, shape)
    value = relabel(local, src_mesh, fine)
    on_fine = ShardedArray(value, src_f, shape, x.dtype)
    value = raw_reshard(on_fine, dst_f)
    out = wrap(relabel(value, fine, dst.mesh), dst_c, shape, x.dtype)
    if dst_c != dst:
        out = wrap(raw_reshard(out, dst), dst, shape, x.dtype)
    if dst.mesh.device_type != src_mesh.device_type:  # the mesh owns the device: the shards move there
        out = wrap(_onto_device(out._local, dst.mesh), dst, shape, x.dtype)
    stride = kept_strides(x)
    return out if stride is None else wrap(out._local, out._layout, shape, x.dtype, stride=stride)


def _onto_device(value: Any, mesh: Mesh) -> Any:
    """A backend value (a tensor, or a tuple of per-device ones) on ``mesh``'s device type."""
    if isinstance(value, tuple):
        return tuple(_onto_device(v, mesh) for v in value)
    return to_mesh_device(value, mesh)


def _said_alike(layout: Layout, fine: Mesh, owner: dict, shape: tuple) -> tuple[Layout, Layout]:
    """``layout``, with the dims whose pieces the fine mesh would cut otherwise replicated
    (an uneven split over a coarse axis is not the nested split over its fine axes: 6 over 4
    is 2, 2, 2, 0, over 2 then 2 it is 2, 1, 2, 1), and that layout said on the fine mesh."""
    f = to_fine(layout, fine, owner)
    shape = _ft.hint_shape(shape)  # (symbolic sizes under compile: their hints)
    a, b = all_boxes(layout, shape), all_boxes(f, shape)
    bad = {i for i in range(len(shape)) if any(p[i] != q[i] for p, q in zip(a, b))}
    if not bad:
        return layout, f
    kept = Layout(layout.mesh, tuple(() if i in bad else axes for i, axes in enumerate(layout.dims)), layout.partial)
    return kept, to_fine(kept, fine, owner)


class _Across(torch.autograd.Function):
    @staticmethod
    def forward(x: Any, dst: Layout) -> Any:
        return _move(x, dst)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.src, ctx.dst = inputs[0]._layout, inputs[1]

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        if not isinstance(g, ShardedArray):
            return None, None
        return reshard_across(g, ctx.src.without_partial() if ctx.src.partial else ctx.src), None

    @staticmethod
    def jvp(ctx: Any, t: Any, _: Any) -> Any:
        return _move(reshard(t, ctx.src), ctx.dst)
