"""Ops dispatch runs by hand rather than by a rule: aliases of an immutable array (the
array itself), size and storage queries and checks (``_assert_tensor_metadata``), whole-value comparisons, ``.item()``, and torch's lazy
conj/neg flags (``_conj``, ``_neg_view``, what torch rejects on flagged views)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..backends.registry import backend_for
from ..values.errors import ShardingError, ShardingRuntimeError
from .array import _BATCHED_NDIM, ShardedArray, _BatchedArray, _make_wrapper, _wrap_output
from .fragments import _odd_stride
from .fresh import held_fragment
from .redistribute import raw_full, raw_reshard

aten = torch.ops.aten


def _alias(func: Any, args: tuple, kwargs: dict) -> Any:
    """The same shards, layout, shape and dtype in a new (contiguous) array; a contiguous
    ``x``'s fast-key fragment holds for it too (not a pending one's: its fragment names the
    reductions kept on ``x``), so its next op needs no fragment lookup."""
    x = args[0]
    if _copies(x, kwargs):
        return aten._to_copy.default(x, memory_format=kwargs["memory_format"])  # a copy
    shape = tuple(x.shape)
    if not _dense_strides(x):
        # torch's strides for the output: a view (detach, alias) keeps x's, clone keeps them where
        # x is dense (``x.as_strided(...).detach().view(-1)`` raises as in torch)
        return _wrap_output(x._local, x._layout, shape, x.dtype, None, _meta_strides(func, x, args, kwargs))
    frag = held_fragment(x)
    if frag is not None and x._layout.partial:
        frag = None
    return _wrap_output(x._local, x._layout, shape, x.dtype, frag)


def _dense_strides(x: Any) -> bool:
    """Whether ``x`` has its shape's contiguous strides and no offset, the strides a wrap with
    none gives (not ``is_contiguous()``: an empty array, or a size-1 dim, is contiguous under
    any strides, and a detach that dropped a view's strides failed Dynamo's fake copy of it)."""
    return _odd_stride(tuple(x.shape), tuple(x.stride()), x.storage_offset()) is None


def _copies(x: Any, kwargs: dict) -> bool:
    """Whether a clone into ``memory_format`` must copy (``x`` is not laid out that way)."""
    fmt = kwargs.get("memory_format")
    return fmt is not None and fmt is not torch.preserve_format and not x.is_contiguous(memory_format=fmt)


class AliasEntry:
    """``_alias`` of one array as a dispatch cache entry: its fast key fixes the layout, shape,
    dtype, strides and storage offset, so a warm ``detach`` or ``clone`` is one wrap."""

    __slots__ = ("shape", "stride", "pending_view", "dtype", "cls")

    def __init__(self, func: Any, x: ShardedArray, kwargs: dict) -> None:
        self.shape = tuple(x.shape)
        self.stride = None if _dense_strides(x) else _meta_strides(func, x, (x,), kwargs)
        self.pending_view = bool(x._layout.partial)  # a pending view is reduced through its base
        self.dtype = x.dtype  # (the fast key fixes it: no torch-function call reading it per call)
        self.cls = ShardedArray if len(self.shape) < _BATCHED_NDIM else _BatchedArray

    def warm(self, args: tuple, kwargs: dict) -> Any:
        x = args[0]
        if self.stride is not None:
            return _wrap_output(x._local, x._layout, self.shape, self.dtype, None, self.stride)
        # ``_wrap_output`` and ``held_fragment`` inlined (two Python calls less on every warm detach)
        frag = None
        if not self.pending_view:
            frag = x._kf
            if frag is None:
                d = x.__dict__
                frag = d.get("_kfh") if "_view_of" in d else d.get("_fresh")
        local = x._local
        r = _make_wrapper(self.cls, self.shape, None, None, None, self.dtype, torch.strided,
                          (local[0] if type(local) is tuple else local).device)
        r._local = local
        r._layout = x._layout
        r._kf = frag
        return r


class CopyEntry:
    """A clone into a memory format its input is not laid out in (the fast key fixes the input's
    strides, so that is known) as a dispatch cache entry: a copy (``_to_copy``), as ``_alias``
    makes, with no cold-path lookups on the way (torch's ``.contiguous()`` of a transposed view)."""

    __slots__ = ("memory_format",)
    pending_view = False

    def __init__(self, memory_format: torch.memory_format) -> None:
        self.memory_format = memory_format

    def warm(self, args: tuple, kwargs: dict) -> Any:
        return aten._to_copy.default(args[0], memory_format=self.memory_format)


def alias_entry(func: Any, args: tuple, kwargs: dict) -> AliasEntry | CopyEntry | None:
    """A cache entry for this call if it is an ``_alias`` of one array (or a clone of it into
    another memory format: a copy)."""
    x = args[0] if len(args) == 1 else None
    if HANDLERS.get(func) is not _alias or type(x) not in (ShardedArray, _BatchedArray):
        return None
    if _copies(x, kwargs):
        return CopyEntry(kwargs["memory_format"])
    return AliasEntry(func, x, kwargs)


def _meta_strides(func: Any, x: Any, args: tuple, kwargs: dict) -> tuple:
    """(strides, storage offset) of ``func``'s output on a meta tensor laid out as ``x`` reports."""
    out = func(_meta_like(x), *args[1:], **kwargs)
    return tuple(out.stride()), out.storage_offset()


def _meta_like(x: Any) -> torch.Tensor:
    """A meta tensor of ``x``'s dtype laid out as ``x`` reports (sizes, strides, storage offset)."""
    stride, off = x.stride(), x.storage_offset()
    extent = off + 1 + sum((n - 1) * s for n, s in zip(x.shape, stride) if n > 0)
    return torch.empty(extent, dtype=x.dtype, device="meta").as_strided(tuple(x.shape), stride, off)


def _is_same_size(func: Any, args: tuple, kwargs: dict) -> bool:
    return tuple(args[0].shape) == tuple(args[1].shape)


def _same_storage_numel(func: Any, args: tuple, kwargs: dict) -> bool:
    # forward AD (jvp) asks before reusing a tangent; a ShardedArray's "storage" is its
    # global extent (wrappers are always contiguous), a plain tensor's its own storage's: a
    # ZeroTensor (a formula's zero tangent, e.g. sgn's) has none, so torch copies it into a
    # new tangent like the primal, which an in-place op may then update (seed 5729103494)
    return _storage_numel(args[0]) == _storage_numel(args[1])


def _storage_numel(t: torch.Tensor) -> int:
    if isinstance(t, ShardedArray):
        return t.numel()
    if t._is_zerotensor():
        return 0
    return t.untyped_storage().nbytes() // t.element_size()


def _metadata(func: Any, args: tuple, kwargs: dict) -> Any:
    """``aten.size`` / ``stride`` / ``numel`` / ``dim`` called as ops: the array's global metadata,
    as the Tensor methods report it. C++ reaches them through the Python sizes policy: ``sgn``'s
    backward reads ``result.sizes()``, which under a dynamic-shape trace asks ``aten.size.default``
    (dispatch raised 'operator aten::size does not exist' looking for a decomposition)."""
    x = args[0]
    if not isinstance(x, ShardedArray):
        return NotImplemented
    name = func.overloadpacket.__name__.removeprefix("sym_")
    if name in ("numel", "dim"):
        return getattr(x, name)()
    dims = getattr(x, name)()
    return list(dims) if len(args) < 2 else dims[args[1]]


def _assert_metadata(func: Any, args: tuple, kwargs: dict) -> None:
    """``_assert_tensor_metadata`` (export and torch.compile graphs check a cast's input with it):
    the array's global sizes, strides, dtype, device and layout against the expected ones, as
    torch checks a tensor's, without reading a shard. torch's own check runs on a meta tensor laid
    out as the array reports (its errors, word for word); the device, which a meta tensor cannot
    carry, is compared here in torch's words."""
    from ..values.schema import bind

    b = bind(func, args, kwargs)
    a = b["a"]
    if not isinstance(a, ShardedArray):
        return NotImplemented
    func(_meta_like(a), b["size"], b["stride"], b["dtype"], layout=b["layout"])
    device = b["device"]
    if device is not None and torch.device(device) != a.device:
        raise ShardingRuntimeError(f"Tensor device mismatch! Expected: {torch.device(device)}, Got: {a.device}")
    return None


def _allclose(func: Any, args: tuple, kwargs: dict) -> bool:
    """Like ``equal``: shard by shard in one layout (broadcasting operands: on full values)."""
    a, b, *rest = args
    if tuple(a.shape) != tuple(b.shape):
        full = [raw_full(t) if isinstance(t, ShardedArray) else t for t in (a, b)]
        return bool(func(*full, *rest, **kwargs))
    return _equal(func, (a, b), {}, compare=lambda x, y: func(x, y, *rest, **kwargs))


def _equal(func: Any, args: tuple, kwargs: dict, compare: Callable = torch.equal) -> bool:
    a, b = args
    if tuple(a.shape) != tuple(b.shape):
        return False
    if not isinstance(a, ShardedArray):
        a, b = b, a
    layout = a._layout.without_partial()
    if isinstance(b, ShardedArray) and b.mesh != a.mesh:
        raise ShardingError(f"aten.equal: operands live on different meshes {a.mesh!r} and {b.mesh!r}")
    from .redistribute import raw_distribute

    va = raw_reshard(a, layout)
    vb = raw_reshard(b, layout) if isinstance(b, ShardedArray) else raw_distribute(b, layout)
    return backend_for(a.mesh).all_true(
        [compare(x, y) for x, y in zip(_shards(va, a.mesh), _shards(vb, a.mesh))], a.mesh
    )


def _shards(value: Any, mesh: Any) -> tuple:
    return backend_for(mesh).shard_list(value, mesh)


def _scalar(func: Any, args: tuple, kwargs: dict) -> Any:
    return func(raw_full(args[0]))


# -- torch's lazy conj/neg flags ----------------------------------------------------------------
# A ShardedArray's shards always hold its true values; its conj/neg flags are metadata that say
# what torch's own tensor would say (``x.conj().is_conj()``), so the ops torch rejects on such a
# view reject it too. Torch's fallback resolves a flagged input with ``clone`` (an unflagged alias
# here: already the true values); views keep the flags (``dispatch.keep_math_bits``).


def _flag_view(func: Any, args: tuple, kwargs: dict) -> Any:
    """``_conj`` / ``_neg_view``: the values conjugated / negated, the flag toggled."""
    x = args[0]
    conj, neg = x.is_conj(), x.is_neg()
    if func is aten._conj.default:
        out, conj = aten.conj_physical.default(x), not conj
    else:
        out, neg = aten.neg.default(x), not neg
    if conj:
        torch._C._set_conj(out, True)
    if neg:
        torch._C._set_neg(out, True)
    return out


def _no_flagged_reinterpret(func: Any, args: tuple, kwargs: dict) -> Any:
    """``view_as_real`` and ``view(dtype)`` of a lazily conjugated or negated view raise as in torch."""
    x = args[0]
    if func is aten.view_as_real.default and x.is_conj():
        raise ShardingRuntimeError(
            "view_as_real doesn't work on unresolved conjugated tensors.  To resolve the conjugate tensor so you "
            "can view it as real, use self.resolve_conj(); however, be warned that the resulting tensor will NOT "
            "alias the original."
        )
    if func is aten.view.dtype and (x.is_conj() or x.is_neg()):
        what = "conjugate view tensors" if x.is_conj() else "tensors with negative bit set"
        raise ShardingRuntimeError(f"torch.Tensor.view is not supported for {what} when converting to a different dtype.")
    return NotImplemented


def _dot_flags(func: Any, args: tuple, kwargs: dict) -> Any:
    """``dot`` / ``vdot`` of flagged operands: torch's kernels answer some pairs with a
    conjugated view (``dot(a.conj(), b.conj())``, ``vdot(a, b.conj())``); so does this."""
    a, b = args[0], args[1]
    ca, cb = a.is_conj(), b.is_conj()
    if not (ca or cb) or not a.is_complex():
        return NotImplemented
    out = func(_unflagged(a), _unflagged(b))
    if (ca and cb) if func is aten.dot.default else (cb and not ca):
        torch._C._set_conj(out, True)
    return out


def _unflagged(v: Any) -> Any:
    """``v``'s values without its lazy flags (an alias here: the shards hold true values)."""
    return _alias(aten.alias.default, (v,), {}) if isinstance(v, ShardedArray) else v.resolve_conj().resolve_neg()


def _to_meta(func: Any, args: tuple, kwargs: dict) -> Any:
    """``aten.to`` onto the meta device (torch's zero-tensor kernels compute an output's
    shape and dtype by running the op on ``x.to("meta")``, as forward AD does under
    ``torch.func.hessian``): a plain meta tensor with the array's global metadata (no data
    to move); any other ``to`` below autograd is what ``.to`` decomposes into (``_to_copy``,
    an alias)."""
    from ..values.schema import bind

    b = bind(func, args, kwargs)
    device = b.get("device")
    if device is None or torch.device(device).type != "meta":
        return func.decompose(*args, **kwargs)
    x = b["self"]
    dtype = b.get("dtype") or x.dtype
    return torch.empty_strided(tuple(x.shape), x.stride(), dtype=dtype, device="meta")


HANDLERS: dict[Any, Callable] = {
    aten.to.dtype_layout: _to_meta,
    aten.to.device: _to_meta,
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.clone.default: _alias,
    aten._lazy_clone.default: _alias,
    aten.lift_fresh.default: _alias,
    aten.is_same_size.default: _is_same_size,
    aten._has_same_storage_numel.default: _same_storage_numel,
    aten.equal.default: _equal,
    aten._assert_tensor_metadata.default: _assert_metadata,
    aten.size.default: _metadata,
    aten.size.int: _metadata,
    aten.stride.default: _metadata,
    aten.stride.int: _metadata,
    aten.sym_size.default: _metadata,
    aten.sym_size.int: _metadata,
    aten.sym_stride.default: _metadata,
    aten.sym_stride.int: _metadata,
    aten.numel.default: _metadata,
    aten.sym_numel.default: _metadata,
    aten.dim.default: _metadata,
    aten.allclose.default: _allclose,
    aten._local_scalar_dense.default: _scalar,
    aten._conj.default: _flag_view,
    aten._neg_view.default: _flag_view,
    aten.view_as_real.default: _no_flagged_reinterpret,
    aten.view.dtype: _no_flagged_reinterpret,
    aten.dot.default: _dot_flags,
    aten.vdot.default: _dot_flags,
}
OWN_FLAGS = frozenset({aten._conj.default, aten._neg_view.default})
