"""ShardedArray: an immutable torch.Tensor wrapper holding the shards of a global value."""

from __future__ import annotations

import copy
import functools
import math
import threading
from typing import Any, Callable, Sequence

import optree
import torch

from ..backends import custom_ops as _contract
from ..backends.registry import backend_for, execute
from ..plans.planner import plan_layouts
from ..values import layout as _lay
from ..values import replica_checks as _replicas
from ..values.errors import ImmutableError, ShardingError
from ..values.layout import Layout
from ..values.mesh import Mesh, current_mesh, to_mesh_device
from ..values.sharded import Sharded
from . import checkpointable as _checkpointable
from . import functorch as _ft
from .fragments import _fragment
from .reduced import base_reduced, link_of
from ..values.spec import NamedSharding, P, Placement, Sharding, check_mesh, layout_placements, layout_to_spec, to_layout


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc = acc * torch.sym_max(n, 1)
    return tuple(reversed(strides))


_no_torch_function = torch._C._disabled_torch_function_impl
_tf_call = threading.local()
"""``args``: the id of the ``self`` of the Tensor-method ``__torch_function__`` call running on this thread."""


def _writing_methods() -> frozenset:
    """The in-place ``torch.Tensor`` methods (``x.add_``, ``x += y``, ``x[i] = v``)."""
    out = set()
    for name in dir(torch.Tensor):
        if name == "__setitem__" or name.startswith("__i") or (name.endswith("_") and not name.startswith("__")):
            f = getattr(torch.Tensor, name, None)
            if callable(f):
                out.add(f)
    return frozenset(out)


_WRITING_METHODS = _writing_methods()
_TF_SPECIAL = _WRITING_METHODS | _contract.FUNCS


def _special_torch_function(func: Any, types: Any, args: tuple, kwargs: dict | None) -> Any:
    """Batched matmul / einsum / rms_norm run as one op (``backends/custom_ops.py``: torch's composite
    would fold the batch dims into one); an in-place method's ``self`` is packed into a
    new argument tuple here, one reference more than torch's C++ path makes, which the
    in-place policy discounts (``_inplace._observed``; an id, which holds no reference)."""
    if func in _contract.FUNCS:
        out = _contract.batched_call(func, args, kwargs)
        if out is not NotImplemented:
            return out
        return _no_torch_function(func, types, args, kwargs or {})
    prev = getattr(_tf_call, "args", None)
    _tf_call.args = id(args[0]) if args else None
    try:
        return _no_torch_function(func, types, args, kwargs or {})
    finally:
        _tf_call.args = prev


