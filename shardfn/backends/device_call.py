"""One device's local computation of a compiled strategy (both backends).

A rule's :class:`~shardfn.rules.base.Candidate` describes the local call in logical
terms: the op itself or ``local_op`` with ``local_args``, size arguments to localise
(``local_sizes``), a ``local_fn`` with the shard facts it needs, dense inputs. Here that
becomes a call on one device's shards (the dist backend's own rank, or each device of
the local backend's per-device path). ``batching`` runs the same description once for
every device of the local backend.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from ..values.schema import _schema_info, bind, replace_arg
from ..values.layout import Layout, device_box, local_shapes
from .kernel_layouts import with_kernel_layouts

aten = torch.ops.aten

# Shards can be non-contiguous (results of collectives): a view of a shard is a reshape.
_AS_RESHAPE = frozenset({aten.view.default, aten._unsafe_view.default, aten.view_copy.default})


def _reshape(x: torch.Tensor, size: Sequence[Any], *rest: Any, **kwargs: Any) -> torch.Tensor:
    """``view``/``_unsafe_view`` of a shard (it may not be viewable): a reshape."""
    return x.reshape(size)


def local_op(func: Any, cand: Any) -> Any:
    """The op each device runs: ``local_op`` or the op itself (views as reshapes)."""
    op = cand.local_op or func
    return _reshape if op in _AS_RESHAPE else op


def rebinder(func: Any, cand: Any) -> Callable[[tuple, dict], tuple[tuple, dict]] | None:
    """Maps the op's arguments to ``local_op``'s (by schema name) with ``local_args``
    set; None when the arguments pass unchanged."""
    if cand.local_op is None and not cand.local_args:
        return None
    target = cand.local_op or func
    fixed = dict(cand.local_args)
    if target is func:
        def same(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            for name, v in fixed.items():
                args, kwargs = replace_arg(func, args, kwargs, name, v)
            return args, kwargs

        return same
    schema = target._schema.arguments
    names = [a.name for a in schema if not a.kwarg_only]
    kw_names = [a.name for a in schema if a.kwarg_only]

    def rebind(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        b = bind(func, args, kwargs)
        b.update(fixed)
        _, defaults = _schema_info(target)
        pos = tuple(b[n] if n in b else defaults[n] for n in names)
        return pos, {n: b[n] for n in kw_names if n in b}

    return rebind


_FLAG_KEYS = (torch._C.DispatchKey.Conjugate, torch._C.DispatchKey.Negative)


def with_flag_keys(fn: Callable) -> Callable:
    """``fn`` run with torch's Conjugate and Negative dispatch keys live. Inside
    ``__torch_dispatch__`` they are excluded, so a kernel that makes a lazy conj/neg view of
    its own (``linalg_pinv``'s ``U.mH()``, a composite's ``x.conj() * s``) would read the view
    as unconjugated values. Shards hold true values, so this changes nothing else."""

    def run(*args: Any, **kwargs: Any) -> Any:
        exclude = torch._C._dispatch_tls_local_exclude_set()
        for k in _FLAG_KEYS:
            exclude = exclude.remove(k)
        with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
            return fn(*args, **kwargs)

    return run


def is_complex_call(dtypes: Sequence[Any]) -> bool:
    """Whether a call with these input/output dtypes (None for non-tensors) computes in
    complex numbers, where kernels make conj views (``with_flag_keys``)."""
    return any(d is not None and d.is_complex for d in dtypes)


def call_is_complex(call: Any) -> bool:
    """``is_complex_call`` of an ``OpCall``'s sharded inputs and outputs."""
    return is_complex_call([v.dtype for _, v in call.arrays] + [getattr(m, "dtype", None) for m in call.out_metas])


def size_splits(layout: Layout) -> tuple[int, ...]:
    """Per dim of ``layout``: into how many pieces it is split."""
    mesh = layout.mesh
    return tuple(math.prod(mesh.axis_size(a) for a in axes) for axes in layout.dims)


