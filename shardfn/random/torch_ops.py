"""torch's random ops on ShardedArrays: sharding-invariant draws from torch's generator.

Each op takes one fresh key (:func:`shardfn.random.keys._next_key`: two words from the
``generator=`` passed, else from torch's default generator, or from the
``sf.random.set_seed`` key), then every device computes only its own shard with the
counter-based generator, so an element's draw depends on its global index and the
generator state alone: replicas draw identical numbers, shards different ones, and the
gathered result is the same for every mesh and sharding. Every process takes exactly
one key per op, so all devices advance the generator in step.

These are special-case handlers (``SPECIAL``, installed in the dispatcher's rule table
when this module is imported) rather than rules: the op itself is replaced, not just its
layouts.

CPU ``F.dropout`` decomposes into ``empty_like`` + ``bernoulli_`` + ``div_`` + ``mul``:
the in-place fills of that private temporary reach the functional forms here through the
in-place policy (``shardfn/arrays/inplace/policy.py``); on an array the user holds they raise
:class:`~shardfn.ImmutableError`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..arrays import rule_table
from ..arrays.array import ShardedArray, wrap
from ..values.strides import dense_strides
from ..arrays.redistribute import raw_reshard
from ..arrays.factories import _box_shape, _build, _from_boxes, _shard_of
from ..arrays.functorch import static_int
from ..rules.base import bind, replicated
from ..values.layout import Box, Layout
from . import counter_rng as _rng
from . import keys as _random

aten = torch.ops.aten

_FLOAT_DIGITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}
_INT_MAX = {torch.uint8: 2**8 - 1, torch.int8: 2**7 - 1, torch.int16: 2**15 - 1, torch.int32: 2**31 - 1,
            torch.int64: 2**63 - 1, torch.bool: 1}


# -- helpers ---------------------------------------------------------------------------------


def _target(x: ShardedArray) -> tuple[tuple[int, ...], Layout]:
    """Shape and output layout of a value drawn "like" ``x`` (pending reductions dropped); a
    dynamic size under torch.compile is specialised, as the shards' boxes are read from it."""
    return tuple(static_int(n) for n in x.shape), x._layout.without_partial()


def _like_strides(x: ShardedArray, memory_format: Any = None) -> tuple[int, ...] | None:
    """The strides torch gives a value made "like" ``x`` (``empty_like``'s: ``x``'s order kept by
    ``preserve_format``), None where contiguous."""
    if memory_format in (None, torch.preserve_format) and x.is_contiguous():
        return None
    meta = torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype, device="meta")
    like = torch.empty_like(meta, memory_format=memory_format or torch.preserve_format)
    return None if like.is_contiguous() else tuple(like.stride())


def _fill(x: ShardedArray, dtype: torch.dtype, draw: Callable[[tuple, Box, torch.device], torch.Tensor],
          memory_format: Any = None) -> ShardedArray:
    """A new array shaped and laid out like ``x`` whose shards are ``draw(shape, box, device)``,
    reporting the strides torch's like-op would give it."""
    shape, layout = _target(x)
    device = x.device
    return _build(shape, layout, lambda box: draw(shape, box, device), dtype, stride=_like_strides(x, memory_format))


def _key(b: dict, x: torch.Tensor) -> _random.Key:
    return _random._next_key(b.get("generator"), x.device)