class ShardedArray(torch.Tensor):
    """A global tensor laid out over a mesh. Its ``shape``/``dtype`` are global; the
    shards live in ``_local`` (the mesh backend's storage). Immutable: in-place ops raise
    :class:`~shardfn.ImmutableError` (the policy: ``shardfn/arrays/inplace.py``), and no tensor
    handed in (``distribute``, ``from_local``) or out (``full_tensor``, ``to_local``,
    ``local_shards``) shares memory with the shards."""

    _local: Any
    _layout: Layout
    _kf: Any = None  # interned (layout, shape, dtype) for dispatch's fast key (dispatch.fragment_of)

    # No torch-function hook: a torch call goes straight to ``__torch_dispatch__`` (a hook
    # costs ~1.2 us on every op). Arrays with batch dims are ``_BatchedArray``s, which have one.
    __torch_function__ = _no_torch_function

    @staticmethod
    def __new__(cls, local: Any, layout: Layout, shape: Sequence[int], dtype: torch.dtype,
                *, requires_grad: bool = False, stride: Sequence[int] | None = None) -> ShardedArray:
        if cls is ShardedArray and len(shape) >= _BATCHED_NDIM:
            cls = _BatchedArray
        if layout.partial:
            check_partial_dtype(layout, dtype)
        like = local[0] if isinstance(local, tuple) else local
        r = torch.Tensor._make_wrapper_subclass(  # strides None: contiguous (computed in C++)
            cls, shape, strides=stride, dtype=dtype, device=like.device, requires_grad=requires_grad,
        )
        r._local = local
        r._layout = layout
        return r

    # -- metadata ------------------------------------------------------------------------
    @property
    def mesh(self) -> Mesh:
        return self._layout.mesh

    @property
    def sharding(self) -> NamedSharding:
        return _named(self._layout)

    @property
    def spec(self) -> P:
        return layout_to_spec(self._layout)

    @property
    def placements(self) -> tuple[Placement, ...]:
        return layout_placements(self._layout)

    def __format__(self, spec: str) -> str:
        """A 0-d array formats as its value, as a 0-d tensor does (``f"{loss:.4f}"``);
        torch's own ``__format__`` does that for plain tensors only."""
        if self.dim() == 0 and spec:
            return self.item().__format__(spec)
        return super().__format__(spec)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        """The values as a tensor prints them, with the sharding, where this process holds
        every shard (the simulated mesh); else this rank's shard and the layout. Never
        communicates (``show.py``)."""
        from .show import show

        return show(self)

    # -- shards ----------------------------------------------------------------------------
    def local_shards(self) -> list[torch.Tensor]:
        """Copies of the shards this process holds, one per device (row-major); no autograd.
        Costs one copy of each shard (writing to one cannot change the array)."""
        return [p.clone() for p in backend_for(self.mesh).shard_list(self._local, self.mesh)]

    def to_local(self, grad_sharding: Sharding | None = None) -> Any:
        """The local shards, differentiable: a list (one per device) on the local backend,
        this rank's tensor on dist. The gradient flowing back is read with
        ``grad_sharding`` (default: this layout, with pending reductions as replicated)."""
        grad_layout = (
            self._layout.without_partial() if grad_sharding is None
            else to_layout(grad_sharding, self.ndim, self.mesh, arg="grad_sharding")
        )
        out = _ToLocal.apply(self, grad_layout)
        return backend_for(self.mesh).pack_local(out, self.mesh)

    def full_tensor(self) -> torch.Tensor:
        """The global value as a plain tensor, ready to use (differentiable)."""
        return _FullTensor.apply(self)

    def redistribute(self, sharding: Sharding) -> ShardedArray:
        """Same value, new layout (see :func:`shardfn.reshard`)."""
        return reshard(self, sharding)

    def to_dtensor(self) -> Any:
        """This value as a torch DTensor holding a copy of this rank's shard (dist backend only;
        a DTensor may be mutated, this array may not)."""
        if _to_dtensor is None:
            raise ShardingError("to_dtensor needs shardfn.interop (import shardfn)")
        return _to_dtensor(self)

    @classmethod
    def from_local(cls, local: Any, sharding: Sharding, *, mesh: Mesh | None = None,
                   shape: Sequence[int] | None = None, stride: Sequence[int] | None = None,
                   run_check: bool = True) -> ShardedArray:
        """Build a ShardedArray from shards: a list, one per device (local backend), or
        this rank's tensor (dist). Shard shapes are always checked against the layout.
        With ``run_check`` (the default), on the local backend shards replicated over an
        axis must be equal (a ShardingError names the devices that differ), and on dist
        every rank's global shape and dtype are checked against the others' (one small
        all_gather; values are trusted, as in JAX/DTensor). ``run_check=False`` skips
        both, for hot loops whose inputs are known to agree (DTensor's spelling)."""
        return _from_local(local, sharding, mesh, shape, stride, run_check=run_check)

    # -- torch integration ---------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return _dispatch_fn(func, args, kwargs or _NO_KWARGS)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        if isinstance(self._local, tuple):
            return [f"_part_{i}" for i in range(len(self._local))], (self._layout, True)
        return ["_local"], (self._layout, False)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_part_"):
            return self._local[int(name[6:])]
        raise AttributeError(name)

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx: Any, outer_size: Any, outer_stride: Any) -> ShardedArray:
        layout, is_parts = ctx
        local = tuple(inner[f"_part_{i}"] for i in range(len(inner))) if is_parts else inner["_local"]
        like = local[0] if is_parts else local
        # Symbolic sizes (torch.compile dynamic dims) stay symbolic: sharding propagation
        # plans from their hints (see dispatch.py); only even, stacked layouts support them.
        outer_size = tuple(outer_size)
        outer_stride = None if outer_stride is None else tuple(outer_stride)
        if not backend_for(layout.mesh).keeps_symbolic(local):
            # e.g. uneven shards, the dist backend: plans on concrete shapes, so specialise
            outer_size = tuple(_ft.static_int(n) for n in outer_size)
            outer_stride = None if outer_stride is None else tuple(_ft.static_int(n) for n in outer_stride)
        elif _ft.is_symbolic(outer_size):
            _check_symbolic_even(layout, outer_size, like)
        return ShardedArray(local, layout, outer_size, like.dtype, stride=outer_stride)

    # torch._dynamo.mark_dynamic(x, d) mirrors itself onto inner tensors of x's rank only;
    # a stacked value has the mesh dims in front, so mirror dim d to mesh.ndim + d here.
    @property
    def _has_dynamo_dim_marking(self) -> bool:
        try:
            return self.__dict__["_has_dynamo_dim_marking"]
        except KeyError:
            raise AttributeError("_has_dynamo_dim_marking") from None

    @_has_dynamo_dim_marking.setter
    def _has_dynamo_dim_marking(self, value: bool) -> None:
        # stored in __dict__ like a plain attribute: Dynamo's guards look for it there
        self.__dict__["_has_dynamo_dim_marking"] = value
        local = self.__dict__.get("_local")
        if not value or not isinstance(local, torch.Tensor) or local.dim() == self.dim():
            return
        from torch._dynamo import mark_dynamic

        m = self._layout.mesh.ndim
        for d in sorted(getattr(self, "_dynamo_dynamic_indices", ())):
            if d + m not in getattr(local, "_dynamo_dynamic_indices", ()):
                mark_dynamic(local, d + m)

    @_has_dynamo_dim_marking.deleter
    def _has_dynamo_dim_marking(self) -> None:
        self.__dict__.pop("_has_dynamo_dim_marking", None)

    # torch.compile: a compiled backward guesses its tangents' layouts from the forward
    # outputs (pending reductions read as replicated); real tangents are resharded to it.
    def __coerce_tangent_metadata__(self) -> ShardedArray:
        return reshard(self, self._layout.without_partial()) if self._layout.partial else self

    def __coerce_same_metadata_as_tangent__(self, flatten_spec: Any, expected_type: Any = None) -> Any:
        if expected_type is not None:
            return None
        return reshard(self, flatten_spec[0])

    def _stable_hash_for_caching(self) -> str:
        """A process-independent key for AOTAutograd's cache (metadata only, see checkpointable.stable_hash)."""
        return _checkpointable.stable_hash(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickling (``torch.save``, multiprocessing) keeps mesh, sharding and values where
        this process holds every shard (local backend); a TypeError naming
        ``sf.checkpoint.save`` elsewhere."""
        return _checkpointable.reduce_array(self)

    def __reduce__(self) -> Any:
        return self.__reduce_ex__(2)

    # DCP's checkpointable-tensor protocol (as DTensor's): dcp.save / dcp.load of state dicts
    def __create_write_items__(self, fqn: str, object: Any) -> list:
        return _checkpointable.create_write_items(self, fqn)

    def __create_chunk_list__(self) -> list:
        return _checkpointable.create_chunk_list(self)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return _checkpointable.get_tensor_shard(self, index)

    def __copy__(self) -> ShardedArray:
        """``copy.copy``: a new array with the same value and layout (as ``copy.deepcopy``)."""
        return copy.deepcopy(self)

    # -- Tensor methods that bypass __torch_dispatch__ and would touch the (absent) data ----
    def share_memory_(self) -> ShardedArray:
        raise ImmutableError(
            "share_memory_ would move a ShardedArray's storage in place, but ShardedArrays are "
            "immutable and hold no single storage; share the shards: [s.share_memory_() for s in x.local_shards()]"
        )

    def apply_(self, callable: Any) -> ShardedArray:
        raise ImmutableError(
            "apply_ would modify a ShardedArray in place, but ShardedArrays are immutable; "
            "use an out-of-place op, or sf.local_map over the shards, and rebind the result"
        )

    def map_(self, tensor: Any, callable: Any) -> ShardedArray:
        raise ImmutableError(
            "map_ would modify a ShardedArray in place, but ShardedArrays are immutable; "
            "use an out-of-place op such as torch.where and rebind the result"
        )

    def map2_(self, x: Any, y: Any, callable: Any) -> ShardedArray:
        raise ImmutableError(
            "map2_ would modify a ShardedArray in place, but ShardedArrays are immutable; "
            "use an out-of-place op and rebind the result"
        )

    # untyped_storage() stays torch's (a RuntimeError: no data): torch.compile asks for it.
    # data_ptr() stays torch's 0 (the null pointer: no single buffer): torch's __deepcopy__,
    # pickling, autograd graph hooks and Dynamo recognise a wrapper subclass by it
    def storage(self) -> Any:
        raise TypeError(
            "a ShardedArray has no single storage (its shards live on the mesh's devices); "
            "use x.local_shards() or x.full_tensor()"
        )

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        raise ImmutableError(  # a capsule would alias (absent) storage: never handed out
            "a ShardedArray cannot be exported with __dlpack__; export x.full_tensor() or its local_shards()")

    def pin_memory(self, *args: Any, **kwargs: Any) -> ShardedArray:
        raise TypeError("pin_memory is not supported on a ShardedArray; pin its local_shards() instead")

    def numpy(self, *, force: bool = False) -> Any:
        """The global value as a numpy array (gathered, like ``x.full_tensor().numpy()``)."""
        return self.full_tensor().numpy(force=force)

    def tolist(self) -> Any:
        """The global value as nested Python lists (gathered)."""
        return self.full_tensor().tolist()

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        out = self.full_tensor().detach().numpy()
        return out if dtype is None else out.astype(dtype)

    # .grad is an attribute: an array read through it is observable (so ``p.grad.zero_()``
    # raises like any held array's in-place op), and ``p.grad = g`` stores a new wrapper
    # over g's (immutable) shards, so the engine's in-place accumulation never changes g.
    @property
    def grad(self) -> Any:
        g = _GRAD.__get__(self)
        if type(g) in ARRAY_TYPES:
            g._aliases_observable = True
        return g

    @grad.setter
    def grad(self, value: Any) -> None:
        if type(value) in ARRAY_TYPES and not value.requires_grad:
            value = _alias(value)
        _GRAD.__set__(self, value)

    @grad.deleter
    def grad(self) -> None:
        _GRAD.__delete__(self)

    @property
    def data(self) -> ShardedArray:
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value: Any) -> None:
        # issue 13: replacing the value of an array others may hold is a mutation
        raise ImmutableError(
            f"x.data = {type(value).__name__}: would replace a ShardedArray's value in place, but "
            f"ShardedArrays are immutable; rebind the name to a new array (x = sf.distribute(t, x.sharding))"
        )


_GRAD = torch._C.TensorBase.grad


def _alias(x: ShardedArray) -> ShardedArray:
    """A new wrapper over ``x``'s shards (no copy: shards are never written in place)."""
    return ShardedArray(x._local, x._layout, tuple(x.shape), x.dtype, stride=x.stride())


def check_partial_dtype(layout: Layout, dtype: torch.dtype) -> None:
    """Pending reductions the dtype supports: max/min need an order (no complex), avg
    follows ``torch.mean`` (floating or complex dtypes only, so no mesh-shape-dependent
    integer rounding)."""
    for axis, op in layout.partial:
        if op in ("max", "min") and dtype.is_complex:
            raise ShardingError(
                f"{layout.spec_str()}: Partial({op!r}) over mesh axis {axis!r} on a {dtype} value: "
                f"complex numbers have no order; use Partial('sum') or Partial('avg'), or a real dtype"
            )
        if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
            raise ShardingError(
                f"{layout.spec_str()}: Partial('avg') over mesh axis {axis!r} on a {dtype} value: "
                f"like torch.mean, an average needs a floating or complex dtype; convert the parts "
                f"(e.g. .float()) or use Partial('sum') and divide"
            )


def _shares_memory(a: Any, sources: Any) -> bool:
    """Whether tensor(s) ``a`` may share storage with tensor(s) ``sources`` (True when unsure:
    tensors without real storage, e.g. under tracing)."""
    try:
        mine = {t.untyped_storage().data_ptr() for t in _tensors(a)}
        theirs = {t.untyped_storage().data_ptr() for t in _tensors(sources)}
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return True
    return bool(mine & theirs)


def _tensors(v: Any) -> list:
    if isinstance(v, torch.Tensor):
        return [v]
    return [t for x in v for t in _tensors(x)]


def _check_symbolic_even(layout: Layout, shape: tuple, local: torch.Tensor) -> None:
    """Tie a symbolic global size to the stacked shard size (``n == k * local``): a guard
    on the relation, never a specialisation to a constant."""
    mesh = layout.mesh
    for d, (n, axes) in enumerate(zip(shape, layout.dims)):
        if isinstance(n, torch.SymInt):
            k = math.prod(mesh.axis_size(a) for a in axes)
            torch._check(n == k * local.shape[mesh.ndim + d])


@functools.lru_cache(maxsize=4096)
def _named(layout: Layout) -> NamedSharding:
    return NamedSharding(layout.mesh, layout_to_spec(layout))


def _no_dispatcher(func: Any, args: tuple, kwargs: dict) -> Any:
    raise RuntimeError("ShardedArray ops need shardfn.arrays.dispatch, which installs itself when imported")


# the op dispatcher: ``dispatch.dispatch``, installed by that module (it imports this one)
_dispatch_fn: Callable = _no_dispatcher
# filled by the layers above when imported (an array never imports them)
_to_dtensor: Callable | None = None  # ``shardfn.interop.dtensor.to_dtensor``
_reshard_tree: Callable | None = None  # ``shardfn.transforms.coalesce.reshard_tree``: pytree reshard
_NO_KWARGS: dict = {}  # read-only: dispatch never writes to kwargs


_make_wrapper = torch.Tensor._make_wrapper_subclass


def _wrap_output(local: Any, layout: Layout, shape: tuple, dtype: torch.dtype, frag: Any,
                 stride: tuple | None = None) -> ShardedArray:
    """``ShardedArray(local, layout, shape, dtype)`` for an op output whose layout, shape and
    dtype dispatch has checked once; ``frag`` is its fast-key fragment; ``stride`` the strides
    and storage offset torch gives the op's output (None: contiguous)."""
    # positional (cls, size, strides, storage_offset, memory_format, dtype, layout, device):
    # parsed faster than keywords
    r = _make_wrapper(ShardedArray if len(shape) < _BATCHED_NDIM else _BatchedArray, shape,
                      *(stride if stride is not None else (None, None)), None,
                      dtype, torch.strided,
                      (local[0] if type(local) is tuple else local).device)
    r._local = local
    r._layout = layout
    r._kf = frag
    return r


def wrap(local: Any, layout: Layout, shape: Sequence[int], dtype: torch.dtype, *, requires_grad: bool = False) -> ShardedArray:
    return ShardedArray(local, layout, tuple(shape), dtype, requires_grad=requires_grad)


def _mesh_of(x: Any, mesh: Mesh | None) -> Mesh | None:
    if mesh is not None:
        check_mesh(mesh, "mesh=")
    if isinstance(x, ShardedArray):
        if mesh is not None and mesh != x.mesh:
            raise ShardingError(f"mesh={mesh!r} differs from the array's mesh {x.mesh!r}")
        return x.mesh
    return mesh if mesh is not None else current_mesh()


# -- public functions -------------------------------------------------------------------


def distribute(tensor: torch.Tensor, sharding: Sharding, *, mesh: Mesh | None = None) -> ShardedArray:
    """Lay out a full tensor over the mesh (each device keeps only its shard).

    A Partial sharding puts the value on the first device of each reduction group (sum)
    or on all of them (avg/max/min). On dist every rank must pass the same tensor.
    """
    if isinstance(tensor, ShardedArray) or _ft.base_array(tensor) is not None:
        return reshard(tensor, sharding)
    if not isinstance(tensor, torch.Tensor):
        raise ShardingError(f"distribute takes a torch.Tensor, got {type(tensor).__name__}")
    layout = to_layout(sharding, tensor.dim(), _mesh_of(tensor, mesh))
    tensor = to_mesh_device(tensor, layout.mesh)  # the mesh owns the device
    backend = backend_for(layout.mesh)
    backend.check_same_meta(layout.mesh, tuple(tensor.shape), tensor.dtype, "distribute")
    if _replicas.checking():
        backend.check_replicas(layout.mesh, tensor, layout.mesh.axis_names, "sf.distribute: the tensor argument")
    return _Distribute.apply(tensor, layout)


device_put = distribute


def reshard(x: ShardedArray, sharding: Sharding) -> ShardedArray:
    """The same global value in a new layout, moved with the cheapest plan; the gradient
    is resharded back. ``x`` may be a pytree of arrays (``sharding`` a matching tree or a
    prefix): leaves sharing plan steps then move together (``coalesce.py``)."""
    if not isinstance(x, torch.Tensor):
        if _reshard_tree is None:
            raise ShardingError(f"reshard takes a ShardedArray, got {type(x).__name__}")
        return _reshard_tree(x, sharding)
    base = x if isinstance(x, ShardedArray) else _ft.base_array(x)
    if base is None:
        if isinstance(x, torch.Tensor):
            return distribute(x, sharding)
        raise ShardingError(f"reshard takes a ShardedArray, got {type(x).__name__}")
    target = _sharding_mesh(sharding)
    if target is not None and target != base.mesh and isinstance(x, ShardedArray):
        from .across_meshes import reshard_across

        return reshard_across(x, to_layout(sharding, x.ndim, target))
    dst = to_layout(sharding, x.ndim, base.mesh)
    if dst == _ft.layout_of(x):
        return x
    return _Reshard.apply(x, dst)


def gather(x: ShardedArray) -> torch.Tensor:
    """The global value as a plain tensor (= ``x.full_tensor()``)."""
    if not isinstance(x, ShardedArray) and _ft.base_array(x) is None:
        raise ShardingError(f"gather takes a ShardedArray, got {type(x).__name__}")
    return _FullTensor.apply(x)


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
        value = _execute_reshard(x, dst)
    cache[dst] = (x._local, x._layout, value)
    x._kf = None  # its dispatch key fragment names the reduced forms it has (dispatch._fragment)
    return value


def note_derived(func: Any, base: ShardedArray, rest: tuple, kwargs: dict, outs: Sequence[Any]) -> None:
    """Link each pending output of a view op to its pending base, so one reduction serves
    both (``raw_reshard``): only where the view has at least the base's elements (reducing
    the base then costs no more than reducing the view)."""
    for i, o in enumerate(outs):
        if (isinstance(o, ShardedArray) and o is not base and o._layout.partial == base._layout.partial
                and o.numel() >= base.numel()):
            o._derived = (base, func, rest, kwargs, i if len(outs) > 1 else None, o._local)
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
    out = _dispatch_fn(func, (reduced, *rest), kwargs)
    if i is not None:
        out = out[i]
    if out._layout == dst:
        return out._local
    return raw_reshard(out, dst)


def _execute_reshard(x: ShardedArray, dst: Layout) -> Any:
    return execute(plan_layouts(x._layout, dst, _ft.hint_shape(x.shape), x.dtype), x._local, tuple(x.shape))


def raw_full(x: ShardedArray) -> torch.Tensor:
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


class _Reshard(_Function):
    @staticmethod
    def forward(x: ShardedArray, dst: Layout) -> ShardedArray:
        return wrap(raw_reshard(x, dst), dst, x.shape, x.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.src, ctx.dst = _ft.layout_of(inputs[0]), inputs[1]

    @staticmethod
    def jvp(ctx: Any, t: Any, _: Any) -> Any:
        return reshard(_as_sharded(t, ctx.dst), ctx.dst)

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        return reshard(_as_sharded(g, ctx.src), ctx.src.without_partial()), None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: Any, dst: Layout) -> tuple:
        b = in_dims[0]
        return _Reshard.apply(x, dst if b is None else _ft.insert_dim(dst, b)), b


class _Distribute(_Function):
    @staticmethod
    def forward(t: torch.Tensor, layout: Layout) -> ShardedArray:
        # like jax.device_put, a copy: where the plan only sliced or expanded ``t``, the
        # shards are redone from one copy of ``t`` (replicas share that copy)
        value = raw_distribute(t.detach(), layout)
        if _shares_memory(value, t):
            value = raw_distribute(t.detach().clone(), layout)
        return wrap(value, layout, t.shape, t.dtype)

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
        b = in_dims[0]
        return _Distribute.apply(t, layout if b is None else _ft.insert_dim(layout, b)), b


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


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(x: ShardedArray, grad_layout: Layout) -> tuple:
        return tuple(x.local_shards())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        x, grad_layout = inputs
        ctx.meta = (grad_layout, tuple(x.shape), x.dtype)
        ctx.mark_non_differentiable(*[s for s in output if not s.is_floating_point() and not s.is_complex()])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        layout, shape, dtype = ctx.meta
        shapes = _lay.local_shapes(layout, shape)
        backend = backend_for(layout.mesh)
        grads = [
            torch.zeros(shapes[d], dtype=dtype) if g is None else g
            for d, g in zip(backend.devices(layout.mesh), grads)
        ]
        return _from_local(backend.pack_local(grads, layout.mesh), layout, layout.mesh, shape, None), None


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(layout: Layout, shape: tuple, stride: Any, *shards: torch.Tensor) -> ShardedArray:
        backend = backend_for(layout.mesh)
        local = backend.from_shards([s.detach() for s in shards], layout, shape)
        if _shares_memory(local, shards):  # kept as given (uneven, dist): copied
            local = backend.from_shards([s.detach().clone() for s in shards], layout, shape)
        out = ShardedArray(local, layout, shape, shards[0].dtype, stride=stride)
        _fragment(out)  # its interned key fragment now, as an op's output has it (was: on first use)
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        layout, shape = inputs[0], inputs[1]
        ctx.meta = (layout, shape, output.detach() if _selects(layout) else None)

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        layout, shape, value = ctx.meta
        grad = reshard(_as_sharded(g, layout), layout.without_partial())
        shards = grad.local_shards()
        avg = math.prod(layout.mesh.axis_size(a) for a, op in layout.partial if op == "avg")
        if avg > 1:
            shards = [s / avg for s in shards]
        if value is not None:
            # max/min: the gradient flows to the parts that attain the reduced value
            reduced = _shards_of(raw_reshard(value, layout.without_partial()), layout.mesh)
            parts = value.local_shards()
            shards = [s * (p == r) for s, p, r in zip(shards, parts, reduced)]
        return (None, None, None, *shards)


def _selects(layout: Layout) -> bool:
    return any(op in ("max", "min") for _, op in layout.partial)


def _shards_of(value: Any, mesh: Mesh) -> tuple:
    return tuple(backend_for(mesh).shard_list(value, mesh))


def _as_sharded(g: Any, layout: Layout) -> ShardedArray:
    if isinstance(g, ShardedArray) or _ft.base_array(g) is not None:
        return g
    return distribute(g, Layout(layout.mesh, ((),) * g.dim()))


def _from_local(local: Any, sharding: Sharding, mesh: Mesh | None, shape: Sequence[int] | None,
                stride: Sequence[int] | None, *, run_check: bool = False) -> ShardedArray:
    if mesh is not None:
        check_mesh(mesh, "from_local(mesh=...)")
    if mesh is None and not isinstance(sharding, NamedSharding | Layout):
        mesh = current_mesh()
    if shape is not None:
        from ..plans.planner import check_shape

        shape = check_shape(shape, "from_local")
    shards = _check_shard_list(local, mesh if mesh is not None else _sharding_mesh(sharding))
    ndim = shards[0].dim()
    layout = to_layout(sharding, ndim, mesh, arg="sharding")
    shards = _to_mesh_devices(shards, layout.mesh)  # the mesh owns the device
    backend = backend_for(layout.mesh)
    shape = backend.global_shape(shards, layout, shape, check_ranks=run_check)
    checked = _replicas.checking()
    if run_check or checked:
        _check_replicas_agree(shards, layout)
    if checked:
        split = set(layout.axis_dim) | set(layout.partial_ops)
        over = tuple(a for a in layout.mesh.axis_names if a not in split)
        backend.check_replicas(layout.mesh, shards[0], over, f"from_local: the local tensor ({layout.spec_str()})")
    return _FromLocal.apply(layout, shape, tuple(stride) if stride is not None else None, *shards)


def _to_mesh_devices(shards: list[torch.Tensor], mesh: Mesh) -> list[torch.Tensor]:
    """Each shard on the mesh's device type (copied there where it is elsewhere). A shard that
    cannot be copied there (a meta tensor holds no data) is a ShardingError naming the device
    of every such shard and the mesh's device_type."""
    devices = backend_for(mesh).devices(mesh)

    def where(bad: list[int]) -> str:
        named = (f"the shard of device {devices[i]} is on {shards[i].device}" for i in bad[:8])
        return ", ".join(named) + (" ..." if len(bad) > 8 else "")

    no_data = [i for i, t in enumerate(shards) if t.is_meta and mesh.device_type != "meta"]
    if no_data:
        raise ShardingError(
            f"from_local: {where(no_data)}: a meta tensor holds no values, but {mesh!r} has device_type "
            f"{mesh.device_type!r} and needs every shard's values; pass tensors with data (any device: they "
            f"are copied to {mesh.device_type!r}), or use a mesh with device_type='meta'"
        )
    out = []
    for i, t in enumerate(shards):
        try:
            out.append(to_mesh_device(t, mesh))
        except (RuntimeError, NotImplementedError) as e:
            raise ShardingError(
                f"from_local: {where([i])} cannot be copied to {mesh!r}'s device_type {mesh.device_type!r}: "
                f"{str(e).splitlines()[0]}"
            ) from None
    return out


def _check_replicas_agree(shards: list[torch.Tensor], layout: Layout) -> None:
    """Shards on devices that differ only along replicated mesh axes hold one value: a
    ShardingError names the devices that disagree. Only replicas this process holds are
    compared (every one on the local backend; on dist values are trusted, as in JAX/DTensor)."""
    mesh = layout.mesh
    split = set(layout.axis_dim) | set(layout.partial_ops)
    replicated = [i for i, a in enumerate(mesh.axis_names) if a not in split and mesh.shape[i] > 1]
    if not replicated:
        return
    held = {dev: i for i, dev in enumerate(backend_for(mesh).devices(mesh))}
    bad = []
    for dev, i in held.items():
        coords = list(mesh.coords(dev))
        for k in replicated:
            coords[k] = 0
        first = mesh.device_at(coords)
        j = held.get(first)
        if j is not None and first != dev and not _same_values(shards[j], shards[i]):
            bad.append((first, dev))
    if bad:
        axes = [mesh.axis_names[i] for i in replicated]
        pairs = ", ".join(f"{a} vs {b}" for a, b in bad[:8])
        raise ShardingError(
            f"from_local: {layout.spec_str()} replicates over mesh axes {axes!r}, but the shards of "
            f"devices {pairs} differ; replicas must hold equal values (shard the value, declare it "
            f"Partial, or pass equal shards)"
        )


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (NaN equal to NaN, as a copy would be)."""
    if a.shape != b.shape or torch.equal(a, b):
        return a.shape == b.shape
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return False


def _sharding_mesh(sharding: Any) -> Mesh | None:
    return getattr(sharding, "mesh", None)


def _check_shard_list(local: Any, mesh: Mesh | None) -> list[torch.Tensor]:
    if mesh is None:
        raise ShardingError("from_local needs a mesh: pass mesh=, a NamedSharding, or enter `with mesh:`")
    local = backend_for(mesh).unpack_local(local, mesh)
    for i, t in enumerate(local):
        if not isinstance(t, torch.Tensor) or isinstance(t, ShardedArray):
            raise ShardingError(f"from_local: shard {i} is {type(t).__name__}, not a plain torch.Tensor")
        if t.dim() != local[0].dim() or t.dtype != local[0].dtype:
            raise ShardingError(
                f"from_local: shard {i} is {t.dtype}[{tuple(t.shape)}] but shard 0 is "
                f"{local[0].dtype}[{tuple(local[0].shape)}]; all shards need one rank and dtype"
            )
    return local


# -- arrays with batch dims ------------------------------------------------------------------

_BATCHED_NDIM = 3
"""Arrays of this many dims or more carry the torch-function hook (``_BatchedArray``)."""


class _BatchedArray(ShardedArray):
    """A ShardedArray of three or more dims. Its torch-function hook runs batched
    ``matmul`` / ``einsum`` and ``rms_norm`` as single ops (``backends/custom_ops.py``: torch's
    composites would fold several sharded batch dims into one and gather them, and reduce
    an RMSNorm gradient twice); every other call keeps torch's behaviour. Lower-rank
    arrays skip the hook and its cost: a 2-d einsum or rms_norm on them runs torch's
    composite (the same values, possibly more communication)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _TF_SPECIAL:
            return _special_torch_function(func, types, args, kwargs)
        return _no_torch_function(func, types, args, kwargs or {})


ARRAY_TYPES = (ShardedArray, _BatchedArray)
"""The exact types of ShardedArrays (for exact-type checks that must not match wrappers)."""
Sharded.register(ShardedArray)  # the layers below recognise it by this marker


# -- pytree registration -------------------------------------------------------------------


def _flatten(x: ShardedArray) -> tuple:
    children = list(x._local) if isinstance(x._local, tuple) else [x._local]
    return children, (x._layout, tuple(x.shape), isinstance(x._local, tuple))


def _unflatten(aux: tuple, children: Any) -> ShardedArray:
    layout, shape, is_parts = aux
    local = tuple(children) if is_parts else children[0]
    return wrap(local, layout, shape, (local[0] if is_parts else local).dtype)


for _cls in ARRAY_TYPES:
    optree.register_pytree_node(_cls, _flatten, _unflatten, namespace="shardfn")