def symbolic_local(sizes: Sequence[Any], splits: Sequence[int]) -> list:
    """Local sizes from global ones that may be symbolic (torch.compile dynamic shapes), for an
    even layout split ``splits`` ways per dim. A -1 stays -1: every device holds the same share
    of the elements, so torch infers the local size from the local elements as it infers the
    global one."""
    out = []
    for n, k in zip(sizes, splits):
        out.append(n if k == 1 or not isinstance(n, torch.SymInt) and n == -1 else n // k)
    return out


def size_one_strided(t: Any) -> Any:
    """``t`` with each size-1 dim strided as a contiguous layout's: the extent of the dims
    inside it (a view; any stride is valid there, but torch's views of stacked shards give
    such a dim the stride of the dim next inside, and some CPU kernels step through a batch
    by one dim's stride: ``lu_solve`` by ``LU.stride(-3)`` and ``pivots.stride(-2)``). The
    strides are remembered per (sizes, strides): every warm gelu restrides its stacked operands."""
    if not isinstance(t, torch.Tensor) or 1 not in t.shape:
        return t
    key = (t.shape, t.stride())
    try:
        stride = _SIZE_ONE.get(key, _SIZE_ONE)
    except TypeError:  # symbolic sizes or strides (SymInts do not hash): left as they are
        return t
    if stride is _SIZE_ONE:
        if len(_SIZE_ONE) >= 4096:
            _SIZE_ONE.clear()
        stride = _SIZE_ONE[key] = _size_one_strides(t)
    return t if stride is None else t.as_strided(t.shape, stride, t.storage_offset())


_SIZE_ONE: dict = {}


def _size_one_strides(t: torch.Tensor) -> list | None:
    """:func:`size_one_strided`'s strides for ``t``, None where they are ``t``'s own (or symbolic)."""
    if any(isinstance(s, torch.SymInt) for s in (*t.shape, *t.stride())):
        return None
    stride, step = [], 1
    for n, s in reversed(list(zip(t.shape, t.stride()))):
        stride.append(step if n == 1 else s)
        step = step if n == 1 else max(step, s * n)
    stride.reverse()
    return None if stride == list(t.stride()) else stride


def dense(v: Any, mode: bool | str = True) -> Any:
    """A tensor (or tensors) contiguous with conj/neg flags resolved; with ``mode="last"``
    only a last dim of stride != 1 is made contiguous (what fused kernels such as CPU flash
    attention assume: torch's front-end only picks them for such inputs, but a gathered
    shard may carry other strides); with ``mode="size_one"`` only size-1 dims are restrided
    (:func:`size_one_strided`, a view); with ``mode="distinct"`` only a tensor whose elements
    may share memory (an ``unfold`` view, which ``clone`` of an array keeps as its shard) is
    made contiguous (what kernels that keep ``self``'s strides, ``copy`` and the ``*_scatter``
    ops by ``clone_preserve_strides``, assume: else they write overlapping memory)."""
    if isinstance(v, torch.Tensor):
        if v.is_conj():  # (the resolve calls return v itself when the flag is off: skip the dispatch)
            v = v.resolve_conj()
        if v.is_neg():
            v = v.resolve_neg()
        if mode == "size_one":
            return size_one_strided(v)
        if mode == "distinct":
            return v.contiguous() if _may_overlap(v) else v
        if mode == "last":  # (a clone, not contiguous(): torch calls an empty or size-1 dim contiguous
            # whatever its stride, yet view(dtype) checks stride(-1) == 1 for any size)
            return v.clone(memory_format=torch.contiguous_format) if v.dim() and v.stride(-1) != 1 else v
        return v.contiguous()
    if isinstance(v, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in v):
        return type(v)(dense(t, mode) for t in v)
    return v


def _may_overlap(t: torch.Tensor) -> bool:
    """Whether two of ``t``'s elements may sit at one address: its dims of size > 1 ordered by
    stride, each stride must step past everything the smaller ones reach (a sufficient test
    for distinct elements; an exotic interleaving it misses is only copied needlessly)."""
    reach = 0
    for st, n in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if st <= reach:
            return True
        reach += st * (n - 1)
    return False


def substitute(args: tuple, kwargs: dict, values: dict, positional: tuple | None,
               fn: Callable | None = None) -> tuple[tuple, dict]:
    """args/kwargs with each sharded argument (by path) replaced by ``fn(its backend
    value)`` (the value itself when ``fn`` is None)."""
    if positional is not None:
        a = list(args)
        if fn is None:
            for p in positional:
                a[p] = values[p]
        else:
            for p in positional:
                a[p] = fn(values[p])
        return tuple(a), kwargs
    fn = fn or same
    new = []
    for i, x in enumerate(args):
        if isinstance(x, (list, tuple)):
            new.append(type(x)(fn(values[(i, j)]) if (i, j) in values else y for j, y in enumerate(x)))
        else:
            new.append(fn(values[i]) if i in values else x)
    return tuple(new), {k: fn(values[k]) if k in values else v for k, v in kwargs.items()}


def same(v: Any) -> Any:
    return v


def with_locals(args: tuple, positional: tuple, index: Any = None) -> list:
    """A warm call's arguments: ``args`` with each array at ``positional`` replaced by its
    backend value (``value[index]`` when ``index`` is given)."""
    a = list(args)
    if index is None:
        for p in positional:
            a[p] = args[p]._local
    else:
        for p in positional:
            a[p] = args[p]._local[index]
    return a


def empty_outputs(cand: Any, out_shapes: Sequence[Any], metas: Sequence[Any] | None = None) -> dict[int, list]:
    """Per device: its local output shapes where every output is an array with no elements
    there while the global outputs have some (an empty shard of a valid call: nothing to
    compute, and kernels may reject the empty piece; an empty global output keeps torch's
    checks, e.g. of indices). An output the op leaves undefined (``metas``: None there, a
    backward's gradient nobody asked for) is None. Devices not listed compute their outputs."""
    layouts = cand.out_layouts
    if not layouts:
        return {}
    arrays = [i for i, layout in enumerate(layouts) if layout is not None]
    undefined = [i for i, layout in enumerate(layouts)
                 if layout is None and metas is not None and len(metas) == len(layouts) and metas[i] is None]
    if not arrays or len(arrays) + len(undefined) != len(layouts) \
            or any(out_shapes[i] is None or 0 in tuple(out_shapes[i]) for i in arrays):
        return {}
    local = {i: local_shapes(layouts[i], tuple(out_shapes[i])) for i in arrays}
    devices = range(len(local[arrays[0]]))
    return {dev: [local[i][dev] if i in local else None for i in range(len(layouts))]
            for dev in devices if all(0 in local[i][dev] for i in arrays)}


def skips_empty(func: Any) -> bool:
    """Whether a device whose outputs are all empty (``empty_outputs``) skips ``func``'s kernel: a
    functional op whose outputs alias no input. A kernel handed the empty piece may reject it, or
    crash the process: CPU ``native_batch_norm_backward`` of no channel divides by zero (SIGFPE)."""
    schema = getattr(func, "_schema", None)
    return schema is not None and not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


def raw_op(fn: Any) -> Any:
    """An aten op's C++ callable (``OpOverload.__call__`` is one Python frame around it,
    a measurable share of a warm call), anything else as it is."""
    return fn._op if isinstance(fn, torch._ops.OpOverload) else fn


class DeviceCall:
    """The local call of one strategy on the shards of the given devices: ``(args,
    kwargs, dev) -> flat outputs``. Localised sizes and shard facts are computed once
    per device, when the strategy is compiled."""

    def __init__(self, func: Any, cand: Any, in_shapes: Sequence[tuple], out_shapes: Sequence[Any],
                 devices: Sequence[int], complex_call: bool = False) -> None:
        self.func = func
        self.fn = cand.local_fn or local_op(func, cand)
        if complex_call:
            self.fn = with_flag_keys(self.fn)
        self.fn = with_kernel_layouts(func, self.fn)
        self.rebind = rebinder(func, cand) if cand.local_fn is None else None
        self.dense = cand.dense
        self.sizes = {dev: [] for dev in devices}
        # per localised size argument: its pieces per dim, for sizes computed on each call
        # (``symbolic``: a call on symbolic shards of an even layout, whose sizes are not the hints')
        self.splits = [(name, size_splits(cand.out_layouts[i])) for name, i in cand.local_sizes]
        for name, i in cand.local_sizes:
            shapes = local_shapes(cand.out_layouts[i], tuple(out_shapes[i]))
            for dev in devices:
                self.sizes[dev].append((name, list(shapes[dev])))
        self.facts = {dev: {} for dev in devices}
        for f in cand.facts:
            for dev in devices:
                lo, hi = device_box(cand.in_layouts[f.input], tuple(in_shapes[f.input]), dev)[f.dim]
                self.facts[dev][f.name] = lo if f.kind == "offset" else hi - lo
        trivial = not (cand.local_sizes or cand.facts or cand.dense) and self.rebind is None
        self.direct = self.fn if trivial else None  # nothing to adapt: call ``fn`` directly

    def __call__(self, args: tuple, kwargs: dict, dev: int, symbolic: bool = False) -> list:
        """``dev``'s outputs. With ``symbolic``, the size arguments are localised from the call's
        own (symbolic) global sizes, each device's share of an even layout, not from the hints
        the strategy was compiled on (the caller runs no call with shard facts so)."""
        if symbolic:
            for name, splits in self.splits:
                local = symbolic_local(bind(self.func, args, kwargs)[name], splits)
                args, kwargs = replace_arg(self.func, args, kwargs, name, local)
        else:
            for name, size in self.sizes[dev]:
                args, kwargs = replace_arg(self.func, args, kwargs, name, size)
        if self.rebind is not None:
            args, kwargs = self.rebind(args, kwargs)
        if self.dense:
            args = tuple(dense(a, self.dense) for a in args)
            kwargs = {k: dense(v, self.dense) for k, v in kwargs.items()}
        facts = self.facts[dev]
        out = self.fn(*args, **kwargs, **facts) if facts else self.fn(*args, **kwargs)
        return list(out) if isinstance(out, (tuple, list)) else [out]