def _randint_box(k: Any, shape: tuple, box: Box, low: int, high: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """Integers in [low, high) as ``dtype`` (non-integer dtypes are drawn as int64)."""
    native = dtype in _rng._INT_DTYPES
    out = _rng.randint(k, shape, box, low=low, high=high, dtype=dtype if native else torch.int64, device=device)
    return out if native else out.to(dtype)


def _int(v: Any) -> int:
    return int(v.item()) if isinstance(v, torch.Tensor) else int(v)


# -- out-of-place ops --------------------------------------------------------------------------


def _rand_like(func: Any, args: tuple, kwargs: dict) -> ShardedArray:
    b = bind(func, args, kwargs)
    x, k = b["self"], _key(b, b["self"])
    dtype = b.get("dtype") or x.dtype
    return _fill(x, dtype, lambda s, box, dev: _rng.uniform(k, s, box, dtype=dtype, device=dev), b.get("memory_format"))


def _randn_like(func: Any, args: tuple, kwargs: dict) -> ShardedArray:
    b = bind(func, args, kwargs)
    x, k = b["self"], _key(b, b["self"])
    dtype = b.get("dtype") or x.dtype
    return _fill(x, dtype, lambda s, box, dev: _rng.normal(k, s, box, dtype=dtype, device=dev), b.get("memory_format"))


def _randint_like(func: Any, args: tuple, kwargs: dict) -> ShardedArray:
    b = bind(func, args, kwargs)
    x, k = b["self"], _key(b, b["self"])
    dtype = b.get("dtype") or x.dtype
    low, high = _int(b.get("low", 0)), _int(b["high"])
    return _fill(x, dtype, lambda s, box, dev: _randint_box(k, s, box, low, high, dtype, dev), b.get("memory_format"))


def _bernoulli(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    b = bind(func, args, kwargs)
    x = b["self"]
    p = b.get("p", x)
    ref = x if isinstance(x, ShardedArray) else p
    k = _key(b, ref)
    shape, layout = _target(ref)
    if tuple(x.shape) != shape:
        shape = tuple(x.shape)
        layout = replicated(ref.mesh, len(shape))
    return _random.bernoulli(k, p, shape, layout, dtype=x.dtype)


def _uniform(func: Any, args: tuple, kwargs: dict) -> ShardedArray:
    b = bind(func, args, kwargs)
    x, k = b["self"], _key(b, b["self"])
    low, high = float(b["from"]), float(b["to"])
    if low == high:
        return _fill(x, x.dtype, lambda s, box, dev: torch.full(_box_shape(box), low, dtype=x.dtype, device=dev))
    return _fill(x, x.dtype, lambda s, box, dev: _rng.uniform(k, s, box, dtype=x.dtype, low=low, high=high,
                                                                device=dev))


def _exponential_box(k: Any, shape: tuple, box: Box, lambd: float, dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
    """``-log(1 - u) / lambd`` with the counter generator's fixed-polynomial log (the
    same bits on every device and shard shape, unlike torch.log's vector/scalar paths)."""
    u = _rng.uniform(k, shape, box, dtype=torch.float64, device=device)
    return _rng._log_f64(u.neg_().add_(1.0)).neg_().div_(lambd).to(dtype)


def _exponential(func: Any, args: tuple, kwargs: dict) -> ShardedArray:
    b = bind(func, args, kwargs)
    x, k = b["self"], _key(b, b["self"])
    lambd = float(b["lambd"])
    return _fill(x, x.dtype, lambda s, box, dev: _exponential_box(k, s, box, lambd, x.dtype, dev))


def _random_range(func: Any, b: dict, dtype: torch.dtype) -> tuple[int, int]:
    """[low, high) of ``aten.random`` for ``dtype`` (torch's defaults when not given)."""
    top = 2 ** _FLOAT_DIGITS[dtype] + 1 if dtype in _FLOAT_DIGITS else _INT_MAX.get(dtype, 2**63 - 1) + 1
    name = func._overloadname
    if name == "to":
        return 0, _int(b["to"])
    if name == "from":
        return _int(b["from"]), top if b.get("to") is None else _int(b["to"])
    return 0, top


def _random_op(func: Any, args: tuple, kwargs: dict) -> ShardedArray:
    b = bind(func, args, kwargs)
    x, k = b["self"], _key(b, b["self"])
    low, high = _random_range(func, b, x.dtype)
    return _fill(x, x.dtype, lambda s, box, dev: _randint_box(k, s, box, low, high, x.dtype, dev))


def _standard_normal(ref: ShardedArray, shape: tuple[int, ...], dtype: torch.dtype, k: Any) -> ShardedArray:
    layout = ref._layout.without_partial() if tuple(ref.shape) == shape else replicated(ref.mesh, len(shape))
    return _random.normal(k, shape, layout, dtype=dtype)


def _normal(func: Any, args: tuple, kwargs: dict) -> ShardedArray:
    """``normal(mean, std)`` with tensor mean and/or std: ``z * std + mean``."""
    b = bind(func, args, kwargs)
    mean, std = b["mean"], b["std"]
    tensors = [t for t in (mean, std) if isinstance(t, torch.Tensor)]
    shape = tuple(torch.broadcast_shapes(*(t.shape for t in tensors)))
    sharded = [t for t in tensors if isinstance(t, ShardedArray)]
    ref = next((t for t in sharded if tuple(t.shape) == shape), sharded[0])
    metas = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors]
    dtype = torch.result_type(*metas) if len(metas) > 1 else metas[0].dtype
    z = _standard_normal(ref, shape, dtype, _key(b, ref))
    return z * std + mean


def _native_dropout(func: Any, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    b = bind(func, args, kwargs)
    x, p, train = b["input"], float(b["p"]), b.get("train")
    if train is False or p == 0.0:
        return x * 1, torch.ones_like(x, dtype=torch.bool)
    k = _random._next_key(None, x.device)
    shape, layout = _target(x)
    mask = _random.bernoulli(k, 1.0 - p, shape, layout, dtype=torch.bool)
    if p == 1.0:
        return x * 0.0, mask
    mesh, xs = layout.mesh, raw_reshard(x, layout)

    def scaled(dev: int, box: Box) -> torch.Tensor:
        # the same arithmetic as CPU dropout: x * (mask / (1 - p))
        keep = _shard_of(mask._local, mesh, dev).to(x.dtype).div_(1.0 - p)
        return _shard_of(xs, mesh, dev) * keep

    return wrap(_from_boxes(layout, shape, scaled, x.dtype, x.device), layout, shape, x.dtype,
                stride=_like_strides(x)), mask


def _fused_dropout(func: Any, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA's legacy fused dropout, ``_fused_dropout(x, p)``: ``p`` is the probability of
    *keeping* an element (``F.dropout`` reaches ``native_dropout`` instead; TorchScript and
    older callers this). The mask is drawn as ``native_dropout``'s, from global indices, so the
    values do not depend on the sharding; the output is the kernel's ``x * mask * (1 / p)``
    and the mask uint8, as CUDA makes them."""
    b = bind(func, args, kwargs)
    x, keep = b["self"], float(b["p"])
    k = _random._next_key(b.get("generator"), x.device)
    shape, layout = _target(x)
    mask = _random.bernoulli(k, keep, shape, layout, dtype=torch.uint8)
    scale = 1.0 / keep if keep > 0.0 else math.inf  # the kernel's 1 / p (a float: no ZeroDivisionError)
    mesh, xs = layout.mesh, raw_reshard(x, layout)

    def scaled(dev: int, box: Box) -> torch.Tensor:
        return _shard_of(xs, mesh, dev) * _shard_of(mask._local, mesh, dev).to(x.dtype) * scale

    return wrap(_from_boxes(layout, shape, scaled, x.dtype, x.device), layout, shape, x.dtype,
                stride=_like_strides(x)), mask


# -- empty arrays and functional fills -------------------------------------------------------


def _empty_like(func: Any, args: tuple, kwargs: dict) -> ShardedArray:
    b = bind(func, args, kwargs)
    x = b["self"]
    dtype = b.get("dtype") or x.dtype
    return _fill(x, dtype, lambda s, box, dev: torch.empty(_box_shape(box), dtype=dtype, device=dev),
                 b.get("memory_format"))


def _new_empty(func: Any, args: tuple, kwargs: dict) -> ShardedArray:
    b = bind(func, args, kwargs)
    x = b["self"]
    shape = tuple(int(n) for n in b["size"])
    dtype = b.get("dtype") or x.dtype
    device = x.device
    # new_empty_strided reports the strides asked for: autograd's CopySlices (the gradient of a write
    # into a view, under torch.func) copies the gradient into ``new_empty_strided(base's strides)`` and
    # views it with ``as_strided`` by those strides; read as contiguous, a transposed base's view
    # picked the wrong elements (Qwen3-Next's gated delta rule: wrong gradients)
    stride = tuple(int(n) for n in b["stride"]) if "stride" in b else None
    if stride is not None and stride == dense_strides(shape):
        stride = None
    return _build(shape, replicated(x.mesh, len(shape)),
                  lambda box: torch.empty(_box_shape(box), dtype=dtype, device=device), dtype, stride=stride)


def _normal_fill(func: Any, args: tuple, kwargs: dict) -> ShardedArray:
    b = bind(func, args, kwargs)
    x, k = b["self"], _key(b, b["self"])
    mean, std = float(b["mean"]), float(b["std"])
    return _fill(x, x.dtype, lambda s, box, dev: _rng.normal(k, s, box, dtype=x.dtype, mean=mean, std=std,
                                                               device=dev))


def _overloads(packet: Any, handler: Callable) -> dict:
    """``handler`` for every functional overload of ``packet`` (``out=`` forms excluded)."""
    ops = (getattr(packet, name) for name in packet.overloads())
    return {op: handler for op in ops if not op._schema.is_mutable}


SPECIAL: dict[Any, Callable] = {
    **_overloads(aten.rand_like, _rand_like),
    **_overloads(aten.randn_like, _randn_like),
    **_overloads(aten.randint_like, _randint_like),
    aten.bernoulli.default: _bernoulli,
    aten.bernoulli.p: _bernoulli,
    aten.bernoulli.Tensor: _bernoulli,
    aten.uniform.default: _uniform,
    aten.exponential.default: _exponential,
    aten.random.default: _random_op,
    aten.random.to: _random_op,
    getattr(aten.random, "from"): _random_op,
    aten.normal.Tensor_float: _normal,
    aten.normal.float_Tensor: _normal,
    aten.normal.Tensor_Tensor: _normal,
    aten.native_dropout.default: _native_dropout,
    aten._fused_dropout.default: _fused_dropout,
    aten.empty_like.default: _empty_like,
    aten.new_empty.default: _new_empty,
    # autograd's gradient layout contract asks for one when a gradient's strides differ from its
    # leaf's (as torch's do, e.g. flash attention's); the result is contiguous, like most leaves
    aten.new_empty_strided.default: _new_empty,
    aten.normal_functional.default: _normal_fill,
}

rule_table.SPECIAL.update(SPECIAL)
